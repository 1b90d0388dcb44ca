# Shared launcher logic, sourced by launch/run_*.sh and launch/sweep_atr_baselines.sh.
#
#   source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
#   divclip_launch <experiment> [--dry-run] [hydra overrides...]
#
# runs `python -m recipe.main +experiments=<experiment> <env overrides> <overrides>` from the
# repository root (configs/experiments/<experiment>.yaml). Explicit Hydra overrides come last,
# so they win over the environment ones.
#
# Environment (each maps to one Hydra key; unset = the experiment config's value):
#   MODEL_PATH       actor_rollout_ref.model.path
#   TRAIN_FILES      data.train_files   (one path, "a,b" or "a b", or a Hydra list "[a,b]")
#   VAL_FILES        data.val_files     (same forms)
#   NNODES           trainer.nnodes
#   GPUS_PER_NODE    trainer.n_gpus_per_node
#   CKPT_DIR         trainer.default_local_dir
#   PROJECT_NAME     trainer.project_name
#   EXPERIMENT_NAME  trainer.experiment_name
#   DATA_DIR         folder of the `python -m data_prep` parquets (default: <repo>/data), used by
#                    the configs' default train/val files (exported as DIVCLIP_DATA_DIR)
#   PYTHON           interpreter (default: <repo>/.venv/bin/python if present, else python3)
#   STRATEGY         actor_rollout_ref.actor.strategy (the configs' default: fsdp2; fsdp = FSDP1, whose
#                    figures are unmeasured, docs/experiments.md); the reference policy follows
#   VOCAB_PASS       actor_rollout_ref.actor.policy_loss.vocab_pass: 1/true = log-probs and entropy of
#                    both actor passes by the chunked vocabulary pass (no logits tensor), 0/false = verl's
#                    materialised logits (docs/losses.md, "The vocabulary pass")
#   MODE             trainer.v1.trainer_mode: sync (the configs' value, what both papers ran), colocate_async
#                    or separate_async (docs/experiments.md, "Trainer modes"). separate_async also needs:
#   ROLLOUT_GPUS_PER_NODE  actor_rollout_ref.rollout.n_gpus_per_node: the standalone rollout pool's GPUs per node
#   ROLLOUT_NNODES   actor_rollout_ref.rollout.nnodes (default 1)
#   CKPT_ENGINE      actor_rollout_ref.rollout.checkpoint_engine.backend, how weights reach the standalone pool
#                    (default nccl; cpu_gloo on the cpu platform)

DIVCLIP_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
DIVCLIP_EXPERIMENTS_DIR="$DIVCLIP_ROOT/configs/experiments"

divclip_die() {
    echo "$(basename "$0"): $*" >&2
    exit 2
}

divclip_python() {
    if [[ -n "${PYTHON:-}" ]]; then
        echo "$PYTHON"
    elif [[ -x "$DIVCLIP_ROOT/.venv/bin/python" ]]; then
        echo "$DIVCLIP_ROOT/.venv/bin/python"
    else
        echo python3
    fi
}

# A Hydra single-quoted string (paths may hold '=', ',', spaces).
divclip_quoted() {
    [[ "$2" != *"'"* ]] || divclip_die "$1: a value with a single quote is not supported: $2"
    echo "'$2'"
}

# "a,b" / "a b" / "[a,b]" -> a Hydra list with each path single-quoted; a single path stays a path.
divclip_files_value() {
    local var="$1" value="$2" item out=() items
    if [[ "$value" == \[* ]]; then
        echo "$value"
        return
    fi
    IFS=$', \t\n' read -r -a items <<< "$value"
    [[ ${#items[@]} -gt 0 ]] || divclip_die "$var is set but empty"
    for item in "${items[@]}"; do
        out+=("$(divclip_quoted "$var" "$item")")
    done
    if [[ ${#out[@]} -eq 1 ]]; then
        echo "${out[0]}"
    else
        local IFS=,
        echo "[${out[*]}]"
    fi
}

divclip_positive_int() {
    local var="$1" value="$2"
    [[ "$value" =~ ^[1-9][0-9]*$ ]] || divclip_die "$var must be a positive integer, got '$value'"
}

# Fills the global array DIVCLIP_ENV_OVERRIDES from the environment.
divclip_env_overrides() {
    DIVCLIP_ENV_OVERRIDES=()
    if [[ -n "${MODEL_PATH:-}" ]]; then DIVCLIP_ENV_OVERRIDES+=("actor_rollout_ref.model.path=$(divclip_quoted MODEL_PATH "$MODEL_PATH")"); fi
    if [[ -n "${TRAIN_FILES:-}" ]]; then
        DIVCLIP_ENV_OVERRIDES+=("data.train_files=$(divclip_files_value TRAIN_FILES "$TRAIN_FILES")")
    fi
    if [[ -n "${VAL_FILES:-}" ]]; then
        DIVCLIP_ENV_OVERRIDES+=("data.val_files=$(divclip_files_value VAL_FILES "$VAL_FILES")")
    fi
    if [[ -n "${NNODES:-}" ]]; then
        divclip_positive_int NNODES "$NNODES"
        DIVCLIP_ENV_OVERRIDES+=("trainer.nnodes=$NNODES")
    fi
    if [[ -n "${GPUS_PER_NODE:-}" ]]; then
        divclip_positive_int GPUS_PER_NODE "$GPUS_PER_NODE"
        DIVCLIP_ENV_OVERRIDES+=("trainer.n_gpus_per_node=$GPUS_PER_NODE")
    fi
    if [[ -n "${CKPT_DIR:-}" ]]; then DIVCLIP_ENV_OVERRIDES+=("trainer.default_local_dir=$(divclip_quoted CKPT_DIR "$CKPT_DIR")"); fi
    if [[ -n "${PROJECT_NAME:-}" ]]; then DIVCLIP_ENV_OVERRIDES+=("trainer.project_name=$(divclip_quoted PROJECT_NAME "$PROJECT_NAME")"); fi
    if [[ -n "${EXPERIMENT_NAME:-}" ]]; then DIVCLIP_ENV_OVERRIDES+=("trainer.experiment_name=$(divclip_quoted EXPERIMENT_NAME "$EXPERIMENT_NAME")"); fi
    if [[ -n "${STRATEGY:-}" ]]; then
        [[ "$STRATEGY" =~ ^[a-z0-9_]+$ ]] || divclip_die "STRATEGY must be a verl strategy name (fsdp2, fsdp, ...), got '$STRATEGY'"
        DIVCLIP_ENV_OVERRIDES+=("actor_rollout_ref.actor.strategy=$STRATEGY")
    fi
    if [[ -n "${VOCAB_PASS:-}" ]]; then DIVCLIP_ENV_OVERRIDES+=("actor_rollout_ref.actor.policy_loss.vocab_pass=$(divclip_bool VOCAB_PASS "$VOCAB_PASS")"); fi
    divclip_mode_overrides
    return 0
}

# MODE (and, for separate_async, its rollout pool and weight transfer) -> DIVCLIP_ENV_OVERRIDES.
divclip_mode_overrides() {
    local mode="${MODE:-}"
    [[ -n "$mode" ]] || { [[ -z "${ROLLOUT_GPUS_PER_NODE:-}${ROLLOUT_NNODES:-}${CKPT_ENGINE:-}" ]] \
        || divclip_die "ROLLOUT_GPUS_PER_NODE / ROLLOUT_NNODES / CKPT_ENGINE configure MODE=separate_async; MODE is unset"; return 0; }
    case "$mode" in
        sync | colocate_async | separate_async) DIVCLIP_ENV_OVERRIDES+=("trainer.v1.trainer_mode=$mode") ;;
        *) divclip_die "MODE must be sync, colocate_async or separate_async, got '$mode'" ;;
    esac
    if [[ "$mode" != separate_async ]]; then
        [[ -z "${ROLLOUT_GPUS_PER_NODE:-}${ROLLOUT_NNODES:-}${CKPT_ENGINE:-}" ]] \
            || divclip_die "ROLLOUT_GPUS_PER_NODE / ROLLOUT_NNODES / CKPT_ENGINE configure MODE=separate_async, not MODE=$mode"
        return 0
    fi
    [[ -n "${ROLLOUT_GPUS_PER_NODE:-}" ]] \
        || divclip_die "MODE=separate_async generates on a standalone rollout pool: set ROLLOUT_GPUS_PER_NODE (its GPUs per node)"
    divclip_positive_int ROLLOUT_GPUS_PER_NODE "$ROLLOUT_GPUS_PER_NODE"
    divclip_positive_int ROLLOUT_NNODES "${ROLLOUT_NNODES:-1}"
    [[ "${CKPT_ENGINE:-nccl}" =~ ^[a-z0-9_]+$ ]] || divclip_die "CKPT_ENGINE must be a checkpoint engine name, got '$CKPT_ENGINE'"
    DIVCLIP_ENV_OVERRIDES+=("actor_rollout_ref.rollout.n_gpus_per_node=$ROLLOUT_GPUS_PER_NODE"
                            "actor_rollout_ref.rollout.nnodes=${ROLLOUT_NNODES:-1}"
                            "actor_rollout_ref.rollout.checkpoint_engine.backend=${CKPT_ENGINE:-nccl}")
}

# 1/true/0/false -> true/false (a Hydra bool), anything else exits 2 naming the variable.
divclip_bool() {
    case "${2,,}" in
        1 | true) echo true ;;
        0 | false) echo false ;;
        *) divclip_die "$1 must be 1, true, 0 or false, got '$2'" ;;
    esac
}

divclip_check_experiment() {
    [[ -f "$DIVCLIP_EXPERIMENTS_DIR/$1.yaml" ]] \
        || divclip_die "no experiment config configs/experiments/$1.yaml"
}

# A `+profile=<name>` override must name configs/profile/<name>.yaml: checked here, before Python
# starts, so a typo exits 2 naming the key instead of reaching Hydra (or a cluster queue).
divclip_check_profiles() {
    local arg name known
    for arg in "$@"; do
        case "$arg" in
            +profile=* | ++profile=* | profile=*)
                name="${arg#*=}"
                if [[ ! -f "$DIVCLIP_ROOT/configs/profile/$name.yaml" ]]; then
                    known="$(cd "$DIVCLIP_ROOT/configs/profile" && ls -- *.yaml 2>/dev/null | sed 's/\.yaml$//' | tr '\n' ' ')"
                    divclip_die "+profile=$name: no configs/profile/$name.yaml; profiles: ${known% }" \
                        "(default without +profile: the paper-text configs)"
                fi
                ;;
        esac
    done
    return 0
}

# Splits arguments into flags (--dry-run, Hydra's --config-name X, -cn X, ...) and overrides into
# the global arrays DIVCLIP_FLAGS / DIVCLIP_OVERRIDES: Hydra's parser needs every flag before
# the first override, and the launcher puts its own overrides first.
divclip_split_args() {
    DIVCLIP_FLAGS=()
    DIVCLIP_OVERRIDES=()
    while [[ $# -gt 0 ]]; do
        case "$1" in
            --config-name | -cn | --config-path | -cp | --config-dir | -cd | --cfg | -c | --package | -p | \
                --experimental-rerun)
                [[ $# -ge 2 ]] || divclip_die "$1 needs a value"
                DIVCLIP_FLAGS+=("$1" "$2")
                shift
                ;;
            -*) DIVCLIP_FLAGS+=("$1") ;;
            *) DIVCLIP_OVERRIDES+=("$1") ;;
        esac
        shift
    done
    return 0
}

# divclip_launch <experiment> [--dry-run] [hydra flags] [hydra overrides...]; replaces the shell.
divclip_launch() {
    local experiment="$1"
    shift
    divclip_check_experiment "$experiment"
    divclip_env_overrides
    if [[ -n "${DATA_DIR:-}" ]]; then export DIVCLIP_DATA_DIR="$DATA_DIR"; fi
    export DIVCLIP_DATA_DIR="${DIVCLIP_DATA_DIR:-$DIVCLIP_ROOT/data}"
    cd "$DIVCLIP_ROOT"   # relative paths in the configs (recipe/reward/score.py) are repo-relative
    divclip_split_args "$@"
    divclip_check_profiles "${DIVCLIP_OVERRIDES[@]}"
    exec "$(divclip_python)" -m recipe.main "${DIVCLIP_FLAGS[@]}" "+experiments=$experiment" \
        "${DIVCLIP_ENV_OVERRIDES[@]}" "${DIVCLIP_OVERRIDES[@]}"
}

# ---------------------------------------------------------------------------------------------
# SFT stage (ATR paper): divclip_launch_sft <sft experiment> [--dry-run] [hydra overrides...]
# runs `python -m recipe.sft +sft=<experiment> ...` (configs/sft/<experiment>.yaml), or
# `torchrun --standalone --nproc_per_node=$GPUS_PER_NODE -m recipe.sft ...` for more than one GPU.
# Environment (unset = the config's value):
#   MODEL_PATH     model.path                 TRAIN_FILES  data.train_files
#   GPUS_PER_NODE  trainer.n_gpus_per_node    CKPT_DIR     trainer.default_local_dir
#   MERGED_DIR     divclip.merged_dir (the merged HF model the RL scripts take as MODEL_PATH)
#   PROJECT_NAME / EXPERIMENT_NAME / DATA_DIR / PYTHON as above
divclip_launch_sft() {
    local experiment="$1" overrides=() dry=0 arg
    shift
    [[ -f "$DIVCLIP_ROOT/configs/sft/$experiment.yaml" ]] || divclip_die "no SFT config configs/sft/$experiment.yaml"
    if [[ -n "${MODEL_PATH:-}" ]]; then overrides+=("model.path=$(divclip_quoted MODEL_PATH "$MODEL_PATH")"); fi
    if [[ -n "${TRAIN_FILES:-}" ]]; then overrides+=("data.train_files=$(divclip_files_value TRAIN_FILES "$TRAIN_FILES")"); fi
    if [[ -n "${GPUS_PER_NODE:-}" ]]; then
        divclip_positive_int GPUS_PER_NODE "$GPUS_PER_NODE"
        overrides+=("trainer.n_gpus_per_node=$GPUS_PER_NODE")
    fi
    if [[ -n "${CKPT_DIR:-}" ]]; then overrides+=("trainer.default_local_dir=$(divclip_quoted CKPT_DIR "$CKPT_DIR")"); fi
    if [[ -n "${MERGED_DIR:-}" ]]; then overrides+=("divclip.merged_dir=$(divclip_quoted MERGED_DIR "$MERGED_DIR")"); fi
    if [[ -n "${PROJECT_NAME:-}" ]]; then overrides+=("trainer.project_name=$(divclip_quoted PROJECT_NAME "$PROJECT_NAME")"); fi
    if [[ -n "${EXPERIMENT_NAME:-}" ]]; then overrides+=("trainer.experiment_name=$(divclip_quoted EXPERIMENT_NAME "$EXPERIMENT_NAME")"); fi
    if [[ -n "${DATA_DIR:-}" ]]; then export DIVCLIP_DATA_DIR="$DATA_DIR"; fi
    export DIVCLIP_DATA_DIR="${DIVCLIP_DATA_DIR:-$DIVCLIP_ROOT/data}"
    cd "$DIVCLIP_ROOT"   # data.custom_cls.path=recipe/sft_dataset.py is repo-relative
    divclip_split_args "$@"
    for arg in "${DIVCLIP_FLAGS[@]}"; do [[ "$arg" == --dry-run ]] && dry=1; done
    local python
    python="$(divclip_python)"
    if [[ $dry -eq 0 && "${GPUS_PER_NODE:-1}" -gt 1 ]]; then
        exec "$python" -m torch.distributed.run --standalone --nproc_per_node="$GPUS_PER_NODE" -m recipe.sft \
            "${DIVCLIP_FLAGS[@]}" "+sft=$experiment" "${overrides[@]}" "${DIVCLIP_OVERRIDES[@]}"
    fi
    exec "$python" -m recipe.sft "${DIVCLIP_FLAGS[@]}" "+sft=$experiment" "${overrides[@]}" "${DIVCLIP_OVERRIDES[@]}"
}

#!/usr/bin/env bash
# ATR paper baselines: Table 2 (clip rules), Table 3 (clip epsilons, KL variants) and the delta
# ablation, each a row on top of configs/experiments/atr_grpo_qwen3_<ATR_MODEL>.yaml.
#
#   bash launch/sweep_atr_baselines.sh [--list] [--dry-run] [--only NAME[,NAME...]] [--seeds S[,S...]] [hydra overrides...]
#
#   --list      print "NAME<TAB>overrides" for every row and exit
#   --dry-run   dry-run every selected row; stdout is one YAML document per run ("--- # NAME" or
#               "--- # NAME_seedS")
#   --only      run just these rows (names from --list)
#   --seeds     run every row once per seed (data.seed, which also seeds the LoRA init and vLLM);
#               Table 3 reports mean +- std over 3 runs: --seeds 1,2,3. Default: the config's seed, one run.
#               (SEEDS="1,2,3" in the environment does the same.)
#   ATR_MODEL   1.7b (default) or 8b
#   SWEEP_JOBS  dry runs in parallel (default 1); real runs are always sequential
# Extra Hydra overrides apply to every row. Each row's trainer.experiment_name is
# atr_<ATR_MODEL>_<NAME> (or $EXPERIMENT_NAME_<NAME>), with _seed<S> appended under --seeds.
# Other environment: launch/common.sh.
# The rows and the choices behind them are documented in docs/experiments.md.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

A=actor_rollout_ref.actor
P=$A.policy_loss
eps() { echo "$P.loss_mode=clip $A.clip_ratio_low=$1 $A.clip_ratio_high=$2"; }

# name | overrides (space-separated Hydra overrides on top of the ATR config)
ROWS=(
    # Table 2
    "clip|$(eps 0.2 0.2)"
    "clip_higher|$(eps 0.2 0.28)"
    "dual_clip|$(eps 0.2 0.2) $P.dual_clip_c=3.0"
    "dynamic_clip|$P.loss_mode=dcpo $A.clip_ratio_low=0.2 $A.clip_ratio_high=0.2 $P.dcpo_cap=10.0"
    "clip_cov|$P.loss_mode=clip_cov $A.clip_ratio_low=0.2 $A.clip_ratio_high=0.2 $P.clip_cov_ratio=0.0002 $P.clip_cov_lb=1.0 $P.clip_cov_ub=5.0"
    "soft_gate|$P.loss_mode=sapo $A.tau_pos=1.0 $A.tau_neg=1.05"
    "atr|$P.loss_mode=kl3 $P.delta=0.07"
    # Table 3: symmetric clip epsilons (0.2 is the Table 2 "clip" row); 0.329 / 0.422 are the
    # lower / upper ratio bounds of KL3 at delta 0.07
    "clip_eps0.1|$(eps 0.1 0.1)"
    "clip_eps0.3|$(eps 0.3 0.3)"
    "clip_eps0.4|$(eps 0.4 0.4)"
    "clip_eps0.5|$(eps 0.5 0.5)"
    "clip_eps0.329|$(eps 0.329 0.329)"
    "clip_eps0.422|$(eps 0.422 0.422)"
    "clip_higher_0.329_0.5|$(eps 0.329 0.5)"
    "clip_higher_0.329_0.6|$(eps 0.329 0.6)"
    "kl1|$P.loss_mode=kl1 $P.delta=0.07"
    "kl2|$P.loss_mode=kl2 $P.delta=0.07"
    "full_kl_guided|$P.loss_mode=trgppo $P.delta=0.07 $A.clip_ratio_low=0.2 $A.clip_ratio_high=0.2"
    "is_kl3|$P.loss_mode=is_kl3 $P.delta=0.07"
    # the exact per-token trust region (ATR Eq. 4) the paper calls intractable: KL over pi_old's
    # stored top-32 + tail bucket (docs/losses.md#kl_full)
    "kl_full|$P.loss_mode=kl_full $P.delta=0.07 $P.kl_full_top_k=32"
    # delta ablation of ATR (kl3); 0.07 is the "atr" row
    "atr_delta0.01|$P.loss_mode=kl3 $P.delta=0.01"
    "atr_delta0.03|$P.loss_mode=kl3 $P.delta=0.03"
    "atr_delta0.05|$P.loss_mode=kl3 $P.delta=0.05"
    "atr_delta0.1|$P.loss_mode=kl3 $P.delta=0.1"
    "atr_delta0.15|$P.loss_mode=kl3 $P.delta=0.15"
    # Sec. 6.5, sequence-level integration: KL3 of GSPO's sequence ratio <= delta
    "seq_kl3|$P.loss_mode=seq_kl3 $P.delta=0.07"
)

list=0
dry=0
only=""
seeds="${SEEDS:-}"
extra=()
while [[ $# -gt 0 ]]; do
    case "$1" in
        --list) list=1 ;;
        --dry-run) dry=1 ;;
        --only)
            [[ $# -ge 2 ]] || divclip_die "--only needs a comma-separated list of row names (see --list)"
            only="$2"
            shift
            ;;
        --only=*) only="${1#--only=}" ;;
        --seeds)
            [[ $# -ge 2 ]] || divclip_die "--seeds needs a comma-separated list of integer seeds, e.g. 1,2,3"
            seeds="$2"
            shift
            ;;
        --seeds=*) seeds="${1#--seeds=}" ;;
        *) extra+=("$1") ;;
    esac
    shift
done

model="${ATR_MODEL:-1.7b}"
case "$model" in
    1.7b | 8b) ;;
    *) divclip_die "ATR_MODEL must be 1.7b or 8b, got '$model'" ;;
esac
experiment="atr_grpo_qwen3_$model"
jobs="${SWEEP_JOBS:-1}"
divclip_positive_int SWEEP_JOBS "$jobs"

names=()
declare -A overrides=()
for row in "${ROWS[@]}"; do
    names+=("${row%%|*}")
    overrides["${row%%|*}"]="${row#*|}"
done

selected=("${names[@]}")
if [[ -n "$only" ]]; then
    IFS=, read -r -a selected <<< "$only"
    for name in "${selected[@]}"; do
        [[ -n "${overrides[$name]+x}" ]] || divclip_die "unknown row '$name'; rows: ${names[*]}"
    done
fi

# runs: "NAME" (the config's seed) or "NAME@SEED" for each seed
seed_list=()
if [[ -n "$seeds" ]]; then
    IFS=, read -r -a seed_list <<< "$seeds"
    [[ ${#seed_list[@]} -gt 0 ]] || divclip_die "--seeds is empty"
    declare -A seen_seed=()
    for seed in "${seed_list[@]}"; do
        [[ "$seed" =~ ^[0-9]+$ ]] || divclip_die "--seeds: '$seed' is not a non-negative integer (in '$seeds')"
        [[ -z "${seen_seed[$seed]+x}" ]] || divclip_die "--seeds: seed $seed given twice (in '$seeds')"
        seen_seed[$seed]=1
    done
fi
runs=()
for name in "${selected[@]}"; do
    if [[ ${#seed_list[@]} -eq 0 ]]; then
        runs+=("$name")
    else
        for seed in "${seed_list[@]}"; do runs+=("$name@$seed"); done
    fi
done

if [[ $list -eq 1 ]]; then
    for name in "${selected[@]}"; do printf '%s\t%s\n' "$name" "${overrides[$name]}"; done
    exit 0
fi

base_name="${EXPERIMENT_NAME:-atr_${model}}"

# "NAME@SEED" -> "NAME_seedSEED" (the run's label and experiment-name suffix); "NAME" stays.
run_label() {
    if [[ "$1" == *@* ]]; then echo "${1%@*}_seed${1#*@}"; else echo "$1"; fi
}

# One run in a subshell: divclip_launch execs recipe.main with the row's overrides, then ours.
run_row() {
    local run="$1" name="${1%@*}" row_overrides
    read -r -a row_overrides <<< "${overrides[$name]}"
    if [[ "$run" == *@* ]]; then row_overrides+=("data.seed=${run#*@}"); fi
    (
        export EXPERIMENT_NAME="${base_name}_$(run_label "$run")"
        if [[ $dry -eq 1 ]]; then
            divclip_launch "$experiment" --dry-run "${row_overrides[@]}" "${extra[@]}"
        else
            divclip_launch "$experiment" "${row_overrides[@]}" "${extra[@]}"
        fi
    )
}

if [[ $dry -eq 0 ]]; then
    for run in "${runs[@]}"; do
        echo "=== sweep run $(run_label "$run"): ${overrides[${run%@*}]}" >&2
        run_row "$run" || divclip_die "run '$(run_label "$run")' failed (exit $?)"
    done
    exit 0
fi

# Dry runs: up to SWEEP_JOBS at once, printed in row order; any failure fails the sweep.
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
for i in "${!runs[@]}"; do
    {
        if run_row "${runs[$i]}" > "$tmp/$i.yaml" 2> "$tmp/$i.err"; then echo 0; else echo $?; fi > "$tmp/$i.rc"
    } &
    while [[ $(jobs -rp | wc -l) -ge $jobs ]]; do wait -n || true; done
done
wait
failed=0
for i in "${!runs[@]}"; do
    if [[ "$(cat "$tmp/$i.rc" 2>/dev/null)" == 0 ]]; then
        echo "--- # $(run_label "${runs[$i]}")"
        cat "$tmp/$i.yaml"
    else
        echo "run '$(run_label "${runs[$i]}")' failed:" >&2
        tail -n 20 "$tmp/$i.err" >&2
        failed=1
    fi
done
exit $failed

#!/usr/bin/env bash
# The main job on a CPU default: verl 0.9.1's v1 trainer end to end through `python -m recipe.main`
# (local Ray, FSDP2 actor on the cpu platform, hf_cpu rollouts, our reward, GRPO advantages, the
# divclip losses, validation, checkpoints) on a synthetic task and a tiny random Qwen3 it generates.
# Nothing is downloaded. See docs/cpu_end_to_end.md.
#
#   bash launch/run_smoke_cpu.sh [extra hydra overrides...]
#
# Environment:
#   LOSS=erc_dapo|kl3|kl_full (default erc_dapo)   STEPS=40   SMOKE_OUT=outputs/smoke/$LOSS
#   TASK=echo   N_DEVICES=1 (device slots per node)   NNODES=1   BATCH=16 prompts x ROLLOUT_N=8   LR=5e-3
#   TEST_FREQ=5   SAVE_FREQ=10   DATA_TRACE=FILE: each step's prompts (dataset index, uid) as JSON lines
#   NNODES > 1 needs a Ray cluster (RAY_ADDRESS, e.g. through launch/submit.sh) whose nodes advertise
#   N_DEVICES "cpu_device" slots each (ray start --resources='{"cpu_device": N_DEVICES}'; docs/cpu_platform.md).
#   ROLLOUT_DEVICES=N (default 0): a standalone rollout pool of N "cpu_device" slots per node for
#   trainer.v1.trainer_mode=separate_async (sets actor_rollout_ref.rollout.nnodes=NNODES and
#   rollout.n_gpus_per_node=N; the local Ray gets N more slots, each with 2 CPUs for its bundle). The mode
#   itself and its other keys are Hydra overrides; see docs/cpu_platform.md, "Asynchronous trainer modes".
#   RESPONSE_LEN=4: data.max_response_length (longer responses give the async modes' aborts something to cut).
#   REQUIRE_MARGIN=1: exit non-zero unless the last-5 mean reward beats the first-5 clearly.
#   VOCAB_PASS=1: log-probs and entropies of both actor passes by the vocabulary pass (no logits tensor).
#   PRECISION=fp32|bf16 (default fp32): the actor's FSDP mixed precision; bf16 is verl's default (bf16 parameters
#   in compute, fp32 reduction), the precision GPU users run.
#   DYNAMIC_BSZ=TOKENS: dynamic batching as the configs run it -- the update's micro-batches hold up to TOKENS
#   tokens (actor.ppo_max_token_len_per_gpu), mini-batches shuffled; the old-log-prob pass is packed as the
#   update (policy_loss.pack_old_log_prob_as_update, the default), or with PACK_OLD_LOG_PROB_AS_UPDATE=false
#   by verl's own packing at its own budget, 2 x TOKENS (rollout.log_prob_max_token_len_per_gpu): the control
#   (actor.shuffle=true); unset: fixed micro-batches of 64 sequences in both passes.
#   HEAD_SCALE=S: the generated model's output head multiplied by S (larger logits, as a trained model's).
#   ROLLOUT=hf_cpu|vllm (default hf_cpu): the rollout engine. vllm is verl's own vLLM server on vLLM's CPU build:
#   it needs the second environment (bash launch/setup_vllm_venv.sh; PYTHON defaults to .venv-vllm/bin/python),
#   generates the model with head_dim 32 (vLLM's CPU attention has no kernel for 16), rolls out in bf16 with no
#   sleep/wake (free_cache_engine=False) and syncs the weights through verl's shared-memory path. docs/vllm_cpu.md.
#   SMOKE_MODEL=DIR: start RL from this Hugging Face model instead of the generated random one (the
#   SFT -> RL chain: the merged output of `python -m recipe.sft` on data/sft_train.parquet, which
#   `python -m recipe.smoke.task --sft N` writes; tests/test_sft_chain_cpu.py).
# Re-running with the same SMOKE_OUT and a larger STEPS resumes from the last checkpoint.
# Writes $SMOKE_OUT/metrics.jsonl (verl file-logger lines, all attempts merged), curves.png and
# report.json.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
ROLLOUT="${ROLLOUT:-hf_cpu}"
if [[ -z "${PYTHON:-}" ]]; then
  if [[ "$ROLLOUT" == vllm ]]; then
    bash "$ROOT/launch/setup_vllm_venv.sh"
    PYTHON="$ROOT/.venv-vllm/bin/python"
  else
    bash "$ROOT/launch/setup_venv.sh"
    PYTHON="$ROOT/.venv/bin/python"
  fi
fi
LOSS="${LOSS:-erc_dapo}"
STEPS="${STEPS:-40}"
TASK="${TASK:-echo}"
SMOKE_OUT="$(mkdir -p "${SMOKE_OUT:-outputs/smoke/$LOSS}" && cd "${SMOKE_OUT:-outputs/smoke/$LOSS}" && pwd)"
N_DEVICES="${N_DEVICES:-1}"
ROLLOUT_DEVICES="${ROLLOUT_DEVICES:-0}"
NNODES="${NNODES:-1}"
BATCH="${BATCH:-16}"
if [[ "$NNODES" != 1 && -z "${RAY_ADDRESS:-}" ]]; then
  echo "run_smoke_cpu.sh: NNODES=$NNODES needs a Ray cluster of that many nodes (RAY_ADDRESS, or launch/submit.sh)" >&2
  exit 2
fi

case "$LOSS" in
  erc_dapo)  # ERC on DAPO clip-higher (ERC paper), beta 0.05/0.05
    LOSS_ARGS=(actor_rollout_ref.actor.policy_loss.loss_mode=clip
               actor_rollout_ref.actor.clip_ratio_low=0.2 actor_rollout_ref.actor.clip_ratio_high=0.28
               actor_rollout_ref.actor.policy_loss.erc_beta_low=0.05 actor_rollout_ref.actor.policy_loss.erc_beta_high=0.05
               actor_rollout_ref.actor.calculate_entropy=True) ;;
  kl3)       # ATR-GRPO, delta 0.07
    LOSS_ARGS=(actor_rollout_ref.actor.policy_loss.loss_mode=kl3 actor_rollout_ref.actor.policy_loss.delta=0.07) ;;
  kl_full)   # the exact trust region (ATR Eq. 4) over pi_old's top-8 of the 33-token vocabulary + tail, delta 0.07
    LOSS_ARGS=(actor_rollout_ref.actor.policy_loss.loss_mode=kl_full actor_rollout_ref.actor.policy_loss.delta=0.07
               actor_rollout_ref.actor.policy_loss.kl_full_top_k=8 actor_rollout_ref.actor.policy_loss.kl_full_diagnostic=True) ;;
  *) echo "run_smoke_cpu.sh: LOSS must be erc_dapo, kl3 or kl_full, got '$LOSS'" >&2; exit 2 ;;
esac
HEAD_DIM=16
case "$ROLLOUT" in
  hf_cpu) ROLLOUT_ARGS=(actor_rollout_ref.rollout.name=hf_cpu actor_rollout_ref.rollout.dtype=float32) ;;
  vllm)   # verl's vLLMHttpServer on vLLM's CPU backend (docs/vllm_cpu.md)
    HEAD_DIM=32
    ROLLOUT_ARGS=(actor_rollout_ref.rollout.name=vllm actor_rollout_ref.rollout.dtype=bfloat16
                  actor_rollout_ref.rollout.enforce_eager=True actor_rollout_ref.rollout.free_cache_engine=False
                  +actor_rollout_ref.rollout.enable_sleep_mode=False)
    export VLLM_CPU_KVCACHE_SPACE="${VLLM_CPU_KVCACHE_SPACE:-1}" ;;
  *) echo "run_smoke_cpu.sh: ROLLOUT must be hf_cpu or vllm, got '$ROLLOUT'" >&2; exit 2 ;;
esac
case "${PRECISION:-fp32}" in
  fp32) PACKING_ARGS=(+actor_rollout_ref.actor.fsdp_config.mixed_precision='{param_dtype:fp32,reduce_dtype:fp32,buffer_dtype:fp32}') ;;
  bf16) PACKING_ARGS=(+actor_rollout_ref.actor.fsdp_config.mixed_precision='{param_dtype:bf16,reduce_dtype:fp32,buffer_dtype:fp32}') ;;
  *) echo "run_smoke_cpu.sh: PRECISION must be fp32 or bf16, got '$PRECISION'" >&2; exit 2 ;;
esac
if [[ -n "${DYNAMIC_BSZ:-}" ]]; then
  [[ "$DYNAMIC_BSZ" =~ ^[1-9][0-9]*$ ]] || { echo "run_smoke_cpu.sh: DYNAMIC_BSZ must be a token count, got '$DYNAMIC_BSZ'" >&2; exit 2; }
  PACKING_ARGS+=(actor_rollout_ref.actor.use_dynamic_bsz=True actor_rollout_ref.rollout.log_prob_use_dynamic_bsz=True
                 actor_rollout_ref.actor.ppo_max_token_len_per_gpu="$DYNAMIC_BSZ"
                 actor_rollout_ref.actor.shuffle=True)
fi
case "${PACK_OLD_LOG_PROB_AS_UPDATE:-true}" in
  true) ;;
  false) PACKING_ARGS+=(actor_rollout_ref.actor.policy_loss.pack_old_log_prob_as_update=false)
         [[ -n "${DYNAMIC_BSZ:-}" ]] && PACKING_ARGS+=(actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu=$((2 * DYNAMIC_BSZ))) ;;
  *) echo "run_smoke_cpu.sh: PACK_OLD_LOG_PROB_AS_UPDATE must be true or false, got '$PACK_OLD_LOG_PROB_AS_UPDATE'" >&2; exit 2 ;;
esac
case "${VOCAB_PASS:-}" in
  "") ;;
  1 | true | TRUE | True) LOSS_ARGS+=(actor_rollout_ref.actor.policy_loss.vocab_pass=true) ;;
  0 | false | FALSE | False) LOSS_ARGS+=(actor_rollout_ref.actor.policy_loss.vocab_pass=false) ;;
  *) echo "run_smoke_cpu.sh: VOCAB_PASS must be 1, true, 0 or false, got '$VOCAB_PASS'" >&2; exit 2 ;;
esac

export VERL_PLATFORM=cpu              # the cpu platform, Ray CPU pools and hf_cpu rollout (verl_ext plugin)
export TOKENIZERS_PARALLELISM=false RAY_DEDUP_LOGS=0 RAY_USAGE_STATS_ENABLED=0
# torch's OpenMP threads sleep between parallel regions instead of spinning: the run's nine processes share a few
# cores, and a spinning thread takes one from the others (the run's thread counts, and its results, unchanged).
export OMP_WAIT_POLICY="${OMP_WAIT_POLICY:-PASSIVE}"
# verl's file logger truncates its file on open: each attempt gets its own log, merged afterwards.
mkdir -p "$SMOKE_OUT/logs"
export VERL_FILE_LOGGER_PATH="$SMOKE_OUT/logs/attempt-$(date +%Y%m%d-%H%M%S)-$$.jsonl"

# 1. Task, model and tokenizer, generated locally.
if [[ ! -f "$SMOKE_OUT/assets/model/config.json" || ! -f "$SMOKE_OUT/assets/data/train.parquet" ]]; then
  "$PYTHON" -m recipe.smoke.task --out "$SMOKE_OUT/assets" --task "$TASK" --head-scale "${HEAD_SCALE:-1}" --head-dim "$HEAD_DIM"
fi

# A local Ray of our own unless we run inside a Ray job (then Ray owns the resources).
# These variables travel in Ray's runtime env too: on a cluster started by `ray start` (a Ray job),
# the TaskRunner and workers do not inherit this shell's environment.
RAY_ARGS=(+ray_kwargs.ray_init.include_dashboard=False
          +ray_kwargs.ray_init.runtime_env.env_vars.VERL_PLATFORM=cpu
          "+ray_kwargs.ray_init.runtime_env.env_vars.VERL_FILE_LOGGER_PATH=$VERL_FILE_LOGGER_PATH")
if [[ -z "${RAY_ADDRESS:-}" ]]; then
  # address=local: a new Ray of our own even where another cluster runs on this machine (a bare
  # ray.init would join the newest one it finds and then refuse num_cpus).
  # Ray's CPU count is logical: it oversubscribes 2 cores on purpose (each device slot's bundle holds
  # 3 for its colocated workers; the TaskRunner, rollout, reward and TransferQueue hold more). The
  # device slots are the cpu platform's "cpu_device" resource, as GPUs are on a GPU node.
  # A standalone rollout pool (ROLLOUT_DEVICES) adds its slots, each bundle holding 2 CPUs (verl's
  # init_standalone pools colocate 2 worker groups).
  RAY_ARGS+=(+ray_kwargs.ray_init.address=local ray_kwargs.ray_init.num_cpus=$((5 + 3 * N_DEVICES + 2 * ROLLOUT_DEVICES))
             "+ray_kwargs.ray_init.resources={cpu_device:$((N_DEVICES + ROLLOUT_DEVICES))}"
             +ray_kwargs.ray_init._node_ip_address=127.0.0.1)
fi
ROLLOUT_POOL_ARGS=()
if [[ "$ROLLOUT_DEVICES" != 0 ]]; then
  ROLLOUT_POOL_ARGS=(actor_rollout_ref.rollout.nnodes="$NNODES" actor_rollout_ref.rollout.n_gpus_per_node="$ROLLOUT_DEVICES")
fi
if [[ -n "${DATA_TRACE:-}" ]]; then RAY_ARGS+=("divclip.data_trace=$DATA_TRACE"); fi
if [[ "$ROLLOUT" == vllm ]]; then
  RAY_ARGS+=("+ray_kwargs.ray_init.runtime_env.env_vars.VLLM_CPU_KVCACHE_SPACE='$VLLM_CPU_KVCACHE_SPACE'")
fi

# 2. verl's trainer through the recipe's entry point. Two PPO mini-batches a step make the second
#    update off-policy, as in the papers, so ERC's entropy ratio and KL3's ratio leave 1.
"$PYTHON" -m recipe.main \
  trainer.device=cpu trainer.nnodes="$NNODES" trainer.n_gpus_per_node="$N_DEVICES" \
  trainer.total_training_steps="$STEPS" trainer.total_epochs=1000 \
  trainer.val_before_train=True trainer.test_freq="${TEST_FREQ:-5}" trainer.save_freq="${SAVE_FREQ:-10}" \
  trainer.resume_mode=auto trainer.default_local_dir="$SMOKE_OUT/ckpt" \
  trainer.logger='[console,file]' trainer.project_name=divclip_smoke trainer.experiment_name="$LOSS" \
  "${RAY_ARGS[@]}" "${ROLLOUT_POOL_ARGS[@]}" \
  transfer_queue.backend.SimpleStorage.num_data_storage_units=1 \
  data.train_files="$SMOKE_OUT/assets/data/train.parquet" data.val_files="$SMOKE_OUT/assets/data/val.parquet" \
  data.train_batch_size="$BATCH" data.max_prompt_length=24 data.max_response_length="${RESPONSE_LEN:-4}" \
  data.filter_overlong_prompts=False data.truncation=error data.dataloader_num_workers=0 \
  algorithm.adv_estimator=grpo algorithm.use_kl_in_reward=False \
  actor_rollout_ref.model.path="${SMOKE_MODEL:-$SMOKE_OUT/assets/model}" actor_rollout_ref.model.use_remove_padding=True \
  +actor_rollout_ref.model.override_config.attn_implementation=sdpa \
  actor_rollout_ref.actor.strategy=fsdp2 actor_rollout_ref.actor.use_torch_compile=False \
  actor_rollout_ref.actor.fsdp_config.use_torch_compile=False \
  "${PACKING_ARGS[@]}" \
  actor_rollout_ref.actor.optim.lr="${LR:-5e-3}" \
  actor_rollout_ref.actor.ppo_mini_batch_size=$((BATCH / 2)) actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=64 \
  actor_rollout_ref.actor.use_kl_loss=False actor_rollout_ref.actor.entropy_coeff=0 \
  actor_rollout_ref.actor.loss_agg_mode=token-mean \
  actor_rollout_ref.actor.checkpoint.save_contents='[model,optimizer,extra]' \
  "${LOSS_ARGS[@]}" \
  "${ROLLOUT_ARGS[@]}" actor_rollout_ref.rollout.mode=async \
  actor_rollout_ref.rollout.n="${ROLLOUT_N:-8}" actor_rollout_ref.rollout.temperature=1.0 \
  actor_rollout_ref.rollout.tensor_model_parallel_size=1 \
  actor_rollout_ref.rollout.calculate_log_probs=True \
  actor_rollout_ref.rollout.agent.num_workers=1 \
  actor_rollout_ref.rollout.val_kwargs.temperature=0 actor_rollout_ref.rollout.val_kwargs.do_sample=False \
  actor_rollout_ref.rollout.val_kwargs.n=1 \
  reward.num_workers=1 \
  reward.custom_reward_function.path="$ROOT/recipe/reward/score.py" reward.custom_reward_function.name=compute_score \
  "$@"

# 3. Merge the attempts' logs, plot, and report the learning margin.
REPORT_ARGS=()
[[ "${REQUIRE_MARGIN:-0}" == 1 ]] && REPORT_ARGS+=(--require-margin)
"$PYTHON" -m recipe.smoke.report "$SMOKE_OUT" "${REPORT_ARGS[@]}"

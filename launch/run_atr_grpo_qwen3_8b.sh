#!/usr/bin/env bash
# ATR paper: ATR-GRPO (KL3 trust region, delta 0.07), Qwen3-8B + LoRA r32/a64 on DAPO-Math-17k.
# Config: configs/experiments/atr_grpo_qwen3_8b.yaml. Usage and environment: launch/common.sh, docs/experiments.md.
#   [MODEL_PATH=... TRAIN_FILES=... VAL_FILES=... NNODES=... GPUS_PER_NODE=...] bash launch/run_atr_grpo_qwen3_8b.sh [--dry-run] [hydra overrides...]
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
divclip_launch atr_grpo_qwen3_8b "$@"

#!/usr/bin/env bash
# ERC paper Table 1: GRPO (clip 0.2/0.2), DeepSeek-R1-Distill-Qwen-7B on KlearReasoner-MathSub-30K.
# Config: configs/experiments/grpo_7b.yaml. Usage and environment: launch/common.sh, docs/experiments.md.
#   [MODEL_PATH=... TRAIN_FILES=... VAL_FILES=... NNODES=... GPUS_PER_NODE=...] bash launch/run_grpo_7b.sh [--dry-run] [hydra overrides...]
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
divclip_launch grpo_7b "$@"

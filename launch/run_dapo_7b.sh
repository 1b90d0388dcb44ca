#!/usr/bin/env bash
# ERC paper Table 1: DAPO (clip-higher 0.2/0.28), DeepSeek-R1-Distill-Qwen-7B on KlearReasoner-MathSub-30K.
# Config: configs/experiments/dapo_7b.yaml. Usage and environment: launch/common.sh, docs/experiments.md.
#   [MODEL_PATH=... TRAIN_FILES=... VAL_FILES=... NNODES=... GPUS_PER_NODE=...] bash launch/run_dapo_7b.sh [--dry-run] [hydra overrides...]
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
divclip_launch dapo_7b "$@"

#!/usr/bin/env bash
# ERC paper Table 3: GPPO (gradient-preserving clip 0.2/0.2), DeepSeek-R1-Distill-Qwen-7B.
# Config: configs/experiments/gppo_7b.yaml. Usage and environment: launch/common.sh, docs/experiments.md.
#   [MODEL_PATH=... TRAIN_FILES=... VAL_FILES=... NNODES=... GPUS_PER_NODE=...] bash launch/run_gppo_7b.sh [--dry-run] [hydra overrides...]
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
divclip_launch gppo_7b "$@"

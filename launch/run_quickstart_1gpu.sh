#!/usr/bin/env bash
# Quick check of one GPU node: ERC-DAPO on Qwen3-0.6B, 2k responses, 5 steps, 1 GPU (a few minutes).
# Config: configs/experiments/quickstart_1gpu.yaml. Usage and environment: launch/common.sh, docs/experiments.md.
#   [MODEL_PATH=... TRAIN_FILES=... VAL_FILES=... NNODES=... GPUS_PER_NODE=...] bash launch/run_quickstart_1gpu.sh [--dry-run] [hydra overrides...]
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
divclip_launch quickstart_1gpu "$@"

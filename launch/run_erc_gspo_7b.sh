#!/usr/bin/env bash
# Beyond the papers: ERC-GSPO (verl's gspo loss + ERC beta 0.05/0.05), DeepSeek-R1-Distill-Qwen-7B.
# Config: configs/experiments/erc_gspo_7b.yaml. Usage and environment: launch/common.sh, docs/experiments.md.
#   [MODEL_PATH=... TRAIN_FILES=... VAL_FILES=... NNODES=... GPUS_PER_NODE=...] bash launch/run_erc_gspo_7b.sh [--dry-run] [hydra overrides...]
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
divclip_launch erc_gspo_7b "$@"

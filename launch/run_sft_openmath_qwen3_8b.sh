#!/usr/bin/env bash
# ATR paper, SFT stage (Appendix B): Qwen3-8b + LoRA r32/a64 on the OpenMathReasoning SFT set, one GPU,
# through verl 0.9.1's SFT trainer; writes the merged Hugging Face model that
# launch/run_atr_grpo_qwen3_8b.sh takes as MODEL_PATH. Data: python -m data_prep openmathreasoning.
# Config: configs/sft/openmath_qwen3_8b.yaml. Usage and environment: launch/common.sh, docs/experiments.md.
#   [MODEL_PATH=... TRAIN_FILES=... GPUS_PER_NODE=... CKPT_DIR=... MERGED_DIR=...] bash launch/run_sft_openmath_qwen3_8b.sh [--dry-run] [hydra overrides...]
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
divclip_launch_sft openmath_qwen3_8b "$@"

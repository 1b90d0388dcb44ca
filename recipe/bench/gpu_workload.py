"""What the GPU probe and the GPU acceptance run measure: the model, the strategies and the losses.

Both :mod:`recipe.bench.gpu` (the probe, one variant per process) and :mod:`recipe.bench.acceptance`
(every target in one call) build R1-Distill-Qwen-1.5B's shape from a config, run it under verl
0.9.1's FSDP1 and FSDP2 and configure ERC-DAPO, ``kl3`` and ``kl_full`` alike. That shared part lives
here, below both, so neither imports the other (``tests/test_layout.py`` checks that no module of the
project takes part in an import cycle); ``python -m recipe.bench gpu --acceptance`` reaches the
acceptance run through ``recipe.bench.__main__``.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

STRATEGIES = ("fsdp", "fsdp2")
"""``actor.strategy``: verl 0.9.1 builds ``fsdp`` (what the launch scripts resolve to) as FSDP1 and
``fsdp2`` as FSDP2; only FSDP2 runs on the CPU platform."""

R1_DISTILL_QWEN_1_5B: dict[str, Any] = dict(  # DeepSeek-R1-Distill-Qwen-1.5B's config.json (Qwen2 architecture)
    vocab_size=151_936,
    hidden_size=1536,
    intermediate_size=8960,
    num_hidden_layers=28,
    num_attention_heads=12,
    num_key_value_heads=2,
    max_position_embeddings=131_072,
    rope_theta=10_000.0,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
)


def build_model(path: Path, args: argparse.Namespace) -> None:
    """Write a random-weight Qwen2 model of the chosen shape to ``path`` (bf16 safetensors).

    Args:
        path: The folder to save the model into.
        args: The parsed options: ``layers`` and ``hidden`` (``None`` keeps R1-Distill-Qwen-1.5B's),
            ``vocab``, ``head_scale`` (multiplies the random output head, so that most tokens are
            confident, as a reasoning model's are) and ``device`` (``"cuda"`` builds on the GPU).
    """
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    shape = dict(R1_DISTILL_QWEN_1_5B)
    if args.layers is not None:
        shape["num_hidden_layers"] = args.layers
    if args.hidden is not None:
        shape.update(hidden_size=args.hidden, intermediate_size=4 * args.hidden,
                     num_attention_heads=max(1, args.hidden // 128), num_key_value_heads=1)
    shape["vocab_size"] = args.vocab
    torch.manual_seed(0)
    device = "cuda" if args.device == "cuda" else "cpu"
    with torch.device(device):
        model = Qwen2ForCausalLM(Qwen2Config(**shape))
    with torch.no_grad():
        model.lm_head.weight.mul_(args.head_scale)
    model.to(torch.bfloat16).save_pretrained(path)
    del model
    if device == "cuda":  # the children measure the GPU: hand the parent's cached blocks back
        torch.cuda.empty_cache()


def chosen_strategies(parser: argparse.ArgumentParser, args: argparse.Namespace) -> list[str]:
    """``--strategies`` checked (default: both on CUDA, FSDP2 on the CPU platform, where FSDP1 does not run).

    Args:
        parser: The command's parser; an unknown strategy, or FSDP1 on the CPU platform, exits through
            its ``error`` (exit code 2).
        args: The parsed options (``strategies``, a comma-separated string or ``None``, and ``device``).

    Returns:
        The strategies to run, in the order given.
    """
    strategies = [s for s in (args.strategies or ",".join(STRATEGIES if args.device == "cuda" else ("fsdp2",))).split(",") if s]
    if sorted(set(strategies) - set(STRATEGIES)):
        parser.error(f"unknown --strategies {sorted(set(strategies) - set(STRATEGIES))}; choose from {list(STRATEGIES)}")
    if args.device == "cpu" and "fsdp" in strategies:
        parser.error("--strategies fsdp (FSDP1) needs --device cuda: verl 0.9.1 runs only FSDP2 on the CPU platform")
    return strategies


def erc_actor_config(sequences: int, vocab_pass: bool = False) -> Any:
    """The actor config of ERC-DAPO (clip-higher 0.2 / 0.28, ERC band 0.05 / 0.05, dual-clip 10) with
    the update as one mini-batch and one micro-batch of ``sequences``; ``vocab_pass`` routes both
    passes through the chunked vocabulary pass."""
    from recipe.bench.harness import make_actor_config
    from verl_ext.config import DivClipPolicyLossConfig

    policy = DivClipPolicyLossConfig(loss_mode="clip", erc_beta_low=0.05, erc_beta_high=0.05, vocab_pass=vocab_pass)
    return make_actor_config(policy_loss=policy, clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=10.0,
                             ppo_mini_batch_size=sequences, ppo_micro_batch_size_per_gpu=sequences)


def divclip_actor_config(mode: str, sequences: int, k: int, vocab_pass: bool) -> Any:
    """The actor config of divclip's ``mode`` (``kl3``, ``kl_full``, ...) at delta = 0.07 and
    ``kl_full_top_k = k``, the update as one mini-batch and one micro-batch of ``sequences``."""
    from recipe.bench.harness import make_actor_config
    from verl_ext.config import DivClipPolicyLossConfig

    policy = DivClipPolicyLossConfig(loss_mode=mode, delta=0.07, kl_full_top_k=k, vocab_pass=vocab_pass)
    return make_actor_config(policy_loss=policy, ppo_mini_batch_size=sequences, ppo_micro_batch_size_per_gpu=sequences)

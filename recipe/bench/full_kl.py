"""Cost of ``kl_full`` against ``kl3`` in the actor's two passes; bytes of the stored top-k.

``python -m recipe.bench full-kl [--json] [--tokens 4096] [--vocab 151936] [--k 32] [--phase update|old]
[--vocab-pass] [--repeats N]``: each variant in its own process, alternating over ``--repeats``, against ``kl3`` on
the same path (docs/benchmarks.md, "Stored top-k").
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import sys
from typing import Any

from recipe.bench.child import add_micro_batch_options, gib, peak_rss_bytes, rss_bytes, run_memory_child

VARIANTS: tuple[str, ...] = ("kl3", "kl_full")

#: Response tokens per training step at the maximum response length: prompts x rollout.n x max_response_length.
STEP_TOKENS: dict[str, tuple[int, int, int]] = {
    "erc_dapo_7b": (128, 8, 16_384),  # configs/experiments/base/erc.yaml
    "atr_grpo_qwen3_8b": (4, 8, 1_536),  # configs/experiments/base/atr.yaml
}


def stored_bytes(k: int) -> dict[str, Any]:
    """Bytes of the stored top-k per response token, and per step of each config at full length."""
    from verl_ext.core.coarsened_kl import stored_bytes_per_token

    per_token = stored_bytes_per_token(k)
    per_step = {name: per_token * prompts * n * length for name, (prompts, n, length) in STEP_TOKENS.items()}
    old_log_probs = {name: 4 * prompts * n * length for name, (prompts, n, length) in STEP_TOKENS.items()}
    return {
        "k": k,
        "bytes_per_token": per_token,
        "bytes_per_step_max": per_step,
        "old_log_probs_bytes_per_step_max": old_log_probs,
    }


PHASES: tuple[str, ...] = ("update", "old")


def _run_variant(variant: str, args: argparse.Namespace) -> dict[str, Any]:
    """Inside the child process: build the actor, run the measured pass (``args.phase``), return the figures."""
    import time

    import torch

    from recipe.bench.harness import (
        WorkerOptions,
        bench_micro_batch,
        bench_worker,
        compute_log_prob,
        make_actor_config,
        update_actor,
    )
    from recipe.bench.ranks import single_rank_env

    single_rank_env()
    from verl_ext.actor_loss import build_actor_loss
    from verl_ext.config import DivClipPolicyLossConfig
    from verl_ext.engine.topk_capture import OLD_TOPK_IDS, OLD_TOPK_LOG_PROBS

    sequences, k, old_pass = args.sequences, args.k, args.phase == "old"
    shape = bench_micro_batch(args.tokens, sequences, args.vocab, args.hidden)
    options = WorkerOptions(micro_batch_size_per_gpu=sequences, max_token_len_per_gpu=args.tokens, mixed_precision=None)
    with bench_worker(shape, options, "full_kl_bench_") as (worker, batch):
        policy = DivClipPolicyLossConfig(loss_mode=variant, kl_full_top_k=k, vocab_pass=args.vocab_pass)
        actor_config = make_actor_config(
            ppo_mini_batch_size=sequences, ppo_micro_batch_size_per_gpu=sequences, policy_loss=policy
        )
        worker.set_loss_fn(build_actor_loss(actor_config))
        if variant == "kl_full" and not old_pass:
            # pi_old's stored top-k: any k distinct ids and normalised log-masses cost the same
            gen = torch.Generator().manual_seed(0)
            response_len = shape.response_len
            masses = [torch.log_softmax(torch.randn(response_len, k + 1, generator=gen), -1) for _ in range(sequences)]
            ids = [
                torch.randperm(args.vocab, generator=gen)[:k].to(torch.int32).expand(response_len, k).clone()
                for _ in range(sequences)
            ]
            batch[OLD_TOPK_LOG_PROBS] = torch.nested.as_nested_tensor(masses, layout=torch.jagged)
            batch[OLD_TOPK_IDS] = torch.nested.as_nested_tensor(ids, layout=torch.jagged)

        rss_before = rss_bytes()
        start, cpu_start = time.perf_counter(), time.process_time()
        if old_pass:
            out = compute_log_prob(worker, batch, old_topk=k if variant == "kl_full" else 0)
        else:
            out = update_actor(worker, batch, calculate_entropy=False)
        seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu_start
        if old_pass:
            assert out is not None and (variant != "kl_full" or OLD_TOPK_IDS in out)
        # the update's loss, or the old pass's mean log-prob (equal with and without the top-k)
        check = float(out["old_log_probs"].values().float().mean()) if old_pass else float(out["loss"][0])
    return {
        "variant": variant,
        "phase": args.phase,
        "path": "vocab_pass" if args.vocab_pass else "logits",
        "tokens": args.tokens,
        "vocab_size": args.vocab,
        "k": k,
        "peak_rss_bytes": peak_rss_bytes(),
        "rss_before_pass_bytes": rss_before,
        "pass_seconds": round(seconds, 2),
        "pass_cpu_seconds": round(cpu_seconds, 2),
        "check": check,
    }


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m recipe.bench full-kl", description=__doc__.split("\n")[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object per variant, then the bytes")
    add_micro_batch_options(parser)
    parser.add_argument("--k", type=int, default=32, help="kl_full_top_k")
    parser.add_argument("--phase", choices=PHASES, default="update", help="the pass that is measured")
    parser.add_argument("--vocab-pass", action="store_true", help="both variants through the vocabulary pass")
    parser.add_argument("--repeats", type=int, default=1, help="run the variants this many times, alternating")
    parser.add_argument("--_child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    if args._child is not None:
        print(json.dumps(_run_variant(args._child, args)))
        return 0

    date = _dt.date.today().isoformat()
    results = []
    for repeat in range(args.repeats):
        runs = {
            v: run_memory_child("recipe.bench.full_kl", v, args, "--phase", "--vocab-pass", "--k") for v in VARIANTS
        }
        base = runs["kl3"]
        for r in runs.values():
            r.update(
                date=date,
                repeat=repeat,
                peak_rss_gib=gib(r["peak_rss_bytes"]),
                pass_increment_gib=gib(r["peak_rss_bytes"] - r["rss_before_pass_bytes"]),
            )
            r["peak_ratio_vs_kl3"] = round(r["peak_rss_bytes"] / base["peak_rss_bytes"], 3)
            r["time_ratio_vs_kl3"] = round(r["pass_seconds"] / base["pass_seconds"], 3)
            # CPU time of the process: less sensitive than wall time to other jobs on a shared machine
            r["cpu_time_ratio_vs_kl3"] = round(r["pass_cpu_seconds"] / base["pass_cpu_seconds"], 3)
            results.append(r)
    sizes = stored_bytes(args.k)
    if args.json:
        for r in results:
            print(json.dumps(r))
        print(json.dumps({"stored_topk": sizes}))
        return 0
    path = "the vocabulary pass" if args.vocab_pass else "verl's materialised logits"
    print(f"pass: {args.phase}, {path}, {args.tokens} tokens, vocabulary {args.vocab}, k={args.k}")
    print(
        f"{'variant':<8} {'rep':>3} {'peak RSS GiB':>12} {'pass +GiB':>9} {'peak/kl3':>8} {'seconds':>8} "
        f"{'time/kl3':>8} {'CPU s':>7} {'CPU/kl3':>7}"
    )
    for r in results:
        print(
            f"{r['variant']:<8} {r['repeat']:>3} {r['peak_rss_gib']:>12.3f} {r['pass_increment_gib']:>9.3f} "
            f"{r['peak_ratio_vs_kl3']:>8.3f} {r['pass_seconds']:>8.1f} {r['time_ratio_vs_kl3']:>8.3f} "
            f"{r['pass_cpu_seconds']:>7.1f} {r['cpu_time_ratio_vs_kl3']:>7.3f}"
        )
    print(f"stored top-k, k={sizes['k']}: {sizes['bytes_per_token']} bytes per response token")
    for name, n in sizes["bytes_per_step_max"].items():
        print(
            f"  {name}: {n / 2**20:,.1f} MiB per step at the maximum response length "
            f"(old_log_probs: {sizes['old_log_probs_bytes_per_step_max'][name] / 2**20:,.1f} MiB)"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

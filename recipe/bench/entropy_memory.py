"""Peak host memory of one actor update with and without the current-policy entropy.

``python -m recipe.bench entropy-memory [--json] [--tokens 4096] [--vocab 151936]``: each of :data:`VARIANTS` in a
fresh process, its peak RSS against ``a_no_entropy``'s (docs/benchmarks.md, "Entropy memory", "Vocabulary pass").
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import sys
from typing import Any

from recipe.bench.child import add_micro_batch_options, gib, peak_rss_bytes, rss_bytes, run_memory_child, subset

VARIANTS: tuple[str, ...] = (
    "a_no_entropy",
    "b_verl_entropy",
    "c_detached",
    "d_vocab_pass",
    "e_old_log_prob_detached",
    "f_old_log_prob_vocab_pass",
)
OLD_LOG_PROB_VARIANTS = ("e_old_log_prob_detached", "f_old_log_prob_vocab_pass")


def _run_variant(variant: str, tokens: int, vocab: int, hidden: int, sequences: int) -> dict[str, Any]:
    """Inside the child process: build the actor, run one update, return the memory figures."""
    import time

    from recipe.bench.features import packed_as_update, with_vocab_pass
    from recipe.bench.harness import (
        WorkerOptions,
        bench_micro_batch,
        bench_worker,
        compute_log_prob,
        make_actor_config,
        ppo_loss_fn,
        update_actor,
    )
    from recipe.bench.ranks import single_rank_env

    single_rank_env()
    shape = bench_micro_batch(tokens, sequences, vocab, hidden)
    # the whole update is one micro-batch of `tokens`, at verl's default precision (bf16 compute, fp32 reduce)
    options = WorkerOptions(micro_batch_size_per_gpu=sequences, max_token_len_per_gpu=tokens, mixed_precision=None)
    with bench_worker(shape, options, "entropy_memory_") as (worker, batch):
        actor_config = make_actor_config(ppo_mini_batch_size=sequences, ppo_micro_batch_size_per_gpu=sequences)
        loss_fn = ppo_loss_fn(actor_config)
        from verl_ext.config_rules.policy import check_entropy_as_mask
        from verl_ext.engine.request import entropy_as_mask

        if variant not in ("a_no_entropy", "b_verl_entropy"):  # ERC's detached entropy, as the actor loss declares it
            check_entropy_as_mask(entropy_coeff=actor_config.entropy_coeff)
            loss_fn = packed_as_update(entropy_as_mask(loss_fn))
        if "vocab_pass" in variant:
            loss_fn = with_vocab_pass(loss_fn)
        worker.set_loss_fn(loss_fn)

        old_log_prob = variant in OLD_LOG_PROB_VARIANTS
        rss_before = rss_bytes()
        start = time.perf_counter()
        if old_log_prob:
            compute_log_prob(worker, batch)
            loss = float("nan")
        else:
            metrics = update_actor(worker, batch, calculate_entropy=variant != "a_no_entropy")
            loss = float(metrics["loss"][0])
        seconds = time.perf_counter() - start
    return {
        "variant": variant,
        "phase": "old_log_prob" if old_log_prob else "update",
        "tokens": tokens,
        "vocab_size": vocab,
        "peak_rss_bytes": peak_rss_bytes(),
        "rss_before_update_bytes": rss_before,
        "update_seconds": round(seconds, 2),  # the phase's seconds (the update, or the old-log-prob pass)
        "loss": loss,
    }


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m recipe.bench entropy-memory", description=__doc__.split("\n")[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object per variant")
    add_micro_batch_options(parser)
    parser.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated subset to run")
    parser.add_argument("--_child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    if args._child is not None:
        print(json.dumps(_run_variant(args._child, args.tokens, args.vocab, args.hidden, args.sequences)))
        return 0

    variants = subset(parser, "--variants", args.variants, VARIANTS, allow_none=True)
    results = [run_memory_child("recipe.bench.entropy_memory", v, args) for v in variants]
    base = next((r for r in results if r["variant"] == "a_no_entropy"), None)
    date = _dt.date.today().isoformat()
    for r in results:
        r["date"] = date
        r["peak_rss_gib"] = gib(r["peak_rss_bytes"])
        r["update_increment_gib"] = gib(r["peak_rss_bytes"] - r["rss_before_update_bytes"])
        if base is not None:
            r["peak_ratio_vs_a"] = round(r["peak_rss_bytes"] / base["peak_rss_bytes"], 3)
            base_inc = base["peak_rss_bytes"] - base["rss_before_update_bytes"]
            inc = r["peak_rss_bytes"] - r["rss_before_update_bytes"]
            r["increment_ratio_vs_a"] = round(inc / base_inc, 3) if base_inc > 0 else None
    if args.json:
        for r in results:
            print(json.dumps(r))
    else:
        print(f"{'variant':<26} {'peak RSS GiB':>12} {'phase +GiB':>11} {'peak/a':>7} {'incr/a':>7} {'seconds':>8}")
        for r in results:
            print(
                f"{r['variant']:<26} {r['peak_rss_gib']:>12.3f} {r['update_increment_gib']:>11.3f} "
                f"{r.get('peak_ratio_vs_a', float('nan')):>7.3f} {r.get('increment_ratio_vs_a') or float('nan'):>7.3f} "
                f"{r['update_seconds']:>8.1f}"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

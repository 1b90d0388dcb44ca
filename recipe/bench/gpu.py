"""GPU probe: ERC's entropy path against verl's on one CUDA GPU, at verl's default bf16 precision.

``python -m recipe.bench gpu [--json] [--out results.json] [--tokens 16384] [--sequences 8] [--variants ...]``:
each of :data:`VARIANTS` in its own process per strategy, against ``no_entropy`` of the same strategy
(docs/benchmarks.md, "GPU: ERC's entropy path on one H100"). ``--acceptance`` is :mod:`recipe.bench.acceptance`.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any, Optional

from recipe.bench.child import peak_rss_bytes, run_child, subset, without_options
from recipe.bench.gpu_workload import (
    Clock,
    MemoryMeter,
    actor_loss,
    add_model_options,
    build_model,
    chosen_strategies,
    probe_batch,
    probe_worker,
)

VARIANTS: dict[str, dict[str, Any]] = {
    "no_entropy": dict(erc=False, entropy=False, compile=True, fused=False),
    "verl_compiled": dict(erc=False, entropy=True, compile=True, fused=False),
    "verl_eager": dict(erc=False, entropy=True, compile=False, fused=False),
    "divclip_erc": dict(erc=True, entropy=True, compile=True, fused=False),
    "divclip_erc_eager": dict(erc=True, entropy=True, compile=False, fused=False),
    "divclip_erc_vocab_pass": dict(erc=True, entropy=True, compile=True, fused=False, vocab_pass=True),
    "divclip_erc_fused": dict(erc=True, entropy=True, compile=True, fused=True),
    # the ERC configs' packing: dynamic batching, the log-prob pass at twice the update's token budget
    "divclip_erc_dynamic": dict(erc=True, entropy=True, compile=True, fused=False, dynamic=True),
    # ATR-GRPO's kl3 and the exact trust region over pi_old's stored top-k (Eq. 4), without entropy
    "divclip_kl3": dict(erc=False, entropy=False, compile=True, fused=False, mode="kl3"),
    "divclip_kl_full": dict(erc=False, entropy=False, compile=True, fused=False, mode="kl_full"),
    "divclip_kl_full_vocab_pass": dict(
        erc=False, entropy=False, compile=True, fused=False, mode="kl_full", vocab_pass=True
    ),
}
DEFAULT_VARIANTS = (
    "no_entropy",
    "verl_compiled",
    "verl_eager",
    "divclip_erc",
    "divclip_erc_eager",
    "divclip_erc_dynamic",
    "divclip_erc_vocab_pass",
)
ERC_METRICS = (
    "actor/divclip/erc/ratio_min",
    "actor/divclip/erc/ratio_max",
    "actor/divclip/erc/clipfrac_upper",
    "actor/divclip/erc/clipfrac_lower",
    "actor/ppo_kl",
)
KL_FULL_METRICS = (
    "actor/divclip/kl_full_mean",
    "actor/divclip/kl_full_max",
    "actor/divclip/kl_full_tail_old",
    "actor/pg_clipfrac",
)
GAUGE_METRICS = (
    "actor/divclip/onpolicy/log_ratio_abs_max",
    "actor/divclip/onpolicy/ratio_clipfrac",
    "actor/divclip/onpolicy/erc_ratio_dev_max",
    "actor/divclip/onpolicy/erc_masked_frac",
)


ON_POLICY: dict[str, dict[str, float]] = {
    "erc": {
        "actor/divclip/erc/ratio_min": 1.0,
        "actor/divclip/erc/ratio_max": 1.0,
        "actor/divclip/erc/clipfrac_upper": 0.0,
        "actor/divclip/erc/clipfrac_lower": 0.0,
    },
    "kl_full": {"actor/divclip/kl_full_mean": 0.0, "actor/divclip/kl_full_max": 0.0, "actor/pg_clipfrac": 0.0},
}
"""The first update's figures when it is exactly on-policy, for ERC's variants and kl_full's."""


def run_variant(name: str, model_path: str, args: argparse.Namespace) -> dict[str, Any]:
    """Inside the child process: one variant's passes and updates under ``args.strategy``; returns its figures."""
    from recipe.bench.harness import compute_log_prob, update_actor, with_old
    from recipe.bench.ranks import single_rank_env

    spec = VARIANTS[name]
    single_rank_env(device=args.device)
    import torch

    from recipe.bench.features import entropy_path_of, uses_vocab_pass

    dynamic = spec.get("dynamic", False)
    worker = probe_worker(
        model_path,
        args,
        micro_batch_size_per_gpu=args.sequences,  # the update is one micro-batch of --tokens
        # dynamic: the update in micro-batches of --tokens/2, the log-prob pass of --tokens
        use_dynamic_bsz=dynamic,
        max_token_len_per_gpu=args.tokens // 2 if dynamic else args.tokens,
        infer_max_token_len_per_gpu=args.tokens if dynamic else None,
        use_torch_compile=spec["compile"] and args.device == "cuda",
        use_fused_kernels=spec["fused"],
    )
    mode = spec.get("mode")
    worker.set_loss_fn(actor_loss(args.sequences, args.k, spec["erc"], mode, spec.get("vocab_pass", False)))
    batch = probe_batch(args, args.sequences)
    cuda, meter = args.device == "cuda", MemoryMeter(args.device)
    meter.sync()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    with Clock(meter) as old_pass:
        old = compute_log_prob(worker, batch, old_topk=args.k if mode == "kl_full" else 0)
    old_peak = torch.cuda.max_memory_allocated() if cuda else None
    batch = with_old(batch, old)  # old_log_probs, entropy (and pi_old's top-k for kl_full)
    old_entropy = old["entropy"].values().float()

    if cuda:
        torch.cuda.reset_peak_memory_stats()
    seconds: list[float] = []
    first: dict[str, Any] = {}
    for step in range(args.warmup + args.repeats):
        with Clock(meter) as update:
            metrics = update_actor(worker, batch, calculate_entropy=spec["entropy"])
        if step == 0:
            first = {
                k: [float(v) for v in metrics[k]] for k in ERC_METRICS + KL_FULL_METRICS + GAUGE_METRICS if k in metrics
            }
        if step >= args.warmup:
            seconds.append(update.seconds)
    peak = torch.cuda.max_memory_allocated() if cuda else peak_rss_bytes()
    result: dict[str, Any] = {
        "variant": name,
        "strategy": args.strategy,
        "entropy_path": entropy_path_of(worker.engine).value,
        "vocab_pass": uses_vocab_pass(worker.engine),
        "peak_bytes": int(peak),
        "update_seconds_median": statistics.median(seconds),
        "update_seconds": [round(s, 4) for s in seconds],
        "old_log_prob_seconds": round(old_pass.seconds, 4),
        "old_log_prob_peak_bytes": old_peak,
        "share_entropy_below_1e-3": float((old_entropy < 1e-3).float().mean()),
        "share_entropy_below_1e-6": float((old_entropy < 1e-6).float().mean()),
    }
    on_policy = ON_POLICY["erc"] if spec["erc"] else ON_POLICY.get(mode)
    if on_policy is not None:
        result["first_update"] = first
        result["on_policy_invariant"] = all(v == want for key, want in on_policy.items() for v in first[key])
    return result


def _spawn(name: str, strategy: str, model_path: str, args: argparse.Namespace) -> dict[str, Any]:
    argv = ["--_child", name, "--_model", model_path, *args.child_argv, "--strategies", strategy]
    child = run_child("recipe.bench.gpu", argv)
    if child.ok:
        return child.result
    if "OutOfMemoryError" in child.stderr and not VARIANTS[name]["erc"] and name != "no_entropy":
        # verl's own entropy path running out of memory is a finding to report, not a probe failure
        return {"variant": name, "strategy": strategy, "out_of_memory": True, "error_line": child.last_error_line()}
    sys.stderr.write(child.stderr[-6000:])
    return {"variant": name, "strategy": strategy, "error": f"exit code {child.returncode}: {child.last_error_line()}"}


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m recipe.bench gpu", description=__doc__.split("\n")[0])
    p.add_argument(
        "--acceptance",
        action="store_true",
        help="every GPU figure in one call, each beside its target (recipe/bench/acceptance.py, its own options: "
        "python -m recipe.bench gpu --acceptance --help)",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object per variant")
    p.add_argument("--out", type=Path, default=None, help="also write all results to this JSON file")
    add_model_options(p)
    p.add_argument("--variants", default=",".join(DEFAULT_VARIANTS), help=f"subset of {list(VARIANTS)}")
    p.add_argument("--warmup", type=int, default=1, help="untimed updates first (the on-policy one included)")
    p.add_argument("--repeats", type=int, default=3, help="timed updates (the median is reported)")
    return p


def main(argv: list[str]) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.acceptance:  # reached only as ``python -m recipe.bench.gpu``: recipe.bench.__main__ routes the flag
        parser.error("--acceptance runs as `python -m recipe.bench gpu --acceptance` (recipe/bench/acceptance.py)")
    if args.tokens % args.sequences:
        parser.error(f"--tokens ({args.tokens}) must be divisible by --sequences ({args.sequences})")
    if args.warmup < 1 or args.repeats < 1:
        parser.error("--warmup and --repeats must be >= 1 (the first update checks the on-policy invariant)")
    strategies = chosen_strategies(parser, args)
    if args._child is not None:
        args.strategy = strategies[0]
        print(json.dumps(run_variant(args._child, args._model, args)))
        return 0
    chosen = subset(parser, "--variants", args.variants, VARIANTS, allow_none=True)
    if "no_entropy" not in chosen:
        chosen.insert(0, "no_entropy")  # ratios need the baseline measured in the same run
    if any(VARIANTS[v].get("mode") == "kl_full" for v in chosen) and "divclip_kl3" not in chosen:
        chosen.insert(1, "divclip_kl3")  # kl_full's own baseline
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            parser.error("no CUDA device: this probe needs one GPU (or --device cpu for a small CPU run)")
    args.child_argv = without_options([a for a in argv if a not in ("--json",)], ("--out", "--strategies"))
    with tempfile.TemporaryDirectory(prefix="divclip_gpu_probe_") as tmp:
        build_model(Path(tmp), args)
        results = [_spawn(name, strategy, tmp, args) for strategy in strategies for name in chosen]

    def baseline(variant: str, strategy: str) -> Optional[dict[str, Any]]:
        """The row of ``variant`` under ``strategy``, unless it failed."""
        rows = (b for b in results if b["variant"] == variant and b["strategy"] == strategy and "error" not in b)
        return next(rows, None)

    for r in results:
        r["date"] = _dt.date.today().isoformat()
        base = baseline("no_entropy", r["strategy"])
        if base is not None and "update_seconds_median" in r:
            r["time_vs_no_entropy"] = round(r["update_seconds_median"] / base["update_seconds_median"], 3)
            r["peak_vs_no_entropy"] = round(r["peak_bytes"] / base["peak_bytes"], 3)
        kl3 = baseline("divclip_kl3", r["strategy"])
        if kl3 is not None and VARIANTS[r["variant"]].get("mode") and "update_seconds_median" in r:
            r["time_vs_kl3"] = round(r["update_seconds_median"] / kl3["update_seconds_median"], 3)
            r["peak_vs_kl3"] = round(r["peak_bytes"] / kl3["peak_bytes"], 3)
            r["old_log_prob_time_vs_kl3"] = round(r["old_log_prob_seconds"] / kl3["old_log_prob_seconds"], 3)
    if args.out is not None:
        args.out.write_text(json.dumps(results, indent=1))
    if args.json:
        for r in results:
            print(json.dumps(r))
    else:
        print(
            f"{'strategy':<8} {'variant':<20} {'path':<13} {'peak GiB':>8} {'x base':>7} {'update s':>9} {'x base':>7} "
            " on-policy"
        )
        for r in results:
            print(f"{r['strategy']:<8} ", end="")
            if "error" in r:
                print(f"{r['variant']:<20} failed: {r['error']}")
                continue
            if r.get("out_of_memory"):
                print(f"{r['variant']:<20} out of memory (verl's path): {r['error_line']}")
                continue
            holds = (
                "KL 0, nothing clipped"
                if VARIANTS[r["variant"]].get("mode") == "kl_full"
                else "ratio 1, nothing masked"
            )
            invariant = {True: holds, False: f"VIOLATED {r.get('first_update')}"}.get(r.get("on_policy_invariant"), "-")
            print(
                f"{r['variant']:<20} {r['entropy_path']:<13} {r['peak_bytes'] / 2**30:>8.2f} "
                f"{r.get('peak_vs_no_entropy', float('nan')):>7.3f} {r['update_seconds_median']:>9.3f} "
                f"{r.get('time_vs_no_entropy', float('nan')):>7.3f}  {invariant}",
                end="",
            )
            if "time_vs_kl3" in r:
                print(
                    f"  vs kl3: peak {r['peak_vs_kl3']:.3f}, update {r['time_vs_kl3']:.3f}, "
                    f"old-log-prob pass {r['old_log_prob_time_vs_kl3']:.3f}",
                    end="",
                )
            print()
    return 1 if any("error" in r for r in results) or any(r.get("on_policy_invariant") is False for r in results) else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""On-policy exactness under the configs' packings, in any loss mode: where the noise comes from, what the fix costs.

``python -m recipe.bench onpolicy [--json] [--modes erc,clip,kl3,gspo] [--threads 1,2] [--seeds 4,5,6,7,8]``: per
case, the old pass then one update, verl's packing (``own``) against the pass packed as the update (``aligned``);
``--cost``: the pass alone (docs/benchmarks.md, "On-policy exactness").
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import sys
import tempfile
import time
from typing import Any

from recipe.bench.child import child_result, forwarded, gib, peak_rss_bytes, subset

BUDGET_PAIRS: tuple[tuple[int, int], ...] = ((40, 64), (40, 80), (24, 48), (64, 128))
"""(update, log-prob) token budgets per micro-batch: the ERC configs' ratio, at the tiny batch's scale."""
PROMPT_LENS = [3, 5, 4, 6, 2, 7, 5, 3]
RESPONSE_LENS = [12, 9, 14, 6, 10, 8, 11, 7]
HEAD_SCALE = 1000.0  # makes 70-84% of the tokens' entropy < 1e-3 nats
COST_HIDDEN = 64
"""``--cost``: the tiny Qwen3's width (the vocabulary, not the body, dominates the pass's memory)."""


ERC_BETA = 0.05
"""ERC's band (1 - beta, 1 + beta) of the ERC configs (the paper's beta_l = beta_h = 0.05)."""
GSPO_BAND = (3e-4, 4e-4)
"""GSPO's sequence-ratio clip (clip_ratio_low/high of the GSPO paper and the erc_gspo config); the other
modes use DAPO's 0.2 / 0.28."""
MODES = ("erc", "clip", "kl3", "gspo")
"""Losses a case can run: ``erc`` is ERC-DAPO (clip-higher + ERC), the others the divclip actor loss in
that ``loss_mode`` without ERC (``gspo`` is verl's own mode through it)."""


def _loss(mode: str) -> Any:
    """The divclip actor loss for ``mode`` (see :data:`MODES`), as the trainer installs it."""
    from recipe.bench.harness import make_actor_config
    from verl_ext.actor_loss import build_actor_loss
    from verl_ext.config import DivClipPolicyLossConfig

    if mode == "erc":
        policy = DivClipPolicyLossConfig(loss_mode="clip", erc_beta_low=ERC_BETA, erc_beta_high=ERC_BETA)
    else:
        policy = DivClipPolicyLossConfig(loss_mode=mode)
    low, high = GSPO_BAND if mode == "gspo" else (0.2, 0.28)
    return build_actor_loss(
        make_actor_config(policy_loss=policy, clip_ratio_low=low, clip_ratio_high=high, clip_ratio_c=10.0)
    )


class _HeadCapture:
    """LM-head input/output of every forward, and the sample order of every micro-batch."""

    def __init__(self, engine: Any) -> None:
        import verl.workers.engine.fsdp.transformer_impl as impl

        self.impl, self.original = impl, impl.prepare_micro_batches
        self.head = engine.module.get_output_embeddings()
        self.forwards: list[tuple[Any, Any]] = []
        self.orders: list[list[int]] = []

    def __enter__(self) -> _HeadCapture:
        def record(module: Any, args: tuple, output: Any) -> None:
            self.forwards.append(
                (
                    args[0].detach().reshape(-1, args[0].shape[-1]).clone(),
                    output.detach().reshape(-1, output.shape[-1]).clone(),
                )
            )

        def prepare(*args: Any, **kwargs: Any) -> Any:
            micro_batches, indices = self.original(*args, **kwargs)
            self.orders.extend(list(rows) for rows in indices)
            return micro_batches, indices

        self.handle = self.head.register_forward_hook(record)
        self.impl.prepare_micro_batches = prepare
        return self

    def __exit__(self, *exc: Any) -> None:
        self.handle.remove()
        self.impl.prepare_micro_batches = self.original

    def per_response_token(self, seq_lens: list[int], prompt_lens: list[int]) -> tuple[Any, Any]:
        """(hidden, logits) rows that predict each response token, in sample order."""
        import torch

        hidden: dict[int, Any] = {}
        logits: dict[int, Any] = {}
        for (h, x), rows in zip(self.forwards, self.orders, strict=False):
            start = 0
            for row in rows:
                end = start + seq_lens[row]
                p = prompt_lens[row]
                hidden[row], logits[row] = h[start + p - 1 : end - 1], x[start + p - 1 : end - 1]
                start = end
        order = sorted(hidden)
        return torch.cat([hidden[i] for i in order]), torch.cat([logits[i] for i in order])


def _case(
    model_path: str, mode: str, update_budget: int, infer_budget: int, seed: int, aligned: bool, source: bool
) -> dict[str, Any]:
    import torch

    from recipe.bench.harness import (
        WorkerOptions,
        build_actor_worker,
        compute_log_prob,
        full_params,
        make_rollout_batch,
        update_actor,
        with_old,
    )
    from verl_ext.core.entropy import entropy_fp32
    from verl_ext.core.erc import entropy_ratio, outside_band
    from verl_ext.engine.seam import set_pack_old_log_prob_as_update

    options = WorkerOptions(
        mixed_precision=None,
        use_dynamic_bsz=True,
        max_token_len_per_gpu=update_budget,
        infer_max_token_len_per_gpu=infer_budget,
        optimizer="SGD",
        lr=0.5,
        clip_grad=1e9,
    )
    worker = build_actor_worker(model_path, options)
    worker.set_loss_fn(_loss(mode))
    set_pack_old_log_prob_as_update(worker.engine, aligned)
    batch = make_rollout_batch(PROMPT_LENS, RESPONSE_LENS, 512, seed=seed)
    old_capture, new_capture = _HeadCapture(worker.engine), _HeadCapture(worker.engine)
    with old_capture:
        old = compute_log_prob(worker, batch)
    weight = full_params(worker)["lm_head.weight"].to(torch.bfloat16)  # what bf16 mixed precision computes with
    with new_capture:
        m = update_actor(worker, with_old(batch, old), calculate_entropy=mode == "erc")
    n_tokens = sum(RESPONSE_LENS)
    gauge = "actor/divclip/onpolicy/"
    row: dict[str, Any] = {
        "mode": mode,
        "packing": "aligned" if aligned else "own",
        "budgets": f"{update_budget}/{infer_budget}",
        "seed": seed,
        "threads": torch.get_num_threads(),
        "old_micro_batches": len(old_capture.orders),
        "update_micro_batches": len(new_capture.orders),
        "same_packing": old_capture.orders == new_capture.orders,
        "log_ratio_abs_max": max(map(float, m[gauge + "log_ratio_abs_max"])),
        "ratio_clipfrac": max(map(float, m[gauge + "ratio_clipfrac"])),
        "pg_clipfrac": max(map(float, m["actor/pg_clipfrac"])),
        "ppo_kl_abs": max(abs(float(v)) for v in m["actor/ppo_kl"]),
        "confident_frac": float((old["entropy"].values() < 1e-3).float().mean()),
    }
    if mode == "erc":
        row.update(
            {
                "erc_ratio_min": min(map(float, m["actor/divclip/erc/ratio_min"])),
                "erc_ratio_max": max(map(float, m["actor/divclip/erc/ratio_max"])),
                "erc_masked_frac": (
                    sum(map(float, m["actor/divclip/erc/clipfrac_upper"] + m["actor/divclip/erc/clipfrac_lower"]))
                    / len(m["actor/divclip/erc/clipfrac_upper"])
                ),
            }
        )
    if source:
        seq_lens = [p + r for p, r in zip(PROMPT_LENS, RESPONSE_LENS, strict=False)]
        h_old, x_old = old_capture.per_response_token(seq_lens, PROMPT_LENS)
        h_new, x_new = new_capture.per_response_token(seq_lens, PROMPT_LENS)
        assert h_old.shape[0] == n_tokens, (h_old.shape, n_tokens)
        fp32_old = entropy_fp32(h_old.float() @ weight.float().T)
        fp32_new = entropy_fp32(h_new.float() @ weight.float().T)
        rho_fp32 = entropy_ratio(fp32_old, fp32_new, torch.ones_like(fp32_old), eps=1e-8)
        row.update(
            {
                "hidden_rows_differing": float((h_old != h_new).any(-1).float().mean()),
                "hidden_max_abs_diff": float((h_old.float() - h_new.float()).abs().max()),
                "logits_max_abs_diff_bf16": float((x_old.float() - x_new.float()).abs().max()),
                "fp32_head_erc_ratio_min": float(rho_fp32.min()),
                "fp32_head_erc_ratio_max": float(rho_fp32.max()),
                "fp32_head_erc_masked_frac": float(outside_band(rho_fp32, ERC_BETA, ERC_BETA).float().mean()),
            }
        )
    return row


def _run_cases(threads: int, seeds: list[int], modes: list[str]) -> list[dict[str, Any]]:
    import torch

    from recipe.bench.harness import TinyQwen3Spec, save_tiny_qwen3
    from recipe.bench.ranks import single_rank_env

    single_rank_env()
    torch.set_num_threads(threads)
    rows = []
    with tempfile.TemporaryDirectory(prefix="onpolicy_") as tmp:
        model_path = save_tiny_qwen3(tmp, TinyQwen3Spec(), seed=0, head_scale=HEAD_SCALE)
        for mode in modes:
            for update_budget, infer_budget in BUDGET_PAIRS:
                for seed in seeds:
                    for aligned in (False, True):
                        source = mode == "erc"  # both arms: the control's noise, and its absence aligned
                        rows.append(_case(model_path, mode, update_budget, infer_budget, seed, aligned, source))
    return rows


def _run_cost(arm: str, mode: str, tokens: int, vocab: int, sequences: int, rounds: int = 3) -> dict[str, Any]:
    """``arm`` = ``own`` or ``aligned``: one old-log-prob pass and its peak RSS (a fresh process per arm);
    ``time``: the median seconds of both arms, alternating on one worker so a busy machine slows both alike."""
    import statistics

    import torch

    from recipe.bench.harness import WorkerOptions, bench_micro_batch, bench_worker, compute_log_prob
    from recipe.bench.ranks import single_rank_env
    from verl_ext.engine.seam import set_pack_old_log_prob_as_update

    single_rank_env()
    shape = bench_micro_batch(tokens, sequences, vocab, hidden=COST_HIDDEN)
    # the ERC configs' budgets, scaled: the log-prob pass holds the whole batch, the update half
    budgets = {"max_token_len_per_gpu": tokens // 2, "infer_max_token_len_per_gpu": tokens}
    options = WorkerOptions(mixed_precision=None, use_dynamic_bsz=True, **budgets)
    with bench_worker(shape, options, "onpolicy_cost_") as (worker, batch):
        worker.set_loss_fn(_loss(mode))
        row: dict[str, Any] = {
            "arm": arm,
            "mode": mode,
            "tokens": tokens,
            "vocab_size": vocab,
            "threads": torch.get_num_threads(),
        }
        if arm != "time":
            set_pack_old_log_prob_as_update(worker.engine, arm == "aligned")
            compute_log_prob(worker, batch)
            row["peak_rss_gib"] = gib(peak_rss_bytes())
            return row
        seconds: dict[str, list[float]] = {"own": [], "aligned": []}
        for round_ in range(rounds + 1):
            for name in seconds:
                set_pack_old_log_prob_as_update(worker.engine, name == "aligned")
                start = time.perf_counter()
                compute_log_prob(worker, batch)
                if round_:  # the first round warms up
                    seconds[name].append(time.perf_counter() - start)
    for name, values in seconds.items():
        row[f"{name}_seconds"] = round(statistics.median(values), 3)
    row["aligned_seconds_vs_own"] = round(row["aligned_seconds"] / row["own_seconds"], 3)
    return row


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m recipe.bench onpolicy", description=__doc__.split("\n")[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object per row")
    parser.add_argument("--threads", default="1,2", help="comma-separated torch thread counts (one child each)")
    parser.add_argument("--seeds", default="4,5,6,7,8", help="comma-separated batch seeds")
    parser.add_argument(
        "--modes", default="erc", help=f"comma-separated losses, of {', '.join(MODES)} (--cost: each measured)"
    )
    parser.add_argument(
        "--cost", action="store_true", help="time the old-log-prob pass, own vs pack_old_log_prob_as_update"
    )
    parser.add_argument("--tokens", type=int, default=4096, help="--cost: tokens in the batch")
    parser.add_argument("--vocab", type=int, default=151_936, help="--cost: vocabulary size")
    parser.add_argument("--sequences", type=int, default=8, help="--cost: sequences in the batch")
    parser.add_argument("--_child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    modes = subset(parser, "--modes", args.modes, MODES)
    if args._child is not None:
        kind, value, *mode = args._child.split(":")
        if kind == "cases":
            print(json.dumps({"rows": _run_cases(int(value), [int(s) for s in args.seeds.split(",")], modes)}))
        else:
            print(json.dumps({"rows": [_run_cost(value, mode[0], args.tokens, args.vocab, args.sequences)]}))
        return 0

    if args.cost:
        jobs = [f"cost:{arm}:{mode}" for mode in modes for arm in ("time", "own", "aligned")]
        extra = forwarded(args, "--tokens", "--vocab", "--sequences")
    else:
        jobs = [f"cases:{t}" for t in args.threads.split(",") if t]
        extra = forwarded(args, "--seeds", "--modes")
    rows: list[dict[str, Any]] = []
    for job in jobs:
        threads = job.split(":")[1] if job.startswith("cases") else os.environ.get("OMP_NUM_THREADS", "")
        env = {"OMP_NUM_THREADS": threads} if threads else {}
        rows.extend(child_result("recipe.bench.onpolicy", ["--_child", job, *extra], job, env)["rows"])
    date = _dt.date.today().isoformat()
    for row in rows:
        row["date"] = date
    if args.cost:
        for start in range(0, len(rows), 3):  # per mode: time, own, aligned
            own, aligned = rows[start + 1], rows[start + 2]
            aligned["peak_ratio_vs_own"] = round(aligned["peak_rss_gib"] / own["peak_rss_gib"], 3)
    if args.json or args.cost:
        for row in rows:
            print(json.dumps(row) if args.json else row)
        return 0
    print(
        f"{'mode':<5} {'packing':<8} {'budgets':>8} {'seed':>4} {'thr':>3} {'same':>5} {'clipfrac':>8} {'rho min':>8} "
        f"{'rho max':>8} {'masked':>7} {'|log w|':>9} {'h rows diff':>11} {'fp32 rho min':>12} {'fp32 rho max':>12}"
    )
    for r in rows:
        print(
            f"{r['mode']:<5} {r['packing']:<8} {r['budgets']:>8} {r['seed']:>4} {r['threads']:>3} "
            f"{str(r['same_packing']):>5} {r['ratio_clipfrac']:>8.3f} {r.get('erc_ratio_min', float('nan')):>8.4f} "
            f"{r.get('erc_ratio_max', float('nan')):>8.4f} {r.get('erc_masked_frac', float('nan')):>7.3f} "
            f"{r['log_ratio_abs_max']:>9.2e} {r.get('hidden_rows_differing', float('nan')):>11.3f} "
            f"{r.get('fp32_head_erc_ratio_min', float('nan')):>12.4f} "
            f"{r.get('fp32_head_erc_ratio_max', float('nan')):>12.4f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

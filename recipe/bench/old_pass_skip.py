"""Actor time per step with and without ``policy_loss.old_log_prob_from_update`` (the old-log-prob pass skipped
where the update's first forward is pi_old bit for bit; :mod:`verl_ext.engine.old_from_update`).

``python -m recipe.bench old-pass-skip [--shapes atr,erc] [--device cpu|cuda] [--rounds N] ...``: one step as
``DivClipTrainer`` runs it, both arms alternating on one worker (docs/benchmarks.md, "The old-log-prob pass
skipped where exact").
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as _dt
import json
import statistics
import sys
from typing import Any

from recipe.bench.child import child_result, forwarded, subset
from recipe.bench.gpu_workload import Clock, MemoryMeter

SHAPES: dict[str, dict[str, Any]] = {
    # mini-batches per step (the update's first epoch) and epochs; loss of the configs
    "atr": dict(mini_batches=1, epochs=2, mode=dict(loss_mode="kl3")),
    "erc": dict(mini_batches=8, epochs=1, mode=dict(loss_mode="clip", erc_beta_low=0.2, erc_beta_high=0.2)),
}


def _run_shape(shape_name: str, args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from recipe.bench.ranks import single_rank_env

    single_rank_env(device=args.device)  # before verl picks its platform (the imports below)
    from recipe.bench.harness import (
        WorkerOptions,
        bench_micro_batch,
        bench_worker,
        compute_log_prob,
        make_actor_config,
        update_actor,
        with_old,
    )
    from verl_ext.actor_loss import build_actor_loss
    from verl_ext.config import DivClipPolicyLossConfig
    from verl_ext.engine.old_from_update import old_pass_rows
    from verl_ext.engine.packing import UpdatePacking

    shape = SHAPES[shape_name]
    micro = bench_micro_batch(args.tokens, args.sequences, args.vocab, hidden=args.hidden)
    if args.sequences % shape["mini_batches"]:
        raise ValueError(
            f"--sequences ({args.sequences}) must split into the {shape_name} shape's {shape['mini_batches']} "
            "mini-batches"
        )
    mini_batch = args.sequences // shape["mini_batches"]
    micro = dataclasses.replace(micro, spec=dataclasses.replace(micro.spec, num_hidden_layers=args.layers))
    erc = "erc_beta_low" in shape["mode"]
    # bf16 (verl's default); dynamic batching with one update mini-batch's tokens per micro-batch at most
    budget = max(args.tokens // args.sequences, args.tokens // max(shape["mini_batches"], 4))
    options = WorkerOptions(
        mixed_precision=None,
        use_dynamic_bsz=True,
        max_token_len_per_gpu=budget,
        infer_max_token_len_per_gpu=2 * budget,
        lr=0.0,
        device=args.device,
    )
    with bench_worker(micro, options, "old_pass_skip_") as (worker, batch):
        policy = DivClipPolicyLossConfig(**shape["mode"])
        worker.set_loss_fn(build_actor_loss(make_actor_config(policy_loss=policy, calculate_entropy=erc)))
        packing = UpdatePacking(mini_batch_size=mini_batch, seed=1, shuffle=True)
        meter = MemoryMeter(args.device)

        def one_step(skip: bool) -> dict[str, float]:
            with Clock(meter) as old_pass:
                old = compute_log_prob(worker, batch, packing=packing, old_from_update=skip)
            rows = float(old_pass_rows(worker.engine) if skip else len(batch))  # before the collect ends the pass
            data = with_old(batch, old)
            with Clock(meter) as update:  # with the skip: the collect too
                update_actor(
                    worker,
                    data,
                    calculate_entropy=erc,
                    mini_batch_size=mini_batch,
                    epochs=shape["epochs"],
                    shuffle=True,
                    seed=1,
                )
                if skip:
                    compute_log_prob(worker, batch, packing=packing, collect=True)
            return {
                "old_pass_s": old_pass.seconds,
                "old_pass_rows": rows,
                "update_s": update.seconds,
                "actor_s": old_pass.seconds + update.seconds,
            }

        rounds: dict[bool, list[dict[str, float]]] = {False: [], True: []}
        for round_ in range(args.rounds + 1):
            for skip in (False, True):
                times = one_step(skip)
                if round_:  # the first round warms up (and compiles, on a GPU)
                    rounds[skip].append(times)
    row: dict[str, Any] = {
        "shape": shape_name,
        "device": args.device,
        "tokens": args.tokens,
        "sequences": args.sequences,
        "mini_batches": shape["mini_batches"],
        "epochs": shape["epochs"],
        "vocab": args.vocab,
        "hidden": args.hidden,
        "layers": args.layers,
        "rounds": args.rounds,
        "threads": torch.get_num_threads(),
    }
    for skip, name in ((False, "without"), (True, "with")):
        for key in ("old_pass_s", "update_s", "actor_s", "old_pass_rows"):
            row[f"{key}_{name}"] = round(statistics.median(t[key] for t in rounds[skip]), 4)
    row["actor_s_with_vs_without"] = round(row["actor_s_with"] / row["actor_s_without"], 3)
    return row


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m recipe.bench old-pass-skip", description=__doc__.split("\n")[0])
    parser.add_argument("--shapes", default="atr,erc", help=f"comma-separated, of {', '.join(SHAPES)}")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--tokens", type=int, default=4096, help="tokens in the step's batch (one rank)")
    parser.add_argument("--sequences", type=int, default=16, help="sequences in the step's batch (divisible by 8)")
    parser.add_argument("--vocab", type=int, default=32768, help="vocabulary size")
    parser.add_argument("--hidden", type=int, default=256, help="model width")
    parser.add_argument("--layers", type=int, default=4, help="transformer layers")
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds per arm, after one warm-up round")
    parser.add_argument("--json", action="store_true", help="print one JSON object per row")
    parser.add_argument("--_child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    shapes = subset(parser, "--shapes", args.shapes, SHAPES)
    if args._child is not None:
        print(json.dumps({"rows": [_run_shape(args._child, args)]}))
        return 0
    options = forwarded(args, "--device", "--tokens", "--sequences", "--vocab", "--hidden", "--layers", "--rounds")
    date = _dt.date.today().isoformat()
    for shape in shapes:  # one process per shape: a fresh process group and allocator; each row printed at once
        for row in child_result("recipe.bench.old_pass_skip", ["--_child", shape, *options], f"shape {shape}")["rows"]:
            row["date"] = date
            print(
                json.dumps(row)
                if args.json
                else f"{row['shape']}: actor {row['actor_s_without']:.3f} s -> {row['actor_s_with']:.3f} s "
                f"({row['actor_s_with_vs_without']:.3f}x); old pass {row['old_pass_s_without']:.3f} s "
                f"({row['old_pass_rows_without']:.0f} rows) -> {row['old_pass_s_with']:.3f} s "
                f"({row['old_pass_rows_with']:.0f} rows); update {row['update_s_without']:.3f} s -> "
                f"{row['update_s_with']:.3f} s (with the collect); {row['device']}, {row['threads']} threads, {date}",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

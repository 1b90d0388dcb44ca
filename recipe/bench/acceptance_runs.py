"""The GPU acceptance's two child runs (:func:`run_losses`, :func:`run_packing`), each in a fresh process for one
strategy, returning its figures as one JSON-able dict; what they measure is defined in docs/benchmarks.md
("GPU acceptance", "What it runs").
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any, Optional

from recipe.bench.acceptance_report import GAUGE, TARGETS
from recipe.bench.gpu_workload import (
    Clock,
    MemoryMeter,
    UpdatePhases,
    actor_loss,
    device_peak_flops,
    longest_fitting,
    pass_memory,
    probe_batch,
    probe_worker,
    response_lengths,
    update_flops,
    update_memory,
)

LOSSES = (
    "no_entropy",
    "divclip_erc",
    "divclip_erc_vocab_pass",
    "divclip_kl3",
    "divclip_kl_full",
    "divclip_kl_full_vocab_pass",
)
SEARCH_LOSSES = ("no_entropy", "divclip_erc_vocab_pass")
"""The losses whose longest micro-batch is searched by default: the target's pair (``--search-losses all``
searches every loss, at about 30 s each on one H200)."""
PACKING_ARMS = ("aligned", "own")
PACKING_RESPONSES_PER_SEQUENCE = 2
"""The packing run's batch: this many responses per ``--sequences``, about ``--tokens`` tokens in all."""


TIMED_LOSSES = ("no_entropy", *dict.fromkeys(t.variant for t in TARGETS if t.figure == "update_time_vs_no_entropy"))
"""The losses timed in every round: the baseline and each loss with a time target. The others run in the
first round only (their memory, and one time without a target); ``--time-every-loss`` times all."""


def _loss(name: str, sequences: int, k: int) -> Any:
    erc = name.startswith("divclip_erc")
    mode = None if erc or name == "no_entropy" else "kl3" if name == "divclip_kl3" else "kl_full"
    return actor_loss(sequences, k, erc, mode, vocab_pass=name.endswith("vocab_pass"))


def spread(values: list[float]) -> dict[str, float]:
    """Median, min, max and quartiles (inclusive method; one value: all equal) of repeated timings."""
    q1, _, q3 = statistics.quantiles(values, n=4, method="inclusive") if len(values) > 1 else values * 3
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "q1": q1, "q3": q3}


def _gauge(metrics: dict[str, Any]) -> dict[str, Any]:
    """The first update's on-policy figures (one value per mini-batch): they all read 0 when the check
    holds. ``holds`` is None for verl's own loss, which logs no gauge."""
    first = {
        k: [float(v) for v in metrics[k]]
        for k in metrics
        if isinstance(metrics[k], list)
        and (
            k.startswith(GAUGE)
            or k in ("actor/divclip/kl_full_max", "actor/pg_clipfrac", "actor/ppo_kl")
            or k.startswith("actor/divclip/erc/clipfrac")
        )
    }
    if f"{GAUGE}log_ratio_abs_max" not in first:
        return {"first_update": first, "holds": None}
    return {"first_update": first, "holds": all(v == 0.0 for values in first.values() for v in values)}


def _recording_tensor_cores() -> list[bool]:
    """Every decision of the vocabulary pass's tensor-core check in this process, in order."""
    import verl_ext.core.vocab_pass as vp

    seen: list[bool] = []
    decide = vp.tensor_core_matmuls

    def recording(hidden: Any, weight: Any, requested: Optional[bool] = None) -> bool:
        seen.append(decide(hidden, weight, requested))
        return seen[-1]

    vp.tensor_core_matmuls = recording
    return seen


def _out_of_memory(error: Optional[BaseException]) -> bool:
    """Whether ``error``, or one it was raised from (a compiled graph or verl may wrap it), is the device
    running out of memory: ``torch.OutOfMemoryError``, or a ``RuntimeError`` saying "out of memory"."""
    import torch

    seen = 0
    while error is not None and seen < 8:
        if isinstance(error, torch.OutOfMemoryError):
            return True
        if isinstance(error, RuntimeError) and "out of memory" in str(error):
            return True
        error, seen = error.__cause__ or error.__context__, seen + 1
    return False


class _WorkerBroken(RuntimeError):
    """A try failed for another reason than memory after an earlier try had run out of memory: verl's engine
    may not have recovered from that exception, so the searches stop there (reported, not a figure)."""


def search_longest(
    worker: Any,
    phases: UpdatePhases,
    meter: MemoryMeter,
    name: str,
    args: argparse.Namespace,
    seconds: float,
    state: dict[str, bool],
) -> dict[str, Any]:
    """The longest micro-batch (tokens) that one update of loss ``name`` fits: :func:`longest_fitting` over its
    sequences, a try not fitting when it runs out of memory or, with ``--search-budget-mib``, when a peak
    exceeds that budget. ``state`` is shared by one worker's searches: a failure of another kind after running
    out of memory means the engine did not recover (``{"broken": why}``)."""
    from recipe.bench.harness import compute_log_prob, update_actor, with_old

    seq_len = args.tokens // args.sequences
    budget = None if args.search_budget_mib is None else args.search_budget_mib * 2**20
    peaks: dict[int, int] = {}
    broken: list[str] = []

    def fits(n: int) -> bool:
        worker.set_loss_fn(_loss(name, n, args.k))
        meter.release()
        mark = phases.mark()
        try:
            batch = probe_batch(args, n, seed=n)
            if "kl_full" in name:  # the update reads pi_old's top-k from the pass
                batch = with_old(batch, compute_log_prob(worker, batch, old_topk=args.k))
            update_actor(
                worker,
                batch,
                calculate_entropy=name.startswith("divclip_erc"),
                extra_info={"micro_batch_size_per_gpu": n, "max_token_len_per_gpu": n * seq_len},
            )
        except Exception as error:  # noqa: BLE001 - only running out of memory means "does not fit"
            if not _out_of_memory(error):
                if not (state["out_of_memory"] or broken):
                    raise
                broken.append(f"{type(error).__name__}: {str(error)[:300]}")
                raise _WorkerBroken(broken[-1]) from error
            state["out_of_memory"] = True
            fitted = False
        else:
            memory = update_memory([p for p in phases.since(mark) if p.name != "forward"])
            peaks[n] = max(memory["loss_peak_bytes"], memory["optimizer_peak_bytes"])
            fitted = budget is None or peaks[n] <= budget
        worker.engine.optimizer_zero_grad()
        meter.release()
        return fitted

    started = time.monotonic()
    limit = max(args.sequences, args.search_max_tokens // seq_len)
    try:
        found = longest_fitting(
            fits,
            min(2 * args.sequences, limit),
            limit=limit,
            resolution=args.search_resolution,
            deadline=started + seconds,
            known_fit=args.sequences,
        )
    except _WorkerBroken as error:
        return {"broken": f"the worker failed after running out of memory: {error}"}
    worker.set_loss_fn(_loss(name, args.sequences, args.k))
    return {
        "tokens": found.fits * seq_len,
        "fails_at_tokens": None if found.fails is None else found.fails * seq_len,
        "stopped": found.stopped,
        "tries": [[n * seq_len, ok] for n, ok in found.tries],
        "peak_bytes_by_tokens": {str(n * seq_len): b for n, b in sorted(peaks.items())},
        "budget_bytes": budget,
        "seconds": round(time.monotonic() - started, 2),
    }


def run_losses(model_path: str, args: argparse.Namespace) -> dict[str, Any]:
    """Child: every loss of :data:`LOSSES` on one worker at one micro-batch of ``--tokens``: warm-up, the
    interleaved timed rounds, then the longest-micro-batch search of ``--search-losses``."""
    from recipe.bench.harness import compute_log_prob, update_actor, with_old
    from recipe.bench.ranks import single_rank_env

    single_rank_env(device=args.device)
    meter = MemoryMeter(args.device)
    stages = {"start": time.perf_counter()}
    tensor_core_calls = _recording_tensor_cores()
    seq_len = args.tokens // args.sequences
    worker = probe_worker(model_path, args, micro_batch_size_per_gpu=args.sequences, max_token_len_per_gpu=args.tokens)
    phases = UpdatePhases(worker.engine, meter, hold_gradients=True)
    batch = probe_batch(args, args.sequences)
    losses = {name: _loss(name, args.sequences, args.k) for name in LOSSES}
    worker.set_loss_fn(losses["no_entropy"])
    update_actor(worker, batch, calculate_entropy=False)  # AdamW's state exists before anything is measured
    data: dict[str, Any] = {}
    gauges: dict[str, dict[str, Any]] = {}
    tensor_cores: dict[str, Optional[bool]] = {}
    stages["build"] = time.perf_counter()
    for name in LOSSES:  # the warm-up: every path compiled, the first update of each loss its on-policy gauge
        worker.set_loss_fn(losses[name])
        calls_before = len(tensor_core_calls)
        data[name] = with_old(batch, compute_log_prob(worker, batch, old_topk=args.k if "kl_full" in name else 0))
        for step in range(args.warmup):
            metrics = update_actor(worker, data[name], calculate_entropy=name.startswith("divclip_erc"))
            if step == 0:
                gauges[name] = _gauge(metrics)
        tensor_cores[name] = any(tensor_core_calls[calls_before:]) if "vocab_pass" in name else None
    seconds: dict[str, list[float]] = {name: [] for name in LOSSES}
    memory: dict[str, list[dict[str, int]]] = {name: [] for name in LOSSES}
    old: dict[str, dict[str, float]] = {}
    stages["warm-up"] = time.perf_counter()
    timed = LOSSES if args.time_every_loss else tuple(n for n in LOSSES if n in TIMED_LOSSES)
    rounds = [rotated(LOSSES if r == 0 else timed, r) for r in range(args.repeats)]
    for round_, order in enumerate(rounds):  # interleaved: each loss once per round, the order rotated by one
        for name in order:
            worker.set_loss_fn(losses[name])
            if round_ == 0:  # each loss's old-log-prob pass, timed once, compiled in the warm-up
                mark = phases.mark()
                with Clock(meter) as clock:
                    top_k = args.k if "kl_full" in name else 0
                    data[name] = with_old(batch, compute_log_prob(worker, batch, old_topk=top_k))
                old[name] = {"seconds": clock.seconds, "peak_bytes": pass_memory(phases.since(mark))}
            mark = phases.mark()
            with Clock(meter) as clock:
                update_actor(worker, data[name], calculate_entropy=name.startswith("divclip_erc"))
            seconds[name].append(clock.seconds)
            memory[name].append(update_memory(phases.since(mark)))
    flops = update_flops(model_path, [seq_len] * args.sequences)
    peak_flops, device_name = device_peak_flops(args.device)
    figures: dict[str, Any] = {}
    for name in LOSSES:
        times = spread(seconds[name])
        figures[name] = {
            "update_seconds": seconds[name],
            **{f"update_seconds_{key}": value for key, value in times.items()},
            **{key: max(m[key] for m in memory[name]) for key in memory[name][0]},
            "old_seconds": round(old[name]["seconds"], 4),
            "old_peak_bytes": old[name]["peak_bytes"],
            "update_flops": flops,
            "update_flops_per_second": flops / times["median"],
            "mfu": None if peak_flops is None else flops / times["median"] / peak_flops,
            "tensor_cores": tensor_cores[name],
            **gauges[name],
        }
    stages["rounds"] = time.perf_counter()
    search_losses = [n for n in LOSSES if n in args.search_losses]
    searches = {"out_of_memory": False}
    for name in search_losses:  # last: an out-of-memory try cannot touch the figures above
        if any("broken" in figures[n].get("longest", {}) for n in search_losses):
            figures[name]["longest"] = {
                "broken": "not searched: the worker failed after an earlier try ran out of memory"
            }
            continue
        try:
            figures[name]["longest"] = search_longest(
                worker, phases, meter, name, args, args.search_seconds / len(search_losses), searches
            )
        except Exception as error:  # noqa: BLE001 - reported as a failed run by the parent, the figures kept
            figures[name]["longest"] = {"error": f"{type(error).__name__}: {str(error)[:400]}"}
    stages["search"] = time.perf_counter()
    return {
        "strategy": args.strategy,
        "run": "losses",
        "figures": figures,
        "rounds": rounds,
        "stage_seconds": _stages(stages),
        "peak_flops": peak_flops,
        "peak_flops_device": device_name,
    }


def rotated(names: tuple[str, ...], by: int) -> list[str]:
    """``names`` rotated left by ``by`` (a round's order: each loss starts one round)."""
    return list(names[by % len(names) :] + names[: by % len(names)])


def _stages(marks: dict[str, float]) -> dict[str, float]:
    """Seconds of each stage from the times its end was marked (the first mark is the start)."""
    names, times = list(marks), list(marks.values())
    return {names[i]: round(times[i] - times[i - 1], 1) for i in range(1, len(names))}


def run_packing(model_path: str, args: argparse.Namespace) -> dict[str, Any]:
    """Child: the configs' 2:1 dynamic packing over responses of varied, long-tailed lengths, the old pass
    aligned and with verl's packing, alternating."""
    from recipe.bench.harness import compute_log_prob, make_rollout_batch, update_actor, with_old
    from recipe.bench.ranks import single_rank_env
    from verl_ext.engine.packing import UpdatePacking
    from verl_ext.engine.seam import set_pack_old_log_prob_as_update

    single_rank_env(device=args.device)
    meter = MemoryMeter(args.device)
    stages = {"start": time.perf_counter()}
    prompt_len = max(1, args.tokens // args.sequences // 8)
    count = PACKING_RESPONSES_PER_SEQUENCE * args.sequences
    lengths = response_lengths(
        count, mean=args.tokens / count - prompt_len, max_len=args.tokens // 2 - prompt_len, seed=args.seed
    )
    options = dict(
        use_dynamic_bsz=True, max_token_len_per_gpu=args.tokens // 2, infer_max_token_len_per_gpu=args.tokens
    )
    worker = probe_worker(model_path, args, **options)
    phases = UpdatePhases(worker.engine, meter)
    batch = make_rollout_batch([prompt_len] * count, lengths, args.vocab, seed=0)
    worker.set_loss_fn(_loss("divclip_erc", count, args.k))
    packing = UpdatePacking(mini_batch_size=count, seed=0, shuffle=False)
    seconds: dict[str, list[float]] = {arm: [] for arm in PACKING_ARMS}
    peaks: dict[str, list[int]] = {arm: [] for arm in PACKING_ARMS}
    gauges: dict[str, Any] = {}
    stages["build"] = time.perf_counter()
    for round_ in range(args.warmup + args.repeats):
        for arm in PACKING_ARMS:
            set_pack_old_log_prob_as_update(worker.engine, arm == "aligned")
            mark = phases.mark()
            with Clock(meter) as clock:
                old = compute_log_prob(worker, batch, packing=packing)
            if round_ >= args.warmup:
                seconds[arm].append(clock.seconds)
                peaks[arm].append(pass_memory(phases.since(mark)))
            if arm not in gauges:
                data = with_old(batch, old)
                gauges[arm] = _gauge(update_actor(worker, data, calculate_entropy=True, mini_batch_size=count))
    figures = {
        arm: {
            **{f"old_seconds_{key}": value for key, value in spread(seconds[arm]).items()},
            "old_peak_bytes": max(peaks[arm]),
            **gauges[arm],
        }
        for arm in PACKING_ARMS
    }
    stages["rounds"] = time.perf_counter()
    return {
        "strategy": args.strategy,
        "run": "packing",
        "figures": figures,
        "response_lengths": lengths,
        "stage_seconds": _stages(stages),
    }

"""GPU acceptance: what each loss changes in verl's actor update, measured as users feel it, beside its target.

``python -m recipe.bench gpu --acceptance [--out DIR] [--strategies fsdp,fsdp2] [--tokens 16384] [--repeats 5] ...``:
the options, two fresh runs of :mod:`recipe.bench.acceptance_runs` per strategy, the report and the exit code.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from recipe.bench.acceptance_report import judge, markdown, ratios, verdict
from recipe.bench.acceptance_runs import LOSSES, SEARCH_LOSSES, run_losses, run_packing
from recipe.bench.child import LIVE_RSS_ENV, run_child, without_options
from recipe.bench.gpu_workload import (
    R1_DISTILL_QWEN_1_5B,
    STRATEGIES,
    add_model_options,
    build_model,
    chosen_strategies,
)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m recipe.bench gpu --acceptance",
        description=__doc__.split("\n")[0],
        epilog="exit codes: 0 every target measured and met (with --allow-unmeasured: every measured one); "
        "1 a target missed, a run failed or an on-policy check broken; 2 bad options or no CUDA device; "
        "3 nothing failed but a target unmeasured, without --allow-unmeasured",
    )
    p.add_argument(
        "--out",
        type=Path,
        default=None,
        help="folder for acceptance.json / acceptance.md (default outputs/gpu_acceptance/<date>)",
    )
    add_model_options(p)
    p.add_argument(
        "--warmup",
        type=int,
        default=2,
        help="untimed updates per loss after its old pass (the first: the gauge; the second: any recompilation)",
    )
    p.add_argument(
        "--repeats",
        type=int,
        default=5,
        help="timed rounds, every loss once per round, interleaved (>= 5 for the acceptance: the median)",
    )
    p.add_argument(
        "--time-every-loss",
        action="store_true",
        help="time every loss in every round (default: the baseline and the losses with a time target; "
        "the others in the first round only)",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the packing run's response lengths")
    p.add_argument(
        "--search-losses",
        default=",".join(SEARCH_LOSSES),
        help=f"losses whose longest micro-batch is searched: a subset of {list(LOSSES)}, 'all' or '' (none)",
    )
    p.add_argument(
        "--search-seconds",
        type=float,
        default=60.0,
        help="time bound of the longest-micro-batch search per strategy, split evenly over the losses "
        "(no try starts after it; 0: no search)",
    )
    p.add_argument("--search-max-tokens", type=int, default=262_144, help="the largest micro-batch the search tries")
    p.add_argument(
        "--search-resolution",
        type=float,
        default=0.25,
        help="bisection stops once the smallest failure is within this share of the largest fit",
    )
    p.add_argument(
        "--search-budget-mib",
        type=float,
        default=None,
        help="a declared memory budget: an update whose loss-phase or optimizer-step peak exceeds it does "
        "not fit (default on cuda: only running out of device memory; --device cpu needs it)",
    )
    p.add_argument(
        "--allow-unmeasured",
        action="store_true",
        help="accept targets this run cannot measure (--device cpu: FSDP1; a --strategies subset: the other "
        "strategy's; a search stopped by its time bound): they are reported as unmeasured and the exit "
        "code is 0 when every measured target is met. Without it an unmeasured target exits 3. "
        "A missed target, a failed run or a broken on-policy check exits 1 either way",
    )
    return p


def _report(
    args: argparse.Namespace,
    child_argv: list[str],
    strategies: list[str],
    finished: list[str],
    results: dict[str, dict[str, Any]],
    errors: dict[str, str],
    extras: dict[str, dict[str, Any]],
    stage_seconds: dict[str, dict[str, float]],
) -> dict[str, Any]:
    """The report of the strategies run so far (``finished``): figures, ratios, targets, gauges, errors."""
    import torch

    report: dict[str, Any] = {
        "date": _dt.date.today().isoformat(),
        "device_name": torch.cuda.get_device_name() if args.device == "cuda" else "CPU platform",
        "command": "python -m recipe.bench gpu --acceptance " + " ".join(child_argv),
        "shape": (
            f"{args.layers or R1_DISTILL_QWEN_1_5B['num_hidden_layers']} layers, hidden "
            f"{args.hidden or R1_DISTILL_QWEN_1_5B['hidden_size']}, vocabulary {args.vocab}, {args.tokens} tokens "
            f"per micro-batch in {args.sequences} sequences, k = {args.k}"
        ),
        "timing": (
            f"{args.warmup} warm-up update(s) per loss, then {args.repeats} rounds with the losses interleaved; "
            f"longest micro-batch of {', '.join(args.search_losses) or 'no loss'} searched in at most "
            f"{args.search_seconds:.0f} s per strategy up to {args.search_max_tokens} tokens"
            + (f" within {args.search_budget_mib:g} MiB" if args.search_budget_mib is not None else "")
        ),
        "peak_flops": "; ".join(
            sorted(
                {
                    f"{e['peak_flops_device']}: "
                    + ("unknown to verl's table" if e["peak_flops"] is None else f"{e['peak_flops'] / 1e12:g} TFLOP/s")
                    for e in extras.values()
                    if "peak_flops_device" in e
                }
            )
        )
        + " (dense bf16, verl.utils.flops_counter.get_device_flops; NVIDIA's H100/H200 datasheets: 1,979 TFLOP/s "
        "with sparsity, half of it dense)",
        "packing_lengths": {
            s_: f"{len(e['response_lengths'])} lengths, median {statistics.median(e['response_lengths']):g}, "
            f"min {min(e['response_lengths'])}, max {max(e['response_lengths'])}"
            for s_, e in extras.items()
            if "response_lengths" in e
        },
        "response_lengths": {s_: e["response_lengths"] for s_, e in extras.items() if "response_lengths" in e},
        "rounds": {s_: e["rounds"] for s_, e in extras.items() if "rounds" in e},
        "stage_seconds": stage_seconds,
        "figures": results,
        "ratios": {},
        "targets": {},
        "on_policy": {},
        "errors": errors,
    }
    for strategy in STRATEGIES:
        got = results.get(strategy, {})
        if "losses" in got and "packing" in got:
            report["ratios"][strategy] = ratios(got["losses"], got["packing"])
            report["targets"][strategy] = judge(report["ratios"][strategy], "the run reported no figure")
            report["on_policy"][strategy] = {
                **{n: {k: f[k] for k in ("holds", "first_update", "tensor_cores")} for n, f in got["losses"].items()},
                **{
                    f"divclip_erc_dynamic ({arm})": {k: f[k] for k in ("holds", "first_update")}
                    for arm, f in got["packing"].items()
                },
            }
        else:
            why = (
                "FSDP1 needs CUDA"
                if strategy == "fsdp" and args.device == "cpu"
                else "not requested"
                if strategy not in strategies
                else "not run yet: a partial report, written before this strategy ran"
                if strategy not in finished
                else f"the run failed: {errors}"
            )
            report["targets"][strategy] = judge(None, why)
    return report


def main(argv: list[str]) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.tokens % args.sequences or args.tokens // args.sequences < 4:
        parser.error(
            f"--tokens ({args.tokens}) must split into --sequences ({args.sequences}) sequences of >= 4 tokens"
        )
    if args.warmup < 1 or args.repeats < 1:
        parser.error("--warmup and --repeats must be >= 1 (the first update is the on-policy check)")
    chosen = [n for n in (LOSSES if args.search_losses == "all" else args.search_losses.split(",")) if n]
    if sorted(set(chosen) - set(LOSSES)):
        parser.error(
            f"unknown --search-losses {sorted(set(chosen) - set(LOSSES))}; choose from {list(LOSSES)} or 'all'"
        )
    args.search_losses = chosen if args.search_seconds > 0 else []
    if args.search_losses and "no_entropy" not in args.search_losses:
        parser.error("--search-losses must include no_entropy: the longest micro-batch is a ratio against it")
    if args.device == "cpu" and args.search_losses and args.search_budget_mib is None:
        parser.error(
            "--device cpu searches against a declared budget: give --search-budget-mib "
            "(or --search-seconds 0 for no search); running out of host memory would end the run"
        )
    strategies = chosen_strategies(parser, args)
    if args._child is not None:
        run, args.strategy = args._child.split(":")
        print(json.dumps((run_losses if run == "losses" else run_packing)(args._model, args)))
        return 0
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("no CUDA device: the acceptance run needs one GPU (--device cpu runs the code at a small shape)")
    started = time.perf_counter()
    out = args.out or Path("outputs") / "gpu_acceptance" / _dt.date.today().isoformat()
    out.mkdir(parents=True, exist_ok=True)
    child_argv = without_options([a for a in argv if a != "--acceptance"], ("--out", "--strategies"))
    results: dict[str, dict[str, Any]] = {}
    errors: dict[str, str] = {}
    extras: dict[str, dict[str, Any]] = {}
    stage_seconds: dict[str, dict[str, float]] = {}
    finished: list[str] = []
    with tempfile.TemporaryDirectory(prefix="divclip_acceptance_") as tmp:
        build_model(Path(tmp), args)
        for strategy in strategies:
            for run in ("losses", "packing"):
                run_started = time.perf_counter()
                child = run_child(
                    "recipe.bench.acceptance",
                    [*child_argv, "--_child", f"{run}:{strategy}", "--_model", tmp],
                    env=dict(LIVE_RSS_ENV) if args.device == "cpu" else None,
                )  # RSS tracks live memory
                if child.ok:
                    results.setdefault(strategy, {})[run] = child.result["figures"]
                    extras.setdefault(strategy, {}).update(
                        {k: v for k, v in child.result.items() if k not in ("figures", "stage_seconds")}
                    )
                    stage_seconds[f"{strategy}/{run}"] = {
                        **child.result.get("stage_seconds", {}),
                        "process": round(time.perf_counter() - run_started, 1),
                    }
                    errors.update(
                        {
                            f"{strategy}/search {name}": f["longest"]["error"]
                            for name, f in child.result["figures"].items()
                            if "error" in f.get("longest", {})
                        }
                    )
                else:
                    sys.stderr.write(child.stderr[-6000:])
                    errors[f"{strategy}/{run}"] = f"exit code {child.returncode}: {child.last_error_line()}"
            finished.append(strategy)
            # written after each strategy: a command stopped later (a time limit) keeps what it measured
            report = _report(args, child_argv, strategies, finished, results, errors, extras, stage_seconds)
            report["wall_seconds"] = time.perf_counter() - started
            (out / "acceptance.json").write_text(json.dumps(report, indent=1))
            (out / "acceptance.md").write_text(markdown(report))
    print((out / "acceptance.md").read_text())
    outcome = verdict(report, allow_unmeasured=args.allow_unmeasured)
    print(outcome.summary())
    return outcome.exit_code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

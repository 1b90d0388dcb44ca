"""Throughput of verl's trainer modes side by side on the CPU smoke task: samples per second of ``sync``
against ``colocate_async`` and ``separate_async``, and how stale each async mode's samples were.

Each mode trains the same ``launch/run_smoke_cpu.sh`` run; samples per second are the trained samples the data
trace counts over verl's ``perf/time_per_step``, step 1 left out (docs/benchmarks.md, "Trainer modes side by side").
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from recipe.bench.child import ROOT, subset

MODES = ("sync", "colocate_async", "separate_async")
BATCH, ROLLOUT_N = 16, 8
LAG = "training/off_policy/trajectory_staleness_worst/mean"
SPANS = "training/off_policy/trajectory_spans/max"

#: What each mode adds to the smoke's command line (docs/cpu_platform.md, "Asynchronous trainer modes"); the async
#: end-to-end tests (tests/test_trainer_modes_cpu.py) run the same.
MODE_ARGS: dict[str, tuple[list[str], dict[str, str]]] = {
    "sync": ([], {}),
    "colocate_async": (["trainer.v1.trainer_mode=colocate_async"], {}),
    "separate_async": (
        [
            "trainer.v1.trainer_mode=separate_async",
            "trainer.v1.separate_async.parameter_sync_step=2",
            "actor_rollout_ref.rollout.checkpoint_engine.backend=cpu_gloo",
        ],
        {"ROLLOUT_DEVICES": "1"},
    ),
}


def run_mode(mode: str, out: Path, steps: int, response_len: int, loss: str) -> tuple[Path, Path]:
    """One mode's smoke run into ``out``: its ``metrics.jsonl`` and its data trace. Raises with the run's last output
    on failure."""
    overrides, extra_env = MODE_ARGS[mode]
    trace = out / "trace.jsonl"
    env = {
        **os.environ,
        "PYTHON": sys.executable,
        "SMOKE_OUT": str(out),
        "LOSS": loss,
        "STEPS": str(steps),
        "TEST_FREQ": "-1",
        "SAVE_FREQ": "-1",
        "RESPONSE_LEN": str(response_len),
        "BATCH": str(BATCH),
        "ROLLOUT_N": str(ROLLOUT_N),
        "DATA_TRACE": str(trace),
        **extra_env,
    }
    env.pop("RAY_ADDRESS", None)
    args = [
        "bash",
        str(ROOT / "launch" / "run_smoke_cpu.sh"),
        "trainer.val_before_train=False",
        "actor_rollout_ref.rollout.max_num_seqs=1",
        *overrides,
    ]
    proc = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=3600)
    if proc.returncode != 0:
        raise RuntimeError(
            f"{mode}: the smoke run failed (exit {proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}"
        )
    return out / "metrics.jsonl", trace


def trained_samples(trace_file: Path) -> dict[int, int]:
    """Samples trained per step, summed over the step's actor updates (the trace's ``trained`` lines)."""
    counts: dict[int, int] = {}
    for line in trace_file.read_text().splitlines():
        record = json.loads(line) if line.strip() else {}
        if record.get("event") == "trained":
            counts[record["step"]] = counts.get(record["step"], 0) + int(record["samples"])
    return counts


def mode_row(mode: str, metrics_file: Path, trace_file: Path) -> dict[str, Any]:
    """Samples per second over steps 2.. of one run, and its staleness (module docstring)."""
    steps = {}
    for line in metrics_file.read_text().splitlines():
        record = json.loads(line)
        if record["step"] >= 2:
            steps[record["step"]] = record["data"]
    if not steps:
        raise ValueError(f"{mode}: {metrics_file} has no step after the first; raise --steps")
    counts = trained_samples(trace_file)
    untraced = sorted(set(steps) - set(counts))
    if untraced:
        raise ValueError(f"{mode}: {trace_file} records no trained sample for steps {untraced} of {metrics_file}")
    seconds = sum(data["perf/time_per_step"] for data in steps.values())
    samples = sum(counts[step] for step in steps)
    row: dict[str, Any] = {
        "mode": mode,
        "steps": len(steps),
        "seconds": round(seconds, 2),
        "samples": samples,
        "samples_per_second": round(samples / seconds, 3),
        "response_length_mean": round(statistics.fmean(d["response_length/mean"] for d in steps.values()), 2),
        "response_length_max": max(d["response_length/max"] for d in steps.values()),
    }
    lags = [d[LAG] for d in steps.values() if LAG in d]
    spans = [d[SPANS] for d in steps.values() if SPANS in d]
    row["version_lag_mean"] = round(statistics.fmean(lags), 3) if lags else None
    row["trajectory_spans_max"] = max(spans) if spans else None
    return row


def compare(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each row with its throughput against the ``sync`` row of the same invocation."""
    baseline = next((r for r in rows if r["mode"] == "sync"), None)
    for row in rows:
        row["vs_sync"] = round(row["samples_per_second"] / baseline["samples_per_second"], 3) if baseline else None
    return rows


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m recipe.bench trainer-modes", description=__doc__.split("\n\n")[0])
    parser.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, from {MODES}")
    parser.add_argument("--steps", type=int, default=6, help="training steps per mode (the first is not timed)")
    parser.add_argument("--response-len", type=int, default=48, help="data.max_response_length")
    parser.add_argument("--loss", default="kl3", choices=("kl3", "erc_dapo"))
    parser.add_argument("--out", default=None, help="folder for the runs (default: a temporary one)")
    parser.add_argument("--json", action="store_true", help="one JSON line per mode")
    args = parser.parse_args(argv)
    modes = subset(parser, "--modes", args.modes, MODES)
    if args.steps < 2:
        parser.error("--steps must be at least 2 (the first step is not timed)")
    out_root = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="bench_trainer_modes_"))
    rows = []
    for mode in modes:
        rows.append(mode_row(mode, *run_mode(mode, out_root / mode, args.steps, args.response_len, args.loss)))
    rows = compare(rows)
    stamp = _dt.date.today().isoformat()
    for row in rows:
        if args.json:
            print(json.dumps({**row, "date": stamp, "loss": args.loss, "response_len": args.response_len}))
        else:
            print(
                f"{row['mode']:>15}: {row['samples_per_second']:8.2f} samples/s over {row['steps']} steps "
                f"(x{row['vs_sync']} of sync), responses mean {row['response_length_mean']} max "
                f"{row['response_length_max']}, version lag {row['version_lag_mean']}, spans max "
                f"{row['trajectory_spans_max']}"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

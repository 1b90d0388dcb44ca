"""``python -m recipe.smoke.report SMOKE_OUT [--require-margin]``: the CPU smoke run's verdict.

Merges the file-logger files of every attempt (``SMOKE_OUT/logs/*.jsonl``; later attempts win on a repeated step)
into ``metrics.jsonl``, plots ``curves.png`` and writes ``report.json`` (the margin: docs/cpu_end_to_end.md).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path
from typing import Any

REWARD_KEYS = ("critic/score/mean", "critic/rewards/mean")
MIN_MARGIN = 0.1
MIN_T = 3.0
WINDOW = 5


def merge_attempts(out: Path) -> dict[int, dict[str, Any]]:
    """step -> metrics, over every attempt's log in the order the attempts ran."""
    logs = sorted((out / "logs").glob("*.jsonl"), key=lambda p: p.stat().st_mtime)
    if not logs:
        raise FileNotFoundError(f"no verl file-logger output under {out / 'logs'}: did the run start?")
    merged: dict[int, dict[str, Any]] = {}
    for log in logs:
        for number, line in enumerate(log.read_text().splitlines(), 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                step, data = int(row["step"]), dict(row["data"])
            except (ValueError, KeyError, TypeError) as error:
                raise ValueError(f"{log}:{number}: not a verl file-logger line ({error})") from error
            merged.setdefault(step, {}).update(data)
    return merged


def reward_series(metrics: dict[int, dict[str, Any]]) -> tuple[str, list[tuple[int, float]]]:
    for key in REWARD_KEYS:
        points = [(s, float(m[key])) for s, m in sorted(metrics.items()) if m.get(key) is not None]
        if points:
            return key, points
    raise KeyError(f"no training reward in the logs (looked for {REWARD_KEYS})")


def margin_test(rewards: list[float], window: int = WINDOW) -> dict[str, float]:
    """Last-window minus first-window mean, its Welch standard error and t statistic."""
    if len(rewards) < 2 * window:
        raise ValueError(f"need at least {2 * window} training steps for the margin test, got {len(rewards)}")
    first, last = rewards[:window], rewards[-window:]
    margin = statistics.fmean(last) - statistics.fmean(first)
    stderr = math.sqrt(statistics.variance(first) / window + statistics.variance(last) / window)
    t = margin / stderr if stderr > 0 else (math.inf if margin > 0 else 0.0)
    return {
        "first_mean": statistics.fmean(first),
        "last_mean": statistics.fmean(last),
        "margin": margin,
        "stderr": stderr,
        "t": t,
    }


def _loss_activity(metrics: dict[int, dict[str, Any]]) -> dict[str, float]:
    """Mean over steps of the divclip metrics that show the loss was active."""
    keys = (
        "actor/divclip/no_grad_frac",
        "actor/divclip/erc/clipfrac_upper",
        "actor/divclip/erc/clipfrac_lower",
        "actor/divclip/clipfrac_upper",
        "actor/divclip/clipfrac_lower",
        "actor/divclip/kl3_mean",
    )
    activity = {}
    for key in keys:
        values = [float(m[key]) for m in metrics.values() if m.get(key) is not None]
        if values:
            activity[key] = statistics.fmean(values)
    return activity


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m recipe.smoke.report", description=__doc__.split("\n")[0])
    parser.add_argument("out", type=Path, help="the smoke run's SMOKE_OUT folder")
    parser.add_argument("--require-margin", action="store_true", help="exit 1 unless the learning margin is clear")
    args = parser.parse_args(argv)

    metrics = merge_attempts(args.out)
    with open(args.out / "metrics.jsonl", "w") as f:
        for step in sorted(metrics):
            f.write(json.dumps({"step": step, "data": metrics[step]}) + "\n")

    from recipe.plots import plot_curves

    plot_curves([args.out / "metrics.jsonl"], args.out / "curves.png")

    key, points = reward_series(metrics)
    report: dict[str, Any] = {"reward_key": key, "steps": [s for s, _ in points], "rewards": [r for _, r in points]}
    report["loss_activity"] = _loss_activity(metrics)
    clear = False
    if len(points) >= 2 * WINDOW:
        test = margin_test([r for _, r in points])
        clear = test["margin"] >= MIN_MARGIN and test["t"] >= MIN_T
        report.update(test)
        verdict = (
            f"reward {test['first_mean']:.3f} (first {WINDOW} steps) -> {test['last_mean']:.3f} (last {WINDOW}): "
            f"margin {test['margin']:+.3f} = {test['t']:.1f} standard errors ({'clear' if clear else 'NOT clear'}: "
            f"needs >= {MIN_MARGIN} and >= {MIN_T} SE)"
        )
    else:
        verdict = f"{len(points)} training steps: too few for the {WINDOW}+{WINDOW}-step margin test"
    report["clear_margin"] = clear
    report["verdict"] = verdict
    (args.out / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    print(f"[smoke] {verdict}")
    print(f"[smoke] metrics: {args.out / 'metrics.jsonl'}  curves: {args.out / 'curves.png'}")
    if args.require_margin and not clear:
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

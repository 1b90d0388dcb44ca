"""``score``'s output: metrics per checkpoint and benchmark, Markdown tables, mean ± std over seeds.

:func:`score_runs` + :func:`render_tables`: one table per metric@k (a "final (best)" row when there are several
checkpoints); :func:`aggregate_runs` + :func:`render_aggregate`: mean ± std over runs, final and best (ATR Table 3).
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from recipe.eval.metrics import METRICS, Checkpoint, resolve_k, score_benchmark
from recipe.eval.presets import _benchmark_order, display_name


def score_runs(runs: Sequence[tuple[str, Checkpoint]], k_values: Sequence[int | str]) -> dict[str, Any]:
    """{"checkpoints": [label...], "results": {label: {benchmark: {"<metric>@<k>": value, "n": n}}}}."""
    results: dict[str, dict[str, dict[str, float]]] = {}
    for label, checkpoint in runs:
        if label in results:
            raise ValueError(f"checkpoint label {label!r} given twice; use --labels to name them")
        results[label] = {}
        for bench, problems in checkpoint.items():
            cell: dict[str, float] = {"n": min(len(p.correct) for p in problems), "problems": len(problems)}
            for k in k_values:
                kk = resolve_k(k, problems, bench)
                for metric, value in score_benchmark(problems, kk).items():
                    cell[f"{metric}@{k}"] = value
                    cell[f"k_of_{k}"] = kk
            results[label][bench] = cell
    return {"checkpoints": [label for label, _ in runs], "results": results}


def _fmt(value: float | None) -> str:
    return "–" if value is None else f"{100.0 * value:.1f}"


def render_tables(scored: dict[str, Any], k_values: Sequence[int | str]) -> str:
    """Markdown: one table per metric and k, checkpoints as rows, benchmarks + Avg as columns.

    Values are percentages. Avg is the unweighted mean over the benchmarks present for that
    checkpoint (ERC Table 1 / ATR Table 2 style). With several checkpoints a last row
    "final (best)" gives the last checkpoint's value with the best over all in parentheses.
    """
    labels: list[str] = scored["checkpoints"]
    results = scored["results"]
    benchmarks = _benchmark_order(b for label in labels for b in results[label])
    lines: list[str] = []
    for metric in METRICS:
        for k in k_values:
            key = f"{metric}@{k}"
            ks = {results[lab][b][f"k_of_{k}"] for lab in labels for b in results[lab]}
            k_text = str(next(iter(ks))) if len(ks) == 1 else "n"
            header = [
                f"{display_name(b)}" + (f" (@{_k_of(results, labels, b, k)})" if k_text == "n" else "")
                for b in benchmarks
            ]
            lines.append(f"### {metric}@{k_text}" + (" (k = each benchmark's n)" if k_text == "n" and k == "n" else ""))
            lines.append("")
            lines.append("| checkpoint | " + " | ".join(header) + " | Avg |")
            lines.append("|---" * (len(benchmarks) + 2) + "|")
            table: dict[str, list[float | None]] = {}
            for label in labels:
                row = [results[label].get(b, {}).get(key) for b in benchmarks]
                present = [v for v in row if v is not None]
                row.append(sum(present) / len(present) if len(present) == len(benchmarks) else None)
                table[label] = row
                lines.append(f"| {label} | " + " | ".join(_fmt(v) for v in row) + " |")
            if len(labels) > 1:
                final = table[labels[-1]]
                cells = []
                for col in range(len(benchmarks) + 1):
                    column = [table[lab][col] for lab in labels if table[lab][col] is not None]
                    best = max(column) if column else None
                    cells.append(f"{_fmt(final[col])} ({_fmt(best)})")
                lines.append("| final (best) | " + " | ".join(cells) + " |")
            lines.append("")
    return "\n".join(lines)


def _k_of(results: dict[str, Any], labels: Sequence[str], benchmark: str, k: int | str) -> str:
    values = sorted({results[lab][benchmark][f"k_of_{k}"] for lab in labels if benchmark in results[lab]})
    return "/".join(str(int(v)) for v in values)


# -- --aggregate: several runs (seeds) of one row -> mean +- std (ATR Table 3) ---------

_SEED_SUFFIX = re.compile(r"[_-]seed\d+$")


def row_label(path: str | os.PathLike[str]) -> str:
    """A run's row: its folder or file name without a ``_seed<S>`` suffix (the sweep's naming)."""
    stem = Path(path).stem if Path(path).is_file() else Path(path).name
    return _SEED_SUFFIX.sub("", stem)


def _avg(cells: dict[str, dict[str, float]], key: str, benchmarks: Sequence[str]) -> float | None:
    values = [cells[b][key] for b in benchmarks if b in cells and key in cells[b]]
    return sum(values) / len(values) if values and len(values) == len(benchmarks) else None


def aggregate_runs(
    rows: Sequence[tuple[str, Sequence[Sequence[tuple[str, Checkpoint]]]]], k_values: Sequence[int | str]
) -> dict[str, Any]:
    """mean and std over the runs of each row, for the final and the best checkpoint of each run.

    ``rows``: (row label, runs), each run the checkpoints of one training run in step order (a
    ``generate`` folder is one checkpoint; a verl ``validation_data_dir`` one per step). A run's
    *final* value is its last checkpoint's; its *best* value, per metric@k, that of the checkpoint
    with the highest benchmark average (ATR Table 2 reports both). The std is the sample standard
    deviation over runs (n - 1 in the denominator; 0 for a single run). Every run of a row must
    cover the same benchmarks. Returns ``{"rows": [...], "results": {row: {"runs": r, "final"|"best":
    {"<metric>@<k>": {benchmark|"avg": {"mean", "std", "values"}}}}}}``.
    """
    results: dict[str, Any] = {}
    for label, runs in rows:
        if label in results:
            raise ValueError(f"row {label!r} given twice")
        if not runs:
            raise ValueError(f"row {label!r} has no runs")
        scored_runs = [score_runs(list(run), k_values) for run in runs]
        benchmarks = sorted({b for sr in scored_runs for cp in sr["results"].values() for b in cp})
        for i, sr in enumerate(scored_runs):
            for cp_label, cells in sr["results"].items():
                missing = [b for b in benchmarks if b not in cells]
                if missing:
                    raise ValueError(
                        f"row {label!r}: run {i + 1} checkpoint {cp_label!r} lacks {missing}; every run of a row "
                        "must be scored on the same benchmarks"
                    )
        keys = [f"{metric}@{k}" for metric in METRICS for k in k_values]
        row: dict[str, Any] = {"runs": len(runs), "benchmarks": benchmarks, "final": {}, "best": {}}
        for key in keys:
            for which in ("final", "best"):
                picked = [
                    sr["results"][sr["checkpoints"][-1]]
                    if which == "final"
                    else max(sr["results"].values(), key=lambda cells: _avg(cells, key, benchmarks) or 0.0)
                    for sr in scored_runs
                ]
                cell: dict[str, dict[str, Any]] = {}
                for column in [*benchmarks, "avg"]:
                    values = [(_avg(c, key, benchmarks) if column == "avg" else c[column][key]) for c in picked]
                    mean = sum(values) / len(values)
                    std = (
                        math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1)) if len(values) > 1 else 0.0
                    )
                    cell[column] = {"mean": mean, "std": std, "values": values}
                row[which][key] = cell
        results[label] = row
    return {"rows": [label for label, _ in rows], "results": results}


def render_aggregate(aggregated: dict[str, Any], k_values: Sequence[int | str]) -> str:
    """Markdown: per metric@k, a "final" and a "best" table of mean ± std (percent) per row."""
    labels = aggregated["rows"]
    results = aggregated["results"]
    benchmarks = _benchmark_order(b for lab in labels for b in results[lab]["benchmarks"])
    lines: list[str] = []
    for metric in METRICS:
        for k in k_values:
            key = f"{metric}@{k}"
            for which in ("final", "best"):
                lines.append(f"### {key}, {which} checkpoint (mean ± std over runs)")
                lines.append("")
                lines.append("| row | runs | " + " | ".join(display_name(b) for b in benchmarks) + " | Avg |")
                lines.append("|---" * (len(benchmarks) + 3) + "|")
                for lab in labels:
                    cell = results[lab][which][key]
                    texts = [
                        "–" if cell.get(c) is None else f"{100 * cell[c]['mean']:.1f} ± {100 * cell[c]['std']:.1f}"
                        for c in [*benchmarks, "avg"]
                    ]
                    lines.append(f"| {lab} | {results[lab]['runs']} | " + " | ".join(texts) + " |")
                lines.append("")
    return "\n".join(lines)

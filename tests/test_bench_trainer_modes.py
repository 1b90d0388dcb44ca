"""``python -m recipe.bench trainer-modes``: how a row is read from a run (samples per second over the steps after
the first: the samples each step trained, counted from the run's data trace, over verl's ``perf/time_per_step``;
the async modes' staleness, verl's own figures) and compared with the sync row of the same invocation. The runs
themselves are the CPU smoke in each mode, which tests/test_trainer_modes_cpu.py runs end to end; their figures
are in docs/benchmarks.md."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from recipe.bench.trainer_modes import LAG, SPANS, compare, main, mode_row


def write_metrics(path: Path, steps: dict[int, dict]) -> Path:
    path.write_text("".join(json.dumps({"step": step, "data": data}) + "\n" for step, data in steps.items()))
    return path


def write_trace(path: Path, updates: list[tuple[int, int]]) -> Path:
    """One ``trained`` line per (step, samples) update, between the ``fetched`` lines a real trace also holds."""
    lines = [{"event": "fetched", "step": 1, "attempt": "a", "prompts": [[0, "x"]]}]
    lines += [
        {"event": "trained", "step": step, "attempt": "a", "prompts": [[0, "x"]], "samples": samples}
        for step, samples in updates
    ]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def step(seconds: float, lag: float | None = None, spans: int | None = None) -> dict:
    data = {"perf/time_per_step": seconds, "response_length/mean": 10.0, "response_length/max": 48}
    if lag is not None:
        data[LAG] = lag
    if spans is not None:
        data[SPANS] = spans
    return data


def test_rows_count_the_trained_samples_of_the_steps_after_the_first_and_compare_with_sync(tmp_path: Path) -> None:
    sync = write_metrics(tmp_path / "sync.jsonl", {0: {"val-core/x": 1.0}, 1: step(100.0), 2: step(4.0), 3: step(4.0)})
    sync_trace = write_trace(tmp_path / "sync_trace.jsonl", [(1, 128), (2, 128), (3, 128)])
    colocate = write_metrics(
        tmp_path / "colocate.jsonl", {1: step(50.0, 0.0, 1), 2: step(2.0, 0.5, 2), 3: step(3.0, 1.5, 3)}
    )
    # two updates a step (as separate_async trains them), one short of the batch: what was trained is what counts
    colocate_trace = write_trace(tmp_path / "colocate_trace.jsonl", [(1, 128), (2, 64), (2, 64), (3, 60), (3, 64)])
    rows = compare([mode_row("sync", sync, sync_trace), mode_row("colocate_async", colocate, colocate_trace)])
    assert rows[0]["samples"] == 256 and rows[0]["samples_per_second"] == pytest.approx(256 / 8)
    assert rows[0]["vs_sync"] == 1.0
    assert rows[1]["samples"] == 252 and rows[1]["samples_per_second"] == pytest.approx(252 / 5)
    assert rows[1]["vs_sync"] == pytest.approx((252 / 5) / (256 / 8), abs=1e-3)
    assert rows[1]["version_lag_mean"] == pytest.approx(1.0) and rows[1]["trajectory_spans_max"] == 3
    assert rows[0]["version_lag_mean"] is None and rows[0]["steps"] == 2


def test_a_run_without_a_timed_step_or_trained_samples_and_bad_options_are_refused(tmp_path: Path) -> None:
    trace = write_trace(tmp_path / "trace.jsonl", [(1, 128), (2, 128)])
    with pytest.raises(ValueError, match="no step after the first"):
        mode_row("sync", write_metrics(tmp_path / "m.jsonl", {1: step(3.0)}), trace)
    with pytest.raises(ValueError, match=r"records no trained sample for steps \[3\]"):
        mode_row("sync", write_metrics(tmp_path / "m.jsonl", {1: step(3.0), 2: step(3.0), 3: step(3.0)}), trace)
    with pytest.raises(SystemExit):
        main(["--modes", "fully_async"])
    with pytest.raises(SystemExit):
        main(["--steps", "1"])

"""``python -m recipe.bench trainer-modes``: how a row is read from a run's metrics (samples per second over
the steps after the first, from verl's ``perf/time_per_step``; the async modes' staleness) and compared with
the sync row of the same invocation. The runs themselves are the CPU smoke in each mode, which
tests/test_trainer_modes_cpu.py runs end to end; their figures are in docs/benchmarks.md."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from recipe.bench.trainer_modes import compare, main, mode_row


def write_metrics(path: Path, steps: dict[int, dict]) -> Path:
    path.write_text("".join(json.dumps({"step": step, "data": data}) + "\n" for step, data in steps.items()))
    return path


def step(seconds: float, lag: float | None = None, spans: int | None = None) -> dict:
    data = {"perf/time_per_step": seconds, "response_length/mean": 10.0, "response_length/max": 48}
    if lag is not None:
        data["actor/divclip/staleness/version_lag_mean"] = lag
    if spans is not None:
        data["training/off_policy/trajectory_spans/max"] = spans
    return data


def test_rows_time_the_steps_after_the_first_and_compare_with_sync(tmp_path: Path) -> None:
    sync = write_metrics(tmp_path / "sync.jsonl", {0: {"val-core/x": 1.0}, 1: step(100.0), 2: step(4.0), 3: step(4.0)})
    colocate = write_metrics(tmp_path / "colocate.jsonl", {1: step(50.0, 0.0, 1), 2: step(2.0, 0.5, 2), 3: step(3.0, 1.5, 3)})
    rows = compare([mode_row("sync", sync, 128), mode_row("colocate_async", colocate, 128)])
    assert rows[0]["samples_per_second"] == pytest.approx(256 / 8) and rows[0]["vs_sync"] == 1.0
    assert rows[1]["samples_per_second"] == pytest.approx(256 / 5) and rows[1]["vs_sync"] == pytest.approx(1.6)
    assert rows[1]["version_lag_mean"] == pytest.approx(1.0) and rows[1]["trajectory_spans_max"] == 3
    assert rows[0]["version_lag_mean"] is None and rows[0]["steps"] == 2


def test_a_run_without_a_timed_step_and_bad_options_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="no step after the first"):
        mode_row("sync", write_metrics(tmp_path / "m.jsonl", {1: step(3.0)}), 128)
    with pytest.raises(SystemExit):
        main(["--modes", "fully_async"])
    with pytest.raises(SystemExit):
        main(["--steps", "1"])

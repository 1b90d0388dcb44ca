"""``python -m recipe.bench onpolicy`` at a tiny size: the rows it prints are the ones docs/benchmarks.md
records. What the code decides is asserted case by case: the packings differ without the alignment and
coincide with it, and with it every ratio is exactly 1 and the LM head sees bit-identical hidden states in both
passes. The control's effect is built into the case: the sequences' lengths vary, so verl's own packing gives the
two passes micro-batches of other lengths, and the final hidden states of some rows differ between the passes
(on this AVX2 machine at one thread too, where equal lengths are bit-identical). Whether that reaches a bf16
log-prob depends on the machine (the case's scaled head makes most tokens saturate), so the effect asserted is
the hidden states', over the budget pairs: on at least one; the log-ratios are recorded, not asserted."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def bench(*args: str) -> list[dict]:
    proc = subprocess.run(
        [sys.executable, "-m", "recipe.bench", "onpolicy", "--json", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]


def test_cases_compare_own_and_aligned_packing() -> None:
    rows = bench("--threads", "1", "--seeds", "4")
    assert {(r["packing"], r["budgets"]) for r in rows} == {
        (p, b) for p in ("own", "aligned") for b in ("40/64", "40/80", "24/48", "64/128")
    }
    own_noise = {r["budgets"]: r["hidden_rows_differing"] for r in rows if r["packing"] == "own"}
    assert max(own_noise.values()) > 0, own_noise  # the noise the alignment removes
    for r in rows:
        assert r["threads"] == 1 and r["confident_frac"] > 0.5
        if r["packing"] == "aligned":
            assert r["same_packing"] is True
            assert r["erc_ratio_min"] == r["erc_ratio_max"] == 1.0 and r["erc_masked_frac"] == 0.0
            assert r["log_ratio_abs_max"] == 0.0
            assert r["hidden_rows_differing"] == 0.0 and r["hidden_max_abs_diff"] == 0.0
        else:  # the log-prob pass's own budget packs fewer, larger micro-batches
            assert r["same_packing"] is False and r["old_micro_batches"] < r["update_micro_batches"]
            assert 0.0 <= r["hidden_rows_differing"] <= 1.0 and r["fp32_head_erc_ratio_min"] > 0


def test_cost_reports_time_and_peak_ratios() -> None:
    rows = bench("--cost", "--tokens", "256", "--vocab", "4096", "--sequences", "4")
    timing, own, aligned = rows
    assert timing["arm"] == "time" and timing["aligned_seconds_vs_own"] > 0
    assert own["arm"] == "own" and aligned["arm"] == "aligned" and aligned["peak_ratio_vs_own"] > 0

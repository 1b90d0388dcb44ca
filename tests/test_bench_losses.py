"""``python -m recipe.bench losses`` runs every variant and reports what it measured under (a tiny
shape; the timings themselves are benchmarks, recorded in docs/benchmarks.md, never asserted)."""

from __future__ import annotations

from recipe.bench import losses as bench


def test_every_variant_is_timed_against_vanilla_with_the_heap_it_ran_under() -> None:
    rows = bench.run(rounds=2, warmup=1, shapes=((2, 64),))
    names = {row["mode"] for row in rows}
    assert names == set(bench._variants())
    assert {"vanilla+erc", "gspo+erc", "sapo+erc", "seq_kl3", "trgppo+erc"} <= names
    vanilla = next(row for row in rows if row["mode"] == "vanilla")
    assert vanilla["ratio_vs_vanilla"] == 1.0
    for row in rows:
        assert row["heap"] in ("steady", "glibc-default (mallopt unavailable)")
        assert isinstance(row["minor_faults_per_step"], (int, float)) and row["minor_faults_per_step"] >= 0
        assert row["median_ms"] > 0 and row["target"] == bench.TARGET_RATIO


def test_the_heap_label_tells_the_truth() -> None:
    """mallopt lasts for the process: once held, a "glibc-default" run in it is labelled steady."""
    rows = bench.run(rounds=1, warmup=0, shapes=((2, 32),), heap="glibc-default")
    expected = "steady (held earlier in this process)" if bench._heap_held else "glibc-default"
    assert {row["heap"] for row in rows} == {expected}

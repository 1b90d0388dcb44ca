"""``python -m recipe.bench entropy-memory`` runs each variant in its own process (through
``recipe.bench.child``) and reports peaks against the no-entropy baseline; ``full-kl`` does the same
for kl_full against kl3 and prints the stored top-k's bytes (tiny shapes; the figures themselves
are benchmarks, recorded in docs/benchmarks.md)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_entropy_memory_reports_every_variant_against_the_baseline() -> None:
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "recipe.bench",
            "entropy-memory",
            "--json",
            "--tokens",
            "64",
            "--vocab",
            "512",
            "--hidden",
            "32",
            "--sequences",
            "2",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = {
        row["variant"]: row for row in map(json.loads, (ln for ln in proc.stdout.splitlines() if ln.startswith("{")))
    }
    assert set(rows) >= {
        "a_no_entropy",
        "b_verl_entropy",
        "c_detached",
        "d_vocab_pass",
        "e_old_log_prob_detached",
        "f_old_log_prob_vocab_pass",
    }
    assert all(row["peak_rss_bytes"] > 0 and row["date"] and "peak_ratio_vs_a" in row for row in rows.values())
    assert {row["phase"] for name, row in rows.items() if "old_log_prob" in name} == {"old_log_prob"}
    assert rows["d_vocab_pass"]["phase"] == "update" and rows["d_vocab_pass"]["loss"] == rows["d_vocab_pass"]["loss"]


def test_engine_benches_share_one_model_and_micro_batch_shape() -> None:
    """``entropy-memory``, ``full-kl`` and ``onpolicy --cost`` build their model and batch from
    ``bench_micro_batch``: a quarter of each sequence is prompt, the MLP is twice the width."""
    from recipe.bench.harness import TinyQwen3Spec, bench_micro_batch

    shape = bench_micro_batch(tokens=256, sequences=4, vocab=4096, hidden=64)
    assert shape.spec == TinyQwen3Spec(
        vocab_size=4096,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=8192,
    )
    assert (shape.prompt_lens, shape.response_lens) == ([16] * 4, [48] * 4)
    long = bench_micro_batch(tokens=65_536, sequences=2, vocab=512, hidden=32)
    assert (long.prompt_len, long.response_len, long.spec.max_position_embeddings) == (8192, 24_576, 32_768)
    assert (bench_micro_batch(6, 3, 512, 32).prompt_len, bench_micro_batch(6, 3, 512, 32).response_len) == (1, 1)
    with pytest.raises(ValueError, match=r"--tokens \(63\) must be divisible by --sequences \(2\)"):
        bench_micro_batch(63, 2, 512, 32)
    with pytest.raises(ValueError, match="--sequences"):
        bench_micro_batch(64, 0, 512, 32)
    with pytest.raises(ValueError, match="fewer than 2 tokens per sequence"):
        bench_micro_batch(4, 4, 512, 32)


def test_child_runs_read_the_last_json_line_and_keep_stderr() -> None:
    from recipe.bench.child import run_child

    ok = run_child("recipe.bench", ["--help"])
    assert ok.returncode == 0 and ok.result is None and not ok.ok  # no JSON line: not a result
    bad = run_child("recipe.bench.no_such_module", [])
    assert bad.returncode != 0 and not bad.ok and bad.last_error_line()


def test_a_parent_hands_its_children_its_options_and_checks_its_subsets(capsys: pytest.CaptureFixture[str]) -> None:
    """``forwarded`` gives a child the options as the parent parsed them (a set flag alone, an unset flag and
    ``None`` left out), ``without_options`` drops the parent's own, and ``subset`` keeps the order given and
    refuses an unknown name, or none unless allowed, naming the choices."""
    import argparse

    from recipe.bench.child import forwarded, subset, without_options

    args = argparse.Namespace(phase="old", vocab_pass=True, json=False, layers=None, tokens=64)
    assert forwarded(args, "--phase", "--vocab-pass", "--json", "--layers", "--tokens") == [
        "--phase",
        "old",
        "--vocab-pass",
        "--tokens",
        "64",
    ]
    argv = ["--device", "cpu", "--out", "x", "--strategies=fsdp2", "--k", "8"]
    assert without_options(argv, ("--out", "--strategies")) == ["--device", "cpu", "--k", "8"]
    parser = argparse.ArgumentParser(prog="bench")
    assert subset(parser, "--modes", "b,,a", ("a", "b")) == ["b", "a"]
    assert subset(parser, "--modes", "", ("a",), allow_none=True) == []
    for value, why in (("a,c", "unknown ['c']"), ("", "none given")):
        with pytest.raises(SystemExit):
            subset(parser, "--modes", value, ("a", "b"))
        assert f"--modes: {why}; choose from ['a', 'b']" in capsys.readouterr().err


@pytest.mark.parametrize("phase, vocab_pass", [("update", False), ("old", True)])
def test_full_kl_bench_reports_kl_full_against_kl3_and_the_stored_bytes(phase: str, vocab_pass: bool) -> None:
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "recipe.bench",
            "full-kl",
            "--json",
            "--tokens",
            "64",
            "--vocab",
            "512",
            "--hidden",
            "32",
            "--sequences",
            "2",
            "--k",
            "8",
            "--phase",
            phase,
            *(["--vocab-pass"] if vocab_pass else []),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [json.loads(ln) for ln in proc.stdout.splitlines() if ln.startswith("{")]
    rows = {row["variant"]: row for row in lines if "variant" in row}
    assert set(rows) == {"kl3", "kl_full"}
    assert {(row["phase"], row["path"]) for row in rows.values()} == {(phase, "vocab_pass" if vocab_pass else "logits")}
    assert rows["kl3"]["peak_ratio_vs_kl3"] == 1.0 and rows["kl_full"]["peak_rss_bytes"] > 0
    if phase == "old":  # same model and batch: storing the top-k leaves the old log-probs as they are
        assert rows["kl3"]["check"] == rows["kl_full"]["check"]
    (sizes,) = [row["stored_topk"] for row in lines if "stored_topk" in row]
    assert sizes["bytes_per_token"] == 8 * 4 + 9 * 4
    assert sizes["bytes_per_step_max"]["atr_grpo_qwen3_8b"] == 68 * 4 * 8 * 1536

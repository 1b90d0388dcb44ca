"""``python -m recipe.bench reward --math500 PATH``: the MATH-500 rows come from the given file (an
installed wheel has no ``../shared`` beside it), and a missing or malformed file is an error that
names ``--math500``. The throughput figures themselves are benchmarks, in docs/benchmarks.md."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def bench(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "recipe.bench", "reward", *args], cwd=ROOT, capture_output=True, text=True, timeout=600
    )


def test_a_missing_math500_file_is_an_error_naming_the_option(tmp_path: Path) -> None:
    missing = tmp_path / "no_such.jsonl"
    proc = bench("--math500", str(missing), "--json")
    assert proc.returncode == 2 and proc.stdout == ""
    assert "--math500" in proc.stderr and str(missing) in proc.stderr


def test_a_malformed_math500_row_is_an_error_naming_the_option_and_line(tmp_path: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"solution": "$\\boxed{1}$", "answer": "1"}) + "\n" + json.dumps({"problem": "x"}) + "\n")
    proc = bench("--math500", str(bad), "--json")
    assert proc.returncode == 2
    assert "--math500" in proc.stderr and "line 2" in proc.stderr and "'answer'" in proc.stderr


def test_the_given_math500_file_is_the_one_scored(tmp_path: Path) -> None:
    rows = [
        {"solution": "So $x = 3$, and the answer is $\\boxed{3}$.", "answer": "3"},
        {"solution": "Adding, we get $\\boxed{\\frac{1}{2}}$.", "answer": "\\frac{1}{2}"},
        {"solution": "Hence $\\boxed{10}$.", "answer": "10"},
    ]
    given = tmp_path / "three.jsonl"
    given.write_text("".join(json.dumps(row) + "\n" for row in rows))
    proc = bench("--math500", str(given), "--synthetic", "2", "--synthetic-chars", "200", "--threads", "1", "--json")
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.splitlines()[-1])
    assert report["corpus"]["math500"] == str(given)
    assert (report["corpus"]["math500_self"], report["corpus"]["math500_shifted"]) == (3, 3)
    ours = next(r for r in report["results"] if r["name"] == "ours")
    # 3 self pairs (all correct), 3 shifted pairs (all wrong: the answers differ), 2 synthetic (one right)
    assert ours["items"] == 3 + 3 + 2 and ours["correct"] == 3 + 1

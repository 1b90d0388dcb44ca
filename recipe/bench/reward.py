"""``python -m recipe.bench reward [--json] [--math500 PATH]``: reward throughput, ours vs verl's.

One mixed corpus (MATH-500 solutions against their own and the next problem's answer, long synthetic chains of
thought) scored by three functions from a thread pool, as verl's reward loop calls a synchronous ``compute_score``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from recipe.bench.child import ROOT

MATH500 = ROOT.parent / "shared/data/eval/math500.h4.jsonl"
"""``--math500``'s default: the shared data beside a checkout (an installed wheel has none)."""

Item = tuple[str, str]  # (solution_str, ground_truth)


def synthetic_cot(rng: random.Random, answer: str, target_chars: int) -> str:
    """A long, number-heavy chain of thought: bare numbers everywhere, one boxed answer at the end."""
    steps = []
    size = 0
    while size < target_chars:
        a, b = rng.randint(2, 999), rng.randint(2, 999)
        step = rng.choice(
            [
                f"Try $n={a}$: then $n^2 = {a * a}$, which leaves remainder {a * a % b} mod {b}. ",
                f"Wait, let me recheck. If $x = \\frac{{{a}}}{{{b}}}$ then $2x = \\frac{{{2 * a}}}{{{b}}}$. ",
                f"So the sum is {a} + {b} = {a + b}, and the product {a * b}. ",
                f"Hmm, {a} cases remain; checking $\\sqrt{{{a * a}}} = {a}$ again. ",
            ]
        )
        steps.append(step)
        size += len(step)
    return "<think>\n" + "".join(steps) + f"\n</think>\nTherefore the answer is $\\boxed{{{answer}}}$."


def load_math500(path: Path) -> list[dict[str, str]]:
    """The ``solution``/``answer`` rows of a MATH-500 JSONL file; a bad line is named with its number."""
    rows = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            row = None
        if not (isinstance(row, dict) and all(isinstance(row.get(key), str) for key in ("solution", "answer"))):
            raise ValueError(
                f"--math500 {path}: line {number} is not a JSON object with string 'solution' and 'answer'"
            )
        rows.append(row)
    if not rows:
        raise ValueError(f"--math500 {path}: no rows")
    return rows


def build_corpus(rows: list[dict[str, str]], n_synthetic: int, synthetic_chars: int, seed: int = 0) -> list[Item]:
    """Each MATH-500 solution against its own answer and against the next row's, plus the synthetic items."""
    corpus: list[Item] = [(r["solution"], r["answer"]) for r in rows]
    corpus += [(r["solution"], rows[(i + 1) % len(rows)]["answer"]) for i, r in enumerate(rows)]
    rng = random.Random(seed)
    for k in range(n_synthetic):
        answer = str(rng.randint(1, 999))
        gold = answer if k % 2 == 0 else str(int(answer) + 1)
        corpus.append((synthetic_cot(rng, answer, synthetic_chars), gold))
    rng.shuffle(corpus)
    return corpus


def run(name: str, score: Callable[[str, str], float], corpus: list[Item], threads: int) -> dict[str, Any]:
    latencies: list[float] = []
    scores: list[float] = []

    def one(item: Item) -> None:
        start = time.perf_counter()
        value = score(*item)
        latencies.append(time.perf_counter() - start)
        scores.append(value)

    start = time.perf_counter()
    with ThreadPoolExecutor(max_workers=threads) as pool:
        list(pool.map(one, corpus))
    elapsed = time.perf_counter() - start
    latencies.sort()
    return {
        "name": name,
        "items": len(corpus),
        "seconds": round(elapsed, 3),
        "items_per_s": round(len(corpus) / elapsed, 2),
        "p50_ms": round(1000 * latencies[len(latencies) // 2], 2),
        "max_s": round(latencies[-1], 3),
        "items_over_10s": sum(1 for t in latencies if t > 10.0),  # verl's wrapper gives up at 30 s
        "correct": sum(1 for s in scores if s > 0),
    }


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m recipe.bench reward", description=__doc__)
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--synthetic", type=int, default=200, help="long synthetic CoT items")
    parser.add_argument("--synthetic-chars", type=int, default=40_000, help="length of each (~10k tokens)")
    parser.add_argument("--threads", type=int, default=8, help="calling threads (verl's reward loop uses many)")
    parser.add_argument(
        "--math500",
        type=Path,
        default=None,
        help=f"MATH-500 JSONL with 'solution' and 'answer' per line (default: {MATH500})",
    )
    args = parser.parse_args(argv)
    math500: Path = args.math500 if args.math500 is not None else MATH500
    if not math500.is_file():
        where = "the given" if args.math500 is not None else "the default"
        print(
            f"error: --math500 {math500} ({where} path) is not a file; the benchmark needs the real MATH-500 "
            "solutions: pass --math500 PATH",
            file=sys.stderr,
        )
        return 2
    try:
        rows = load_math500(math500)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2

    from verl.utils.reward_score import math_dapo
    from verl.utils.reward_score import math_verify as verl_math_verify

    import recipe.reward.score as ours

    corpus = build_corpus(rows, args.synthetic, args.synthetic_chars)
    # Warm every pool (process start-up is not throughput) before timing.
    ours.compute_score("math500", "\\boxed{1}", "2")
    verl_math_verify.compute_score("\\boxed{1}", "2")
    for _ in range(8):
        verl_math_verify.compute_score("\\boxed{1/2}", "0.5")

    results = [
        run("ours", lambda s, g: ours.compute_score("math500", s, g)["score"], corpus, args.threads),
        run("verl_math_verify", lambda s, g: verl_math_verify.compute_score(s, g), corpus, args.threads),
        run("verl_math_dapo", lambda s, g: math_dapo.compute_score(s, g)["score"], corpus, args.threads),
    ]
    by_name = {r["name"]: r for r in results}
    stats = ours.reward_stats()
    report = {
        "cpu_count": os.cpu_count(),
        "threads": args.threads,
        "corpus": {
            "math500": str(math500),
            "math500_self": len(rows),
            "math500_shifted": len(rows),
            "synthetic": args.synthetic,
            "synthetic_chars": args.synthetic_chars,
        },
        "results": results,
        "ratio_vs_verl_math_verify": round(
            by_name["ours"]["items_per_s"] / by_name["verl_math_verify"]["items_per_s"], 2
        ),
        "ratio_vs_verl_math_dapo": round(by_name["ours"]["items_per_s"] / by_name["verl_math_dapo"]["items_per_s"], 3),
        "ours_timeouts": stats["timeouts"],
        "ours_stats": stats,
    }
    ours.shutdown_pool()
    if args.json:
        print(json.dumps(report))
    else:
        for r in results:
            print(
                f"{r['name']:>18}: {r['items_per_s']:>9.1f} items/s  p50 {r['p50_ms']} ms  max {r['max_s']} s  "
                f"correct {r['correct']}/{r['items']}"
            )
        print(
            f"ours / verl math_verify: {report['ratio_vs_verl_math_verify']}x; "
            f"ours / verl math_dapo: {report['ratio_vs_verl_math_dapo']}x; our timeouts: {stats['timeouts']}"
        )
    return 0

"""The metrics: unbiased pass@k, mean@k and maj@k per problem, averaged per benchmark.

Pure functions of per-response correctness (and extracted answers for maj@k); no I/O. pass@k is the
unbiased estimator of Chen et al. (2021), 1 - C(n-c, k) / C(n, k), computed as a product; mean@k and
maj@k use the first k responses (docs/evaluation.md, "Metric definitions").
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass


def _check_counts(n: int, k: int, c: int | None = None) -> None:
    for name, value in (("n", n), ("k", k)) + ((("c", c),) if c is not None else ()):
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"{name} must be an integer, got {value!r}")
    if k < 1:
        raise ValueError(f"k must be >= 1, got k={k}")
    if n < k:
        raise ValueError(f"pass@k/mean@k/maj@k need n >= k responses, got n={n} < k={k}")
    if c is not None and not 0 <= c <= n:
        raise ValueError(f"c (correct responses) must lie in [0, n={n}], got c={c}")


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k (Chen et al. 2021): 1 - C(n-c, k) / C(n, k).

    C(n-c, k) / C(n, k) = prod_{i=n-c+1}^{n} (1 - k / i), a product of c factors in (0, 1],
    which stays accurate where the binomials themselves overflow a float (n = 1024, k = 512).
    """
    _check_counts(n, k, c)
    if n - c < k:  # every k-subset contains a correct response
        return 1.0
    miss = 1.0
    for i in range(n - c + 1, n + 1):
        miss *= 1.0 - k / i
    return 1.0 - miss


def mean_at_k(correct: Sequence[bool], k: int) -> float:
    """Accuracy of the first k responses (mean@n: all of them)."""
    _check_counts(len(correct), k)
    return sum(bool(x) for x in correct[:k]) / k


_VOTE_SPACE = re.compile(r"\s+")


def vote_key(pred: str) -> str:
    """Answer text as compared for voting: spacing, \\left/\\right, \\dfrac and a final dot ignored."""
    from recipe.reward.score import cosmetic_normal_form

    return _VOTE_SPACE.sub("", cosmetic_normal_form(pred))


def majority_vote(preds: Sequence[str | None], correct: Sequence[bool], k: int) -> bool:
    """Whether the majority answer of the first k responses is correct (maj@k for one problem).

    Clustering: every response the reward judged correct is equivalent to the gold answer, so
    all correct responses form one cluster (``1/2`` and ``0.5`` vote together). Incorrect
    answers cluster by :func:`vote_key`. Responses without an extracted answer (empty or
    missing ``pred``) abstain; if all k abstain the vote is wrong.

    Ties: among clusters with the highest count, the one whose first member appears earliest
    among the k responses wins. Sampling order is random, so this is an unbiased coin between
    tied clusters, yet reproducible for a given file.
    """
    _check_counts(len(correct), k)
    if len(preds) != len(correct):
        raise ValueError(f"majority_vote: {len(preds)} preds but {len(correct)} correctness flags")
    counts: dict[str, int] = {}
    first_seen: dict[str, int] = {}
    for position, (pred, ok) in enumerate(zip(preds[:k], correct[:k], strict=False)):
        key = "\x00correct" if ok else (vote_key(pred) if pred else "")
        if not key:  # no extracted answer: abstains
            continue
        counts[key] = counts.get(key, 0) + 1
        first_seen.setdefault(key, position)
    if not counts:
        return False
    winner = min(counts, key=lambda key: (-counts[key], first_seen[key]))
    return winner == "\x00correct"


@dataclass
class ProblemSamples:
    """All responses to one problem, reduced to what the metrics need."""

    key: str
    correct: list[bool]
    preds: list[str | None]


#: benchmark -> problems, for one checkpoint
Checkpoint = dict[str, list[ProblemSamples]]


METRICS = ("mean", "pass", "maj")


def score_benchmark(problems: Sequence[ProblemSamples], k: int) -> dict[str, float]:
    """mean@k, pass@k and maj@k (fractions) averaged over the benchmark's problems."""
    if not problems:
        raise ValueError("no problems to score")
    totals = dict.fromkeys(METRICS, 0.0)
    for p in problems:
        n = len(p.correct)
        if n < k:
            raise ValueError(f"problem {p.key}: n={n} responses < k={k}; pass@k needs n >= k")
        totals["mean"] += mean_at_k(p.correct, k)
        totals["pass"] += pass_at_k(n, sum(p.correct), k)
        totals["maj"] += float(majority_vote(p.preds, p.correct, k))
    return {metric: value / len(problems) for metric, value in totals.items()}


def resolve_k(k: int | str, problems: Sequence[ProblemSamples], benchmark: str) -> int:
    n_min = min(len(p.correct) for p in problems)
    if k == "n":
        return n_min
    if int(k) > n_min:
        short = next(p.key for p in problems if len(p.correct) < int(k))
        raise ValueError(f"benchmark {benchmark!r}: k={k} exceeds n={n_min} (problem {short}); pass@k needs n >= k")
    return int(k)

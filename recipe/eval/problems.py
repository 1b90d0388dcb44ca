"""Inputs shared by ``generate`` and ``score``: evaluation parquets, run folders, the reward scorer.

:func:`load_eval_parquet` reads and validates the parquets ``python -m data_prep`` writes (verl's
RL schema); :func:`reward_scorer` scores a response with the training reward
(:mod:`recipe.reward.score`, imported lazily), so offline and in-training accuracy agree.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from recipe.eval.presets import canonical_benchmark


@dataclass(frozen=True)
class Problem:
    """One row of an evaluation parquet (verl RL schema, as written by data_prep)."""

    problem_id: int
    benchmark: str
    data_source: str
    messages: list[dict[str, str]]
    ground_truth: str
    extra_info: dict[str, Any] = field(default_factory=dict)


REQUIRED_COLUMNS = ("data_source", "prompt", "reward_model", "extra_info")


def load_eval_parquet(path: str | os.PathLike[str]) -> tuple[str, list[Problem]]:
    """Read and validate an evaluation parquet; returns (benchmark, problems).

    The benchmark is the (single) ``data_source`` of the file. Every row must have a non-empty
    chat ``prompt`` of role/content strings, a string ``reward_model.ground_truth`` and an
    integer ``extra_info.index`` unique in the file; the first bad row raises ValueError naming
    the file, the row and the key.
    """
    import pyarrow.parquet as pq

    path = Path(path)
    if not path.is_file():
        raise ValueError(f"evaluation parquet {str(path)!r} does not exist")
    try:
        table = pq.read_table(path)
    except Exception as exc:  # pyarrow raises several types for a non-parquet file
        raise ValueError(f"{path}: not a readable parquet file ({exc})") from exc
    missing = [c for c in REQUIRED_COLUMNS if c not in table.column_names]
    if missing:
        raise ValueError(f"{path}: missing column(s) {missing}; found {table.column_names} (write it with data_prep)")
    if table.num_rows == 0:
        raise ValueError(f"{path}: no rows")
    rows = table.select(list(REQUIRED_COLUMNS)).to_pylist()
    sources = {row["data_source"] for row in rows}
    if len(sources) != 1 or not all(isinstance(s, str) and s for s in sources):
        raise ValueError(
            f"{path}: expected one non-empty data_source per evaluation file, got {sorted(map(str, sources))}"
        )
    benchmark = canonical_benchmark(next(iter(sources)))
    problems: list[Problem] = []
    seen: set[int] = set()
    for i, row in enumerate(rows):
        where = f"{path} row {i}"
        prompt = row["prompt"]
        if not isinstance(prompt, list) or not prompt:
            raise ValueError(f"{where}: 'prompt' must be a non-empty list of chat messages, got {prompt!r:.80}")
        for message in prompt:
            if not (
                isinstance(message, dict)
                and isinstance(message.get("role"), str)
                and isinstance(message.get("content"), str)
            ):
                raise ValueError(f"{where}: 'prompt' messages need string 'role' and 'content', got {message!r:.80}")
        reward_model = row["reward_model"]
        gt = reward_model.get("ground_truth") if isinstance(reward_model, dict) else None
        if not isinstance(gt, str) or not gt.strip():
            raise ValueError(f"{where}: 'reward_model.ground_truth' must be a non-empty string, got {gt!r}")
        extra = row["extra_info"] if isinstance(row["extra_info"], dict) else None
        index = extra.get("index") if extra else None
        if isinstance(index, bool) or not isinstance(index, int):
            raise ValueError(f"{where}: 'extra_info.index' must be an integer, got {index!r}")
        if index in seen:
            raise ValueError(f"{where}: duplicate 'extra_info.index' {index}")
        seen.add(index)
        messages = [{"role": m["role"], "content": m["content"]} for m in prompt]
        problems.append(Problem(index, benchmark, row["data_source"], messages, gt, extra or {}))
    return benchmark, problems


def expand_files(entry: str | os.PathLike[str], pattern: str, what: str) -> list[Path]:
    """A file as itself, a folder as its sorted ``pattern`` files; missing or empty is an error."""
    path = Path(entry)
    if path.is_dir():
        found = sorted(path.glob(pattern))
        if not found:
            raise ValueError(f"{what} folder {str(path)!r} holds no {pattern}")
        return found
    if path.is_file():
        return [path]
    raise ValueError(f"{what} {str(path)!r} does not exist")


Scorer = Callable[[str, str, str, dict[str, Any]], dict[str, Any]]


def reward_scorer(think: str = "auto") -> Scorer:
    """Our training reward (recipe/reward/score.py), so offline and in-training accuracy agree."""
    from recipe.reward.score import compute_score

    return functools.partial(compute_score, think=think)

"""Upstream layouts: which columns hold the problem, the answer and the row id (docs/data_and_reward.md, "Layouts").

A layout is chosen from the column names alone (``detect_layout``); every row then becomes a :class:`Problem` or a
:class:`Rejected` with the reason counted in the summary. Values are checked, never coerced silently: ``142.0``
becomes ``"142"``, but a dict where a string belongs is a rejected row.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from data_prep.io import DataPrepError, UnreadableRow


@dataclass(frozen=True)
class Problem:
    """One usable row: the bare problem text and its reference answer."""

    problem: str
    answer: str
    source_id: str
    data_source: str | None = None
    extras: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Rejected:
    reason: str


class RowError(Exception):
    """A row that cannot be used; the message is the reason counted in the summary."""


def _text(value: Any, what: str) -> str:
    if value is None:
        raise RowError(f"missing {what}")
    if not isinstance(value, str):
        raise RowError(f"{what} is {type(value).__name__}, not a string")
    value = value.strip()
    if not value:
        raise RowError(f"empty {what}")
    return value


def _strip_dollars(text: str) -> str:
    """``$\\frac{1}{2}$`` -> ``\\frac{1}{2}`` (OlympiadBench wraps final answers in math mode)."""
    text = text.strip()
    while len(text) >= 2 and text.startswith("$") and text.endswith("$"):
        text = text[1:-1].strip()
    return text


def answer_text(value: Any, what: str = "answer") -> str:
    """Reference answer as text. Integral floats lose their ``.0``; lists (OlympiadBench
    ``final_answer``) are joined with ``, ``; other types are rejected."""
    if isinstance(value, bool):
        raise RowError(f"{what} is bool, not a string or number")
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if not math.isfinite(value):
            raise RowError(f"{what} is not a finite number")
        return str(int(value)) if value.is_integer() else repr(value)
    if isinstance(value, (list, tuple)):
        parts = [_strip_dollars(_text(item, what)) for item in value]
        parts = [part for part in parts if part]
        if not parts:
            raise RowError(f"empty {what}")
        return ", ".join(parts)
    answer = _strip_dollars(_text(value, what))
    if not answer:
        raise RowError(f"empty {what}")
    return answer


def _id(value: Any, fallback: int) -> str:
    return str(fallback) if value is None else str(value)


def _user_content(messages: Any, what: str) -> str:
    """Content of the last user message of a chat list."""
    if not isinstance(messages, (list, tuple)):
        raise RowError(f"{what} is {type(messages).__name__}, not a chat list")
    for message in reversed(messages):
        if isinstance(message, Mapping) and message.get("role") == "user":
            return _text(message.get("content"), f"{what} user content")
    raise RowError(f"{what} has no user message")


def _mapping(value: Any, what: str) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise RowError(f"missing {what}" if value is None else f"{what} is {type(value).__name__}, not an object")
    return value


def _verl(row: Mapping[str, Any], position: int) -> Problem:
    """verl RL rows (DAPO-Math-17k, KlearReasoner-MathSub-30K)."""
    problem = _user_content(row.get("prompt"), "prompt")
    answer = answer_text(_mapping(row.get("reward_model"), "reward_model").get("ground_truth"), "ground_truth")
    extra = row.get("extra_info")
    row_id = extra.get("index") if isinstance(extra, Mapping) else None
    if row_id is None:
        row_id = row.get("__index_level_0__")
    source = row.get("data_source")
    return Problem(problem, answer, _id(row_id, position), source if isinstance(source, str) and source else None)


def _klear_meta(row: Mapping[str, Any], position: int) -> Problem:
    """KlearReasoner AIME24/25: ``messages`` plus ``meta{solution, unique_id}``."""
    meta = _mapping(row.get("meta"), "meta")
    return Problem(
        _user_content(row.get("messages"), "messages"),
        answer_text(meta.get("solution"), "meta.solution"),
        _id(meta.get("unique_id"), position),
    )


def _klear_answer(row: Mapping[str, Any], position: int) -> Problem:
    """KlearReasoner HMMT: ``messages`` plus a top-level ``answer``."""
    return Problem(
        _user_content(row.get("messages"), "messages"), answer_text(row.get("answer")), _id(row.get("id"), position)
    )


def _olympiad(row: Mapping[str, Any], position: int) -> Problem:
    """Hothan/OlympiadBench and math-ai/olympiadbench: ``question`` / ``final_answer`` list."""
    if any(key.startswith("image_") and row.get(key) for key in row):
        raise RowError("problem needs an image")
    final = row.get("final_answer")
    if final is None or (isinstance(final, (list, tuple)) and not final):
        raise RowError("no final_answer (proof problem)")
    return Problem(
        _text(row.get("question"), "question"), answer_text(final, "final_answer"), _id(row.get("id"), position)
    )


def _columns(
    problem_key: str, answer_key: str, id_keys: tuple[str, ...]
) -> Callable[[Mapping[str, Any], int], Problem]:
    def convert(row: Mapping[str, Any], position: int) -> Problem:
        row_id = next((row[k] for k in id_keys if row.get(k) is not None), None)
        extras = {k: str(row[k]) for k in ("subject", "level") if row.get(k) is not None}
        return Problem(
            _text(row.get(problem_key), problem_key),
            answer_text(row.get(answer_key), answer_key),
            _id(row_id, position),
            extras=extras,
        )

    convert.__doc__ = f"Flat rows: ``{problem_key}`` / ``{answer_key}``."
    return convert


@dataclass(frozen=True)
class Layout:
    name: str
    required: frozenset[str]
    convert: Callable[[Mapping[str, Any], int], Problem]
    examples: str


#: Checked in order; the first layout whose required columns are all present wins.
LAYOUTS: tuple[Layout, ...] = (
    Layout("verl", frozenset({"prompt", "reward_model"}), _verl, "DAPO-Math-17k, KlearReasoner-MathSub-30K"),
    Layout("klear-meta", frozenset({"messages", "meta"}), _klear_meta, "KlearReasoner aime24/aime25"),
    Layout("klear-answer", frozenset({"messages", "answer"}), _klear_answer, "KlearReasoner HMMT-202502"),
    Layout(
        "olympiadbench",
        frozenset({"question", "final_answer"}),
        _olympiad,
        "Hothan/OlympiadBench, math-ai/olympiadbench",
    ),
    Layout(
        "Problem-Answer",
        frozenset({"Problem", "Answer"}),
        _columns("Problem", "Answer", ("ID",)),
        "Maxwell-Jia/AIME_2024",
    ),
    Layout(
        "problem-answer",
        frozenset({"problem", "answer"}),
        _columns("problem", "answer", ("unique_id", "id", "problem_idx")),
        "HuggingFaceH4/MATH-500, HuggingFaceH4/aime_2024, yentinglin/aime_2025, AI-MO/aimo-validation-amc, "
        "MathArena/hmmt_feb_2025, Qwen2.5-Math amc23",
    ),
    Layout(
        "question-answer",
        frozenset({"question", "answer"}),
        _columns("question", "answer", ("id",)),
        "opencompass/AIME2025, math-ai/amc23",
    ),
)


def detect_layout(columns: list[str], description: str = "input") -> Layout:
    """The layout matching ``columns``; an unknown layout is an error listing what was found."""
    present = set(columns)
    for layout in LAYOUTS:
        if layout.required <= present:
            return layout
    known = "; ".join(f"{layout.name}: {sorted(layout.required)}" for layout in LAYOUTS)
    raise DataPrepError(f"{description}: unknown layout, columns found: {sorted(present)}. Known layouts need: {known}")


def convert_row(layout: Layout, row: Any, position: int) -> Problem | Rejected:
    """Apply ``layout`` to one row, turning every problem into a counted :class:`Rejected`."""
    if isinstance(row, UnreadableRow):
        return Rejected(row.reason)
    if not isinstance(row, Mapping):
        return Rejected(f"row is {type(row).__name__}, not an object")
    try:
        return layout.convert(row, position)
    except RowError as exc:
        return Rejected(str(exc))

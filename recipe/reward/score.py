"""Hang-proof math reward for verl 0.9.1 (``reward.custom_reward_function``; routes, scores: docs/data_and_reward.md).

Answer extraction (anchored, linear time, cannot hang) and scoring; math-verify runs in :mod:`recipe.reward.workers`.
Who may import it: verl (by path), :mod:`recipe.eval`, the benchmarks and tests.
"""

from __future__ import annotations

import asyncio
import importlib
import math
import os
import re
import sys
from typing import Any

# verl executes this file by path (``custom_reward_function.path``) under a private module name,
# where ``recipe`` imports only if the project is installed; the repository root makes it import.
_REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
try:
    from recipe.reward.workers import STATS, get_pool, reward_stats, shutdown_pool
except ImportError:
    sys.path.insert(0, _REPO_ROOT)
    from recipe.reward.workers import STATS, get_pool, reward_stats, shutdown_pool

CANONICAL_MODULE = "recipe.reward.score"

#: Only this many trailing characters of the (post-``</think>``) response are searched for the
#: answer: the final answer sits at the end, and scanning 16k-token responses is wasted work.
TAIL_CHARS = 4096
#: Answers (extracted or gold) beyond these bounds are not sent to math-verify at all: no
#: real answer is that long or that deeply nested, and such inputs are what makes the
#: LaTeX parser crawl. They are compared as strings only (cheap, cannot hang).
MAX_ANSWER_CHARS = 1000
MAX_BRACE_DEPTH = 24
DEFAULT_TIMEOUT_S = 10.0

DAPO_DATA_SOURCES = frozenset({"math_dapo"})
THINK_MODES = ("auto", "required", "off")
#: Keyword arguments verl's reward managers inject on their own; accepted and ignored.
VERL_INJECTED_KWARGS = frozenset({"reward_router_address", "reward_model_tokenizer"})

THINK_CLOSE = "</think>"
#: ``Answer: 34`` / ``**Final Answer:** 34`` at the start of a line; "our answer: ..." mid-sentence
#: is prose, not an answer line.
_ANSWER_LINE = re.compile(r"(?im)^[ \t>#*_]*(?:the[ \t]+)?(?:final[ \t]+)?answer[ \t*_]*[:：][ \t*_]*(\S[^\n]*)")
_BOX_COMMANDS = ("\\boxed", "\\fbox")
_PLAIN_INTEGER = re.compile(r"-?\d+")


# -- extraction (parent process; pure string work, linear time, cannot hang) --------------


def _braced_argument(text: str, open_idx: int) -> str | None:
    """Content of the ``{...}`` group opening at ``open_idx``; None when braces never balance."""
    depth = 0
    for i in range(open_idx, len(text)):
        char = text[i]
        if char == "{":
            depth += 1
        elif char == "}":
            depth -= 1
            if depth == 0:
                return text[open_idx + 1 : i]
    return None


def last_boxed(text: str) -> tuple[int, str] | None:
    """Position and content of the last well-formed ``\\boxed{...}`` / ``\\fbox{...}``.

    A box whose braces never close (a truncated response) is skipped in favour of an
    earlier, complete one rather than guessed at.
    """
    end = len(text)
    while True:
        start = max(text.rfind(cmd, 0, end) for cmd in _BOX_COMMANDS)
        if start < 0:
            return None
        cmd_len = len("\\boxed") if text.startswith("\\boxed", start) else len("\\fbox")
        rest = start + cmd_len
        while rest < len(text) and text[rest] == " ":
            rest += 1
        if rest < len(text) and text[rest] == "{":
            content = _braced_argument(text, rest)
            if content is not None:
                return start, content
        elif rest < len(text) and cmd_len == len("\\boxed") and rest > start + cmd_len:
            # ``\boxed 5``: TeX takes the next token as the argument.
            token = re.match(r"[^\s$.,]+", text[rest:])
            if token:
                return start, token.group(0)
        end = start


def last_answer_line(text: str) -> tuple[int, str] | None:
    """Position and content of the last ``Answer: ...`` line (DAPO / Minerva style)."""
    match = None
    for match in _ANSWER_LINE.finditer(text):
        pass
    if match is None:
        return None
    content = match.group(1).strip()
    boxed = last_boxed(content)
    if boxed is not None:
        content = boxed[1]
    return match.start(), content


def strip_math_delimiters(answer: str) -> str:
    """Drop ``$...$`` / ``\\(...\\)`` wrappers and a trailing full stop around an answer."""
    answer = answer.strip().rstrip(".").strip()
    for left, right in (("$$", "$$"), ("$", "$"), ("\\(", "\\)"), ("\\[", "\\]")):
        if len(answer) >= len(left) + len(right) and answer.startswith(left) and answer.endswith(right):
            answer = answer[len(left) : len(answer) - len(right)].strip()
    return answer.rstrip(".").strip()


def extract_answer(text: str) -> str | None:
    """The anchored final answer of ``text`` (whichever of box / ``Answer:`` comes last)."""
    tail = text[-TAIL_CHARS:]
    candidates = [c for c in (last_boxed(tail), last_answer_line(tail)) if c is not None]
    if not candidates:
        return None
    _, answer = max(candidates, key=lambda c: c[0])
    answer = strip_math_delimiters(answer)
    return answer or None


_COSMETIC = re.compile(r"\\left|\\right|\\!|\\,|\\;|\\ |\s+|\$")


def cosmetic_normal_form(answer: str) -> str:
    """Answer text with spacing and sizing commands removed, for the exact-match fast path."""
    return _COSMETIC.sub("", answer.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")).rstrip(".")


# -- scoring ----------------------------------------------------------------------------


def _result(score: float, correct: bool, pred: str) -> dict[str, Any]:
    return {"score": float(score), "acc": bool(correct), "pred": pred[:200]}


def _normalise_gold(ground_truth: Any) -> str | None:
    """Gold answer as text; numbers are accepted (``27.0`` -> ``27``), anything else is invalid."""
    if isinstance(ground_truth, bool):
        return None
    if isinstance(ground_truth, int):
        return str(ground_truth)
    if isinstance(ground_truth, float):
        if not math.isfinite(ground_truth):
            return None
        return str(int(ground_truth)) if ground_truth.is_integer() else repr(ground_truth)
    if isinstance(ground_truth, str):
        gold = strip_math_delimiters(ground_truth)
        return gold or None
    return None


def _wants_think(data_source: str, think: str, extra_info: Any) -> bool:
    if think != "auto":
        return think == "required"
    if isinstance(extra_info, dict) and extra_info.get("think") is True:
        return True
    return "longcot" in data_source.lower()


def brace_depth(text: str) -> int:
    """Deepest ``{``/``(``/``[`` nesting in ``text`` (unbalanced closers are ignored)."""
    depth = deepest = 0
    for char in text:
        if char in "{([":
            depth += 1
            deepest = max(deepest, depth)
        elif char in "})]" and depth:
            depth -= 1
    return deepest


def too_complex(answer: str) -> bool:
    return len(answer) > MAX_ANSWER_CHARS or brace_depth(answer) > MAX_BRACE_DEPTH


class ScoreTable:
    """The score of each outcome of one response (:func:`score_table`). A plain class, not a dataclass:
    verl executes this file under a module name not in ``sys.modules``, where ``dataclasses`` cannot resolve
    postponed annotations."""

    OUTCOMES = ("correct", "wrong", "unparseable", "truncated")

    def __init__(self, correct: float, wrong: float, unparseable: float, truncated: float) -> None:
        self.correct = float(correct)
        self.wrong = float(wrong)
        self.unparseable = float(unparseable)
        self.truncated = float(truncated)

    def as_dict(self) -> dict[str, float]:
        return {name: getattr(self, name) for name in self.OUTCOMES}


#: verl's ``math_dapo`` convention for a wrong answer; every other source scores a wrong answer 0.
DAPO_DEFAULT_WRONG_SCORE = -1.0


def _check_score(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    return float(value)


def score_table(
    data_source: str,
    *,
    correct_score: float = 1.0,
    wrong_score: float | None = None,
    unparseable_score: float | None = None,
    truncated_score: float = -0.5,
) -> ScoreTable:
    """The scores ``compute_score`` gives on ``data_source`` with these keywords.

    * correct: the anchored answer equals the reference (math-verify, or verl's ``math_dapo``).
    * wrong: an answer was found and differs. ``None`` = the source's convention: -1 on
      ``math_dapo`` (verl's DAPO reward), 0 elsewhere.
    * unparseable: no anchored answer (no ``\\boxed{}`` / ``Answer:`` line), and invalid inputs.
      ``None`` = the wrong score.
    * truncated: a think response without a closing ``</think>`` (it ran out of length).

    Raises ValueError on a non-numeric score (a typo in ``reward_kwargs`` fails the first call).
    """
    if wrong_score is None:
        wrong_score = DAPO_DEFAULT_WRONG_SCORE if data_source in DAPO_DATA_SOURCES else 0.0
    wrong = _check_score("wrong_score", wrong_score)
    unparseable = wrong if unparseable_score is None else _check_score("unparseable_score", unparseable_score)
    return ScoreTable(
        _check_score("correct_score", correct_score),
        wrong,
        unparseable,
        _check_score("truncated_score", truncated_score),
    )


def _score_math_verify(answer: str | None, gold: str, timeout_s: float, scores: ScoreTable) -> dict[str, Any]:
    if answer is None:
        return _result(scores.unparseable, False, "")
    if cosmetic_normal_form(answer) == cosmetic_normal_form(gold):
        STATS.bump("fast_path")
        return _result(scores.correct, True, answer)
    if too_complex(answer) or too_complex(gold):
        STATS.bump("too_complex")
        return _result(scores.wrong, False, answer)
    if _PLAIN_INTEGER.fullmatch(answer) and _PLAIN_INTEGER.fullmatch(gold):
        STATS.bump("fast_path")
        return _result(scores.wrong, False, answer)  # two different integers: nothing to verify
    correct, _problem = get_pool().verify(gold, answer, timeout_s)
    return _result(scores.correct if correct else scores.wrong, bool(correct), answer)


def _score_dapo(text: str, gold: str, scores: ScoreTable) -> dict[str, Any]:
    """verl's ``math_dapo`` decides correctness; the score comes from ``scores``."""
    from verl.utils.reward_score import math_dapo

    result = math_dapo.compute_score(text, gold)
    pred = str(result["pred"] or "")
    if result["acc"]:
        return _result(scores.correct, True, pred)
    # math_dapo marks "no Answer: line found" with this sentinel (normalised like any answer)
    unparseable = pred == math_dapo.normalize_final_answer("[INVALID]")
    return _result(scores.unparseable if unparseable else scores.wrong, False, "" if unparseable else pred)


def compute_score(
    data_source: str,
    solution_str: str,
    ground_truth: str,
    extra_info: dict[str, Any] | None = None,
    *,
    think: str = "auto",
    timeout_s: float = DEFAULT_TIMEOUT_S,
    correct_score: float = 1.0,
    wrong_score: float | None = None,
    unparseable_score: float | None = None,
    truncated_score: float | None = None,
    no_think_close_score: float | None = None,
    **verl_kwargs: Any,
) -> dict[str, Any]:
    """Score one response; returns ``{"score": float, "acc": bool, "pred": str}``.

    Scores per outcome: :func:`score_table` (``truncated_score`` -0.5 by default; ``no_think_close_score`` is
    its former name and still accepted). Never raises on bad data (a reward function that raises kills a
    training step): a ``None`` / non-string response or gold answer scores as unparseable and is counted in
    ``reward_stats()["invalid_inputs"]``. Misconfiguration raises ``TypeError``/``ValueError`` (an unknown
    keyword, ``think`` mode or a non-numeric score), or ``RuntimeError`` (workers failed to start 3 times).
    """
    if __name__ != CANONICAL_MODULE:
        # verl loads this file by path under a private module name that workers cannot import and that would get a
        # pool of its own: every call goes to the one copy imported as recipe.reward.score (importable: the import
        # of recipe.reward.workers above put the repository root on the path if needed)
        return importlib.import_module(CANONICAL_MODULE).compute_score(
            data_source,
            solution_str,
            ground_truth,
            extra_info,
            think=think,
            timeout_s=timeout_s,
            correct_score=correct_score,
            wrong_score=wrong_score,
            unparseable_score=unparseable_score,
            truncated_score=truncated_score,
            no_think_close_score=no_think_close_score,
            **verl_kwargs,
        )
    unknown = set(verl_kwargs) - VERL_INJECTED_KWARGS
    if unknown:
        raise TypeError(f"compute_score got unknown keyword arguments {sorted(unknown)}")
    if think not in THINK_MODES:
        raise ValueError(f"think must be one of {THINK_MODES}, got {think!r}")
    if not (isinstance(timeout_s, (int, float)) and timeout_s > 0):
        raise ValueError(f"timeout_s must be a positive number, got {timeout_s!r}")
    if truncated_score is not None and no_think_close_score is not None and truncated_score != no_think_close_score:
        raise ValueError(
            f"truncated_score={truncated_score!r} and its former name no_think_close_score={no_think_close_score!r} "
            "disagree; pass truncated_score only"
        )
    truncated = next((v for v in (truncated_score, no_think_close_score) if v is not None), -0.5)

    source = data_source if isinstance(data_source, str) else ""
    scores = score_table(
        source,
        correct_score=correct_score,
        wrong_score=wrong_score,
        unparseable_score=unparseable_score,
        truncated_score=truncated,
    )
    STATS.bump("calls")
    gold = _normalise_gold(ground_truth)
    if not isinstance(solution_str, str) or gold is None:
        STATS.bump("invalid_inputs")
        return _result(scores.unparseable, False, "")

    text = solution_str
    close = text.rfind(THINK_CLOSE)
    wants_think = _wants_think(source, think, extra_info)
    if wants_think and close < 0:
        return _result(scores.truncated, False, "")
    if close >= 0 and (wants_think or think == "auto"):  # "auto" honours a </think> but does not require one
        text = text[close + len(THINK_CLOSE) :]

    if source in DAPO_DATA_SOURCES:
        return _score_dapo(text[-TAIL_CHARS:], gold, scores)
    return _score_math_verify(extract_answer(text), gold, float(timeout_s), scores)


async def compute_score_async(
    data_source: str, solution_str: str, ground_truth: str, extra_info: dict[str, Any] | None = None, **kwargs: Any
) -> dict[str, Any]:
    """Coroutine form for verl's async reward loop: the blocking wait runs in a thread,
    so one slow item never stalls the event loop."""
    return await asyncio.to_thread(compute_score, data_source, solution_str, ground_truth, extra_info, **kwargs)


__all__ = [
    "compute_score",
    "score_table",
    "compute_score_async",
    "extract_answer",
    "reward_stats",
    "shutdown_pool",
    "get_pool",
]

"""``python -m data_prep openmathreasoning``: the SFT set of the ATR paper (Appendix B).

Input: ``nvidia/OpenMathReasoning`` (hub id with ``--split cot``, or local files or folders of its shards). Output:
``<output>/openmathreasoning_sft.parquet``, one ``[user, assistant]`` row per problem in verl's SFT schema: the RL
prompt, then the solution after ``</think>`` and an ``Answer:`` line (docs/experiments.md, "SFT stage").
"""

from __future__ import annotations

import hashlib
import heapq
import re
import unicodedata
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from data_prep.convert import RowCounts, _progress
from data_prep.io import DataPrepError, open_input
from data_prep.sft_tokens import encode_pair
from data_prep.templates import apply_template

NAME = "openmathreasoning"
OUTPUT_FILE = "openmathreasoning_sft.parquet"
DATA_SOURCE = "openmathreasoning"
REQUIRED_COLUMNS = ("problem", "generated_solution", "expected_answer", "problem_type", "inference_mode")
DEFAULT_SAMPLE = 10_000
DEFAULT_MAX_TOKENS = 2048
DEFAULT_SEED = 42
#: Candidates kept per wanted row before the token-length filter (most summaries fit in 2,048).
OVERSAMPLE = 4
THINK_CLOSE = "</think>"

NOT_COT = "not a chain-of-thought row (inference_mode != cot)"
NO_VERIFIABLE_ANSWER = "no verifiable expected answer (problem_type != has_answer_extracted)"
EMPTY_ANSWER = "empty expected_answer"
NO_THINK_CLOSE = "solution without </think> or text after it"
EVAL_OVERLAP = "problem of an evaluation set (--exclude)"
OTHER_SOLUTION = "another solution of the same problem (the shortest is kept)"
TOO_LONG = "longer than --max-tokens"
NOT_SAMPLED = "beyond the sample size"


@dataclass
class SFTSummary(RowCounts):
    rows_read: int = 0
    rows_written: int = 0
    dropped: Counter[str] = field(default_factory=Counter)
    excluded_problems: int = 0
    output: str = ""

    def lines(self) -> list[str]:
        excluded = f"evaluation problems excluded against: {self.excluded_problems}"
        return [*self.count_lines(), excluded, f"output: {self.output}"]


_NON_ALNUM = re.compile(r"[\W_]+", re.UNICODE)


def loose_key(problem: str) -> str:
    """Problem text as compared with the evaluation sets: NFKC, lower case, letters and digits only
    (``$``, backslashes, spacing and punctuation ignored), so a re-typeset copy still matches."""
    return _NON_ALNUM.sub("", unicodedata.normalize("NFKC", problem).lower())


def load_exclusions(paths: list[str]) -> set[str]:
    """Loose keys of every problem in the evaluation parquets written by data_prep (files or folders)."""
    import pyarrow.parquet as pq

    if not paths:
        raise DataPrepError(
            "openmathreasoning needs --exclude: the evaluation parquets (or their folder) written by "
            "`python -m data_prep <benchmark>`, so no evaluation problem is trained on"
        )
    files: list[Path] = []
    for entry in paths:
        path = Path(entry)
        if path.is_dir():
            found = sorted(p for p in path.glob("*.parquet") if p.name != OUTPUT_FILE)
            if not found:
                raise DataPrepError(f"--exclude {path}: folder holds no .parquet files")
            files.extend(found)
        elif path.is_file():
            files.append(path)
        else:
            raise DataPrepError(f"--exclude {path}: no such file or folder")
    keys: set[str] = set()
    for file in files:
        try:
            table = pq.read_table(file)
        except Exception as exc:  # pyarrow raises several types for a non-parquet file
            raise DataPrepError(f"--exclude {file}: not a readable parquet file ({exc})") from exc
        if "extra_info" not in table.column_names:
            raise DataPrepError(f"--exclude {file}: no 'extra_info' column (write it with python -m data_prep)")
        for i, extra in enumerate(table.column("extra_info").to_pylist()):
            problem = extra.get("problem") if isinstance(extra, dict) else None
            if not isinstance(problem, str) or not problem.strip():
                raise DataPrepError(f"--exclude {file} row {i}: no 'extra_info.problem' text")
            keys.add(loose_key(problem))
    return keys


def solution_summary(solution: str) -> str | None:
    """The text after the last ``</think>``, stripped; None when there is none."""
    close = solution.rfind(THINK_CLOSE)
    if close < 0:
        return None
    text = solution[close + len(THINK_CLOSE) :].strip()
    return text or None


def assistant_text(summary: str, answer: str) -> str:
    """The target: the written-up solution, then the ``Answer:`` line the RL reward reads."""
    return f"{summary}\n\nAnswer: {answer}"


@dataclass(order=True)
class _Candidate:
    neg_priority: bytes  # max-heap on priority via the complement: the heap top is the worst kept
    key: str = field(compare=False)
    problem: str = field(compare=False)
    summary: str = field(compare=False)
    answer: str = field(compare=False)
    extras: dict[str, str] = field(compare=False)


def _text(row: dict[str, Any], key: str) -> str | None:
    value = row.get(key)
    return value.strip() if isinstance(value, str) and value.strip() else None


def convert_openmath(
    source: str,
    output_dir: str | Path,
    tokenizer: str,
    exclude: list[str],
    sample: int = DEFAULT_SAMPLE,
    max_tokens: int = DEFAULT_MAX_TOKENS,
    seed: int = DEFAULT_SEED,
    split: str | None = None,
    config: str | None = None,
    enable_thinking: bool = False,
) -> SFTSummary:
    """Convert OpenMathReasoning into ``output_dir/openmathreasoning_sft.parquet`` (module docstring)."""
    if sample < 1:
        raise DataPrepError(f"--sample must be >= 1, got {sample}")
    if max_tokens < 16:
        raise DataPrepError(f"--max-tokens must be >= 16, got {max_tokens}")
    excluded = load_exclusions(exclude)
    tok = _load_tokenizer(tokenizer)
    records = open_input(source, split=split, config=config)
    missing = [c for c in REQUIRED_COLUMNS if c not in records.columns]
    if missing:
        raise DataPrepError(
            f"{records.description}: not the nvidia/OpenMathReasoning layout, missing column(s) {missing}; "
            f"columns found: {sorted(records.columns)} (needs {list(REQUIRED_COLUMNS)})"
        )
    summary = SFTSummary(excluded_problems=len(excluded))
    keep = sample * OVERSAMPLE
    heap: list[_Candidate] = []  # the `keep` best-priority problems seen so far
    in_heap: dict[str, _Candidate] = {}
    for row in _progress(records.rows, records.total, records.description):
        summary.rows_read += 1
        if not isinstance(row, dict):
            summary.dropped[f"row is {type(row).__name__}, not an object"] += 1
            continue
        if row.get("inference_mode") != "cot":
            summary.dropped[NOT_COT] += 1
            continue
        if row.get("problem_type") != "has_answer_extracted":
            summary.dropped[NO_VERIFIABLE_ANSWER] += 1
            continue
        problem, answer = _text(row, "problem"), _text(row, "expected_answer")
        if problem is None:
            summary.dropped["empty problem"] += 1
            continue
        if answer is None:
            summary.dropped[EMPTY_ANSWER] += 1
            continue
        solution = row.get("generated_solution")
        text = solution_summary(solution) if isinstance(solution, str) else None
        if text is None:
            summary.dropped[NO_THINK_CLOSE] += 1
            continue
        key = loose_key(problem)
        if key in excluded:
            summary.dropped[EVAL_OVERLAP] += 1
            continue
        extras = {k: str(row[k]) for k in ("problem_source", "generation_model") if row.get(k) is not None}
        priority = hashlib.blake2b(f"{seed}\x00{key}".encode(), digest_size=16).digest()
        candidate = _Candidate(bytes(255 - b for b in priority), key, problem, text, answer, extras)
        kept = in_heap.get(key)
        if kept is not None:
            summary.dropped[OTHER_SOLUTION] += 1
            if len(text) < len(kept.summary):
                kept.summary, kept.answer, kept.extras = text, answer, extras
            continue
        if len(heap) < keep:
            heapq.heappush(heap, candidate)
        else:
            summary.dropped[NOT_SAMPLED] += 1  # the candidate, or the worst kept one it replaces
            if candidate.neg_priority <= heap[0].neg_priority:
                continue
            del in_heap[heapq.heapreplace(heap, candidate).key]
        in_heap[key] = candidate
    ordered = sorted(heap, reverse=True)  # best priority first
    rows: list[dict[str, Any]] = []
    for position, cand in enumerate(ordered):
        if len(rows) == sample:
            summary.dropped[NOT_SAMPLED] += len(ordered) - position
            break
        messages = [
            {"role": "user", "content": apply_template("dapo", cand.problem)},
            {"role": "assistant", "content": assistant_text(cand.summary, cand.answer)},
        ]
        prompt, target = encode_pair(tok, messages, enable_thinking=enable_thinking)
        if len(prompt) + len(target) > max_tokens:
            summary.dropped[TOO_LONG] += 1
            continue
        rows.append(
            {
                "data_source": DATA_SOURCE,
                "messages": messages,
                "enable_thinking": enable_thinking,
                "extra_info": {
                    "index": len(rows),
                    "problem": cand.problem,
                    "expected_answer": cand.answer,
                    "num_tokens": len(prompt) + len(target),
                    **cand.extras,
                },
            }
        )
    summary.write(rows, Path(output_dir) / OUTPUT_FILE, records.description)
    return summary


def _load_tokenizer(name: str) -> Any:
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(name)
    except Exception as exc:  # offline hub id, missing folder, broken files
        raise DataPrepError(f"--tokenizer {name!r} could not be loaded: {exc}") from exc
    if not getattr(tokenizer, "chat_template", None):
        raise DataPrepError(f"--tokenizer {name!r} has no chat template (the SFT rows are chat-templated)")
    return tokenizer

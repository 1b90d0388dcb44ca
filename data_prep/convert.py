"""The conversion pipeline: read -> layout -> dedupe -> template -> verl parquet.

Output rows follow verl's RL schema (``data_source``, ``prompt`` chat list, ``ability``,
``reward_model{style, ground_truth}``, ``extra_info{index, split, ...}``), which
``verl.utils.dataset.rl_dataset.RLHFDataset`` reads as is.
"""

from __future__ import annotations

import hashlib
import re
import sys
import unicodedata
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from data_prep.io import DataPrepError, open_input
from data_prep.layouts import Problem, Rejected, convert_row, detect_layout
from data_prep.templates import TEMPLATES, apply_template, strip_known_template


@dataclass(frozen=True)
class DatasetSpec:
    """What distinguishes one CLI dataset name from another."""

    name: str
    data_source: str
    split: str
    default_template: str
    #: Keep the input row's own ``data_source`` (Klear's ``math_longcot_math_verify`` selects
    #: the think-aware route of recipe/reward/score.py).
    keep_input_data_source: bool = False
    #: Output file stem (default: the dataset name): ``<output_name>.parquet``.
    output_name: str | None = None
    #: Columns the input must have (checked before any row is read), besides the layout's own.
    required_columns: frozenset[str] = frozenset()
    #: A benchmark whose every problem counts (a score is a multiple of 1/N): a row that cannot
    #: be used is an error naming it, instead of a counted drop, and nothing is written.
    strict: bool = False

    @property
    def filename(self) -> str:
        return f"{self.output_name or self.name}.parquet"


DATASETS: dict[str, DatasetSpec] = {
    spec.name: spec
    for spec in (
        DatasetSpec("dapo-math-17k", "math_dapo", "train", "dapo"),
        DatasetSpec("klear-math-30k", "math_longcot_math_verify", "train", "bare", keep_input_data_source=True),
        DatasetSpec("aime24", "aime24", "test", "boxed"),
        DatasetSpec("aime25", "aime25", "test", "boxed"),
        DatasetSpec("amc23", "amc23", "test", "boxed"),
        # ATR Table 2's AMC2023: AI-MO/aimo-validation-amc, 83 problems of AMC 2022 and 2023
        # (columns id, problem, answer as a float, url); amc23 (40 problems) stays for the ERC runs.
        DatasetSpec(
            "aimo-amc",
            "aimo_amc",
            "test",
            "boxed",
            output_name="aimo_amc",
            required_columns=frozenset({"id", "problem", "answer", "url"}),
            strict=True,
        ),
        DatasetSpec("math500", "math500", "test", "boxed"),
        DatasetSpec("hmmt25", "hmmt25", "test", "boxed"),
        DatasetSpec("olympiadbench", "olympiadbench", "test", "boxed"),
    )
}

#: DAPO prompts only keep the ``math_dapo`` (``Answer:``, +-1) reward route under their own template.
DAPO_OTHER_TEMPLATE_SOURCE = "dapo_math_17k"

DUPLICATE = "duplicate problem (same answer)"
CONFLICT = "conflicting answers for one problem"


class RowCounts:
    """The counts :class:`Summary` and ``openmath.SFTSummary`` keep (as dataclass fields), printed and written alike."""

    rows_read: int
    rows_written: int
    dropped: Counter[str]
    output: str

    def count_lines(self) -> list[str]:
        return [
            f"rows read: {self.rows_read}",
            f"rows written: {self.rows_written}",
            f"rows dropped: {sum(self.dropped.values())}",
            *(f"  {reason}: {count}" for reason, count in self.dropped.most_common()),
        ]

    def as_dict(self) -> dict[str, Any]:
        return {**vars(self), "dropped": dict(self.dropped)}

    def write(self, rows: list[dict[str, Any]], path: Path, description: str) -> None:
        """Write ``rows`` to ``path`` and count them; no rows is an error and nothing is written."""
        if not rows:
            raise DataPrepError(
                f"{description}: no usable rows (read {self.rows_read}; dropped {dict(self.dropped)}); "
                "refusing to write an empty parquet"
            )
        self.rows_written = len(rows)
        self.output = str(write_parquet(rows, path))


@dataclass
class Summary(RowCounts):
    layout: str = ""
    rows_read: int = 0
    rows_written: int = 0
    dropped: Counter[str] = field(default_factory=Counter)
    conflicting_problems: int = 0
    output: str = ""

    def lines(self) -> list[str]:
        lines = [f"layout: {self.layout}", *self.count_lines()]
        if self.conflicting_problems:
            lines.append(f"problems dropped for conflicting answers: {self.conflicting_problems}")
        return [*lines, f"output: {self.output}"]


_WHITESPACE = re.compile(r"\s+")


def problem_key(problem: str) -> bytes:
    """Dedupe key: NFKC-normalised problem with runs of whitespace collapsed (hashed, to keep
    1.8 M rows' worth of keys small)."""
    normal = _WHITESPACE.sub(" ", unicodedata.normalize("NFKC", problem)).strip()
    return hashlib.blake2b(normal.encode("utf-8"), digest_size=16).digest()


def answer_key(answer: str) -> str:
    """Answers that differ only in spacing do not conflict."""
    return _WHITESPACE.sub("", unicodedata.normalize("NFKC", answer))


class Deduplicator:
    """Streaming stable dedupe: the first row of every problem is kept, in input order, and only first rows are
    held in memory (the policy: docs/data_and_reward.md, "DAPO-Math-17k dedupe policy")."""

    def __init__(self) -> None:
        self._first: dict[bytes, Problem] = {}
        self._answers: dict[bytes, set[str]] = {}
        self._counts: Counter[bytes] = Counter()

    def add(self, item: Problem) -> None:
        key = problem_key(item.problem)
        self._counts[key] += 1
        self._answers.setdefault(key, set()).add(answer_key(item.answer))
        self._first.setdefault(key, item)

    def finish(self, summary: Summary) -> list[Problem]:
        kept: list[Problem] = []
        for key, item in self._first.items():  # dicts keep insertion (= input) order
            if len(self._answers[key]) > 1:
                summary.dropped[CONFLICT] += self._counts[key]
                summary.conflicting_problems += 1
                continue
            if self._counts[key] > 1:
                summary.dropped[DUPLICATE] += self._counts[key] - 1
            kept.append(item)
        return kept


def to_verl_row(spec: DatasetSpec, template: str, item: Problem, index: int) -> dict[str, Any]:
    data_source = spec.data_source
    if spec.keep_input_data_source and item.data_source:
        data_source = item.data_source
    if spec.name == "dapo-math-17k" and template != "dapo":
        data_source = DAPO_OTHER_TEMPLATE_SOURCE
    extra_info: dict[str, Any] = {
        "index": index,
        "split": spec.split,
        "source_id": item.source_id,
        "problem": item.problem,
    }
    extra_info.update(item.extras)
    return {
        "data_source": data_source,
        "prompt": [{"role": "user", "content": apply_template(template, item.problem)}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": item.answer},
        "extra_info": extra_info,
    }


def _progress(rows: Any, total: int | None, description: str) -> Any:
    """tqdm on stderr for long inputs; plain iteration when tqdm is missing or output is not a tty."""
    try:
        from tqdm import tqdm
    except ImportError:
        return rows
    return tqdm(
        rows,
        total=total,
        desc=f"reading {description}",
        unit="rows",
        file=sys.stderr,
        mininterval=1.0,
        disable=total is not None and total < 10_000,
    )


def convert(
    dataset: str,
    source: str,
    output_dir: str | Path,
    template: str | None = None,
    split: str | None = None,
    config: str | None = None,
) -> Summary:
    """Convert ``source`` into ``output_dir/<dataset>.parquet``; raise DataPrepError when unusable."""
    if dataset not in DATASETS:
        raise DataPrepError(f"unknown dataset {dataset!r}; choose one of {sorted(DATASETS)}")
    spec = DATASETS[dataset]
    template = template or spec.default_template
    if template not in TEMPLATES:
        raise DataPrepError(f"unknown template {template!r}; choose one of {sorted(TEMPLATES)}")

    records = open_input(source, split=split, config=config)
    missing = sorted(spec.required_columns - set(records.columns))
    if missing:
        raise DataPrepError(
            f"{records.description}: {dataset} needs column(s) {missing} (upstream layout "
            f"{sorted(spec.required_columns)}); columns found: {sorted(records.columns)}"
        )
    layout = detect_layout(records.columns, records.description)
    summary = Summary(layout=layout.name)
    dedupe = Deduplicator()
    for position, row in enumerate(_progress(records.rows, records.total, records.description)):
        summary.rows_read += 1
        item = convert_row(layout, row, position)
        if isinstance(item, Rejected):
            if spec.strict:
                row_id = row.get("id") if isinstance(row, dict) else None
                raise DataPrepError(
                    f"{records.description}: row {position}"
                    + (f" (id {row_id})" if row_id is not None else "")
                    + f": {item.reason}; every {dataset} problem counts, so nothing was written"
                )
            summary.dropped[item.reason] += 1
            continue
        bare = strip_known_template(item.problem)
        if bare != item.problem:
            item = Problem(bare, item.answer, item.source_id, item.data_source, item.extras)
        dedupe.add(item)

    kept = dedupe.finish(summary)
    if spec.strict and summary.dropped:
        raise DataPrepError(
            f"{records.description}: {dict(summary.dropped)}; every {dataset} problem counts, so nothing was written"
        )
    rows = [to_verl_row(spec, template, item, index) for index, item in enumerate(kept)]
    summary.write(rows, Path(output_dir) / spec.filename, records.description)
    return summary


def write_parquet(rows: list[dict[str, Any]], path: Path) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_suffix(".parquet.tmp")
    pq.write_table(pa.Table.from_pylist(rows), temporary)
    temporary.replace(path)  # never leave a half-written parquet under the final name
    return path

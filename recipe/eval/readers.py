"""``score``'s inputs: ``generate`` JSONL files and verl validation dumps, read into checkpoints.

A checkpoint (:data:`~recipe.eval.metrics.Checkpoint`) maps each benchmark to its problems' per-response correctness
and extracted answers; verl's ``trainer.validation_data_dir`` dumps are mapped back to benchmarks through the eval
parquets (:class:`PromptIndex`) or ``--benchmark``. Every malformed line raises ValueError naming file and line.
"""

from __future__ import annotations

import functools
import json
import os
import re
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from recipe.eval.metrics import Checkpoint, ProblemSamples
from recipe.eval.presets import canonical_benchmark
from recipe.eval.problems import Scorer, expand_files, load_eval_parquet, reward_scorer

_DUMP_KEYS = ("input", "output", "gts", "score", "step")


def iter_jsonl(path: Path) -> Iterator[tuple[int, dict[str, Any]]]:
    """(line number, object) for each non-blank line; bad JSON or a non-object names the line."""
    with open(path, encoding="utf-8") as handle:
        for lineno, line in enumerate(handle, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path} line {lineno}: not valid JSON ({exc.msg})") from exc
            if not isinstance(row, dict):
                raise ValueError(f"{path} line {lineno}: expected a JSON object, got {type(row).__name__}")
            yield lineno, row


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    rows = [row for _, row in iter_jsonl(path)]
    if not rows:
        raise ValueError(f"{path}: empty file")
    return rows


def file_kind(path: Path, rows: list[dict[str, Any]]) -> str:
    """``"generate"`` (our rows), ``"verl"`` (validation dump rows) or ValueError."""
    first = rows[0]
    if "responses" in first:
        return "generate"
    if all(key in first for key in _DUMP_KEYS):
        return "verl"
    raise ValueError(
        f"{path} line 1: neither a `generate` row (needs 'responses') nor a verl validation dump row "
        f"(needs {list(_DUMP_KEYS)}); keys found: {sorted(first)}"
    )


def _rescore(scorer: Scorer, data_source: str, response: Any, ground_truth: Any) -> tuple[bool, str]:
    result = scorer(data_source, "" if response is None else str(response), ground_truth, {})
    return bool(result["acc"]), str(result.get("pred", ""))


def parse_generate_rows(path: Path, rows: list[dict[str, Any]], scorer: Callable[[], Scorer]) -> Checkpoint:
    """Rows written by ``generate``; responses without ``acc``/``preds`` are scored with our reward."""
    out: Checkpoint = {}
    for lineno, row in enumerate(rows, 1):
        where = f"{path} line {lineno}"
        for key in ("problem_id", "benchmark", "ground_truth", "responses"):
            if key not in row:
                raise ValueError(f"{where}: missing key {key!r}")
        responses = row["responses"]
        if not isinstance(responses, list) or not responses:
            raise ValueError(f"{where}: 'responses' must be a non-empty list")
        benchmark = canonical_benchmark(str(row["benchmark"]))
        if isinstance(row.get("acc"), list) and isinstance(row.get("preds"), list):
            correct, preds = [bool(x) for x in row["acc"]], list(row["preds"])
            if not len(correct) == len(preds) == len(responses):
                raise ValueError(f"{where}: 'acc', 'preds' and 'responses' differ in length")
        else:
            data_source = str(row.get("data_source", benchmark))
            pairs = [_rescore(scorer(), data_source, r, row["ground_truth"]) for r in responses]
            correct, preds = [p[0] for p in pairs], [p[1] for p in pairs]
        out.setdefault(benchmark, []).append(ProblemSamples(f"{benchmark}:{row['problem_id']}", correct, preds))
    return out


_WS = re.compile(r"\s+")


def _squash(text: str) -> str:
    return _WS.sub(" ", text).strip()


class PromptIndex:
    """Maps a verl dump's decoded ``input`` back to (benchmark, data_source) via the eval parquets.

    verl's dump carries no data_source, only the chat-templated prompt decoded without special
    tokens. A problem matches when its last user message (whitespace collapsed) is contained
    in the input and its ground truth equals the row's ``gts``.
    """

    def __init__(self, parquets: Sequence[str | os.PathLike[str]]):
        self.by_truth: dict[str, list[tuple[str, str, str]]] = {}
        for parquet in parquets:
            benchmark, problems = load_eval_parquet(parquet)
            for p in problems:
                content = _squash(p.messages[-1]["content"])
                self.by_truth.setdefault(_squash(p.ground_truth), []).append((content, benchmark, p.data_source))

    def lookup(self, prompt: str, ground_truth: Any, where: str) -> tuple[str, str]:
        text = _squash(prompt)
        hits = {
            (benchmark, source)
            for content, benchmark, source in self.by_truth.get(_squash(str(ground_truth)), [])
            if content in text
        }
        if len(hits) != 1:
            what = "no problem" if not hits else f"problems of several benchmarks {sorted(hits)}"
            raise ValueError(
                f"{where}: the prompt matches {what} of the --data parquets with ground truth {ground_truth!r}; "
                "pass the parquets the run validated on, or --benchmark NAME for a single-benchmark dump"
            )
        return next(iter(hits))


def parse_verl_dump(
    path: Path,
    rows: list[dict[str, Any]],
    scorer: Callable[[], Scorer],
    index: PromptIndex | None,
    benchmark: str | None,
) -> tuple[int, Checkpoint]:
    """One ``<step>.jsonl`` from ``trainer.validation_data_dir``; returns (step, checkpoint).

    Responses are grouped per problem by the ``uid`` verl's v1 trainer adds (``<uid>_<i>_<turn>``;
    for multi-turn sessions only the last turn counts), else by the decoded ``input`` (the
    classic trainer repeats each prompt n times). Correctness is the reward's ``acc`` when the
    dump has it, else the response is re-scored with our reward.
    """
    if index is None and benchmark is None:
        raise ValueError(
            f"{path}: a verl validation dump has no data_source; pass --data PARQUET... or --benchmark NAME"
        )
    steps = {row.get("step") for row in rows}
    if len(steps) != 1 or not isinstance(next(iter(steps)), int):
        raise ValueError(f"{path}: expected one integer 'step' in a validation dump, got {sorted(map(str, steps))}")
    sessions: dict[str, tuple[int, dict[str, Any]]] = {}
    for lineno, row in enumerate(rows, 1):
        missing = [k for k in _DUMP_KEYS if k not in row]
        if missing:
            raise ValueError(f"{path} line {lineno}: missing key(s) {missing}")
        uid = row.get("uid")
        parts = str(uid).rsplit("_", 2) if uid is not None else []
        if len(parts) == 3 and parts[1].isdigit() and parts[2].isdigit():
            problem_key, session = parts[0], f"{parts[0]}_{parts[1]}"
        else:
            problem_key = str(row["input"]) if uid is None else str(uid)
            session = f"{problem_key}\x00{lineno}"
        # later turns of a session replace earlier ones (dump is sorted by turn)
        sessions[session] = (lineno, row | {"_problem": problem_key})
    grouped: dict[str, list[tuple[int, dict[str, Any]]]] = {}
    for lineno, row in sessions.values():
        grouped.setdefault(row["_problem"], []).append((lineno, row))
    out: Checkpoint = {}
    for problem_key, members in grouped.items():
        lineno, first = members[0]
        where = f"{path} line {lineno}"
        if benchmark is not None:
            bench, data_source = canonical_benchmark(benchmark), benchmark
        else:
            assert index is not None
            bench, data_source = index.lookup(str(first["input"]), first["gts"], where)
        correct: list[bool] = []
        preds: list[str | None] = []
        for _, row in sorted(members, key=lambda m: m[0]):
            if "acc" in row and row["acc"] is not None:
                correct.append(bool(row["acc"]))
                preds.append(None if row.get("pred") is None else str(row["pred"]))
            else:
                ok, pred = _rescore(scorer(), data_source, row["output"], row["gts"])
                correct.append(ok)
                preds.append(pred)
        out.setdefault(bench, []).append(ProblemSamples(problem_key, correct, preds))
    return next(iter(steps)), out


def load_runs(
    paths: Sequence[str | os.PathLike[str]],
    data: Sequence[str | os.PathLike[str]] = (),
    benchmark: str | None = None,
    think: str = "auto",
) -> list[tuple[str, Checkpoint]]:
    """(label, checkpoint) for every path, in order.

    A ``generate`` output folder (or one of its files) is one checkpoint labelled by the
    folder name. A verl validation dump file is one checkpoint ("step N"); a
    ``validation_data_dir`` folder gives one checkpoint per step file, in step order.
    """
    scorer = functools.cache(functools.partial(reward_scorer, think))  # built on first use only
    index = PromptIndex(data) if data else None
    runs: list[tuple[str, Checkpoint]] = []
    for entry in paths:
        path = Path(entry)
        files = expand_files(path, "*.jsonl", "run")
        loaded = [(f, _read_jsonl(f)) for f in files]
        kinds = {f: file_kind(f, rows) for f, rows in loaded}
        if len(set(kinds.values())) != 1:
            raise ValueError(f"{path}: mixes `generate` files and verl validation dumps: {sorted(map(str, kinds))}")
        if next(iter(kinds.values())) == "generate":
            checkpoint: Checkpoint = {}
            for f, rows in loaded:
                for bench, problems in parse_generate_rows(f, rows, scorer).items():
                    if bench in checkpoint:
                        raise ValueError(f"{f}: benchmark {bench!r} appears in more than one file of {path}")
                    checkpoint[bench] = problems
            runs.append((path.stem if path.is_file() else path.name, checkpoint))
        else:
            steps = sorted(
                (parse_verl_dump(f, rows, scorer, index, benchmark) for f, rows in loaded), key=lambda s: s[0]
            )
            runs.extend((f"step {step}", checkpoint) for step, checkpoint in steps)
    return runs

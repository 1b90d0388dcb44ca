"""Readers: turn a local file, a folder, or a hub id into ``(columns, rows)``.

Every reader yields plain ``dict`` rows and says which columns it saw, so that layout
detection (``layouts.py``) works the same whatever the container format. Large parquet
files are streamed in record batches: DAPO-Math-17k as published is 1.79 M rows.
"""

from __future__ import annotations

import itertools
import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any


class DataPrepError(Exception):
    """An input that cannot be used at all (unreadable file, unknown layout, nothing to write)."""


@dataclass
class RecordSource:
    """Rows of one input plus what is known about them before iterating."""

    description: str
    columns: list[str]
    total: int | None
    rows: Iterator[Any]


#: A row that could not be decoded at all; layouts count it as a dropped row with this reason.
@dataclass(frozen=True)
class UnreadableRow:
    reason: str


DATA_SUFFIXES = (".parquet", ".jsonl", ".json")
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
_COLUMN_PEEK_ROWS = 100


def open_input(source: str, split: str | None = None, config: str | None = None) -> RecordSource:
    """Open ``source``: a data file, a folder of data files, a ``save_to_disk`` folder, or a hub id."""
    path = Path(source)
    if path.is_file():
        return _open_file(path)
    if path.is_dir():
        if any((path / name).exists() for name in ("dataset_info.json", "dataset_dict.json", "state.json")):
            return _open_saved_dataset(path, split)
        return _open_folder(path)
    if _HUB_ID.match(source):
        return _open_hub(source, split, config)
    raise DataPrepError(f"input {source!r} is neither an existing file or folder nor a hub id (owner/name)")


def _open_file(path: Path) -> RecordSource:
    suffix = path.suffix.lower()
    if suffix == ".parquet":
        return _open_parquet(path)
    if suffix in (".json", ".jsonl"):
        return _open_json(path)
    raise DataPrepError(f"{path}: unsupported file type {suffix!r}; expected one of {', '.join(DATA_SUFFIXES)}")


def _open_parquet(path: Path) -> RecordSource:
    import pyarrow.parquet as pq

    try:
        parquet = pq.ParquetFile(path)
    except Exception as exc:  # pyarrow raises several unrelated types for corrupt files
        raise DataPrepError(f"{path}: not a readable parquet file ({exc})") from exc

    def rows() -> Iterator[dict[str, Any]]:
        for batch in parquet.iter_batches(batch_size=8192):
            yield from batch.to_pylist()

    return RecordSource(str(path), list(parquet.schema_arrow.names), parquet.metadata.num_rows, rows())


def _open_json(path: Path) -> RecordSource:
    """A JSON array of objects or JSON lines; which one is decided by the first character."""
    try:
        with path.open("rb") as handle:
            head = handle.read(4096).lstrip()
    except OSError as exc:
        raise DataPrepError(f"{path}: cannot read ({exc})") from exc
    if not head:
        raise DataPrepError(f"{path}: file is empty")
    if head.startswith(b"["):
        try:
            with path.open(encoding="utf-8") as handle:
                records = json.load(handle)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise DataPrepError(f"{path}: not valid JSON ({exc})") from exc
        return _with_columns(str(path), len(records), iter(records))
    return _open_json_lines(path)


def _open_json_lines(path: Path) -> RecordSource:
    def rows() -> Iterator[Any]:
        with path.open(encoding="utf-8", errors="replace") as handle:
            for line in handle:
                if not line.strip():
                    continue
                try:
                    yield json.loads(line)
                except json.JSONDecodeError:
                    yield UnreadableRow("invalid JSON line")

    with path.open(encoding="utf-8", errors="replace") as handle:
        total = sum(1 for line in handle if line.strip())
    source = _with_columns(str(path), total, rows())
    if not source.columns:
        # One JSON object spread over several lines is a document, not JSON lines.
        try:
            document = json.loads(path.read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise DataPrepError(f"{path}: neither JSON lines nor a JSON array of objects") from None
        raise DataPrepError(
            f"{path}: top-level JSON {type(document).__name__}; expected an array of objects or JSON lines"
        )
    return source


def _with_columns(description: str, total: int | None, rows: Iterator[Any]) -> RecordSource:
    """Peek at the first rows to learn the columns, then hand back an iterator over all rows."""
    peeked = list(itertools.islice(rows, _COLUMN_PEEK_ROWS))
    columns = list(dict.fromkeys(key for row in peeked if isinstance(row, dict) for key in row))
    return RecordSource(description, columns, total, itertools.chain(peeked, rows))


def _open_folder(path: Path) -> RecordSource:
    files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix.lower() in DATA_SUFFIXES)
    if not files:
        raise DataPrepError(
            f"{path}: folder holds no {', '.join(DATA_SUFFIXES)} files and is not a save_to_disk folder"
        )
    sources = [_open_file(file) for file in files]
    columns = list(dict.fromkeys(column for source in sources for column in source.columns))
    totals = [s.total for s in sources]
    total = sum(t for t in totals if t is not None) if all(t is not None for t in totals) else None
    return RecordSource(
        f"{path} ({len(files)} files)", columns, total, itertools.chain.from_iterable(s.rows for s in sources)
    )


def _open_saved_dataset(path: Path, split: str | None) -> RecordSource:
    import datasets

    try:
        loaded = datasets.load_from_disk(str(path))
    except Exception as exc:  # datasets raises FileNotFoundError, ValueError, ... for broken folders
        raise DataPrepError(f"{path}: not a readable save_to_disk folder ({exc})") from exc
    return _from_hf(str(path), loaded, split)


def _open_hub(hub_id: str, split: str | None, config: str | None) -> RecordSource:
    import datasets

    try:
        loaded = datasets.load_dataset(hub_id, config, split=split)
    except Exception as exc:  # offline, unknown id, gated, missing config ...
        raise DataPrepError(f"hub dataset {hub_id!r} (config {config!r}) could not be loaded: {exc}") from exc
    return _from_hf(hub_id, loaded, split)


def _from_hf(description: str, loaded: Any, split: str | None) -> RecordSource:
    import datasets

    if isinstance(loaded, datasets.DatasetDict):
        if split is None:
            if len(loaded) != 1:
                raise DataPrepError(f"{description}: several splits {sorted(loaded)}; choose one with --split")
            split = next(iter(loaded))
        if split not in loaded:
            raise DataPrepError(f"{description}: no split {split!r}; splits are {sorted(loaded)}")
        loaded = loaded[split]
    return RecordSource(description, list(loaded.column_names), len(loaded), iter(loaded))

"""Read records from jsonl / jsonl.gz / json / parquet files or a Hugging Face dataset.

Each record comes with its location (``file:line`` for jsonl, ``file row N`` otherwise) so a
malformed row is reported where it is, and nothing is skipped silently: callers count skips
and log them.
"""

from __future__ import annotations

import gzip
import json
import os
from dataclasses import dataclass
from typing import Any, Iterator, Sequence


class DataError(ValueError):
    """Bad input data; the message names the file (and line or row) and the problem."""


@dataclass(frozen=True)
class Row:
    """One record and where it came from (for error messages)."""

    data: dict[str, Any]
    where: str
    """e.g. ``data/train.jsonl:17`` or ``Anthropic/hh-rlhf[train] row 17``."""


_JSONL = (".jsonl", ".jsonl.gz", ".ndjson")
_FILES = _JSONL + (".json", ".parquet")


def is_file_source(source: str) -> bool:
    return source.endswith(_FILES)


def _iter_jsonl(path: str) -> Iterator[Row]:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, start=1):
            if not line.strip():
                continue  # blank lines (e.g. a trailing newline) are not records
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as err:
                raise DataError(f"{path}:{lineno}: invalid JSON ({err.msg} at column {err.colno})") from None
            if not isinstance(obj, dict):
                raise DataError(f"{path}:{lineno}: expected a JSON object, got {type(obj).__name__}")
            yield Row(obj, f"{path}:{lineno}")


def _iter_json(path: str) -> Iterator[Row]:
    with open(path, encoding="utf-8") as fh:
        try:
            obj = json.load(fh)
        except json.JSONDecodeError as err:
            raise DataError(f"{path}:{err.lineno}: invalid JSON ({err.msg})") from None
    if not isinstance(obj, list):
        raise DataError(f"{path}: expected a JSON list of objects, got {type(obj).__name__}")
    for i, item in enumerate(obj, start=1):
        if not isinstance(item, dict):
            raise DataError(f"{path} item {i}: expected a JSON object, got {type(item).__name__}")
        yield Row(item, f"{path} item {i}")


def _iter_parquet(path: str) -> Iterator[Row]:
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except Exception as err:  # pyarrow raises several types for corrupt files
        raise DataError(f"{path}: not a readable parquet file ({err})") from None
    for i, item in enumerate(table.to_pylist(), start=1):
        yield Row(item, f"{path} row {i}")


def _iter_hf(name: str, split: str) -> Iterator[Row]:
    import datasets

    try:
        if os.path.isdir(name):
            ds = datasets.load_from_disk(name)
            ds = ds[split] if isinstance(ds, datasets.DatasetDict) else ds
        else:
            ds = datasets.load_dataset(name, split=split)
    except (FileNotFoundError, ConnectionError, OSError, ValueError) as err:
        raise DataError(
            f"could not load dataset '{name}' (split '{split}'): {err}. Offline? Point the data "
            f"config at a local .jsonl/.jsonl.gz/.parquet file or a `save_to_disk` folder."
        ) from err
    for i, item in enumerate(ds, start=1):
        yield Row(dict(item), f"{name}[{split}] row {i}")


def iter_rows(source: str, split: str = "train") -> Iterator[Row]:
    """Records of a file (by extension) or a dataset (a ``save_to_disk`` folder or hub name)."""
    if is_file_source(source):
        if not os.path.isfile(source):
            raise DataError(f"{source}: no such file")
        if source.endswith(_JSONL):
            return _iter_jsonl(source)
        if source.endswith(".json"):
            return _iter_json(source)
        return _iter_parquet(source)
    return _iter_hf(source, split)


def require_str(row: Row, field: str, fields_hint: Sequence[str] = ()) -> str:
    """``row.data[field]`` as a string, or a DataError that names the row and the keys it has."""
    if field not in row.data:
        have = ", ".join(sorted(row.data)) or "none"
        hint = f" (configure {', '.join(fields_hint)})" if fields_hint else ""
        raise DataError(f"{row.where}: missing field '{field}'; the row has: {have}{hint}")
    value = row.data[field]
    if not isinstance(value, str):
        raise DataError(f"{row.where}: field '{field}' must be a string, got {type(value).__name__}")
    return value

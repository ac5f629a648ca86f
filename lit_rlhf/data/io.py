"""Read records from jsonl / jsonl.gz / json / parquet files or a Hugging Face dataset.

Each record comes with its location (``file:line`` for jsonl, ``file row N`` otherwise) so a
malformed row is reported where it is, and nothing is skipped silently: callers count skips
and log them.
"""

from __future__ import annotations

import gzip
import json
import os
import zlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from lit_rlhf.utils.errors import UserError


class DataError(UserError, ValueError):
    """Bad input data; the message names the file (and line or row) and the problem."""


@dataclass(frozen=True)
class Row:
    """One record and where it came from (for error messages)."""

    data: dict[str, Any]
    where: str
    """e.g. ``data/train.jsonl:17`` or ``Anthropic/hh-rlhf[train] row 17``."""
    number: int = 0
    """1-based line number (jsonl) or row number (other sources), for row-range selection."""


_JSONL = (".jsonl", ".jsonl.gz", ".ndjson")
_FILES = _JSONL + (".json", ".parquet")


def is_file_source(source: str) -> bool:
    return source.endswith(_FILES)


def _lines(path: str) -> Iterator[tuple[int, bytes]]:
    """(1-based line number, raw bytes) of a text or gzip file; a truncated or corrupt gzip stream
    and an unreadable file are DataErrors naming the file and the last complete line."""
    opener = gzip.open if path.endswith(".gz") else open
    lineno = 0
    try:
        with opener(path, "rb") as fh:
            for lineno, line in enumerate(fh, start=1):
                yield lineno, line
    except (EOFError, gzip.BadGzipFile, zlib.error, OSError) as err:
        raise DataError(
            f"{path}: unreadable after line {lineno} ({type(err).__name__}: {err}); the file is "
            "truncated or not what its extension says — re-download or re-compress it"
        ) from None


def _iter_jsonl(path: str) -> Iterator[Row]:
    for lineno, raw in _lines(path):
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as err:
            raise DataError(
                f"{path}:{lineno}: not valid UTF-8 (byte {err.start} of the line: {raw[err.start : err.start + 4]!r})"
            ) from None
        if not line.strip():
            continue  # blank lines (e.g. a trailing newline) are not records
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as err:
            raise DataError(f"{path}:{lineno}: invalid JSON ({err.msg} at column {err.colno})") from None
        if not isinstance(obj, dict):
            raise DataError(f"{path}:{lineno}: expected a JSON object, got {type(obj).__name__}")
        yield Row(obj, f"{path}:{lineno}", lineno)


def _iter_json(path: str) -> Iterator[Row]:
    with open(path, "rb") as fh:
        raw = fh.read()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        line = raw[: err.start].count(b"\n") + 1
        raise DataError(f"{path}:{line}: not valid UTF-8 (byte offset {err.start})") from None
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as err:
        raise DataError(f"{path}:{err.lineno}: invalid JSON ({err.msg})") from None
    if not isinstance(obj, list):
        raise DataError(f"{path}: expected a JSON list of objects, got {type(obj).__name__}")
    for i, item in enumerate(obj, start=1):
        if not isinstance(item, dict):
            raise DataError(f"{path} item {i}: expected a JSON object, got {type(item).__name__}")
        yield Row(item, f"{path} item {i}", i)


def _iter_parquet(path: str) -> Iterator[Row]:
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except Exception as err:  # pyarrow raises several types for corrupt files
        raise DataError(f"{path}: not a readable parquet file ({err})") from None
    for i, item in enumerate(table.to_pylist(), start=1):
        yield Row(item, f"{path} row {i}", i)


def _iter_hf(name: str, split: str, data_dir: str | None = None) -> Iterator[Row]:
    import datasets

    try:
        if os.path.isdir(name):
            ds = datasets.load_from_disk(name)
            ds = ds[split] if isinstance(ds, datasets.DatasetDict) else ds
        else:
            ds = datasets.load_dataset(name, split=split, data_dir=data_dir)
    except (FileNotFoundError, ConnectionError, OSError, ValueError) as err:
        raise DataError(
            f"could not load dataset '{name}' (split '{split}'): {err}. Offline? Point the data "
            f"config at a local .jsonl/.jsonl.gz/.parquet file or a `save_to_disk` folder."
        ) from err
    for i, item in enumerate(ds, start=1):
        yield Row(dict(item), f"{name}[{split}] row {i}", i)


def iter_rows(source: str, split: str = "train", data_dir: str | None = None) -> Iterator[Row]:
    """Records of a file (by extension) or a dataset (a ``save_to_disk`` folder or hub name;
    ``data_dir`` selects a subset of a hub dataset, e.g. "harmless-base" of Anthropic/hh-rlhf)."""
    if is_file_source(source):
        if not os.path.isfile(source):
            raise DataError(f"{source}: no such file")
        if source.endswith(_JSONL):
            return _iter_jsonl(source)
        if source.endswith(".json"):
            return _iter_json(source)
        return _iter_parquet(source)
    return _iter_hf(source, split, data_dir)


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


def parse_rows(spec: str | None) -> tuple[int, int | None] | None:
    """``"1-2000"`` → (1, 2000); ``"2001-"`` → (2001, None); None → None (all rows). 1-based, inclusive."""
    if spec is None:
        return None
    head, sep, tail = str(spec).partition("-")
    if not sep or not head.strip().isdigit() or (tail.strip() and not tail.strip().isdigit()):
        raise ValueError(f"expected a row range like '1-2000' or '2001-', got {spec!r}")
    lo, hi = int(head), int(tail) if tail.strip() else None
    if lo < 1 or (hi is not None and hi < lo):
        raise ValueError(f"empty or invalid row range {spec!r}")
    return lo, hi


def select_rows(rows: list[Row], spec: str | None) -> list[Row]:
    """Rows whose 1-based line/row number lies in the range ``spec`` (see :func:`parse_rows`)."""
    bounds = parse_rows(spec)
    if bounds is None:
        return rows
    lo, hi = bounds
    return [r for r in rows if r.number >= lo and (hi is None or r.number <= hi)]


def ranges_overlap(a: str | None, b: str | None) -> bool:
    """Whether two row ranges share a row (None = all rows)."""
    ra, rb = parse_rows(a) or (1, None), parse_rows(b) or (1, None)
    hi_a = ra[1] if ra[1] is not None else float("inf")
    hi_b = rb[1] if rb[1] is not None else float("inf")
    return ra[0] <= hi_b and rb[0] <= hi_a

"""Records of local JSONL and Parquet files of {prompt, answer, ...} objects; a task source
over them comes from the one factory, `areal.data.sources.make_source` (a `ListTaskSource`:
wrap-around, seeded per-epoch shuffles).

Invariants:
- The whole file is read and validated at once: a record without the prompt or answer field
  (or with a null / non-scalar value) fails right there with the file, line (JSONL) or row
  (Parquet, 0-based) and field name, never later in the middle of a run.
- A record's metadata holds every other field of the record plus `source` and `line` / `row`.
- Non-string answers (e.g. JSON numbers) are converted with `str`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

Record = tuple[str, str, dict[str, Any]]  # prompt, answer, metadata


def _field(record: dict[str, Any], name: str, where: str) -> str:
    if name not in record or record[name] is None:
        raise ValueError(f"{where}: record has no {name!r} field (fields: {sorted(record)})")
    value = record[name]
    if isinstance(value, (dict, list)):
        raise ValueError(f"{where}: field {name!r} must be a string or number, got {value!r:.80}")
    return value if isinstance(value, str) else str(value)


def record_of(
    record: Any, prompt_field: str, answer_field: str, where: str, extra: dict[str, Any]
) -> Record:
    """One validated record: its prompt and answer fields, every other field as metadata."""
    if not isinstance(record, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(record).__name__}")
    prompt = _field(record, prompt_field, where)
    answer = _field(record, answer_field, where)
    meta = {k: v for k, v in record.items() if k not in (prompt_field, answer_field)}
    return prompt, answer, {**meta, **extra}


def read_jsonl_records(path: str | Path, prompt_field: str, answer_field: str) -> list[Record]:
    """Every record of a JSONL file, validated (module invariants)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"dataset file {path} does not exist")
    items = []
    with path.open(encoding="utf-8") as f:
        for line_no, line in enumerate(f, start=1):
            if not line.strip():
                continue
            where = f"{path}:{line_no}"
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{where}: invalid JSON ({e.msg})") from None
            extra = {"source": str(path), "line": line_no}
            items.append(record_of(record, prompt_field, answer_field, where, extra))
    if not items:
        raise ValueError(f"dataset file {path} has no records")
    return items


def read_parquet_records(path: str | Path, prompt_field: str, answer_field: str) -> list[Record]:
    """Every row of a Parquet table, validated (module invariants). Needs pyarrow."""
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise ImportError(
            "reading Parquet datasets needs pyarrow: pip install 'areal-bus[parquet]'"
        ) from None
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"dataset file {path} does not exist")
    table = pq.read_table(path)
    for col in (prompt_field, answer_field):
        if col not in table.column_names:
            raise ValueError(
                f"{path}: no {col!r} column (columns: {table.column_names}); "
                "pass prompt_field= / answer_field= to name the right ones"
            )
    items = []
    for row, record in enumerate(table.to_pylist()):
        where = f"{path}: row {row}"
        items.append(
            record_of(record, prompt_field, answer_field, where, {"source": str(path), "row": row})
        )
    if not items:
        raise ValueError(f"dataset file {path} has no records")
    return items

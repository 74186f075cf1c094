"""File task sources (`make_source` over a JSONL / Parquet file): loading, wrap-around,
shuffled epochs, bad records."""

from __future__ import annotations

import json
import sys

import pytest

from areal.config import DataSettings
from areal.data.sources import ListTaskSource, make_source

RECORDS = [{"prompt": f"q{i}", "answer": i, "level": i % 2} for i in range(5)]


def file_source(path, *, shuffle=False, seed=0, **fields):
    """The one factory's source over the file at `path` (field names as `data.*_field`)."""
    data = DataSettings(source=str(path), shuffle=shuffle, **fields)
    return make_source(str(path), data, seed)


def write_jsonl(path, records, blank_lines=False):
    lines = [json.dumps(r) for r in records]
    if blank_lines:
        lines.insert(1, "   ")
    path.write_text("\n".join(lines) + "\n")
    return path


def test_jsonl_loads_and_wraps(tmp_path):
    src = file_source(write_jsonl(tmp_path / "d.jsonl", RECORDS, blank_lines=True))
    assert len(src) == 5
    item = src.get(2)
    assert (item.index, item.prompt, item.answer) == (2, "q2", "2")  # numbers become strings
    assert item.metadata["level"] == 0 and item.metadata["line"] == 4  # line 2 is blank
    wrapped = src.get(7)
    assert (wrapped.index, wrapped.prompt) == (7, "q2")


def test_jsonl_custom_fields(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"question": "2+2=", "solution": "#### 4"}])
    item = file_source(path, prompt_field="question", answer_field="solution").get(0)
    assert (item.prompt, item.answer) == ("2+2=", "#### 4")


def test_shuffle_permutes_each_epoch_deterministically(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": str(i), "answer": "0"} for i in range(50)])
    src = file_source(path, shuffle=True, seed=1)
    epoch0 = [src.get(i).prompt for i in range(50)]
    epoch1 = [src.get(i).prompt for i in range(50, 100)]
    assert sorted(epoch0, key=int) == [str(i) for i in range(50)]
    assert epoch0 != epoch1 and sorted(epoch1) == sorted(epoch0)
    again = file_source(path, shuffle=True, seed=1)
    assert [again.get(i).prompt for i in (60, 3, 99)] == [epoch1[10], epoch0[3], epoch1[49]]


def test_jsonl_missing_field_names_file_line_and_field(tmp_path):
    path = write_jsonl(tmp_path / "bad.jsonl", [{"prompt": "a", "answer": "1"}, {"prompt": "b"}])
    with pytest.raises(ValueError, match=r"bad\.jsonl:2.*'answer'"):
        file_source(path)


@pytest.mark.parametrize(
    ("line", "match"),
    [
        ("{not json", "invalid JSON"),
        ("[1, 2]", "JSON object"),
        ('{"prompt": null, "answer": 1}', "'prompt'"),
    ],
)
def test_jsonl_bad_lines(tmp_path, line, match):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"prompt": "a", "answer": "1"}) + "\n" + line + "\n")
    with pytest.raises(ValueError, match=rf"bad\.jsonl:2: .*{match}"):
        file_source(path)


def test_jsonl_empty_and_missing_files(tmp_path):
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(ValueError, match="no records"):
        file_source(tmp_path / "empty.jsonl")
    with pytest.raises(FileNotFoundError):
        file_source(tmp_path / "missing.jsonl")


def test_parquet_loads_and_wraps(tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    path = tmp_path / "d.parquet"
    pq.write_table(pa.Table.from_pylist(RECORDS), path)
    src = file_source(path)
    assert isinstance(src, ListTaskSource) and len(src) == 5
    item = src.get(8)
    assert (item.prompt, item.answer, item.metadata["row"], item.metadata["level"]) == (
        "q3",
        "3",
        3,
        1,
    )


def test_parquet_missing_column_and_null(tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    path = tmp_path / "d.parquet"
    pq.write_table(pa.Table.from_pylist([{"prompt": "a"}]), path)
    with pytest.raises(ValueError, match=r"no 'answer' column"):
        file_source(path)
    pq.write_table(
        pa.Table.from_pylist([{"prompt": "a", "answer": "1"}, {"prompt": "b", "answer": None}]),
        path,
    )
    with pytest.raises(ValueError, match=r"row 1.*'answer'"):
        file_source(path)


def test_parquet_without_pyarrow_names_the_extra(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "pyarrow", None)
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    with pytest.raises(ImportError, match=r"areal-bus\[parquet\]"):
        file_source(tmp_path / "d.parquet")

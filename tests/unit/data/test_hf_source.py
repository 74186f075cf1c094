"""`data.source: hf:...` (`areal.data.hf`): datasets the test builds with `datasets` itself
(`save_to_disk` folders, Parquet shards, a hub cache entry), read with the run's field mapping,
split and seeded shuffle, and never a network connection."""

from __future__ import annotations

import importlib.util
import socket
import time

import pytest

from areal.config import ConfigError, DataSettings, load_settings
from areal.data.sources import make_source, make_sources, source_error

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("datasets") is None, reason="pip install 'areal-bus[data]'"
)
N = 12


@pytest.fixture(autouse=True)
def no_network(monkeypatch, tmp_path):
    """A private, empty Hugging Face cache, and any attempt to connect fails the test."""
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_DATASETS_CACHE"):
        monkeypatch.delenv(var, raising=False)

    def refuse(*args, **kwargs):
        raise AssertionError(f"a network connection was attempted: {args}")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)


def rows(n: int = N, offset: int = 0) -> dict[str, list]:
    """GSM8K-like columns: the prompt is `question`, the answer `solution`."""
    idx = range(offset, offset + n)
    return {
        "question": [f"{i}+{i}=" for i in idx],
        "solution": [str(2 * i) for i in idx],  # numbers as text, as in most HF sets
        "level": list(idx),
        "tags": [["add", f"t{i}"] for i in idx],
    }


def mapped(**kw) -> DataSettings:
    return DataSettings(prompt_field="question", answer_field="solution", shuffle=False, **kw)


def prompts(src, n=None) -> list[str]:
    return [src.get(i).prompt for i in range(len(src) if n is None else n)]


def test_save_to_disk_dataset_dict_with_field_mapping_and_split(tmp_path):
    from datasets import Dataset, DatasetDict

    folder = tmp_path / "gsm"
    DatasetDict(
        {"train": Dataset.from_dict(rows()), "test": Dataset.from_dict(rows(3, offset=100))}
    ).save_to_disk(str(folder))
    spec = f"hf:{folder}"
    assert source_error(spec) is None
    train = make_source(spec, mapped(source=spec), seed=0)
    assert len(train) == N
    item = train.get(5)
    assert (item.prompt, item.answer) == ("5+5=", "10")
    # every other column is metadata, as for JSONL, plus where the row came from
    assert item.metadata == {
        "level": 5,
        "tags": ["add", "t5"],
        "source": spec,
        "split": "train",
        "row": 5,
    }
    test = make_source(spec, mapped(source=spec, split="test"), seed=0)
    assert prompts(test) == ["100+100=", "101+101=", "102+102="]
    with pytest.raises(ValueError, match=r"no split 'dev' \(splits: \['test', 'train'\]\)"):
        make_source(spec, mapped(source=spec, split="dev"), seed=0)


def test_parquet_shards_folder_and_glob(tmp_path):
    from datasets import Dataset

    ds = Dataset.from_dict(rows())
    shards = tmp_path / "shards"
    shards.mkdir()
    # hub-style shard names: the split is in the file name, shards in name order
    ds.select(range(6)).to_parquet(str(shards / "train-00000-of-00002.parquet"))
    ds.select(range(6, N)).to_parquet(str(shards / "train-00001-of-00002.parquet"))
    Dataset.from_dict(rows(2, offset=50)).to_parquet(str(shards / "test-00000-of-00001.parquet"))
    folder = make_source(f"hf:{shards}", mapped(), seed=0)
    assert prompts(folder) == [f"{i}+{i}=" for i in range(N)]
    test = make_source(f"hf:{shards}", mapped(split="test"), seed=0)
    assert prompts(test) == ["50+50=", "51+51="]
    # a glob is the files of one split, in name order
    spec = f"hf:{shards}/train-*.parquet"
    assert source_error(spec) is None
    assert prompts(make_source(spec, mapped(), seed=0)) == prompts(folder)
    # Arrow shards (what save_to_disk writes) by glob
    ds.save_to_disk(str(tmp_path / "flat"))
    arrow = make_source(f"hf:{tmp_path}/flat/*.arrow", mapped(), seed=0)
    assert prompts(arrow) == prompts(folder)


def test_shuffle_is_seeded_stable_and_the_same_on_resume(tmp_path):
    from datasets import Dataset

    Dataset.from_dict(rows(40)).save_to_disk(str(tmp_path / "d"))
    data = DataSettings(source=f"hf:{tmp_path}/d", prompt_field="question", answer_field="solution")
    assert data.shuffle  # on by default, as for every finite source
    order = prompts(make_source(data.source, data, seed=7), 80)  # two epochs
    # a restarted controller (same seed) reads the same tasks at the same indices
    again = make_source(data.source, data, seed=7)
    assert [again.get(i).prompt for i in (79, 3, 41)] == [order[79], order[3], order[41]]
    assert order[:40] != [f"{i}+{i}=" for i in range(40)]  # shuffled...
    assert sorted(order[:40]) == sorted(order[40:])  # ...each epoch a permutation...
    assert order[:40] != order[40:]  # ...a new one per epoch
    assert prompts(make_source(data.source, data, seed=8), 40) != order[:40]  # the run's seed


def test_held_out_split_and_eval_split(tmp_path):
    from datasets import Dataset, DatasetDict

    DatasetDict(
        {"train": Dataset.from_dict(rows(20)), "test": Dataset.from_dict(rows(4, offset=100))}
    ).save_to_disk(str(tmp_path / "d"))
    spec = f"hf:{tmp_path}/d"
    train, held = make_sources(mapped(source=spec, eval_size=5), seed=0)
    assert held is not None and len(held) == 5 and len(train) == 15
    assert not set(prompts(held)) & set(prompts(train))
    # the test split as the held-out set (data.eval_split, "test" by default)
    train, held = make_sources(mapped(source=spec, eval_source=spec), seed=0)
    assert len(train) == 20 and prompts(held) == [f"{i}+{i}=" for i in range(100, 104)]


def cache_hub_dataset(tmp_path, sha: str) -> None:
    """`me/tiny` in the private hub cache, in the cache's own layout (as
    `datasets.load_dataset("me/tiny")` leaves it): one Parquet shard of `rows()`."""
    from datasets import Dataset

    repo = tmp_path / "hf-home" / "hub" / "datasets--me--tiny"
    snap = repo / "snapshots" / sha
    (snap / "data").mkdir(parents=True)
    Dataset.from_dict(rows()).to_parquet(str(snap / "data" / "train-00000-of-00001.parquet"))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(sha)


def test_a_hub_name_is_read_from_the_local_cache_only(tmp_path, monkeypatch):
    cache_hub_dataset(tmp_path, "ab" * 20)
    monkeypatch.delenv("HF_DATASETS_OFFLINE", raising=False)  # offline whatever the env says
    assert source_error("hf:me/tiny") is None
    src = make_source("hf:me/tiny", mapped(), seed=0)
    assert prompts(src) == [f"{i}+{i}=" for i in range(N)]


def test_a_hub_name_not_in_the_cache_fails_at_once_with_one_line(tmp_path):
    t0 = time.monotonic()
    problem = source_error("hf:someone/not-cached")
    assert problem is not None and "\n" not in problem
    assert "no hub dataset 'someone/not-cached' in the Hugging Face cache" in problem
    assert 'datasets.load_dataset("someone/not-cached").save_to_disk(DIR)' in problem
    assert "use hf:DIR" in problem
    # the config fails on it, naming the field; building the source fails the same way
    with pytest.raises(ConfigError) as e:
        load_settings(None, ["data.source=hf:someone/not-cached"])
    assert "data.source: hf:someone/not-cached: no local folder" in str(e.value)
    with pytest.raises(FileNotFoundError, match="areal never downloads"):
        make_source("hf:someone/not-cached", mapped(), seed=0)
    assert time.monotonic() - t0 < 5  # no network timeout behind it (connect() would raise)


@pytest.mark.parametrize(
    ("spec", "problem"),
    [
        ("hf:/no/such/folder", "no such folder or file; give a datasets.save_to_disk folder"),
        ("hf:./no-such-dir", "no such folder or file"),
        ("hf:/no/such/*.parquet", "no file matches the glob"),
    ],
)
def test_bad_hf_specs_fail_config_validation_with_the_field_and_the_fix(spec, problem):
    with pytest.raises(ConfigError) as e:
        load_settings(None, [f"data.eval_source={spec}"])
    assert f"data.eval_source: {spec}: {problem}" in str(e.value)
    assert "\n" not in str(e.value)


def test_hf_without_a_dataset():
    assert "names no dataset" in source_error("hf:")


def test_a_glob_of_other_files_and_a_missing_column(tmp_path):
    from datasets import Dataset

    (tmp_path / "a.csv").write_text("x\n")
    assert "must match only .parquet or .arrow" in source_error(f"hf:{tmp_path}/*")
    Dataset.from_dict(rows()).save_to_disk(str(tmp_path / "d"))
    with pytest.raises(ValueError, match=r"no 'problem' column .* set data.prompt_field"):
        make_source(f"hf:{tmp_path}/d", DataSettings(prompt_field="problem"), seed=0)


def test_eval_source_on_the_training_split_is_refused(tmp_path):
    from datasets import Dataset

    Dataset.from_dict(rows()).save_to_disk(str(tmp_path / "d"))
    spec = f"hf:{tmp_path}/d"
    with pytest.raises(ConfigError, match="set data.eval_split to another split"):
        load_settings(
            None,
            [f"data.source={spec}", f"data.eval_source={spec}", "data.eval_split=train"],
        )


def _as_joined_worker_reads(spec: str, copy_dir, tmp_path) -> list[str]:
    """What a worker on another host reads of `spec`: the launcher's `source_files` copied into
    `copy_dir` (as `fetch_run_files` leaves them), the original moved out of reach, the spec
    rewritten by `with_copy`."""
    import shutil

    from areal.data.sources import source_files, with_copy

    files = source_files(spec)
    assert files
    for rel, src in files.items():
        (copy_dir / rel).parent.mkdir(parents=True, exist_ok=True)
        (copy_dir / rel).write_bytes(src.read_bytes())
    shutil.move(tmp_path / "launcher", tmp_path / "gone")  # the launcher's files are elsewhere
    try:
        return prompts(make_source(with_copy(spec, copy_dir), mapped(split="train"), seed=0))
    finally:
        shutil.move(tmp_path / "gone", tmp_path / "launcher")


@pytest.mark.parametrize("form", ["save_to_disk", "shards", "glob", "file"])
def test_an_hf_dataset_is_shared_with_workers_on_other_hosts_as_its_files(tmp_path, form):
    from datasets import Dataset, DatasetDict

    base = tmp_path / "launcher"
    ds = Dataset.from_dict(rows())
    if form == "save_to_disk":
        DatasetDict({"train": ds, "test": Dataset.from_dict(rows(2, 50))}).save_to_disk(
            str(base / "d")
        )
        spec = f"hf:{base}/d"
    else:
        (base / "d" / "data").mkdir(parents=True)
        ds.select(range(6)).to_parquet(str(base / "d" / "data" / "train-00000-of-00002.parquet"))
        ds.select(range(6, N)).to_parquet(str(base / "d" / "data" / "train-00001-of-00002.parquet"))
        (base / "d" / "README.md").write_text("not data")
        spec = {
            "shards": f"hf:{base}/d",
            "glob": f"hf:{base}/d/data/train-*.parquet",
            "file": f"hf:{base}/d/data/train-00000-of-00002.parquet",
        }[form]
    here = prompts(make_source(spec, mapped(split="train"), seed=0))
    assert _as_joined_worker_reads(spec, tmp_path / "copy", tmp_path) == here
    assert len(here) == (6 if form == "file" else N)


def test_a_cached_hub_dataset_is_shared_as_its_snapshot(tmp_path, monkeypatch):
    from areal.data.sources import source_files, with_copy

    cache_hub_dataset(tmp_path, "cd" * 20)
    assert list(source_files("hf:me/tiny")) == ["data/train-00000-of-00001.parquet"]
    assert with_copy("hf:me/tiny", tmp_path / "copy") == f"hf:{tmp_path / 'copy'}"


def test_what_reads_files_is_told_from_the_spec_alone():
    from areal.data.sources import reads_files, source_files

    for spec in ("synthetic:arithmetic", "reasoning_gym:gsm_symbolic", "champ", "humaneval"):
        assert not reads_files(spec) and source_files(spec) == {}
    for spec in ("hf:some/dir", "champ:x.json", "humaneval:x.jsonl", "tasks.jsonl"):
        assert reads_files(spec)

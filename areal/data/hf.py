"""`data.source: hf:<where>`: Hugging Face datasets read from this host's disk.

`<where>` is one of:
- a `datasets` `save_to_disk` folder: a `Dataset`, or a `DatasetDict` whose split
  `data.split` is read;
- a folder of data shards (`*.parquet`, `*.arrow`; CSV / JSON too): its splits come from the
  file names as on the hub (`train-00000-of-00002.parquet`, `data/test-*.parquet`); unnamed
  shards are one `train` split;
- a glob or a single `.parquet` / `.arrow` file: these files are the split `data.split`;
- a hub dataset name (`openai/gsm8k`, its subset in `data.subset`), read from the local
  Hugging Face cache (`HF_HUB_CACHE`, else `$HF_HOME/hub`).

Invariants:
- Nothing here opens a network connection (`HF_DATASETS_OFFLINE=1` semantics whatever the
  environment says): a hub name is looked up in the cache's own layout
  (`datasets--<org>--<name>/refs/main` -> `snapshots/<sha>`) and loaded as a local folder; a name
  that is not cached fails at once with one line naming the command that downloads it.
- Records are validated at construction exactly as a JSONL file's (`data.prompt_field`,
  `data.answer_field`, `areal.data.datasets.record_of`); every other field whose value is JSON
  data is the task's metadata (it travels in the prompt message), plus `source`, `split`, `row`.
- Records keep the dataset's row order (shards in name order), so the held-out split and the
  per-epoch shuffle (`areal.data.sources`) are pure functions of (data, seeds, index).
"""

from __future__ import annotations

import contextlib
import glob
import os
import re
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from areal.data.contained import check_contained_file, contained_files, share_root
from areal.data.datasets import Record, record_of

__all__ = [
    "SHARD_SUFFIXES",
    "hf_files",
    "hf_records",
    "hf_spec_error",
    "hf_where_in",
    "hub_cache_dir",
    "hub_snapshot",
]

SHARD_SUFFIXES = (".parquet", ".arrow")
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")
_GLOB = re.compile(r"[*?\[]")


def _hf_home() -> Path:
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME") or "~/.cache"
    return Path(xdg).expanduser() / "huggingface"


def hub_cache_dir() -> Path:
    """Where `huggingface_hub` keeps downloads (its own rule, read from the environment now)."""
    env = os.environ.get("HF_HUB_CACHE") or os.environ.get("HUGGINGFACE_HUB_CACHE")
    return Path(env).expanduser() if env else _hf_home() / "hub"


def _datasets_cache_dir() -> Path:
    env = os.environ.get("HF_DATASETS_CACHE")
    return Path(env).expanduser() if env else _hf_home() / "datasets"


def _is_hub_name(where: str) -> bool:
    return bool(_HUB_ID.match(where)) and Path(where).suffix.lower() not in SHARD_SUFFIXES


def hub_snapshot(name: str) -> Path | None:
    """The cached snapshot folder of hub dataset `name` (its `main` revision, else the only
    snapshot there is), or None. Reads the cache's layout only."""
    repo = hub_cache_dir() / f"datasets--{name.replace('/', '--')}"
    ref = repo / "refs" / "main"
    if ref.is_file():
        snap = repo / "snapshots" / ref.read_text().strip()
        if snap.is_dir():
            return snap
    snaps = [p for p in (repo / "snapshots").glob("*") if p.is_dir()]
    return snaps[0] if len(snaps) == 1 else None


def _not_cached(name: str) -> str:
    return (
        f"hf:{name}: no local folder or file of that name, and no hub dataset {name!r} in the "
        f"Hugging Face cache ({hub_cache_dir()}); areal never downloads: where you have network "
        f"run `python -c 'import datasets; datasets.load_dataset(\"{name}\").save_to_disk(DIR)'`"
        " and use hf:DIR"
    )


def _glob_files(where: str) -> list[Path]:
    return sorted(Path(p) for p in glob.glob(os.path.expanduser(where), recursive=True))


def hf_spec_error(where: str) -> str | None:
    """Why `hf:<where>` cannot be read here (one line with the fix), or None. Cheap: no
    `datasets` import, no data read, only the file system."""
    if not where:
        return (
            "hf: names no dataset: hf:<save_to_disk folder | folder or glob of .parquet/.arrow "
            "shards | hub name in the local cache>"
        )
    if _GLOB.search(where):
        files = _glob_files(where)
        if not files:
            return f"hf:{where}: no file matches the glob"
        odd = sorted({p.suffix or p.name for p in files if p.suffix.lower() not in SHARD_SUFFIXES})
        if odd:
            return (
                f"hf:{where}: the glob matches {odd} files; it must match only .parquet or .arrow"
            )
        return None
    path = Path(where).expanduser()
    if path.is_dir():
        return None
    if path.is_file():
        if path.suffix.lower() in SHARD_SUFFIXES:
            return None
        return (
            f"hf:{where}: a {path.suffix or 'suffix-less'} file; hf: reads .parquet / .arrow "
            "files and dataset folders (give a .jsonl or .parquet file as data.source directly)"
        )
    if _is_hub_name(where):
        return None if hub_snapshot(where) is not None else _not_cached(where)
    return (
        f"hf:{where}: no such folder or file; give a datasets.save_to_disk folder, a folder or "
        "glob of .parquet/.arrow shards, or a hub dataset name cached on this host"
    )


def _base_and_rest(where: str) -> tuple[str, str]:
    """`where` as a base folder (or hub name) and the rest under it, from the string alone: a
    glob's folders before its first pattern, a shard file's folder, else all of it."""
    if _GLOB.search(where):
        parts = Path(where).parts
        first = next(i for i, part in enumerate(parts) if _GLOB.search(part))
        return str(Path(*parts[:first])) if first else ".", str(Path(*parts[first:]))
    if Path(where).suffix.lower() in SHARD_SUFFIXES:
        return str(Path(where).parent), Path(where).name
    return where, ""


def hf_files(where: str, *, forbidden: Iterable[str | Path | None] = ()) -> dict[str, Path]:
    """The files `hf:<where>` reads, by their path under its base folder (`_base_and_rest`): a
    copy of them in a folder D reads as `hf:<hf_where_in(where, D)>`, the same dataset. A hub
    name's base is its cached snapshot, whose links into the repo's `blobs/` are followed.

    Nothing outside the base folder (the hub repo folder for a snapshot) is ever returned: a link
    that leads out, a special file, a file in a `forbidden` folder raise `EscapingPath`
    (`areal.data.contained`)."""
    problem = hf_spec_error(where)
    if problem:
        raise FileNotFoundError(problem)
    base_s, rest = _base_and_rest(where)
    base = Path(base_s).expanduser()
    if not base.is_dir():  # a hub name (hf_spec_error found its snapshot)
        snap = hub_snapshot(where)
        assert snap is not None
        base = snap
    within = share_root(base)
    if _GLOB.search(where):
        picked = []
        for p in _glob_files(where):
            if p.is_dir() and not p.is_symlink():
                continue  # `**` matches folders too; their files match on their own
            picked.append(check_contained_file(p, within=within, forbidden=forbidden))
    else:
        target = base / rest if rest else base
        picked = (
            contained_files(target, within=within, forbidden=forbidden)
            if target.is_dir()
            else [check_contained_file(target, within=within, forbidden=forbidden)]
        )
    return {p.relative_to(base).as_posix(): p for p in picked}


def hf_where_in(where: str, copy_dir: Path | str) -> str:
    """What `hf:` names for a copy of `hf_files(where)` in `copy_dir` (no file system read)."""
    rest = _base_and_rest(where)[1]
    return str(Path(copy_dir) / rest) if rest else str(copy_dir)


@contextlib.contextmanager
def _offline_and_quiet(datasets: Any) -> Iterator[None]:
    """No network (HF_HUB_OFFLINE, as the libraries read it at call time) and no progress bars."""
    import huggingface_hub.constants as hub_constants

    saved = datasets.config.HF_HUB_OFFLINE, hub_constants.HF_HUB_OFFLINE
    bars = not datasets.are_progress_bars_disabled()
    datasets.config.HF_HUB_OFFLINE = hub_constants.HF_HUB_OFFLINE = True
    datasets.disable_progress_bars()
    try:
        yield
    finally:
        datasets.config.HF_HUB_OFFLINE, hub_constants.HF_HUB_OFFLINE = saved
        if bars:
            datasets.enable_progress_bars()


def _pick_split(obj: Any, where: str, split: str) -> Any:
    """A `DatasetDict`'s split (a plain `Dataset` is taken whole)."""
    if not hasattr(obj, "keys"):
        return obj
    if split not in obj:
        raise ValueError(
            f"hf:{where} has no split {split!r} (splits: {sorted(obj)}); set data.split "
            "(data.eval_split for data.eval_source)"
        )
    return obj[split]


def _load(where: str, split: str, subset: str | None) -> Any:
    """The `datasets.Dataset` that `hf:<where>` names (module docstring)."""
    try:
        import datasets
    except ImportError:
        raise ImportError(
            f"data.source hf:{where} needs the datasets package: pip install 'areal-bus[data]'"
        ) from None
    problem = hf_spec_error(where)
    if problem:
        raise FileNotFoundError(problem)
    cache = str(_datasets_cache_dir())
    with _offline_and_quiet(datasets):
        if _GLOB.search(where) or Path(where).expanduser().is_file():
            files = [str(p) for p in _glob_files(where)]
            builder = "parquet" if files[0].lower().endswith(".parquet") else "arrow"
            return datasets.load_dataset(
                builder, data_files={split: files}, split=split, cache_dir=cache
            )
        folder = Path(where).expanduser()
        if not folder.is_dir():  # a hub name: its cached snapshot (hf_spec_error checked it)
            snap = hub_snapshot(where)
            assert snap is not None
            folder = snap
        if (folder / "dataset_dict.json").is_file() or (folder / "state.json").is_file():
            return _pick_split(datasets.load_from_disk(str(folder)), where, split)
        try:
            return datasets.load_dataset(str(folder), name=subset, split=split, cache_dir=cache)
        except ValueError as e:  # an unknown split or subset: the library lists the choices
            knob = "data.subset" if "BuilderConfig" in str(e) else "data.split / data.eval_split"
            raise ValueError(f"hf:{where}: {e} (set {knob})") from None


def _json_data(value: Any) -> bool:
    if value is None or isinstance(value, (str, bool, int, float)):
        return True
    if isinstance(value, list):
        return all(_json_data(v) for v in value)
    if isinstance(value, dict):
        return all(isinstance(k, str) and _json_data(v) for k, v in value.items())
    return False


def hf_records(
    where: str, *, split: str, subset: str | None, prompt_field: str, answer_field: str
) -> list[Record]:
    """Every row of `hf:<where>`'s split as a validated record (module invariants)."""
    ds = _load(where, split, subset)
    for col in (prompt_field, answer_field):
        if col not in ds.column_names:
            raise ValueError(
                f"hf:{where} (split {split!r}): no {col!r} column (columns: {ds.column_names}); "
                "set data.prompt_field / data.answer_field"
            )
    records = []
    for row, rec in enumerate(ds.to_list()):
        rec = {k: v for k, v in rec.items() if _json_data(v)}
        extra = {"source": f"hf:{where}", "split": split, "row": row}
        where_row = f"hf:{where} (split {split!r}) row {row}"
        records.append(record_of(rec, prompt_field, answer_field, where_row, extra))
    if not records:
        raise ValueError(f"hf:{where} (split {split!r}) has no rows")
    return records

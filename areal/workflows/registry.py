"""One registry for workflows: `single_turn`, `tool_call`, or `pkg.mod:Name` (a class built
as `Name(ctx, **workflow_kwargs)` whose `arun_episode` returns an `Episode`)."""

from __future__ import annotations

import inspect
from typing import Any

from areal.config import ConfigError
from areal.user_code import CWD_RULE, import_user_module
from areal.workflows.api import RolloutWorkflow
from areal.workflows.context import WorkflowContext

BUILTIN = {
    "single_turn": "areal.workflows.single_turn:SingleTurn",
    "tool_call": "areal.workflows.tool_call:ToolCall",
}


def resolve_workflow_class(spec: str) -> type:
    """The class `spec` names; `ConfigError` naming `rollout.workflow` and the fix."""
    target = BUILTIN.get(spec, spec)
    mod_name, sep, attr = target.partition(":")
    if not sep or not mod_name or not attr:
        raise ConfigError(
            f"config error: rollout.workflow={spec!r}: one of {', '.join(BUILTIN)}, or "
            "'pkg.module:ClassName' (a class with `async arun_episode(gen, task, sample_idx)`)"
        )
    try:
        obj: Any = import_user_module(mod_name)
    except ImportError as e:
        raise ConfigError(
            f"config error: rollout.workflow={spec!r}: cannot import {mod_name} ({e}); looked "
            f"in the {CWD_RULE}: run from the directory that holds it, or add its directory "
            "to PYTHONPATH"
        ) from None
    for part in attr.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            raise ConfigError(f"config error: rollout.workflow={spec!r}: {target} not found")
    run = getattr(obj, "arun_episode", None)
    if not inspect.isclass(obj) or run is None or not inspect.iscoroutinefunction(run):
        raise ConfigError(
            f"config error: rollout.workflow={spec!r}: {target} is not a class with an "
            "`async def arun_episode(self, gen, task, sample_idx)`"
        )
    return obj


def make_workflow(spec: str, ctx: WorkflowContext, kwargs: dict[str, Any]) -> RolloutWorkflow:
    cls = resolve_workflow_class(spec)
    try:
        return cls(ctx, **kwargs)
    except TypeError as e:
        raise ConfigError(
            f"config error: rollout.workflow_kwargs {sorted(kwargs)} do not fit {spec} ({e})"
        ) from None

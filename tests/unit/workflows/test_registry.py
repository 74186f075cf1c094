"""`rollout.workflow`: a built-in name or `pkg.mod:Name`, refused at start with the field and
the fix; a module next to where the run starts is found (the same rule as reward functions)."""

from __future__ import annotations

import sys

import pytest

from areal.config import ConfigError
from areal.workflows.context import WorkflowContext
from areal.workflows.registry import make_workflow, resolve_workflow_class
from areal.workflows.single_turn import SingleTurn


def ctx() -> WorkflowContext:
    return WorkflowContext(decode=lambda ids: "", encode=lambda text: [], max_new_tokens=4)


def test_builtins_and_specs_resolve():
    assert resolve_workflow_class("single_turn") is SingleTurn
    assert resolve_workflow_class("areal.workflows.single_turn:SingleTurn") is SingleTurn
    assert resolve_workflow_class("tool_call").__name__ == "ToolCall"


@pytest.mark.parametrize(
    ("spec", "why"),
    [
        ("multi_turn", "one of single_turn, tool_call"),
        ("no_such_module_xyz:Flow", "cannot import no_such_module_xyz"),
        ("areal.workflows.single_turn:Nope", "not found"),
        ("areal.workflows.api:ENV_VERSION", "not a class with an `async def arun_episode"),
    ],
)
def test_a_bad_spec_names_the_setting_and_the_fix(spec, why):
    with pytest.raises(ConfigError, match="rollout.workflow") as e:
        resolve_workflow_class(spec)
    assert why in str(e.value)


def test_kwargs_that_do_not_fit_are_a_config_error():
    with pytest.raises(ConfigError, match="workflow_kwargs"):
        make_workflow("single_turn", ctx(), {"temperature": 2})


def test_a_module_in_the_working_directory_is_found(tmp_path, monkeypatch):
    (tmp_path / "my_flow_mod.py").write_text(
        "class Flow:\n"
        "    def __init__(self, ctx, n=1):\n        self.n = n\n"
        "    async def arun_episode(self, gen, task, sample_idx):\n        raise NotImplementedError\n"
    )
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    assert make_workflow("my_flow_mod:Flow", ctx(), {"n": 3}).n == 3

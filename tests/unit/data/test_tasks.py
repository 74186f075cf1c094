"""Synthetic tasks: deterministic random access, well-formed answers, long-tailed lengths."""

from __future__ import annotations

import collections
import json

import pytest

from areal.config import DataSettings
from areal.data.sources import make_source
from areal.data.tasks import (
    ArithmeticTask,
    RunningSumTask,
    TaskItem,
    TaskSource,
    ToolArithmeticTask,
)
from areal.rewards.synthetic import arithmetic_reward, running_sum_reward, tool_arithmetic_reward
from areal.tools.calc import calc
from areal.tools.formats import TagsFormat
from areal.workflows.api import ToolCallRecord


def test_arithmetic_items_are_correct_and_deterministic():
    task = ArithmeticTask(seed=3)
    for i in (0, 1, 17, 10**6, len(task) - 1):
        item = task.get(i)
        assert item == ArithmeticTask(seed=3).get(i)
        a, b = item.prompt[:-1].split("+")
        assert item.prompt.endswith("=") and int(a) + int(b) == int(item.answer)
        assert 0 <= int(a) <= 99 and 0 <= int(b) <= 99
        assert item.index == i and item.metadata["target"] == item.answer
        assert arithmetic_reward(item.metadata["target"], item.answer) == 1.0


def test_seed_changes_the_stream():
    a = [ArithmeticTask(seed=0).get(i).prompt for i in range(20)]
    b = [ArithmeticTask(seed=1).get(i).prompt for i in range(20)]
    assert a != b


def test_arithmetic_ops_and_digits():
    task = ArithmeticTask(seed=0, min_digits=3, max_digits=3, ops="-*")
    for i in range(50):
        item = task.get(i)
        op = item.metadata["op"]
        a, b = item.metadata["a"], item.metadata["b"]
        assert op in "-*" and 100 <= a <= 999 and 100 <= b <= 999
        assert int(item.answer) == (a - b if op == "-" else a * b)
        assert item.prompt == f"{a}{op}{b}="


@pytest.mark.parametrize(
    "kwargs", [{"min_digits": 0}, {"min_digits": 3, "max_digits": 2}, {"ops": "/"}]
)
def test_arithmetic_bad_args(kwargs):
    with pytest.raises(ValueError):
        ArithmeticTask(**kwargs)


def test_tool_arithmetic_items_and_their_demonstration_are_what_the_tool_writes():
    """The warm start's target is the transcript the `tool_call` workflow builds: the model's
    call in the tags format, the calc tool's result as the workflow appends it, the answer."""
    fmt = TagsFormat()
    task = ToolArithmeticTask(seed=0)
    for i in (0, 1, 17, 10**6):
        item = task.get(i)
        assert item == ToolArithmeticTask(seed=0).get(i)
        expr = item.metadata["expr"]
        a, rest = expr.split("*")
        b, c = rest.split("+")
        assert 10 <= int(a) <= 99 and 10 <= int(b) <= 99 and 0 <= int(c) <= 99
        assert item.prompt == f"{expr}=" and int(item.answer) == int(a) * int(b) + int(c)
        call = fmt.call_text("calc", expr)
        (parsed,) = fmt.parse(call).calls
        result = fmt.render_result(ToolCallRecord("calc", parsed.arguments, calc(parsed.arguments)))
        assert item.metadata["target"] == call + result + item.answer
        # the sample's text as the rollout decodes it (the stop token dropped) earns the reward
        assert tool_arithmetic_reward(call[:-1] + result + item.answer, item.answer) == 1.0
    assert ToolArithmeticTask(seed=0, digits=1).get(0).prompt[1] == "*"
    with pytest.raises(ValueError):
        ToolArithmeticTask(digits=0)


def test_running_sum_items():
    task = RunningSumTask(seed=0)
    for i in range(200):
        item = task.get(i)
        terms = [int(t) for t in item.prompt[:-1].split(" ")]
        sums = [int(s) for s in item.metadata["target"].split(" ")]
        assert item.prompt.endswith(":")
        assert sums == [sum(terms[: k + 1]) for k in range(len(terms))]
        assert item.answer == str(sum(terms)) and item.metadata["n_terms"] == len(terms)
        assert all(0 <= t <= 9 for t in terms) and 1 <= len(terms) <= 12
        assert running_sum_reward(item.metadata["target"], item.answer) == 1.0
    assert task.get(5) == RunningSumTask(seed=0).get(5)


def test_running_sum_lengths_are_long_tailed():
    task = RunningSumTask(seed=0)
    counts = collections.Counter(task.get(i).metadata["n_terms"] for i in range(4000))
    n = sum(counts.values())
    assert counts[1] / n > 0.4  # most tasks are short
    assert sum(counts[k] for k in (1, 2, 3)) / n > 0.7
    assert sum(counts[k] for k in range(8, 13)) / n > 0.03  # but a real tail exists
    assert max(counts) == 12


def test_index_out_of_range():
    with pytest.raises(IndexError):
        ArithmeticTask().get(-1)


def _source(spec: str, seed: int, **task_kwargs):
    """`spec` from the one factory, as `data.source` with `data.task_kwargs`."""
    return make_source(spec, DataSettings(source=spec, task_kwargs=task_kwargs), seed)


def test_the_factory_makes_synthetic_tasks_with_their_options():
    src = _source("synthetic:arithmetic", 2, max_digits=1)
    assert isinstance(src, TaskSource) and src.name == "synthetic:arithmetic"
    assert src.get(4) == ArithmeticTask(seed=2, max_digits=1).get(4)
    assert isinstance(_source("synthetic:running_sum", 0), RunningSumTask)
    assert _source("synthetic:tool_arithmetic", 0, digits=1).get(0).prompt[1] == "*"


def test_the_factory_makes_file_sources(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps({"prompt": "1+1=", "answer": "2"}) + "\n")
    item = _source(str(path), 0).get(3)
    assert isinstance(item, TaskItem) and (item.prompt, item.answer) == ("1+1=", "2")


@pytest.mark.parametrize(
    ("spec", "match"), [("synthetic:nope", "unknown synthetic task"), ("data.csv", "jsonl")]
)
def test_the_factory_rejects_unknown_specs(spec, match):
    with pytest.raises(ValueError, match=match):
        _source(spec, 0)

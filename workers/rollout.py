"""Rollout replica: generates samples with per-token behaviour log-probs and versions."""

from __future__ import annotations

import sys
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from areal.bus.client import Bus
from areal.config import RunSettings
from areal.config_views import RolloutView, fields_from
from areal.launch.worker import RoleSpec, resolve_model_path
from areal.launch.worker import main as worker_main

if TYPE_CHECKING:  # heavy: imported inside build() at run time
    from areal.services.rollout import RolloutService


@dataclass(frozen=True)
class RolloutParts:
    view: RolloutView
    engine: Any  # areal.engines.base.InferenceEngine
    params: Any  # areal.engines.base.SamplingParams
    decode_text: Callable[[list[int]], str]
    eval_plan: Any  # areal.services.evaluation.EvalPlan | None
    workflow: Any  # areal.workflows.api.RolloutWorkflow


def prepare(settings: RunSettings, worker_id: str) -> RolloutParts:
    import torch

    from areal.data.prompts import stop_token_ids
    from areal.data.tokenizer import load_tokenizer
    from areal.engines.base import InferenceEngineConfig, SamplingParams
    from areal.engines.factory import make_inference_engine

    view = RolloutView.of(settings)
    r = view.rollout
    torch.set_num_threads(r.torch_threads)
    path = resolve_model_path(settings)
    tok = load_tokenizer(path)
    stop_ids = stop_token_ids(tok, path, view.prompt.stop)
    engine = make_inference_engine(
        InferenceEngineConfig(
            kind=r.engine,
            model_path=path,
            dtype=view.model.dtype,
            device=view.model.device,
            max_batch_size=r.max_batch_size,
            seed=(view.seed * 1_000_003 + zlib.crc32(worker_id.encode())) % (2**31),
        )
    )
    params = SamplingParams(
        max_new_tokens=r.max_new_tokens,
        temperature=r.temperature,
        top_p=r.top_p,
        stop_token_ids=stop_ids,
    )

    def decode_text(ids: list[int]) -> str:
        return tok.decode([t for t in ids if t not in stop_ids], skip_special_tokens=True)

    return RolloutParts(
        view, engine, params, decode_text, eval_plan(view, tok, params), _workflow(r, tok, params)
    )


def _workflow(r: Any, tok: Any, params: Any) -> Any:
    """`rollout.workflow` built with the run's tokenizer and episode budget."""
    from areal.workflows.context import WorkflowContext
    from areal.workflows.registry import make_workflow

    stop_ids = tuple(params.stop_token_ids)
    ctx = WorkflowContext(
        decode=lambda ids: tok.decode([t for t in ids if t not in stop_ids]),
        encode=lambda text: tok.encode(text, add_special_tokens=False),
        max_new_tokens=r.max_new_tokens,
        max_turns=r.max_turns,
        max_episode_tokens=r.episode_tokens,
        stop_token_ids=stop_ids,
        tokenizer=tok,
    )
    return make_workflow(r.workflow, ctx, dict(r.workflow_kwargs))


def eval_plan(view: RolloutView, tok: Any, params: Any) -> Any:
    """The held-out set rendered as the controller renders tasks, or None without eval (also
    what `areal eval` scores a model dir with: `areal.launch.evaluate`)."""
    if view.eval.every_versions == 0:
        return None
    from dataclasses import replace

    from areal.data.prompts import PromptBuilder
    from areal.data.sources import held_out_source
    from areal.services.evaluation import EvalItem, EvalPlan

    held_out = held_out_source(view.data, view.seed)
    if held_out is None:
        raise ValueError(
            "eval.every_versions is set but the run has no held-out set: set data.eval_size "
            "(items held out of the training data) or data.eval_source"
        )
    prompts = PromptBuilder(view.prompt, tok)
    items = [held_out.get(i) for i in range(len(held_out))]
    return EvalPlan(
        every_versions=view.eval.every_versions,
        items=[EvalItem(prompts.ids(it), it.answer) for it in items],
        params=replace(
            params,
            temperature=view.eval.temperature,
            max_new_tokens=view.eval.max_new_tokens or params.max_new_tokens,
        ),
        reward_fn=view.reward_fn,
        timeout_s=view.reward_timeout_s,
    )


def scheduler_policy(view: RolloutView) -> Any:
    """The scheduler's knobs: `rollout.interruptible`, `.interrupt_min_interval_s`,
    `.needed_first` and η (`algo.max_staleness`)."""
    from areal.core.scheduling import SchedulerPolicy

    return fields_from(SchedulerPolicy, view.rollout, view)


def build(parts: RolloutParts, bus: Bus) -> RolloutService:
    from areal.core.validate import Bounds
    from areal.services.evaluation import Evaluator
    from areal.services.rollout import RolloutService

    v = parts.view
    r = v.rollout
    return RolloutService(
        bus,
        parts.engine,
        parts.decode_text,
        parts.params,
        policy=scheduler_policy(v),
        max_concurrent_tasks=r.max_concurrent_tasks,
        evaluator=Evaluator(parts.eval_plan) if parts.eval_plan is not None else None,
        workflow=parts.workflow,
        bounds=Bounds.with_model(
            parts.engine,
            run_id=bus.names.run_id,
            group_size=v.group_size,
            **r.sample_limits(),
        ),
    )


SPEC = RoleSpec("rollout", prepare, build)


def main(argv: list[str] | None = None) -> int:
    return worker_main(SPEC, argv)


if __name__ == "__main__":
    sys.exit(main())

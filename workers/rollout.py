"""Rollout replica: generates samples with per-token behaviour log-probs and versions."""

from __future__ import annotations

import sys
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from areal.bus.client import Bus
from areal.config import RunSettings
from areal.config_views import RolloutView
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


def prepare(settings: RunSettings, worker_id: str) -> RolloutParts:
    import torch

    from areal.data.tokenizer import load_tokenizer
    from areal.engines.base import InferenceEngineConfig, SamplingParams
    from areal.engines.factory import make_inference_engine

    view = RolloutView.of(settings)
    r = view.rollout
    torch.set_num_threads(r.torch_threads)
    path = resolve_model_path(settings)
    tok = load_tokenizer(path)
    stop_ids = (tok.eos_token_id,)
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

    return RolloutParts(view, engine, params, decode_text)


def build(parts: RolloutParts, bus: Bus) -> RolloutService:
    from areal.core.scheduling import SchedulerPolicy
    from areal.engines.torch_infer import weights_from_safetensors
    from areal.services.rollout import RolloutService

    r = parts.view.rollout
    return RolloutService(
        bus,
        parts.engine,
        parts.decode_text,
        parts.params,
        policy=SchedulerPolicy(
            interruptible=r.interruptible, interrupt_min_interval_s=r.interrupt_min_interval_s
        ),
        max_concurrent_tasks=r.max_concurrent_tasks,
        weights_from_bytes=weights_from_safetensors,
    )


SPEC = RoleSpec("rollout", prepare, build)


def main(argv: list[str] | None = None) -> int:
    return worker_main(SPEC, argv)


if __name__ == "__main__":
    sys.exit(main())

"""Rollout replica: generates samples with per-token behaviour log-probs and versions."""

from __future__ import annotations

import sys
import zlib

from areal.launch.worker import main as worker_main
from areal.launch.worker import resolve_model_path


async def build(settings, bus, worker_id):
    import torch

    from areal.data.tokenizer import load_tokenizer
    from areal.engines.base import SamplingParams
    from areal.engines.factory import make_inference_engine
    from areal.engines.torch_infer import weights_from_safetensors
    from areal.services.rollout import RolloutService

    r = settings.rollout
    torch.set_num_threads(r.torch_threads)
    path = resolve_model_path(settings)
    tok = load_tokenizer(path)
    seed = (settings.seed * 1_000_003 + zlib.crc32(worker_id.encode())) % (2**31)
    kind_kw = {"device": settings.model.device} if r.engine == "torch" else {}
    engine = make_inference_engine(
        r.engine,
        model_path=path,
        dtype=settings.model.dtype,
        max_batch_size=r.max_batch_size,
        seed=seed,
        **kind_kw,
    )
    params = SamplingParams(
        max_new_tokens=r.max_new_tokens,
        temperature=r.temperature,
        top_p=r.top_p,
        stop_token_ids=(tok.eos_token_id,),
    )
    svc = RolloutService(
        bus,
        engine,
        tok,
        params,
        interruptible=r.interruptible,
        interrupt_min_interval_s=r.interrupt_min_interval_s,
        max_concurrent_tasks=r.max_concurrent_tasks,
        weights_from_bytes=weights_from_safetensors,
    )
    return svc.run


def main(argv: list[str] | None = None) -> int:
    return worker_main("rollout", build, argv)


if __name__ == "__main__":
    sys.exit(main())

"""RewardService scoring: batched pool calls, per-sample errors, a hanging scorer isolated."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from areal.services.reward import RewardService
from schemas import Sample
from schemas.subjects import RunNames
from tests.factories import make_sample

FN = "tests.unit.services.scorers:picky"


def sample(i: int, text: str, answer: str = "7") -> Sample:
    return make_sample(
        n=1,
        task_id=f"t{i}",
        task_seq=i,
        sample_idx=0,
        group_size=1,
        output_text=text,
        answer=answer,
    )


async def score_all(svc: RewardService, texts: list[str]) -> list[tuple[float, dict]]:
    return await asyncio.gather(*(svc.score(sample(i, t)) for i, t in enumerate(texts)))


@pytest.mark.asyncio
async def test_samples_arriving_together_share_one_pool_call():
    svc = RewardService(
        SimpleNamespace(worker_id="r", names=RunNames("r")), FN, timeout_s=20, pool_workers=1
    )
    try:
        texts = ["7", "8", " 7 ", "boom"] * 10
        out = await score_all(svc, texts)
        assert [r for r, _ in out] == [1.0, 0.0, 1.0, 0.0] * 10
        errors = [d.get("error") for _, d in out]
        assert errors[3] == "ValueError: scorer exploded" and errors[:3] == [None] * 3
        assert svc.n_errors == 10
        assert svc.heartbeat()["pool_calls"] == 2  # 40 samples, batch_size 32: 32 + 8
    finally:
        svc.close()


@pytest.mark.asyncio
async def test_a_hanging_scorer_costs_only_its_own_sample():
    svc = RewardService(
        SimpleNamespace(worker_id="r", names=RunNames("r")),
        FN,
        timeout_s=2.0,
        pool_workers=1,
        batch_size=8,
    )
    try:
        out = await score_all(svc, ["7", "hang", "7", "1"])
        assert [r for r, _ in out] == [1.0, 0.0, 1.0, 0.0]
        assert out[1][1]["error"] == "timeout after 2.0s"
        assert all("error" not in d for i, (_, d) in enumerate(out) if i != 1)
        # the pool still works
        assert (await svc.score(sample(9, "7")))[0] == 1.0
    finally:
        svc.close()

"""Reward replica: scores samples in a process pool and publishes scored samples."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

from areal.bus.client import Bus
from areal.config import RunSettings
from areal.config_views import RewardView
from areal.launch.worker import RoleSpec
from areal.launch.worker import main as worker_main

if TYPE_CHECKING:  # heavy: imported inside build() at run time
    from areal.services.reward import RewardService


def prepare(settings: RunSettings, worker_id: str) -> RewardView:
    from areal.rewards.registry import get_reward_fn

    view = RewardView.of(settings)
    get_reward_fn(view.fn)  # a bad reward spec fails before connecting
    return view


def build(view: RewardView, bus: Bus) -> RewardService:
    from areal.services.reward import OverlongShaping, RewardService

    r, ro = view.reward, view.rollout
    shaping = None
    if ro.overlong == "penalty":
        shaping = OverlongShaping(ro.max_new_tokens, ro.overlong_buffer, ro.overlong_penalty)
    from areal.core.validate import Bounds

    bounds = Bounds(run_id=bus.names.run_id, group_size=view.group_size, **ro.sample_limits())
    return RewardService(
        bus,
        view.fn,
        timeout_s=r.timeout_s,
        pool_workers=r.pool_workers,
        batch_size=r.batch_size,
        overlong=shaping,
        bounds=bounds,
        score_range=view.score_range,
    )


SPEC = RoleSpec("reward", prepare, build)


def main(argv: list[str] | None = None) -> int:
    return worker_main(SPEC, argv)


if __name__ == "__main__":
    sys.exit(main())

"""Reward replica: scores samples in a process pool and publishes scored samples."""

from __future__ import annotations

import sys

from areal.launch.worker import main as worker_main


async def build(settings, bus, worker_id):
    from areal.services.reward import RewardService

    svc = RewardService(
        bus,
        settings.reward_fn_name(),
        timeout_s=settings.reward.timeout_s,
        pool_workers=settings.reward.pool_workers,
        batch_size=settings.reward.batch_size,
    )
    return svc.run


def main(argv: list[str] | None = None) -> int:
    return worker_main("reward", build, argv)


if __name__ == "__main__":
    sys.exit(main())

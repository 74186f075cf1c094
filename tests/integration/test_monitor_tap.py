"""`areal tap` on a real pipeline: it sees every message and disturbs nothing; `areal plot` on
the same real run dir.

One real run (`areal run ... --nats-url`, 6 steps) is tapped in-process on `prompts` and
`trajectories` (core subscriptions, the tap's own code path) from before its first message.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest

from areal.bus.tap import TapClient
from areal.monitor.tap import Tap, TapItem
from schemas import subjects as S

# Slow: a real 4-process run (~20 s on 2 cores; the first run on a machine also builds the cached
# warm-start model, ~1 min).
# The timeout covers that first build on a busy machine.
pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(900)]

REPO = Path(__file__).resolve().parents[2]
STEPS = 6


@dataclass
class TappedRun:
    run_id: str
    out: Path
    summary: dict
    config: dict
    items: dict[str, list[TapItem]]
    taps: dict[str, Tap]
    consumers: dict[str, int]


async def _run_with_tap(url: str, run_id: str, out: Path) -> TappedRun:
    client = await TapClient.connect(url, run_id)
    items: dict[str, list[TapItem]] = {S.PROMPTS: [], S.TRAJECTORIES: []}
    taps = {s: Tap(emit=None, on_item=items[s].append) for s in items}
    for stream, tap in taps.items():  # a core subscription needs no stream: tap before the run
        await client.follow(stream, tap.on_message)
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "areal.cli",
        "run",
        str(REPO / "examples" / "arithmetic.yaml"),
        "--nats-url",
        url,
        "--set",
        f"run_id={run_id}",
        "--set",
        f"train.total_steps={STEPS}",
        "--quiet",
        "--out",
        str(out),
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    log, _ = await asyncio.wait_for(proc.communicate(), 800)
    assert proc.returncode == 0, log.decode()[-3000:]
    await asyncio.sleep(0.5)  # let the last core deliveries land
    stats = await client.stream_stats()
    consumers = {s: stats[s].consumers for s in S.WORK_QUEUE_STREAMS}
    await client.close()
    return TappedRun(
        run_id,
        out,
        json.loads((out / "summary.json").read_text()),
        json.loads((out / "config.json").read_text()),
        items,
        taps,
        consumers,
    )


@pytest.fixture(scope="module")
def tapped_run(nats_server, tmp_path_factory) -> TappedRun:
    run_id = f"t{uuid.uuid4().hex[:10]}"
    return asyncio.run(_run_with_tap(nats_server.url, run_id, tmp_path_factory.mktemp("run")))


def test_tap_receives_every_prompt_and_every_sample(tapped_run):
    summary, items = tapped_run.summary, tapped_run.items
    G = tapped_run.config["algo"]["group_size"]
    task_ids = {it.msg.task_id for it in items[S.PROMPTS]}
    sample_ids = {it.msg.sample_id for it in items[S.TRAJECTORIES]}
    assert summary["admitted"] > 0
    assert len(task_ids) == summary["admitted"]
    assert len(sample_ids) == summary["admitted"] * G
    # the tap already de-duplicated by Nats-Msg-Id: what it counted are distinct messages
    assert tapped_run.taps[S.PROMPTS].n == len(task_ids)
    assert tapped_run.taps[S.TRAJECTORIES].n == len(sample_ids)
    assert {s.rsplit("/", 1)[0] for s in sample_ids} == task_ids
    assert all(
        it.record["kind"] == "sample" and it.record["output_ids"]["len"] >= 0
        for it in items[S.TRAJECTORIES]
    )


def test_tap_disturbs_nothing(tapped_run):
    s = tapped_run.summary
    assert s["admitted"] == s["trained"] + s["dropped_stale"] + s["filtered"]
    assert s["in_flight"] == 0 and s["steps"] == STEPS
    # no second consumer was ever attached to a work queue: only each stage's durable one
    assert tapped_run.consumers == {stream: 1 for stream in S.WORK_QUEUE_STREAMS}
    # nothing was held back on the way: each group reached the tap right after the rollout
    # worker stamped its last sample finished (publish follows at once)
    last_finished: dict[int, float] = {}  # group message -> its last sample's finish time
    for it in tapped_run.items[S.TRAJECTORIES]:
        t = it.msg.timings["finished_at"]
        last_finished[id(it.tm)] = max(last_finished.get(id(it.tm), t), t)
    lags = sorted(
        it.tm.received_at - last_finished[id(it.tm)] for it in tapped_run.items[S.TRAJECTORIES]
    )
    assert lags[0] > -0.05, lags[:5]  # same host clock
    # typically milliseconds; the bound is loose so a loaded machine that deschedules the tap
    # or the worker for a while does not fail it, yet a group held back is still caught
    assert lags[-1] < 5.0, lags[-5:]


def test_plot_on_the_real_run_dir(tapped_run, capsys):
    import matplotlib.image as mpimg

    from areal.cli import main

    assert main(["plot", str(tapped_run.out)]) == 0
    printed = [Path(p) for p in capsys.readouterr().out.split()]
    names = {p.name for p in printed}
    assert {"reward.png", "staleness.png", "throughput.png", "idle.png"} <= names
    for p in printed:
        assert p.parent == tapped_run.out / "plots"
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        img = mpimg.imread(p)
        assert img.ndim == 3 and img.shape[0] > 100 and img.std() > 0, p

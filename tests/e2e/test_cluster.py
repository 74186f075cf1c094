"""A three-node NATS JetStream cluster that loses a node mid-run (`nats.replicas=3`).

Three local nats-servers (`EmbeddedCluster`, external to the launcher) hold the run's streams,
consumers and buckets in three copies. One node, the leader of the run's prompts stream (the
JetStream meta leader when that cannot be read), is SIGKILLed mid-run and stays dead: the
workers fail over to the two others, re-issue their pulls, retry their publishes with the same
message ids through the election, and the run finishes with exact accounting, no task trained
twice and no worker restarted. The longest gap between step records around the kill (the
workers' stall) is printed: it is measured, not asserted (no clock decides anything here but
the generous hang guards)."""

from __future__ import annotations

import asyncio
import json
import time

import pytest

from tests.e2e.test_run import check_invariants, records, start_run, wait_steps

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(1200)]

KILL_AFTER_STEP = 8


def _leader_of_prompts(cluster, run_id: str) -> str | None:
    """The server name leading the run's prompts stream (None if it cannot be read)."""
    from areal.bus.connection import Patience, connect
    from schemas import subjects as S
    from schemas.subjects import RunNames

    async def look() -> str | None:
        nc = await connect(cluster.url, "test-leader", patience=Patience(first_connect_s=10))
        try:
            info = await nc.jetstream().stream_info(RunNames(run_id).stream(S.PROMPTS))
            return info.cluster.leader if info.cluster else None
        finally:
            await nc.close()

    try:
        return asyncio.run(asyncio.wait_for(look(), 30))
    except Exception:  # noqa: BLE001 - fall back to the meta leader
        return None


@pytest.mark.slow  # a 24-step run on a 3-node cluster, one node killed: ~2 minutes on 2 cores
def test_a_cluster_node_killed_mid_run_costs_no_worker_and_no_sample(tmp_path):
    from areal.bus.embedded import EmbeddedCluster

    cluster = EmbeddedCluster(tmp_path / "cluster").start()
    out = tmp_path / "run"
    proc = start_run(
        out,
        "run_id=cluster1",
        "train.total_steps=24",
        "nats.ack_wait_s=4",
        f"nats.url={cluster.url}",
        "nats.replicas=3",
    )
    try:
        wait_steps(proc, out, KILL_AFTER_STEP)
        victim = _leader_of_prompts(cluster, "cluster1") or cluster.meta_leader()
        assert victim is not None
        meta = cluster.meta_leader()
        cluster.kill(cluster.index_of(victim))
        killed_at = time.time()
        _, err = proc.communicate(timeout=900)  # hang guard
    finally:
        if proc.poll() is None:
            proc.kill()
        cluster.stop()
    assert proc.returncode == 0, err.decode()[-3000:]
    summary = check_invariants(out, eta=4, B=16)
    assert summary["steps"] == 24
    assert "worker_restarted" not in err.decode()  # the launcher restarted no worker
    for log in (out / "logs").glob("*.log"):
        assert "worker_failed" not in log.read_text(), log.name
    recs = records(out)
    seen: dict[int, int] = {}
    for r in recs:  # nothing trained twice: each task in at most one step
        for seq in r["task_seqs"]:
            assert seq not in seen, (seq, seen.get(seq), r["step"])
            seen[seq] = r["step"]
    # the stall: the largest gap between consecutive step records after the kill's step
    gaps = [
        (recs[i]["wall_s"] - recs[i - 1]["wall_s"], recs[i]["step"]) for i in range(1, len(recs))
    ]
    stall, at_step = max(g for g in gaps if g[1] > KILL_AFTER_STEP)
    before = [g for g, step in gaps if step < KILL_AFTER_STEP]
    report = {
        "killed": victim,
        "meta_leader_before": meta,
        "stall_s": round(stall, 2),
        "stall_before_step": at_step,
        "typical_gap_s": round(sorted(before)[len(before) // 2], 2) if before else None,
        "killed_at_wall": round(killed_at, 1),
    }
    print("cluster_node_kill", json.dumps(report))
    (tmp_path / "cluster_stall.json").write_text(json.dumps(report))

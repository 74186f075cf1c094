"""`areal metrics-exporter`: Prometheus gauges for one run, from its metrics stream.

The gauges are a pure function of a RunState (`families`); a custom collector serves the latest
snapshot, swapped in whole by the asyncio loop, so a scrape (on prometheus_client's HTTP thread)
never sees a half-updated state and workers that went away simply stop being exported.
Uses its own registry (no process/platform collectors mixed in).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Iterable
from typing import Any

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from areal.bus.auth import NO_CREDENTIALS, Credentials
from areal.monitor.state import RunState

# name -> (help, step-record key)
STEP_GAUGES: dict[str, tuple[str, str]] = {
    "areal_train_step": ("last completed training step", "step"),
    "areal_reward_mean": ("mean reward of the last step's batch", "reward_mean"),
    "areal_staleness_max": ("max sample staleness (versions) in the last step", "staleness_max"),
    "areal_dropped_stale_total": ("groups dropped as too stale, run total", "dropped_stale"),
    "areal_filtered_total": ("groups filtered (zero advantage), run total", "filtered"),
    "areal_loss": ("policy loss of the last step", "loss"),
    "areal_approx_kl": ("approximate KL of the last step", "approx_kl"),
    "areal_clipfrac": ("PPO clip fraction of the last step", "clipfrac"),
    "areal_interrupted_fraction": (
        "fraction of the last step's samples interrupted by a weight update",
        "interrupted_frac",
    ),
    "areal_weights_publish_seconds": ("time to publish the last weights", "weights_publish_s"),
    "areal_trainer_wait_seconds": ("time the trainer waited for the last batch", "wait_s"),
    "areal_train_seconds": ("time of the last update", "train_s"),
    "areal_batch_generation_seconds": (
        "first task received -> last sample finished, of the last step's batch",
        "gen_span_s",
    ),
    "areal_batch_tail_seconds": (
        "median task finished -> last sample finished, of the last step's batch",
        "tail_s",
    ),
    "areal_batch_ready_age_seconds": (
        "last sample finished -> the trainer took the batch, of the last step",
        "ready_age_s",
    ),
    "areal_wall_seconds": ("trainer wall time since the run started", "wall_s"),
}


def _gauge(name: str, doc: str, value: float | None) -> GaugeMetricFamily | None:
    return None if value is None else GaugeMetricFamily(name, doc, value=float(value))


def _labelled(
    name: str, doc: str, labels: list[str], rows: Iterable[tuple[list[str], Any]]
) -> GaugeMetricFamily:
    g = GaugeMetricFamily(name, doc, labels=labels)
    for lv, v in rows:
        if v is not None:
            g.add_metric(lv, float(v))
    return g


def families(st: RunState, now: float) -> list[GaugeMetricFamily]:
    last = st.last_step or {}
    out: list[GaugeMetricFamily | None] = [
        _gauge("areal_policy_version", "latest policy version", st.version),
        _gauge("areal_step_rate", "training steps per second (recent)", st.step_rate()),
        _gauge(
            "areal_run_finished", "1 once the run_finished event was seen", 1 if st.finished else 0
        ),
    ]
    out += [_gauge(name, doc, last.get(key)) for name, (doc, key) in STEP_GAUGES.items()]
    for key, name in (
        ("admitted", "areal_admitted_tasks"),
        ("outstanding", "areal_outstanding_tasks"),
        ("capacity", "areal_admission_capacity"),
    ):
        out.append(_gauge(name, f"controller admission: {key}", st.admission.get(key)))
    wt = st.weight_times(now)
    out.append(
        _gauge(
            "areal_weights_load_seconds",
            "mean rollout weight load time per load",
            wt["load_mean_s"],
        )
    )
    tp = st.throughput(now)
    out.append(
        _labelled(
            "areal_samples_per_second",
            "samples per second by role",
            ["role"],
            (([r], v[0]) for r, v in tp.items()),
        )
    )
    out.append(
        _labelled(
            "areal_tokens_per_second",
            "generated tokens per second by role",
            ["role"],
            (([r], v[1]) for r, v in tp.items()),
        )
    )
    live = st.live_workers(now)
    out.append(
        _labelled(
            "areal_live_workers",
            "workers heard from recently, by role",
            ["role"],
            (([r], len(ws)) for r, ws in live.items()),
        )
    )
    out.append(
        _labelled(
            "areal_busy_fraction",
            "fraction of wall time a worker was busy",
            ["role", "worker"],
            (
                ([w.role, w.worker_id], w.values.get("busy_frac"))
                for ws in live.values()
                for w in ws
            ),
        )
    )
    out.append(
        _labelled(
            "areal_queue_depth",
            "messages stored in a stream",
            ["stream"],
            (([s], q["messages"]) for s, q in st.queues.items()),
        )
    )
    out.append(
        _labelled(
            "areal_ack_pending",
            "delivered, unacknowledged messages of a stage",
            ["stream"],
            (([s], q.get("ack_pending")) for s, q in st.queues.items()),
        )
    )
    out.append(
        _labelled(
            "areal_consumer_pending",
            "messages not yet delivered to a stage",
            ["stream"],
            (([s], q.get("pending")) for s, q in st.queues.items()),
        )
    )
    out.append(
        _labelled(
            "areal_dlq_messages",
            "dead letters by stage",
            ["stage"],
            (([s], n) for s, n in st.dlq_counts().items()),
        )
    )
    out.append(
        _labelled(
            "areal_staleness_samples",
            "trained samples by staleness, run total",
            ["lag"],
            (([str(k)], n) for k, n in st.staleness_totals().items()),
        )
    )
    return [f for f in out if f is not None]


class SnapshotCollector(Collector):
    def __init__(self) -> None:
        self.snapshot: list[GaugeMetricFamily] = []

    def collect(self) -> Iterable[GaugeMetricFamily]:
        return list(self.snapshot)


def make_registry() -> tuple[CollectorRegistry, SnapshotCollector]:
    registry = CollectorRegistry(auto_describe=False)
    collector = SnapshotCollector()
    registry.register(collector)
    return registry, collector


async def run_exporter(
    url: str,
    run_id: str,
    *,
    port: int,
    addr: str,
    interval_s: float,
    writers: list | None = None,
    credentials: Credentials | None = None,
) -> int:
    from areal.bus.tap import TapClient
    from areal.monitor.live import attach, check_server, note, refresh

    client = await TapClient.connect(
        url, run_id, name="areal-exporter", note=note, credentials=credentials or NO_CREDENTIALS
    )
    writers = writers or []
    try:
        await client.check_run()
        st = RunState()
        await attach(client, st, step_history=True, traffic=True)  # run totals need all steps
        registry, collector = make_registry()
        server, _thread = start_http_server(port, addr=addr, registry=registry)
        print(
            f"serving Prometheus metrics of run {run_id} on http://{addr}:{port}/metrics",
            flush=True,
        )
        logged = 0
        try:
            while True:
                check_server(client, "metrics-exporter")  # stale gauges would look live
                with contextlib.suppress(Exception):
                    await refresh(client, st)
                collector.snapshot = families(st, time.time())
                for rec in [r for r in st.step_records() if r["step"] > logged]:
                    for w in writers:
                        w.log(rec)
                    logged = rec["step"]
                await asyncio.sleep(interval_s)
        finally:
            server.shutdown()
            for w in writers:
                w.close()
    finally:
        await client.close()

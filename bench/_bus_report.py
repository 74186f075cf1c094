"""Part 3 of the bus benchmark: the markdown tables, the profile section and the plot.

Pure formatting of what `_bus_load.bus_bench` and `_bus_profile.profile_run` measured: every
table cell is the median over repeats (or runs), best throughput in brackets.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Literal

from _bus_load import CONSUMER_MAX_INFLIGHT, PUBLISH_CONCURRENCY, BusResults
from _bus_profile import Profile, ProfileMode, RunProfile, pipeline_rate
from _common import md_table, median

MI = CONSUMER_MAX_INFLIGHT


def bus_table(
    sizes: Sequence[int], bus_res: BusResults, codec: dict[int, tuple[float, float, int]]
) -> str:
    """One row per message size: size, codec cost, latency, publish / consume / end-to-end rates."""
    rows = []
    for s in sizes:
        r = bus_res[s]
        nbytes = r["bytes"][0]
        pub, d4, d64 = (median(r[k]) for k in ("publish", f"drain{MI}", "drain64"))
        e2e = min(pub, d4)
        rows.append(
            [
                s,
                f"{nbytes / 1024:.0f}",
                f"{codec[s][0]:.0f} / {codec[s][1]:.0f}",
                f"{median(r['lat_p50_ms']):.2f}",
                f"{median(r['lat_p99_ms']):.2f}",
                f"{pub:.0f} ({max(r['publish']):.0f})",
                f"{d4:.0f} ({max(r[f'drain{MI}']):.0f})",
                f"{d64:.0f} ({max(r['drain64']):.0f})",
                f"{e2e * nbytes / 2**20:.0f} / {min(pub, d64) * nbytes / 2**20:.0f}",
                f"{e2e * s / 1e6:.2f} / {min(pub, d64) * s / 1e6:.2f}",
            ]
        )
    return md_table(
        [
            "gen tokens",
            "msg KiB",
            "encode / decode µs",
            "latency p50 ms",
            "latency p99 ms",
            "publish msg/s",
            f"consume msg/s, max_inflight {MI}",
            "consume msg/s, max_inflight 64",
            f"end-to-end MiB/s (inflight {MI} / 64)",
            f"end-to-end M tokens/s (inflight {MI} / 64)",
        ],
        rows,
    )


def run_line(i: int, res: RunProfile) -> str:
    """One progress line per profiled run: wall, samples/s, bus+codec+weights share per worker."""
    mean_rate, _ = pipeline_rate(res["metrics"])
    shares = ", ".join(
        f"{w}: {sum(v for k, v in p['cats'].items() if k != 'other') / p['wall']:.2%}"
        for w, p in res["profiles"].items()
    )
    return f"  run {i}: {res['launcher_wall_s']:.1f}s, {mean_rate:.0f} samples/s, {shares}"


def _share(p: Profile, cats: Sequence[str], denom: Literal["wall", "nonidle"] = "wall") -> float:
    return sum(p["cats"].get(c, 0) for c in cats) / max(1, p[denom])


def _profile_table(
    results: list[RunProfile], rate: int
) -> tuple[str, dict[str, Counter[tuple[str, str]]]]:
    prof_rows = []
    hot_all: dict[str, Counter[tuple[str, str]]] = defaultdict(Counter)
    for wid in ("rollout-0", "trainer-0"):
        profs = [r["profiles"][wid] for r in results if wid in r["profiles"]]
        if not profs:
            continue
        for p in profs:
            hot_all[wid].update(p["hot"])
        prof_rows.append(
            [
                wid,
                f"{median([p['ticks'] / rate for p in profs]):.1f}",
                f"{median([p['empty'] / max(1, p['ticks']) for p in profs]):.0%}",
                f"{median([p['nonidle'] / p['wall'] for p in profs]):.0%}",
                f"{median([_share(p, ['codec']) for p in profs]):.2%}",
                f"{median([_share(p, ['bus']) for p in profs]):.2%}",
                f"{median([_share(p, ['codec', 'bus']) for p in profs]):.2%}",
                f"{median([_share(p, ['weights']) for p in profs]):.2%}",
                f"{median([_share(p, ['codec', 'bus', 'weights'], 'nonidle') for p in profs]):.2%}",
            ]
        )
    table = md_table(
        [
            "worker",
            "profiled wall s",
            "ticks without a stack",
            "busy (non-idle samples / wall)",
            "codec % of wall",
            "bus msg % of wall",
            "**bus + codec % of wall**",
            "weights I/O % of wall",
            "all bus code % of busy samples",
        ],
        prof_rows,
    )
    return table, hot_all


def _need_table(results: list[RunProfile], bus_res: BusResults) -> tuple[str, float]:
    rates = [pipeline_rate(r["metrics"]) for r in results]
    need = median([m for m, _ in rates])
    peak = median([p for _, p in rates])
    r1k = bus_res[1024]
    bus_1k = min(median(r1k["publish"]), median(r1k[f"drain{MI}"]))
    bus_1k_64 = min(median(r1k["publish"]), median(r1k["drain64"]))
    table = md_table(
        [
            "profiled run: samples/s (mean)",
            "p90 per-step samples/s",
            "bus msg/s, 1k-token Samples",
            "**ratio (bus / mean need)**",
            "ratio vs p90 step",
        ],
        [
            [
                f"{need:.0f}",
                f"{peak:.0f}",
                f"{bus:.0f} (consumer max_inflight {mi})",
                f"**{bus / need:.1f}x**",
                f"{bus / peak:.1f}x",
            ]
            for bus, mi in ((bus_1k, MI), (bus_1k_64, 64))
        ],
    )
    return table, need


def flusher_note(extra: Sequence[str], weights_bytes: int, versions: int) -> str:
    """What the trainer's nats-py flusher writes, for the profile section."""
    note = (
        "The nats-py flusher (`Client._flusher > TcpTransport.writelines`) writes every outgoing "
        "byte of a connection, so its time is counted as bus msg"
    )
    if "weights.transport=file" in extra:
        return note + " (weights go to files here, so its bytes are acks, pulls and metrics).\n"
    return note + (
        f"; in the trainer those bytes are mostly weights: {weights_bytes / 2**20:.1f} MiB of "
        f"safetensors per version x {versions} versions ({weights_bytes * versions / 2**20:.0f} "
        "MiB) against ~100 B per ack / heartbeat.\n"
    )


def profile_section(
    results: list[RunProfile],
    bus_res: BusResults,
    *,
    steps: int,
    rate: int,
    mode: ProfileMode,
    extra: Sequence[str],
) -> tuple[str, float]:
    """The markdown of parts 2 and 3, and the pipeline's mean samples/s (the plot's red line)."""
    prof_table, hot_all = _profile_table(results, rate)
    need_table, need = _need_table(results, bus_res)
    gen_len = median(
        [
            sum(x["tokens"] for x in r["metrics"]) / sum(x["samples"] for x in r["metrics"])
            for r in results
        ]
    )
    hot_lines = []
    for wid, hot in hot_all.items():
        tot = sum(p["wall"] for r in results for w, p in r["profiles"].items() if w == wid)
        top = ", ".join(
            f"{name} [{cat}] {n / max(1, tot):.2%}" for (cat, name), n in hot.most_common(6)
        )
        hot_lines.append(f"- {wid}: {top}")
    text = (
        f"\n## Share of a real run's wall time in bus + codec code\n\n"
        f"`areal run examples/arithmetic.yaml --out <tmp> --quiet --set "
        f"train.total_steps={steps}"
        + "".join(f" --set '{kv}'" for kv in extra)
        + f"`, {len(results)} run(s), py-spy {rate} Hz "
        f"(`--{mode} --threads`; gil: a stack counts only while it holds the GIL, "
        f"so waits for the GIL held by the generate/train thread are not billed to the bus; "
        f"idle: every thread always, an upper bound) attached to each worker from its "
        f"`*_started` log line to its exit; median over runs. codec = stacks in "
        f"`areal/bus/codec.py`, msgpack, `schemas/`, pydantic (incl. building `Sample`s); bus "
        f"msg = other `areal/bus/` + `nats/` stacks (publish, pull, ack, heartbeats, KV); "
        f"weights I/O = `Bus.get_weights`/`put_weights` incl. the object-store weights "
        f"connection's thread, the file write and sha256 "
        f"(bus code too, but bulk transfer, reported apart).\n\n{prof_table}\n\n"
        f"Top bus/codec stacks, outermost > innermost bus/codec frame (share of that worker's wall, "
        f"all runs):\n\n"
        + "\n".join(hot_lines)
        + "\n\n"
        + flusher_note(extra, results[0]["weights_bytes"], steps + 1)
        + "\n## Bus throughput vs what the pipeline needs\n\n"
        f"Samples/s of the same runs from `metrics.jsonl` (sum of samples / final wall_s; "
        f"mean generated length {gen_len:.1f} tokens). Each sample crosses the bus twice "
        f"(trajectories, rewards), plus one prompt per {8} samples.\n\n{need_table}\n"
    )
    return text, need


def markdown(header: str, table: str, prof_section: str, png: str) -> str:
    """The whole `bus<tag>.md` report."""
    return (
        "# Bus benchmark\n\n"
        + header
        + "\n\n## Sample messages through the trajectories stream\n\n"
        + "Latency: closed loop (one message in flight), from before `Bus.publish` (encode "
        "included) to after the consumer's handler has the decoded `Sample` and acked it "
        f"(consumer `max_inflight` {MI}). Publish: `Bus.publish` alone "
        f"(consumer paused), {PUBLISH_CONCURRENCY} in flight, each awaiting its JetStream ack. "
        "Consume: a separate process drains that backlog with `Bus.consume` (decode + ack), "
        f"`max_inflight` {MI} (the reward worker's default, "
        "4 x pool_workers) and 64. End-to-end = min(publish, consume). encode/decode: "
        "in-process codec cost per message.\n\n"
        + table
        + "\n"
        + prof_section
        + f"\n![latency and throughput vs size]({png})\n"
    )


def plot(path: Path, sizes: Sequence[int], bus_res: BusResults, need: float | None) -> None:
    """Latency (p50, p99) and throughput (publish, consume) against the message size."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 4))
    p50 = [median(bus_res[s]["lat_p50_ms"]) for s in sizes]
    p99 = [median(bus_res[s]["lat_p99_ms"]) for s in sizes]
    a1.plot(sizes, p50, "o-", label="p50")
    a1.plot(sizes, p99, "s--", label="p99")
    a1.set_xscale("log", base=2)
    a1.set_xlabel("generated tokens per Sample")
    a1.set_ylabel("publish -> consumed + acked (ms)")
    a1.set_title("Bus latency (closed loop, median of reps)")
    a1.grid(True, alpha=0.3)
    a1.legend()
    mi = MI
    for key, label, style in (
        ("publish", "publish (64 in flight)", "o-"),
        (f"drain{mi}", f"consume, max_inflight {mi} (reward default)", "s-"),
        ("drain64", "consume, max_inflight 64", "^--"),
    ):
        a2.plot(sizes, [median(bus_res[s][key]) for s in sizes], style, label=label)
    if need:
        a2.axhline(need, color="r", ls=":", label=f"arithmetic run needs {need:.0f}/s")
    a2.set_xscale("log", base=2)
    a2.set_yscale("log")
    a2.set_xlabel("generated tokens per Sample")
    a2.set_ylabel("Samples / s")
    a2.set_title("Bus throughput (median of reps)")
    a2.grid(True, alpha=0.3, which="both")
    a2.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)

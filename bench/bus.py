"""Bus benchmark: what the message bus costs, and whether it can keep up with the pipeline.

1. Publish-to-consume latency (p50/p99) and throughput of real `Sample` messages with 1k, 8k and
   32k generated tokens through a real `EmbeddedNats`, the run's real `trajectories` work-queue
   stream and the real codec: `Bus.publish` (encode + JetStream publish awaiting its ack) in this
   process, `Bus.consume` + lease ack in a separate consumer process (as the reward worker does).
   Latency = from just before `Bus.publish` (encode included) to just after the consumer's
   handler got the decoded `Sample` and acked it (both ends read CLOCK_MONOTONIC). Latency is
   measured closed-loop (one message in flight); throughput open-loop (up to 64 publishes in
   flight, like the rollout's publish-per-finished-sample, consumer `max_inflight` as the reward
   worker's default, 4).
2. The share of a real run's wall time spent in bus + codec code: `areal run
   examples/arithmetic.yaml --set train.total_steps=30`, with `py-spy record --idle --threads`
   attached to the rollout and the trainer worker as soon as each logs that it started.
   Samples whose stack has a frame in `areal/bus/`, `nats/`, `msgpack`, `schemas/` or pydantic
   count as bus + codec; share of wall = those samples / main-thread samples (py-spy --idle
   samples every thread at every tick, so main-thread samples = ticks).
3. The pipeline's need: samples/s of the run (metrics.jsonl: samples / wall_s), against the
   bus throughput of 1k-token samples (the run's samples are ~3 tokens, so this is conservative).

    python bench/bus.py [--quick]

Layout: `_bus_load.py` (part 1), `_bus_profile.py` (part 2, py-spy and the billing of stacks),
`_bus_report.py` (tables, plot); this file is the command line.

No timing assertions: it prints a machine header, the command and markdown tables, and writes
`bus.md` and `bus.png` in the results dir
(bench/_common.py).
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import sys
from pathlib import Path

_HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(_HERE), str(_HERE.parent)]  # bench/_common.py, bench/_bus_*.py, the repo


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer messages, one profiled run")
    ap.add_argument("--reps", type=int, default=None, help="repeats of the bus measurements")
    ap.add_argument("--runs", type=int, default=None, help="profiled `areal run`s")
    ap.add_argument("--steps", type=int, default=30, help="train.total_steps of profiled runs")
    ap.add_argument("--rate", type=int, default=200, help="py-spy samples per second")
    ap.add_argument(
        "--profile-mode",
        choices=("gil", "idle"),
        default="gil",
        help="gil: count code only while it holds the GIL (default); idle: count every thread "
        "always, including waits for the GIL inside bus code (an upper bound)",
    )
    ap.add_argument("--no-profile", action="store_true", help="skip the profiled runs")
    ap.add_argument("--keep-profiles", type=Path, default=None, help="copy raw py-spy output here")
    ap.add_argument(
        "--set",
        dest="extra",
        action="append",
        default=[],
        help="extra override for the profiled runs, e.g. model.preset=small",
    )
    ap.add_argument("--tag", default="", help="suffix of the output files, e.g. _small")
    ap.add_argument("--_consumer", nargs=2, help=argparse.SUPPRESS)  # the consumer process
    return ap.parse_args(argv)


def _has_pyspy() -> bool:
    return bool(shutil.which("py-spy") or (Path(sys.executable).parent / "py-spy").exists())


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args._consumer:
        from _bus_load import consumer_main

        asyncio.run(consumer_main(*args._consumer))
        return 0

    import torch
    from _bus_load import (
        CONSUMER_MAX_INFLIGHT,
        PUBLISH_CONCURRENCY,
        SIZES,
        bus_bench,
        codec_cost_us,
    )
    from _bus_profile import profile_run
    from _bus_report import bus_table, markdown, plot, profile_section, run_line
    from _common import RESULTS_DIR, machine_header, write_result

    torch.set_num_threads(1)
    reps = args.reps or (1 if args.quick else 3)
    runs = args.runs or (1 if args.quick else 3)
    n_lat = {1024: 1000, 8192: 600, 32768: 300}
    n_tput = {1024: 1500, 8192: 600, 32768: 200}
    if args.quick:
        n_lat = {k: v // 5 for k, v in n_lat.items()}
        n_tput = {k: v // 5 for k, v in n_tput.items()}

    header = machine_header(
        {
            "bus": f"nats-server (EmbeddedNats, file storage), nats-py, consumer in its own process "
            f"with max_inflight {CONSUMER_MAX_INFLIGHT}, publisher {PUBLISH_CONCURRENCY} in flight",
            "repeats": f"{reps} per size (table: median of reps; best throughput in brackets)",
        }
    )
    print("# Bus benchmark\n")
    print(header + "\n", flush=True)

    print("codec micro-benchmark (in process) ...", flush=True)
    codec = {s: codec_cost_us(s, 400 if s <= 1024 else 100 if s <= 8192 else 30) for s in SIZES}
    print("bus round trips ...", flush=True)
    bus_res = asyncio.run(bus_bench(SIZES, reps, n_lat, n_tput))
    table = bus_table(SIZES, bus_res, codec)
    print("\n## Sample messages through the trajectories stream\n")
    print(table + "\n", flush=True)

    prof_section, need = "", None
    if not args.no_profile and not _has_pyspy():
        print("py-spy not found (`pip install py-spy`): skipping the profiled runs", flush=True)
        args.no_profile = True
    if not args.no_profile:
        print(f"profiling {runs} x `areal run` ({args.steps} steps) ...", flush=True)
        results = []
        for i in range(runs):
            keep = args.keep_profiles / f"run{i}" if args.keep_profiles else None
            results.append(profile_run(args.steps, args.rate, keep, args.profile_mode, args.extra))
            print(run_line(i, results[-1]), flush=True)
        prof_section, need = profile_section(
            results,
            bus_res,
            steps=args.steps,
            rate=args.rate,
            mode=args.profile_mode,
            extra=args.extra,
        )
        print(prof_section, flush=True)

    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    png = f"bus{args.tag}.png"
    plot(RESULTS_DIR / png, SIZES, bus_res, need)
    path = write_result(f"bus{args.tag}.md", markdown(header, table, prof_section, png))
    print(f"wrote {path} and {RESULTS_DIR / png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

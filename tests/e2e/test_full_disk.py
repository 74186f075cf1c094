"""A full disk mid-run (issue 42): `--out` on a small tmpfs that fills up while the run trains.

Everything of the run is on it: the trainer's weights, checkpoints and metrics, the worker
logs, and the embedded nats-server's store. The test fills the tmpfs to the last byte once
`metrics.jsonl` shows step `FILL_AT`, holds it full for `HOLD_S` seconds, then deletes the
filler. Nothing else is done to the run: the trainer pauses its writes (one `storage_full`
event, then `storage_recovered`), the launcher restarts the nats-server whose store hit the
full disk once there is room again, and the run finishes by itself (exit 0) with exact
accounting. The model cache is not on the tmpfs (it lives in the user's cache dir).

Afterwards the run's store is opened again to read its events: the pause is in the events
stream and in `areal top`'s state (the reducer over those events, and `areal top --once`).
The hold is the fault's length, not an assertion: nothing is decided by the wall clock but
generous hang guards."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import json
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from areal.data.warm_start import cache_root
from tests.e2e.test_run import ROOT, check_invariants, start_run, wait_steps

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(1200)]

TMPFS_MB = 256  # the run's out dir: a few tens of MB by the end of TOTAL_STEPS
TOTAL_STEPS, FILL_AT, HOLD_S = 30, 8, 6.0
PROBE_EVENTS, PROBE_PAD = 64, 2048  # what the store is made to write while the disk is full
RUN_ID = "arithmetic"  # the example's
EVENT_TYPES = ("storage_full", "write_failed", "storage_recovered", "run_finished")


@contextlib.contextmanager
def small_tmpfs(path: Path, size_mb: int):
    """A tmpfs of `size_mb` mounted at `path` (skip when that is not possible); always
    unmounted at the end."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root (mount -t tmpfs)")
    path.mkdir(parents=True, exist_ok=True)
    r = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size_mb}m", "tmpfs", str(path)],
        capture_output=True,
        text=True,
    )
    if r.returncode != 0:
        pytest.skip(f"mount -t tmpfs failed: {r.stderr.strip() or r.returncode}")
    try:
        yield path
    finally:
        for _ in range(50):  # a process of the run may still hold a file for a moment
            if subprocess.run(["umount", str(path)], capture_output=True).returncode == 0:
                break
            time.sleep(0.2)
        else:
            subprocess.run(["umount", "-l", str(path)], check=False)


def fill(path: Path) -> int:
    """Write `path` until the filesystem is full, to the last byte; returns the bytes written."""
    n = 0
    with open(path, "wb", buffering=0) as f:
        for size in (2**20, 2**12, 1):
            block = b"\0" * size
            while True:
                try:
                    n += f.write(block)
                except OSError as e:
                    assert e.errno == errno.ENOSPC, e
                    break
    return n


def make_the_store_write(out: Path, stop: threading.Event) -> threading.Thread:
    """While the disk is full, publish `PROBE_EVENTS` run events of `PROBE_PAD` bytes as the
    controller would (an event type no worker acts on): a paused run writes little, and its
    writes may all land in tmpfs pages the store's files already have, so without this the
    server's store fails only now and then. Publishes past the store's failure wait until
    `stop`; nothing here is asserted."""
    cfg = json.loads((out / "config.json").read_text())

    async def probe() -> None:
        from areal.bus.auth import load_credentials
        from areal.bus.client import Bus

        creds = load_credentials(Path(cfg["nats"]["credentials_dir"]) / "controller.json")
        bus = await Bus.connect(
            cfg["nats"]["url"],
            RUN_ID,
            "controller",
            "disk-probe",
            declare=False,
            credentials=creds,
        )
        try:
            for i in range(PROBE_EVENTS):
                await bus.event("disk_probe", i=i, pad="x" * PROBE_PAD)
        finally:
            await bus.close()

    def main() -> None:
        async def until_stopped() -> None:
            task = asyncio.ensure_future(probe())
            while not stop.is_set() and not task.done():
                await asyncio.sleep(0.1)
            task.cancel()
            with contextlib.suppress(BaseException):
                await task

        asyncio.run(until_stopped())

    t = threading.Thread(target=main, daemon=True)
    t.start()
    return t


def steps_done(out: Path) -> int:
    path = out / "metrics.jsonl"
    return len(path.read_text().splitlines()) if path.exists() else 0


async def read_events(out: Path) -> tuple[list, str]:
    """Every storage/finish event of the run, from its store reopened on a fresh server, in
    stream order; and `areal top --once` of that server."""
    from areal.bus.auth import load_credentials
    from areal.bus.embedded import EmbeddedNats
    from areal.bus.nats_config import authorization_block, ensure_accounts
    from areal.bus.tap import TapClient
    from areal.monitor.format import decode_for
    from schemas import subjects as S

    keys = out / "keys" / "nats"
    auth = authorization_block(ensure_accounts(keys, [RUN_ID]))
    server = EmbeddedNats(store_dir=out / "nats", authorization=auth).start()
    try:
        client = await TapClient.connect(
            server.url, RUN_ID, credentials=load_credentials(keys / "monitor.json")
        )
        events: list = []

        async def on_msg(tm) -> None:
            ev = decode_for(tm.subject, tm.data)
            if ev.type in EVENT_TYPES:
                events.append(ev)

        try:
            await client.follow(S.EVENTS, on_msg, history=-1)
            async with asyncio.timeout(60):  # hang guard: the run's last event is run_finished
                while not any(e.type == "run_finished" for e in events):
                    await asyncio.sleep(0.1)
        finally:
            await client.close()
        top = subprocess.run(
            [sys.executable, "-m", "areal.cli", "top", "--once", "--nats-url", server.url]
            + ["--run", RUN_ID, "--credentials", str(out)],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert top.returncode == 0, top.stderr[-2000:]
        return events, top.stdout
    finally:
        server.stop()


@pytest.mark.slow  # a 30-step run with a full disk for a few seconds: ~2-3 minutes on 2 cores
def test_a_full_disk_pauses_the_run_and_it_finishes_by_itself_once_space_returns(tmp_path):
    from areal.monitor.state import RunState
    from areal.monitor.top import storage_line

    with small_tmpfs(tmp_path / "small", TMPFS_MB) as mnt:
        cache = cache_root(os.environ.get("AREAL_CACHE_DIR")).resolve()
        assert not cache.is_relative_to(mnt.resolve()), "the model cache must not be on the tmpfs"
        out, filler = mnt / "run", mnt / "filler"
        t0 = time.monotonic()
        proc = start_run(
            out,
            f"train.total_steps={TOTAL_STEPS}",
            "train.checkpoint_every=1",  # a checkpoint (~5 MB) every step: the fill bites at once
            "nats.ack_wait_s=4",
        )
        try:
            wait_steps(proc, out, FILL_AT)
            filled = fill(filler)
            t_fill, at_fill = time.monotonic(), steps_done(out)
            stop_probe = threading.Event()
            probe = make_the_store_write(out, stop_probe)
            time.sleep(HOLD_S)  # the fault's length
            during = steps_done(out) - at_fill
            stop_probe.set()
            probe.join(60)  # hang guard
            filler.unlink()
            t_free = time.monotonic()
            _, err = proc.communicate(timeout=900)  # hang guard
            wall_s = time.monotonic() - t0
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        stderr = err.decode()
        assert proc.returncode == 0, stderr[-3000:]
        summary = check_invariants(out, eta=1, B=16)
        assert summary["steps"] == TOTAL_STEPS
        # one checkpoint in flight and nothing acked past it: the trainer went at most a step
        # past the fill (an append that still fit a page the file already had)
        assert during <= 1, during
        assert "worker_restarted" not in stderr  # no worker crashed for the full disk
        # the launcher saw its server's store fail and restarted it once there was room
        assert "cannot write its store" in stderr and "writes its store again" in stderr
        store_pause = re.search(r"writes its store again \(([\d.]+) s after the error", stderr)
        events, top = asyncio.run(read_events(out))
    mine = [e for e in events if e.type != "run_finished"]
    kinds = [e.type for e in mine]
    assert kinds and kinds[0] in ("storage_full", "write_failed") and "storage_recovered" in kinds
    first = mine[0]
    assert first.worker_id == "trainer-0" and first.detail["path"].startswith(str(out))
    recovered = next(e for e in mine if e.type == "storage_recovered")
    assert recovered.detail["since"] == first.detail["since"]
    # `areal top`'s state, folded event by event: paused after the first, clear after the last
    st = RunState(run_id=RUN_ID)
    st.fold(first)
    line = storage_line(st, now=first.time + 1.0)
    assert line is not None and line.startswith("paused: ") and str(out) in line
    for ev in events:
        st.fold(ev)
    assert st.storage_pause() is None
    assert "last storage pause" in top and "[finished]" in top
    print(
        f"\nfull disk: filled {filled / 2**20:.0f} MiB at step {at_fill}, held {HOLD_S:.0f} s "
        f"(freed {t_free - t_fill:.1f} s after); trainer paused "
        f"{recovered.detail['paused_s']} s over {recovered.detail['retries']} retries "
        f"({first.type}: {first.detail['what']} at {first.detail['path']}, needs "
        f"{first.detail['needs_bytes']} B); nats store paused "
        f"{store_pause.group(1) if store_pause else '?'} s; events {kinds}; "
        f"run {wall_s:.0f} s; summary "
        + json.dumps({k: summary[k] for k in ("steps", "admitted", "trained", "in_flight")})
        + f" dropped_stale {summary['dropped_stale']} filtered {summary['filtered']} "
        f"rejected {summary['rejected']}\ntop while paused: {line}\ntop after: "
        + " | ".join(ln.strip(" │") for ln in top.splitlines() if "storage pause" in ln)
        + "\nlauncher: "
        + " | ".join(ln for ln in stderr.splitlines() if "store" in ln)
    )

"""`areal run --nats-url URL` with no server at URL: one line naming the URL and the fix, a
non-zero exit in seconds, and `--out` as it was, so that the same command works once the
server is up. A launch that fails before any worker starts takes back what it wrote."""

from __future__ import annotations

import time

import pytest

from areal.bus.embedded import free_port
from areal.config import load_settings
from areal.launch.exit_codes import EXIT_CONFIG
from areal.launch.local import EXIT_NOT_FINISHED, Launcher


def _dead_url() -> str:
    return f"nats://127.0.0.1:{free_port()}"  # nothing listens there: connection refused


def _launcher(out, url: str | None = None, **kw) -> Launcher:
    sets = [f"out_dir={out}", "nats.outage_tolerance_s=2"]
    if url:
        sets.append(f"nats.url={url}")
    return Launcher(load_settings(None, sets), quiet=True, **kw)


@pytest.mark.parametrize("out_exists", [False, True], ids=["new-out", "empty-out"])
def test_an_unreachable_nats_url_fails_fast_in_one_line_and_leaves_out_alone(
    tmp_path, capsys, out_exists
):
    out = tmp_path / "run"
    if out_exists:
        out.mkdir()
    url = _dead_url()
    t0 = time.monotonic()
    rc = _launcher(out, url).run()
    took = time.monotonic() - t0
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == EXIT_CONFIG
    assert took < 15, took  # min(PROBE_S, nats.outage_tolerance_s) plus one connect attempt
    assert len(err) == 1 and url in err[0] and "omit it" in err[0], err
    # nothing was created: the same command can simply be run again
    assert out.is_dir() == out_exists
    assert not out_exists or not any(out.iterdir())


def test_resume_on_an_unreachable_server_leaves_the_run_as_it_was(tmp_path, capsys):
    out = tmp_path / "run"
    out.mkdir()
    (out / "config.json").write_text("{}")
    (out / "logs").mkdir()
    assert _launcher(out, _dead_url(), resume=True).run() == EXIT_CONFIG
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "logs"]
    assert "cannot connect to NATS" in capsys.readouterr().err


def test_a_launch_that_fails_before_any_worker_takes_back_what_it_wrote(
    tmp_path, monkeypatch, capsys
):
    out = tmp_path / "run"
    out.mkdir()
    (out / "notes.txt").write_text("mine")  # not a run artifact: --overwrite keeps it
    launcher = _launcher(out, overwrite=True)

    def prepare():  # as far as the launcher got: logs, keys, weights; then the server went
        for d in ("logs", "keys", "weights"):
            (out / d).mkdir()
        raise ConnectionError("cannot connect to NATS at nats://x:1: gone")

    monkeypatch.setattr(launcher, "prepare", prepare)
    assert launcher.run() == EXIT_NOT_FINISHED
    assert [p.name for p in out.iterdir()] == ["notes.txt"]
    assert capsys.readouterr().err.splitlines()[0].startswith("error: cannot connect to NATS")
    # a new dir that the launch created goes too
    fresh = tmp_path / "fresh"
    launcher = _launcher(fresh)
    monkeypatch.setattr(launcher, "prepare", lambda: (fresh / "logs").mkdir() or 1 / 0)
    with pytest.raises(ZeroDivisionError):  # a programming error still crashes loudly
        launcher.run()
    assert not fresh.exists()

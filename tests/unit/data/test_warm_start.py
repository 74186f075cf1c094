"""Warm start: builds a loadable model, caches it by key, reuses the cache, locks concurrent builds.

The default recipe's calibration (accuracy of the warm model) is measured by hand, not asserted
here: it takes ~15-60 s on a 2-core CPU (see `DEFAULT_RECIPES`).
"""

from __future__ import annotations

import dataclasses
import json
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from transformers import AutoModelForCausalLM, AutoTokenizer

from areal.data import warm_start
from areal.data.evaluate import evaluate_accuracy
from areal.data.tasks import ArithmeticTask
from areal.data.warm_start import cache_root, ensure_warm_model


def test_build_load_and_reuse(tmp_path):
    path = ensure_warm_model(sft_steps=3, seed=0, cache_dir=tmp_path)
    assert path.parent == tmp_path and path.is_dir()
    AutoModelForCausalLM.from_pretrained(str(path))
    assert AutoTokenizer.from_pretrained(str(path)).eos_token_id == 2
    meta = json.loads((path / "areal_warm_start.json").read_text())
    assert meta["recipe"]["steps"] == 3 and meta["final_loss"] > 0
    mtime = (path / "model.safetensors").stat().st_mtime_ns
    assert ensure_warm_model(sft_steps=3, seed=0, cache_dir=tmp_path) == path
    assert (path / "model.safetensors").stat().st_mtime_ns == mtime  # not rebuilt
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp-")]
    acc = evaluate_accuracy(path, ArithmeticTask(), n=16, temperature=1.0, seed=0)
    assert 0.0 <= acc <= 1.0
    assert evaluate_accuracy(path, ArithmeticTask(), n=16, temperature=1.0, seed=0) == acc


def test_cache_key_separates_recipes(tmp_path):
    a = ensure_warm_model(sft_steps=0, seed=0, cache_dir=tmp_path)
    b = ensure_warm_model(sft_steps=0, seed=1, cache_dir=tmp_path)
    c = ensure_warm_model(sft_steps=0, seed=0, cache_dir=tmp_path, task_kwargs={"max_digits": 1})
    assert len({a, b, c}) == 3 and all(p.parent == tmp_path for p in (a, b, c))


def test_the_task_is_part_of_the_cache_key(tmp_path):
    """The tool task's warm model is its own, never the arithmetic quickstart's."""
    a = ensure_warm_model("synthetic:arithmetic", sft_steps=0, seed=0, cache_dir=tmp_path)
    t = ensure_warm_model("synthetic:tool_arithmetic", sft_steps=0, seed=0, cache_dir=tmp_path)
    assert a != t and t.name.startswith("warm-tool_arithmetic-0-")
    meta = json.loads((t / "areal_warm_start.json").read_text())
    assert meta["task_spec"] == "synthetic:tool_arithmetic"


def test_cache_root_is_the_argument_else_the_home_default(tmp_path, monkeypatch):
    # the lookup reads no environment variable: AREAL_CACHE_DIR reaches it through the settings
    monkeypatch.setenv("AREAL_CACHE_DIR", str(tmp_path / "ignored"))
    assert cache_root(tmp_path) == tmp_path
    assert cache_root(str(tmp_path)) == tmp_path
    assert cache_root(None) == Path.home() / ".cache" / "areal-bus" / "models"


def test_concurrent_builds_agree(tmp_path):
    # flock locks belong to open file descriptions, so two threads exclude each other exactly
    # as two processes would (and threads start in milliseconds, processes in seconds).
    def build(_: int):
        return ensure_warm_model(sft_steps=2, seed=5, cache_dir=tmp_path)

    with ThreadPoolExecutor(2) as pool:
        paths = list(pool.map(build, range(2)))
    assert paths[0] == paths[1]
    built = [p for p in tmp_path.iterdir() if p.is_dir()]
    assert len(built) == 1


def test_presets_are_separate_cache_entries_with_their_dims(tmp_path, monkeypatch):
    from areal.config import ConfigError, load_settings
    from areal.data.tiny_model import PRESETS
    from areal.launch.worker import resolve_model_path

    tiny = ensure_warm_model(sft_steps=0, seed=0, cache_dir=tmp_path)
    small = ensure_warm_model(sft_steps=0, seed=0, cache_dir=tmp_path, preset=PRESETS["small"])
    assert tiny != small
    cfg = json.loads((small / "config.json").read_text())
    assert (cfg["hidden_size"], cfg["num_hidden_layers"]) == (256, 4)
    assert json.loads((small / "areal_warm_start.json").read_text())["preset"]["hidden_size"] == 256
    # the config knob reaches the same cache entry; AREAL_CACHE_DIR reaches it as settings.cache_dir
    monkeypatch.setenv("AREAL_CACHE_DIR", str(tmp_path))
    settings = load_settings(None, ["model.preset=small", "model.warm_start_steps=0"])
    assert resolve_model_path(settings) == str(small)
    with pytest.raises(ConfigError, match="model.preset"):
        load_settings(None, ["model.preset=huge"])


def test_label_smoothing_is_part_of_the_recipe_and_its_cache_key(tmp_path, monkeypatch):
    from areal.config import ConfigError, load_settings
    from areal.launch.worker import resolve_model_path

    kw = dict(sft_steps=0, seed=0, cache_dir=tmp_path, task_kwargs={"max_terms": 4})
    plain = ensure_warm_model("synthetic:running_sum", **kw)
    smoothed = ensure_warm_model("synthetic:running_sum", label_smoothing=0.1, **kw)
    assert plain != smoothed
    meta = json.loads((smoothed / "areal_warm_start.json").read_text())
    assert meta["recipe"]["label_smoothing"] == 0.1
    assert (
        json.loads((plain / "areal_warm_start.json").read_text())["recipe"]["label_smoothing"]
        == warm_start.DEFAULT_RECIPES["synthetic:running_sum"].label_smoothing
    )
    monkeypatch.setenv("AREAL_CACHE_DIR", str(tmp_path))
    settings = load_settings(
        None,
        [
            "data.source=synthetic:running_sum",
            "data.task_kwargs={max_terms: 4}",
            "model.warm_start_steps=0",
            "model.warm_start_label_smoothing=0.1",
        ],
    )
    assert resolve_model_path(settings) == str(smoothed)
    with pytest.raises(ConfigError, match="model.warm_start_label_smoothing"):
        load_settings(None, ["model.warm_start_label_smoothing=1.5"])


class _Recorder:
    """Stands in for the module's structlog logger: keeps (event, fields)."""

    def __init__(self) -> None:
        self.records: list[tuple[str, dict]] = []

    def info(self, event: str, **fields) -> None:
        self.records.append((event, fields))


def _hold_lock(path: Path, held: threading.Event, release: threading.Event) -> None:
    """Another builder: holds the lock (as `ensure_warm_model` does) until told to let go. flock
    locks belong to open file descriptions, so a thread excludes exactly as a process would."""
    with warm_start.build_lock(path, "warm-other-build"):
        held.set()
        release.wait(30)


def _lock_path(tmp_path: Path) -> Path:
    """The lock `ensure_warm_model(sft_steps=0, seed=0)` takes for the default task."""
    recipe = dataclasses.replace(warm_start.DEFAULT_RECIPES["synthetic:arithmetic"], steps=0)
    return tmp_path / f"warm-{warm_start.warm_key('synthetic:arithmetic', {}, recipe, 0)}.lock"


def test_a_lock_wait_names_the_holder_and_gives_up_in_time(tmp_path, monkeypatch):
    logs = _Recorder()
    monkeypatch.setattr(warm_start, "log", logs)
    lock = _lock_path(tmp_path)
    held, release = threading.Event(), threading.Event()
    holder = threading.Thread(target=_hold_lock, args=(lock, held, release))
    holder.start()
    try:
        assert held.wait(10)
        with pytest.raises(warm_start.WarmStartLockTimeout) as err:
            ensure_warm_model(
                sft_steps=0, cache_dir=tmp_path, lock_timeout_s=0.5, lock_progress_s=0.2
            )
    finally:
        release.set()
        holder.join(10)
    msg = str(err.value)
    assert f"gave up after 0.5 s waiting for the warm-start lock {lock}" in msg
    assert f"pid {os.getpid()}" in msg and "building warm-other-build" in msg
    waits = [fields for event, fields in logs.records if event == "warm_model_lock_wait"]
    assert len(waits) >= 2  # at once, then every lock_progress_s
    assert all("building warm-other-build" in w["holder"] for w in waits)
    assert [w["waited_s"] for w in waits] == sorted(w["waited_s"] for w in waits)
    assert not [p for p in tmp_path.iterdir() if p.is_dir()]  # nothing was built


def test_a_lock_released_in_time_is_taken_and_the_model_built(tmp_path, monkeypatch):
    logs = _Recorder()
    monkeypatch.setattr(warm_start, "log", logs)
    lock = _lock_path(tmp_path)
    held, release = threading.Event(), threading.Event()
    holder = threading.Thread(target=_hold_lock, args=(lock, held, release))
    holder.start()
    assert held.wait(10)
    threading.Timer(0.6, release.set).start()
    path = ensure_warm_model(
        sft_steps=0, cache_dir=tmp_path, lock_timeout_s=60, lock_progress_s=0.2
    )
    holder.join(10)
    assert path.is_dir()
    events = [event for event, _ in logs.records]
    assert events[0] == "warm_model_lock_wait" and "warm_model_lock_acquired" in events
    assert lock.read_text() == ""  # the holder's record goes with the lock


@pytest.mark.slow  # ~12 s on 2 cores: a fresh interpreter that builds a warm start
def test_a_cached_warm_start_is_found_without_importing_torch(tmp_path):
    """The launcher finds the cached model through this module before it spawns any worker:
    importing torch and transformers there cost seconds of every run's start-up."""
    import subprocess
    import sys

    code = f"""
import sys
from pathlib import Path
from areal.data.warm_start import ensure_warm_model
from areal.launch.local import Launcher  # the launcher's own imports, too
from areal.launch.worker import resolve_model_path
first = ensure_warm_model(sft_steps=0, cache_dir={str(tmp_path)!r})
heavy = sorted(m for m in ("torch", "transformers") if m in sys.modules)
second = ensure_warm_model(sft_steps=0, cache_dir={str(tmp_path)!r})
assert first == second, (first, second)
print(",".join(heavy) or "none")
"""
    # the first call builds (it may import torch); only the cached call must not
    build = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert build.returncode == 0, build.stderr[-2000:]
    cached = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert cached.returncode == 0, cached.stderr[-2000:]
    assert cached.stdout.strip() == "none"

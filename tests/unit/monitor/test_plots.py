"""`areal plot` helpers and output on a synthetic metrics.jsonl (real runs: integration tests)."""

from __future__ import annotations

import json

import pytest

from areal.monitor.plots import plot_run, rolling_mean, staleness_matrix, step_rates
from areal.monitor.writers import MissingExtra, _require, read_records, scalars


def records(n: int = 6) -> list[dict]:
    return [
        {
            "step": i,
            "wall_s": 0.5 * i,
            "reward_mean": 0.1 * i,
            "reward_std": 0.05,
            "samples": 64,
            "tokens": 128,
            "staleness_hist": {"0": 64 - i, str(1 + i % 2): i},
            "trainer_idle_frac": 0.5,
            "dropped_stale": i // 3,
            **({"eval_reward": 0.2} if i % 3 == 0 else {}),
        }
        for i in range(1, n + 1)
    ]


def test_step_rates_and_staleness_matrix():
    recs = records(3)
    # walls 0.5, 1.0, 1.5: each step took 0.5 s -> 128 samples/s
    assert step_rates(recs, "samples") == pytest.approx([128.0, 128.0, 128.0])
    lags, rows = staleness_matrix(recs)
    # step1: {0: 63, 2: 1}; step2: {0: 62, 1: 2}; step3: {0: 61, 2: 3}
    assert lags == [0, 1, 2]
    assert rows == [[63, 62, 61], [0, 2, 0], [1, 0, 3]]


def test_rolling_mean_is_trailing():
    # window 2: [1], [1, 3], [3, 5], [5, 7]
    assert rolling_mean([1.0, 3.0, 5.0, 7.0], 2) == [1.0, 2.0, 4.0, 6.0]
    assert rolling_mean([], 3) == []


def test_plot_run_writes_pngs_and_notes_missing_heartbeats(tmp_path):
    import matplotlib.image as mpimg

    (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in records()) + "\n{torn")
    paths, notes = plot_run(tmp_path)
    assert [p.name for p in paths] == ["reward.png", "staleness.png", "throughput.png", "idle.png"]
    assert all(p.parent == tmp_path / "plots" for p in paths)
    assert mpimg.imread(paths[0]).std() > 0
    assert len(notes) == 1 and "heartbeats.jsonl" in notes[0]
    hb = {
        "role": "rollout",
        "worker_id": "rollout-0",
        "type": "heartbeat",
        "values": {"busy_frac": 0.3},
    }
    (tmp_path / "heartbeats.jsonl").write_text(
        "\n".join(json.dumps({**hb, "time": 100.0 + t}) for t in range(3))
    )
    _, notes = plot_run(tmp_path, tmp_path / "other")
    assert notes == [] and (tmp_path / "other" / "idle.png").exists()


def test_plot_run_errors_name_the_fix(tmp_path):
    with pytest.raises(FileNotFoundError, match="--out dir"):
        plot_run(tmp_path)
    (tmp_path / "metrics.jsonl").write_text("")
    with pytest.raises(ValueError, match="no step records"):
        plot_run(tmp_path)


def test_writer_scalars_flatten_and_missing_extra_names_pip():
    rec = {"step": 3, "loss": 0.1, "done": True, "staleness_hist": {"0": 5}, "note": "x"}
    assert scalars(rec) == {"loss": 0.1, "done": 1.0, "staleness_hist/0": 5.0}
    with pytest.raises(MissingExtra, match=r"pip install 'areal-bus\[nope_extra\]'"):
        _require("areal_no_such_module_xyz", "nope_extra")


def test_read_records_skips_torn_lines(tmp_path):
    p = tmp_path / "m.jsonl"
    p.write_text('{"step": 1}\n{"st')
    assert read_records(p) == [{"step": 1}]

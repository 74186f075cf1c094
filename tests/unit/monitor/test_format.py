"""Tap formatting: arrays summarised, one readable line per message kind, field selection."""

from __future__ import annotations

import json

import pytest

from areal.bus.codec import encode, pack
from areal.bus.tap import TapMessage
from areal.monitor.format import decode_for, get_field, json_line, one_line, select, to_record
from areal.monitor.tap import Tap, load_detokenizer
from schemas import (
    DeadLetter,
    Event,
    MetricRecord,
    SampleGroup,
    ScoredGroup,
    ScoredSample,
    Task,
    WeightAnnouncement,
)
from tests.factories import make_sample


def test_sample_arrays_are_summarised_not_dumped():
    rec = to_record(make_sample(n=10))
    assert rec["output_ids"] == {"len": 10, "head": [0, 1, 2, 3, 4, 5]}
    # behav_logp = linspace(-2, -0.1, 10): mean -1.05
    assert rec["behav_logp"] == {"len": 10, "mean": pytest.approx(-1.05, abs=1e-4)}
    assert rec["versions"] == {"len": 10, "min": 2, "max": 2}
    assert rec["sample_id"] == "run-t3/1"
    json.dumps(rec)  # JSON-able as is
    line = one_line(rec)
    assert line.startswith("sample run-t3/1 by w v2..2 out=10tok[0,1,2,3,4,5,…]")
    assert "logp_mean=-1.05" in line and 'text="42"' in line


class CharTok:
    def decode(self, ids, skip_special_tokens=False):
        return "".join(chr(ord("a") + i) for i in ids)


def test_tokenizer_decodes_prompt_and_output():
    rec = to_record(make_sample(n=3), CharTok())
    assert rec["prompt_text"] == "fgh" and rec["output_decoded"] == "abc"
    assert 'prompt="fgh"' in one_line(rec) and 'text="abc"' in one_line(rec)


def test_one_line_per_kind():
    task = Task(
        task_id="r-t0",
        seq=0,
        dataset_index=0,
        prompt="1+1=",
        prompt_ids=pack([1, 2], "int32"),
        answer="2",
        group_size=4,
        admitted_version=3,
    )
    assert (
        one_line(to_record(task)) == 'task r-t0 seq=0 v3 G=4 prompt="1+1=" ids=2tok[1,2] answer="2"'
    )
    scored = ScoredSample(
        sample=make_sample(),
        reward=1.0,
        reward_worker_id="reward-0",
        verifier={"error": "timeout after 5s"},
    )
    line = one_line(to_record(scored))
    assert line.startswith('scored run-t3/1 reward=1 by reward-0 error="timeout after 5s" | by w')
    ann = WeightAnnouncement(
        version=4, uri="nats-obj://b/v4", sha256="ab" * 32, bytes=2_500_000, step=4
    )
    assert one_line(to_record(ann)) == (
        "weights v4 step=4 2.50 MB float32 sha256=abababababab nats-obj://b/v4"
    )
    hb = MetricRecord(
        role="rollout",
        worker_id="rollout-0",
        type="heartbeat",
        values={"busy_frac": 0.25, "version": 3},
    )
    assert one_line(to_record(hb)) == "metric rollout/rollout-0 heartbeat busy_frac=0.25 version=3"
    st = MetricRecord(
        role="trainer",
        worker_id="trainer-0",
        type="step",
        values={"step": 2, "reward_mean": 0.5, "grad_norm": 1.0},
    )
    assert "step=2" in one_line(to_record(st)) and "grad_norm" not in one_line(to_record(st))
    ev = Event(
        type="task_dropped_stale", role="trainer", worker_id="trainer-0", detail={"task_id": "r-t1"}
    )
    assert one_line(to_record(ev)) == "event task_dropped_stale trainer/trainer-0 task_id=r-t1"
    dl = DeadLetter(stage="rewards", reason="bad", subject="areal.r.rewards", payload=b"\x00" * 7)
    assert (
        one_line(to_record(dl)) == 'dlq rewards from ? on areal.r.rewards payload=7B reason="bad"'
    )


def test_fields_select_dotted_paths_and_metric_values():
    scored = to_record(ScoredSample(sample=make_sample(), reward=0.5))
    assert select(scored, ["reward", "sample.worker_id", "missing"]) == {
        "reward": 0.5,
        "sample.worker_id": "w",
        "missing": None,
    }
    metric = to_record(
        MetricRecord(role="trainer", worker_id="t", type="step", values={"loss": 0.1})
    )
    assert get_field(metric, "loss") == 0.1  # bare name finds values.loss
    assert one_line(metric, ["loss", "worker_id"]) == "metric loss=0.1 worker_id=t"
    assert json.loads(json_line(metric, ["loss"])) == {"loss": 0.1}


async def test_tap_decodes_by_subject_dedups_by_msg_id_and_stops_at_count():
    lines: list[str] = []
    tap = Tap(emit=lines.append, count=3)
    g = SampleGroup(samples=[make_sample(sample_idx=0, group_size=2), make_sample(group_size=2)])
    raw = encode(g)
    subj = "areal.r.trajectories"
    for _ in range(2):  # a retried publish: same Nats-Msg-Id twice
        await tap.on_message(TapMessage(subj, raw, g.msg_id(), 1.0))
    await tap.on_message(TapMessage(subj, b"junk", None, 2.0))
    await tap.on_message(TapMessage(subj, b"junk2", None, 3.0))  # past the count: not shown
    # a group message is shown as its samples, one line each
    assert tap.n == 3 and tap.duplicates == 1 and tap.done.is_set() and len(lines) == 3
    assert lines[0].startswith("sample run-t3/0") and lines[1].startswith("sample run-t3/1")
    assert lines[2].startswith("undecodable")
    assert decode_for(subj, raw) == g


async def test_tap_stops_inside_a_group_at_its_count():
    lines: list[str] = []
    tap = Tap(emit=lines.append, count=1)
    g = ScoredGroup(
        scored=[
            ScoredSample(sample=make_sample(sample_idx=i, group_size=2), reward=float(i))
            for i in range(2)
        ]
    )
    await tap.on_message(TapMessage("areal.r.rewards", encode(g), g.msg_id(), 1.0))
    assert tap.n == 1 and len(lines) == 1 and lines[0].startswith("scored")


async def test_tap_json_lines_carry_subject_and_receive_time():
    lines: list[str] = []
    tap = Tap(emit=lines.append, as_json=True)
    ev = Event(type="run_finished", role="trainer")
    await tap.on_message(
        TapMessage("areal.r.events.run_finished", encode(ev), ev.msg_id(), 12.5, 7)
    )
    rec = json.loads(lines[0])
    assert rec["subject"] == "areal.r.events.run_finished" and rec["seq"] == 7
    assert rec["received_at"] == 12.5 and rec["type"] == "run_finished"


def test_load_detokenizer_names_the_fix_when_no_tokenizer(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model": {"path": str(tmp_path / "m")}}))
    (tmp_path / "m").mkdir()
    with pytest.raises(FileNotFoundError, match="no tokenizer in"):
        load_detokenizer(str(tmp_path))

"""The trainer's files in `--out`: `metrics.jsonl` (one `StepRecord` per step),
`eval.jsonl` (one record per evaluation round) and `summary.json` (`RunSummary`).

Invariants:
- after a restart `metrics.jsonl` holds exactly the steps the checkpoint covers (`truncate`),
  so a step is never recorded twice nor skipped;
- an append that fails (a full disk) leaves the file as it was (`append_line` cuts a partial
  line off again), so the trainer can retry it (`areal.services.storage`) without tearing a
  record;
- `eval.jsonl` holds each evaluation round at most once, in arrival order (`EvalLog.add` skips
  a round it already has: the trainer replays the stream's eval records on every start).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from areal.services.checkpoints import write_text_atomic
from schemas.state import Accounting, RunSummary, StepRecord, TrainerState


class MetricsLog:
    def __init__(self, path: Path) -> None:
        self.path = path

    def append(self, rec: StepRecord) -> None:
        append_line(self.path, rec.model_dump_json(exclude_none=True))

    def records(self) -> list[dict]:
        if not self.path.exists():
            return []
        return [json.loads(ln) for ln in self.path.read_text().splitlines() if ln.strip()]

    def truncate(self, step: int) -> None:
        """Keep only the records of steps `<= step`; later steps will be redone."""
        recs = self.records()
        kept = [r for r in recs if r["step"] <= step]
        if len(kept) != len(recs):
            self.path.write_text("".join(json.dumps(r) + "\n" for r in kept))

    def reward_means(self) -> list[float]:
        return [float(r["reward_mean"]) for r in self.records()]


class EvalLog:
    def __init__(self, path: Path) -> None:
        self.path = path
        recs = self.records()
        if path.exists() and path.read_text() != "".join(json.dumps(r) + "\n" for r in recs):
            # a torn last line from a crash: drop it (its round is replayed) before appending
            write_text_atomic(path, "".join(json.dumps(r) + "\n" for r in recs))
        self.rounds = {r["round"] for r in recs}

    def records(self) -> list[dict]:
        if not self.path.exists():
            return []
        out = []
        for ln in self.path.read_text().splitlines():
            try:
                rec = json.loads(ln)
            except json.JSONDecodeError:
                continue
            if isinstance(rec, dict) and "round" in rec:
                out.append(rec)
        return out

    def add(self, values: dict) -> bool:
        """Append a round's record unless it is already there; True if appended."""
        if values["round"] in self.rounds:
            return False
        append_line(self.path, json.dumps(values))
        self.rounds.add(values["round"])
        return True


def append_line(path: Path, line: str) -> None:
    """Append `line` and a newline to `path`, whole or not at all: a write that fails part way
    (ENOSPC after some bytes) is cut off again before the error is raised."""
    data = (line + "\n").encode()
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        start = os.lseek(fd, 0, os.SEEK_END)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
        except BaseException:
            os.ftruncate(fd, start)
            raise
    finally:
        os.close(fd)


def write_summary(path: Path, summary: RunSummary) -> None:
    write_text_atomic(path, summary.model_dump_json(indent=1))


def make_summary(
    acc: Accounting, state: TrainerState, reward_means: list[float], *, dlq: int
) -> RunSummary:
    """The run's accounting and outcome; rewards are the per-step means of `metrics.jsonl`."""
    first, last = reward_means[:5], reward_means[-5:]
    return RunSummary(
        **acc.model_dump(),
        in_flight=acc.in_flight,
        dlq=dlq,
        steps=state.step,
        final_version=state.version,
        samples=state.samples,
        skipped_steps=state.skipped_steps,
        tokens=state.tokens,
        reward_first5=sum(first) / max(1, len(first)),
        reward_last5=sum(last) / max(1, len(last)),
        final_reward=reward_means[-1] if reward_means else None,
        wall_s=round(state.wall_s, 2),
    )

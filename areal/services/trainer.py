"""Trainer: assembles complete groups, enforces the intake check, runs decoupled-PPO steps,
publishes new weights, and checkpoints so a restart resumes with nothing lost.

Invariants:
- never trains on a sample whose oldest token version is `< version - max_staleness`; a group
  with such a sample is dropped whole, counted (`dropped_stale`) and its slot is returned to
  admission at once (KV), never silently;
- a scored sample is acknowledged only once a checkpoint covers its effect (trained or dropped);
  until then its lease is heart-beaten, and after a crash it is redelivered and de-duplicated
  against the checkpoint's `done_tasks`;
- per step the order is: update -> publish weights -> KV (version, returned slots) -> step record
  -> checkpoint -> ack; the controller never sees a version whose weights are not announced;
- with an engine that can snapshot its state (`snapshot_checkpoint` / `write_checkpoint`), the
  checkpoint file is written and its leases acked in the background, one checkpoint at a time in
  step order, while the next step trains: the acks still follow the durable write;
- a restart resumes from the checkpoint: step records after it are dropped from metrics.jsonl
  (they are redone), and if newer weights were already announced the version rolls forward
  past them, so versions stay monotonic.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import structlog
import torch

from areal.algo.advantages import grpo_advantages, zero_adv_groups
from areal.algo.staleness import is_fresh, sample_staleness
from areal.bus.client import Bus, Lease
from areal.bus.codec import unpack
from areal.engines.base import TrainEngine, TrainSeq
from areal.services.common import BusyMeter, heartbeat_loop
from areal.services.controller import CONTROLLER_KEY, TRAINER_KEY, trainer_state_default
from schemas import ScoredSample
from schemas import subjects as S

log = structlog.get_logger()


@dataclass
class TrainerOptions:
    batch_size: int
    group_size: int
    max_staleness: int
    total_steps: int
    max_tokens_per_mb: int
    checkpoint_every: int = 1
    adv_norm_std: bool = True
    adv_batch_norm: bool = False
    filter_zero_adv_groups: bool = False
    weights_dtype: str = "float32"
    weights_dir: str | None = None  # None: object store; else a shared dir (file:// URIs)


Group = dict[int, tuple[ScoredSample, Lease]]


def _write_json_atomic(path: Path, obj: dict) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(obj, indent=1, sort_keys=True))
    os.replace(tmp, path)


class TrainerService:
    def __init__(
        self, bus: Bus, engine: TrainEngine, opts: TrainerOptions, out_dir: str | Path
    ) -> None:
        self.bus, self.engine, self.opts = bus, engine, opts
        self.out_dir = Path(out_dir)
        self.ckpt_dir = self.out_dir / "checkpoint"
        self.groups: dict[str, Group] = {}
        self.done_tasks: set[str] = set()
        self.unacked: list[Lease] = []
        self._ckpt_task: asyncio.Task | None = None
        self.checkpoint_s = 0.0  # duration of the last checkpoint write (+ acks)
        self.state = trainer_state_default() | {"samples": 0, "tokens": 0, "wall_s": 0.0}
        self._data = asyncio.Event()
        self.meter = BusyMeter()
        self.t_start = time.time()

    # ------------------------------------------------------------------ intake
    async def handle(self, scored: ScoredSample, lease: Lease) -> None:
        s = scored.sample
        group = self.groups.setdefault(s.task_id, {}) if s.task_id not in self.done_tasks else None
        if group is None or s.sample_idx in group:  # already trained/dropped, or a duplicate
            await lease.ack()
            return
        group[s.sample_idx] = (scored, lease)
        if len(group) == s.group_size:
            self._data.set()

    @staticmethod
    def _min_version(group: Group) -> int:
        mins = [
            int(unpack(sc.sample.versions).min())
            for sc, _ in group.values()
            if len(sc.sample.versions)
        ]
        return min(mins) if mins else 0

    async def _retire(self, task_id: str, counter: str) -> None:
        """Drop or filter a group: count it, return its slot now, ack at the next checkpoint."""
        group = self.groups.pop(task_id)
        self.done_tasks.add(task_id)
        self.unacked.extend(lease for _, lease in group.values())
        self.state[counter] += 1
        await self.bus.kv_put(TRAINER_KEY, self.state)
        await self.bus.event(
            f"task_{counter}",
            task_id=task_id,
            version=self.engine.version,
            min_version=self._min_version(group),
        )

    async def _next_batch(self, stop: asyncio.Event) -> list[tuple[str, Group]] | None:
        """The B oldest complete, fresh groups (dropping stale ones on the way)."""
        B, G = self.opts.batch_size, self.opts.group_size
        chosen: list[tuple[str, Group]] = []
        while len(chosen) < B:
            if stop.is_set():
                return None
            taken = {tid for tid, _ in chosen}
            complete = [tid for tid, g in self.groups.items() if len(g) >= G and tid not in taken]
            if not complete:
                self._data.clear()
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self._data.wait(), 1.0)
                continue
            tid = min(
                complete, key=lambda t: next(iter(self.groups[t].values()))[0].sample.task_seq
            )
            group = self.groups[tid]
            if not is_fresh(self.engine.version, self._min_version(group), self.opts.max_staleness):
                await self._retire(tid, "dropped_stale")
                continue
            rewards = torch.tensor([[sc.reward for sc, _ in group.values()]])
            if self.opts.filter_zero_adv_groups and bool(zero_adv_groups(rewards)[0]):
                await self._retire(tid, "filtered")
                continue
            chosen.append((tid, group))
        return chosen

    # ------------------------------------------------------------------ one step
    def _build(self, batch: list[tuple[str, Group]]) -> tuple[list[TrainSeq], dict]:
        G = self.opts.group_size
        scored = [[group[i][0] for i in range(G)] for _, group in batch]
        rewards = torch.tensor([[sc.reward for sc in grp] for grp in scored], dtype=torch.float32)
        adv = grpo_advantages(
            rewards, norm_std=self.opts.adv_norm_std, batch_norm=self.opts.adv_batch_norm
        )
        seqs: list[TrainSeq] = []
        v = self.engine.version
        tok_lags: Counter[int] = Counter()
        sample_lags: Counter[int] = Counter()
        interrupted = reprefill = 0
        for gi, grp in enumerate(scored):
            for si, sc in enumerate(grp):
                s = sc.sample
                versions = unpack(s.versions).astype(np.int64)
                seqs.append(
                    TrainSeq(
                        prompt_ids=torch.from_numpy(unpack(s.prompt_ids).astype(np.int64)),
                        output_ids=torch.from_numpy(unpack(s.output_ids).astype(np.int64)),
                        behav_logp=torch.from_numpy(unpack(s.behav_logp).copy()),
                        versions=torch.from_numpy(versions),
                        adv=float(adv[gi, si]),
                    )
                )
                tok_lags.update(np.maximum(0, v - versions).tolist())
                if len(versions):
                    sample_lags[sample_staleness(v, int(versions.min()))] += 1
                interrupted += s.n_interrupts > 0
                reprefill += s.n_reprefill_tokens
        n = len(seqs)
        info = {
            "reward_mean": float(rewards.mean()),
            "reward_std": float(rewards.std(unbiased=False)),
            "samples": n,
            "tokens": int(sum(len(s.output_ids) for s in seqs)),
            "staleness_hist": {str(k): c for k, c in sorted(sample_lags.items())},
            "staleness_hist_tokens": {str(k): c for k, c in sorted(tok_lags.items())},
            "staleness_max": max(sample_lags, default=0),
            "token_version_min": min(
                (int(s.versions.min()) for s in seqs if len(s.versions)), default=v
            ),
            "token_version_max": max(
                (int(s.versions.max()) for s in seqs if len(s.versions)), default=v
            ),
            "interrupted_frac": interrupted / max(1, n),
            "reprefill_tokens": reprefill,
            "gen_len_mean": float(np.mean([len(s.output_ids) for s in seqs])) if seqs else 0.0,
        }
        return seqs, info

    async def _checkpoint(self, *, background: bool = False) -> None:
        """Checkpoint the engine and trainer state, then ack the leases it covers. In the
        background variant only the snapshot is taken now; writing and acking run in a task
        chained after the previous checkpoint's (`flush_checkpoints` waits for them)."""
        state = {**self.state, "done_tasks": sorted(self.done_tasks)}
        leases, self.unacked = self.unacked, []
        snapshot_fn = getattr(self.engine, "snapshot_checkpoint", None)
        if snapshot_fn is None or not background:
            await self._write_checkpoint(self._ckpt_task, state, leases, None)
            self._ckpt_task = None
            return
        snap = await asyncio.to_thread(snapshot_fn)
        self._ckpt_task = asyncio.create_task(
            self._write_checkpoint(self._ckpt_task, state, leases, snap)
        )

    async def _write_checkpoint(
        self, prev: asyncio.Task | None, state: dict, leases: list[Lease], snap: dict | None
    ) -> None:
        if prev is not None:
            await prev  # checkpoints land (and ack) in step order
        t0 = time.perf_counter()
        self.ckpt_dir.mkdir(parents=True, exist_ok=True)
        engine_path = str(self.ckpt_dir / "engine")
        if snap is None:
            await asyncio.to_thread(self.engine.save_checkpoint, engine_path)
        else:
            await asyncio.to_thread(self.engine.write_checkpoint, snap, engine_path)
        await asyncio.to_thread(_write_json_atomic, self.ckpt_dir / "trainer_state.json", state)
        for lease in leases:
            with contextlib.suppress(Exception):
                await lease.ack()
        self.checkpoint_s = time.perf_counter() - t0

    async def flush_checkpoints(self) -> None:
        """Wait for background checkpoints (and their acks) to land."""
        if self._ckpt_task is not None:
            await self._ckpt_task

    async def _publish_weights(self) -> float:
        t0 = time.perf_counter()
        data = await asyncio.to_thread(self.engine.export_safetensors)
        await self.bus.put_weights(
            self.engine.version,
            data,
            self.opts.weights_dtype,
            self.state["step"],
            file_dir=self.opts.weights_dir,
        )
        return time.perf_counter() - t0

    async def step(self, batch: list[tuple[str, Group]], wait_s: float) -> dict:
        seqs, info = self._build(batch)
        version_before = self.engine.version
        self.meter.start()
        t0 = time.perf_counter()
        stats = await asyncio.to_thread(self.engine.train_step, seqs, self.opts.max_tokens_per_mb)
        train_s = time.perf_counter() - t0
        self.meter.stop()
        for tid, group in batch:
            self.groups.pop(tid, None)
            self.done_tasks.add(tid)
            self.unacked.extend(lease for _, lease in group.values())
        self.state["step"] += 1
        self.state["version"] = self.engine.version
        self.state["trained"] += len(batch)
        self.state["samples"] += info["samples"]
        self.state["tokens"] += info["tokens"]
        self.state["wall_s"] = time.time() - self.t_start
        publish_s = await self._publish_weights()
        await self.bus.kv_put(TRAINER_KEY, self.state)
        ctrl = await self.bus.kv_get(CONTROLLER_KEY) or {"admitted": 0}
        returned = self.state["dropped_stale"] + self.state["filtered"]
        rec = {
            "step": self.state["step"],
            "version": self.state["version"],
            "trained_on_version": version_before,
            "wall_s": round(self.state["wall_s"], 3),
            **info,
            "dropped_stale": self.state["dropped_stale"],
            "filtered": self.state["filtered"],
            "admitted": ctrl["admitted"],
            "outstanding": ctrl["admitted"] - returned,
            "train_s": round(train_s, 4),
            "wait_s": round(wait_s, 4),
            "weights_publish_s": round(publish_s, 4),
            "checkpoint_s": round(self.checkpoint_s, 4),
            "trainer_idle_frac": round(1 - self.meter.busy_frac(), 4),
            **{
                ("train_tokens" if k == "tokens" else k): (
                    round(v, 6) if isinstance(v, float) else v
                )
                for k, v in stats.items()
            },
        }
        with open(self.out_dir / "metrics.jsonl", "a") as f:
            f.write(json.dumps(rec) + "\n")
        await self.bus.metric("step", rec)
        last = self.state["step"] >= self.opts.total_steps
        if self.state["step"] % self.opts.checkpoint_every == 0 or last:
            await self._checkpoint(background=not last)
        log.info(
            "train_step",
            step=rec["step"],
            policy_version=rec["version"],
            reward_mean=round(rec["reward_mean"], 3),
            staleness_max=rec["staleness_max"],
            loss=round(float(stats.get("loss", 0.0)), 4),
        )
        return rec

    # ------------------------------------------------------------------ lifecycle
    async def _restore(self) -> None:
        state_path = self.ckpt_dir / "trainer_state.json"
        if state_path.exists():
            saved = json.loads(state_path.read_text())
            self.done_tasks = set(saved.pop("done_tasks", []))
            self.state.update(saved)
            await asyncio.to_thread(self.engine.load_checkpoint, str(self.ckpt_dir / "engine"))
            self.t_start = time.time() - self.state.get("wall_s", 0.0)
            self._truncate_metrics(self.state["step"])
            log.info("trainer_resumed", step=self.state["step"], policy_version=self.engine.version)
        latest = await self.bus.latest_weights()
        if latest is None or latest.version < self.engine.version:
            await self._publish_weights()
        elif latest.version > self.engine.version:
            # Weights newer than our checkpoint were announced (crash between publish and the
            # next checkpoint, checkpoint_every > 1): keep versions monotonic.
            log.warning(
                "version_rollforward", checkpoint=self.engine.version, announced=latest.version
            )
            self.engine.version = latest.version + 1
            await self._publish_weights()
        self.state["version"] = self.engine.version
        await self.bus.kv_put(TRAINER_KEY, self.state)

    def _truncate_metrics(self, step: int) -> None:
        """Keep only step records the checkpoint covers; later steps will be redone."""
        path = self.out_dir / "metrics.jsonl"
        if path.exists():
            lines = path.read_text().splitlines()
            kept = [ln for ln in lines if ln.strip() and json.loads(ln)["step"] <= step]
            if len(kept) != len(lines):
                path.write_text("".join(ln + "\n" for ln in kept))

    async def write_summary(self) -> dict:
        ctrl = await self.bus.kv_get(CONTROLLER_KEY) or {"admitted": 0}
        try:
            dlq = (await self.bus.js.stream_info(self.bus.names.stream(S.DLQ))).state.messages
        except Exception:
            dlq = None
        recs = [
            json.loads(line) for line in (self.out_dir / "metrics.jsonl").read_text().splitlines()
        ]
        first = [r["reward_mean"] for r in recs[:5]]
        last = [r["reward_mean"] for r in recs[-5:]]
        st = self.state
        summary = {
            "admitted": ctrl["admitted"],
            "trained": st["trained"],
            "dropped_stale": st["dropped_stale"],
            "filtered": st["filtered"],
            "dlq": dlq,
            "in_flight": ctrl["admitted"] - st["trained"] - st["dropped_stale"] - st["filtered"],
            "steps": st["step"],
            "final_version": st["version"],
            "samples": st["samples"],
            "tokens": st["tokens"],
            "reward_first5": sum(first) / max(1, len(first)),
            "reward_last5": sum(last) / max(1, len(last)),
            "final_reward": recs[-1]["reward_mean"] if recs else None,
            "wall_s": round(st["wall_s"], 2),
        }
        _write_json_atomic(self.out_dir / "summary.json", summary)
        return summary

    def heartbeat(self) -> dict:
        complete = sum(1 for g in self.groups.values() if len(g) >= self.opts.group_size)
        return {
            "version": self.engine.version,
            "step": self.state["step"],
            "busy_frac": self.meter.busy_frac(),
            "buffered_groups": len(self.groups),
            "complete_groups": complete,
            "held_leases": self.bus.held_leases,
        }

    async def run(self, stop: asyncio.Event) -> dict | None:
        self.out_dir.mkdir(parents=True, exist_ok=True)
        await self._restore()
        consumer = asyncio.create_task(
            self.bus.consume(
                S.REWARDS,
                ScoredSample,
                self.handle,
                max_inflight=1_000_000,
                stop=stop,
                inline=True,  # handle() only files the sample into its group
            )
        )
        hb = asyncio.create_task(heartbeat_loop(self.bus, self.heartbeat, stop))
        log.info("trainer_started", policy_version=self.engine.version, step=self.state["step"])
        try:
            while self.state["step"] < self.opts.total_steps and not stop.is_set():
                t_wait = time.perf_counter()
                batch = await self._next_batch(stop)
                if batch is None:
                    break
                await self.step(batch, time.perf_counter() - t_wait)
                if consumer.done():
                    consumer.result()  # surface a consumer crash
            if self.state["step"] >= self.opts.total_steps:
                await asyncio.to_thread(self.engine.save_pretrained, str(self.out_dir / "final"))
                self.state["done"] = True
                await self.bus.kv_put(TRAINER_KEY, self.state)
                summary = await self.write_summary()
                await self.bus.event("run_finished", **summary)
                log.info("run_finished", **summary)
                return summary
            return None
        finally:
            stop.set()
            hb.cancel()
            with contextlib.suppress(Exception, asyncio.CancelledError):
                await self.flush_checkpoints()  # a stop mid-run still lands what was trained
            with contextlib.suppress(Exception, asyncio.CancelledError):
                await consumer

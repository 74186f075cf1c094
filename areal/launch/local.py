"""`areal run`: the local launcher.

Starts an embedded nats-server (unless a URL is configured), the controller, the trainer and N
rollout / M reward worker processes, shows a progress bar fed by the trainer's step metrics, and
stops everything on completion, on a worker crash, or on Ctrl-C. Invariant: no child process
outlives the launcher (they are signalled on exit and die with it via PR_SET_PDEATHSIG).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import structlog

from areal.bus.embedded import EmbeddedNats, die_with_parent
from areal.config import RunSettings
from areal.launch.worker import resolve_model_path

log = structlog.get_logger()

RUN_ARTIFACTS = (
    "metrics.jsonl",
    "summary.json",
    "config.json",
    "checkpoint",
    "final",
    "nats",
    "logs",
)


class Launcher:
    def __init__(
        self,
        settings: RunSettings,
        *,
        resume: bool = False,
        quiet: bool = False,
        max_restarts: int = 3,
    ) -> None:
        self.s = settings
        self.out = Path(settings.out_dir)
        self.resume, self.quiet = resume, quiet
        self.max_restarts = max_restarts
        self.procs: dict[str, subprocess.Popen] = {}
        self.restarts: dict[str, int] = {}
        self._cfg_path: Path | None = None
        self._env: dict[str, str] = {}
        self.server: EmbeddedNats | None = None

    def prepare(self) -> Path:
        if not self.resume:
            for name in RUN_ARTIFACTS:
                p = self.out / name
                if p.is_dir():
                    shutil.rmtree(p)
                elif p.exists():
                    p.unlink()
        (self.out / "logs").mkdir(parents=True, exist_ok=True)
        from areal.rewards.registry import get_reward_fn

        get_reward_fn(self.s.reward_fn_name())  # a bad reward spec fails before anything starts
        self.s.model.path = resolve_model_path(self.s)
        if not self.s.nats.url:
            self.server = EmbeddedNats(store_dir=self.out / "nats").start()
            self.s.nats.url = self.server.url
        cfg_path = self.out / "config.json"
        cfg_path.write_text(json.dumps(self.s.model_dump(mode="json"), indent=1))
        return cfg_path

    def spawn(self, cfg_path: Path) -> None:
        self._cfg_path = cfg_path
        roles = [("controller", 0), ("trainer", 0)]
        roles += [("reward", i) for i in range(self.s.replicas.get("reward", 1))]
        roles += [("rollout", i) for i in range(self.s.replicas.get("rollout", 1))]
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        keep = ("AREAL_LOG_FORMAT", "AREAL_LOG_LEVEL", "AREAL_CACHE_DIR")
        for key in [k for k in env if k.startswith("AREAL_") and k not in keep]:
            env.pop(key)  # the resolved config.json already holds every setting
        self._env = env
        for role, i in roles:
            self._start(f"{role}-{i}")

    def _start(self, wid: str) -> None:
        role = wid.rsplit("-", 1)[0]
        threads = self.s.train.torch_threads if role == "trainer" else self.s.rollout.torch_threads
        logf = open(self.out / "logs" / f"{wid}.log", "ab")  # noqa: SIM115 - owned by child
        self.procs[wid] = subprocess.Popen(
            [
                sys.executable,
                "-m",
                f"workers.{role}",
                "--config",
                str(self._cfg_path),
                "--worker-id",
                wid,
            ],
            stdout=logf,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env={**self._env, "OMP_NUM_THREADS": str(threads)},
            preexec_fn=die_with_parent,
        )
        logf.close()

    def stop_all(self, timeout_s: float = 15.0) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    p.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        for p in self.procs.values():
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            if p.poll() is None:
                p.kill()
                p.wait()
        if self.server:
            self.server.stop()
            self.server = None

    def _log_tail(self, wid: str, n: int = 25) -> str:
        lines = (self.out / "logs" / f"{wid}.log").read_text(errors="replace").splitlines()
        return "\n".join(lines[-n:])

    async def _watch(self) -> int:
        from areal.bus.client import Bus
        from areal.launch.progress import StepProgress
        from schemas import MetricRecord

        progress = StepProgress(self.s.train.total_steps, quiet=self.quiet)
        assert self.s.nats.url is not None

        async def on_step(rec: MetricRecord) -> None:
            progress.update(rec.values)

        # the progress bar is a view: the run goes on without it (declare=False: the workers
        # own the run's streams)
        bus = await Bus.connect(
            self.s.nats.url, self.s.run_id, "launcher", "launcher", self.s.nats, declare=False
        )
        await bus.subscribe_metrics("trainer", "step", on_step)
        try:
            with progress:
                while True:
                    trainer = self.procs["trainer-0"]
                    if trainer.poll() == 0:
                        return 0
                    for wid, p in list(self.procs.items()):
                        if p.poll() is None or (p.returncode == 0 and wid != "trainer-0"):
                            continue
                        if self.restarts.get(wid, 0) >= self.max_restarts:
                            print(
                                f"worker {wid} exited with {p.returncode} after "
                                f"{self.restarts.get(wid, 0)} restarts; last log lines:\n"
                                f"{self._log_tail(wid)}",
                                file=sys.stderr,
                            )
                            return p.returncode or 1
                        # crash recovery: the bus redelivers its unfinished work; the trainer
                        # resumes from its checkpoint, the controller from its KV cursor
                        self.restarts[wid] = self.restarts.get(wid, 0) + 1
                        log.warning(
                            "worker_restarted",
                            worker=wid,
                            exit_code=p.returncode,
                            restarts=self.restarts[wid],
                        )
                        self._start(wid)
                    await asyncio.sleep(0.2)
        finally:
            await bus.close()

    def run(self) -> int:
        t0 = time.time()
        try:
            cfg = self.prepare()
            self.spawn(cfg)
            rc = asyncio.run(self._watch())
        except KeyboardInterrupt:
            print("\ninterrupted: stopping all workers", file=sys.stderr)
            rc = 130
        finally:
            self.stop_all()
        summary_path = self.out / "summary.json"
        if rc == 0 and summary_path.exists():
            summary = json.loads(summary_path.read_text())
            print(json.dumps(summary, indent=1))
            print(f"run finished in {time.time() - t0:.1f}s; artifacts in {self.out}/")
        elif rc != 0 and rc != 130:
            print(f"run failed (exit {rc}); logs in {self.out}/logs/", file=sys.stderr)
        return rc

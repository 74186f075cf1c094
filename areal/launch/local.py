"""`areal run`: the local launcher.

Checks everything that can be checked (the config, extras, reward spec, dataset, model dir, the
state of `--out`), starts an embedded nats-server (unless a URL is configured), the controller,
the trainer and N rollout / M reward worker processes, shows a progress bar fed by the trainer's
step metrics, and stops everything on completion, on a worker crash, on Ctrl-C or on SIGTERM.

Invariants:
- no child process outlives the launcher (they are signalled on exit and die with it via
  PR_SET_PDEATHSIG);
- a stop (Ctrl-C, SIGTERM, the end of the run) stops the workers first and the embedded
  nats-server last, so their stop paths (the trainer's checkpoint) still reach it; the server
  runs in its own session, out of reach of a terminal's Ctrl-C;
- exit codes: 0 only when this run's trainer reached `train.total_steps` (`trainer_finished`);
  130 after Ctrl-C, 143 after SIGTERM; 2 for a config error; 1 when the trainer exited 0
  before `total_steps` (stopped by a signal from elsewhere); else the failed worker's code;
- nothing is started and nothing in `--out` is touched before every check passed (`check`),
  among them that a `nats.url` of the user's answers (within `declare.PROBE_S`); a new run
  never deletes data implicitly (`areal.launch.run_dir`), and one that fails before any worker
  started takes back what it wrote in `--out` (a plain retry then works);
- a worker that exits with `EXIT_CONFIG` (a deterministic failure) is not restarted: the run
  stops with its one-line reason; other crashes are restarted up to `max_restarts` times, and
  a worker that ran `HEALTHY_S` before it exited has its budget back; an exit because the bus
  was away (`EXIT_BUS_UNAVAILABLE`) does not spend the budget; a worker other than the trainer
  that exits 0 before the run finished (stopped by a signal from elsewhere) is restarted as a
  crash is;
- a worker whose heartbeats stop for `watchdog.frozen_after_s` (frozen: SIGSTOPped, a hung
  event loop) is named in a `worker_frozen` event, SIGKILLed and restarted as a crash is
  (`areal.launch.watchdog`); `worker_recovered` reports what its freeze cost the run;
- with `train.nproc` N > 1 the trainer is a group of N local ranks (`trainer-0` is rank 0,
  `trainer-0.rank<r>` the others; RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR / MASTER_PORT
  set, a fresh port per start): the group lives and dies whole. A rank that fails stops the
  others, and the group is restarted from the trainer's checkpoint as the trainer would be
  (same budget, same exit rules, judged by rank 0's exit code or the first failed rank's);
- a dead embedded nats-server is restarted on the same store, port and accounts, and said so;
  so is one whose store hit a write error (a full disk: nats-server writes that stream no more
  until restarted), once the store's disk has room again (`areal.launch.store_watch`);
- the embedded server has one account per role of the run (`areal.bus.nats_config`), their
  credentials in `<out>/keys/nats/<role>.json` (0600), kept on `--resume`; config.json names
  that dir (`nats.credentials_dir`) and each worker connects with its own role's file;
- with `cpu_affinity`, each process it starts (workers, trainer ranks, the embedded
  nats-server, a restarted one too) runs on its role's cores from its first instruction (set
  between fork and exec), and a process with no entry on every core the launcher started with;
  cores this host does not give the launcher fail the check;
- the run's keys (`areal.security.keys`: the trainer's weights signing key, its verify key, the
  message-id secret) exist before any worker starts, are kept on `--resume`, and config.json
  names their dir (`security.keys_dir`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Literal

import structlog

from areal.bus.embedded import EmbeddedNats, free_port
from areal.bus.errors import BusUnavailable, PermissionDenied, RunConflictError
from areal.bus.nats_config import authorization_block, ensure_accounts
from areal.bus.streams import StorageLimitError
from areal.config import ConfigError, RunSettings
from areal.core.watchdog import WatchdogPolicy
from areal.launch import run_dir
from areal.launch.declare import declare_run_now, probe_server
from areal.launch.exit_codes import (
    EXIT_BUS_UNAVAILABLE,
    EXIT_CONFIG,
    EXIT_INTERRUPTED,
    EXIT_NOT_FINISHED,
    EXIT_TERMINATED,
)
from areal.launch.join import public_url_of, share_run
from areal.launch.preflight import check_run
from areal.launch.store_watch import StoreWatch
from areal.launch.watchdog import LauncherWatchdog
from areal.launch.worker import resolve_model_path
from areal.proc import child_setup, format_cpu_list
from areal.security.keys import KeysError, ensure_run_keys, keys_dir_of

log = structlog.get_logger()

RUN_ARTIFACTS = run_dir.RUN_ARTIFACTS  # kept importable from here
NATS_KEYS_SUBDIR = "keys/nats"  # under --out: the embedded server's per-role credentials
Supervision = Literal["finished", "ignore", "restart", "restart_free", "give_up", "config_error"]
HEALTHY_S = 300.0  # a worker up this long before it exits has its restart budget back
CAUSE_LINES, CAUSE_CHARS = 200, 300  # where the restart warning looks for the cause; its length
# the last line of a Python traceback: the exception's (qualified) type, then its message
EXCEPTION_LINE = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Exit|Interrupt|Lost|Held)\b")
MAX_OUTAGE_RESTARTS = 20  # restarts after outages (not counted in max_restarts), per worker
TRAINER = "trainer-0"  # the trainer's worker id (rank 0 of its group when train.nproc > 1)
RANK_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def _honour_sigint() -> None:
    """Ctrl-C (SIGINT) stops the run even when the launcher inherited SIGINT ignored: a shell
    without job control (a script, CI, `nohup cmd &`) starts background jobs so, and Python then
    raises no KeyboardInterrupt, so `kill -INT` did nothing and the run went on to its last
    step. Only the main thread may set a handler; elsewhere the caller owns signals."""
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN and (
        threading.current_thread() is threading.main_thread()
    ):
        signal.signal(signal.SIGINT, signal.default_int_handler)


def trainer_finished(out: Path, total_steps: int) -> bool:
    """Whether the trainer finished the run: its `summary.json`, which it writes only on
    reaching `train.total_steps`, says so. A trainer that exits 0 without it was stopped (a
    SIGTERM or SIGINT sent to it alone), and an older summary (`--resume` to more steps) counts
    fewer steps."""
    try:
        return int(json.loads((out / "summary.json").read_text())["steps"]) >= total_steps
    except (OSError, ValueError, KeyError, TypeError):
        return False


def _terminate(procs: list[subprocess.Popen], timeout_s: float) -> None:
    """SIGTERM every live process of `procs`, then SIGKILL what is left after `timeout_s`."""
    for p in procs:
        if p.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    for p in procs:
        with contextlib.suppress(subprocess.TimeoutExpired):
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
        if p.poll() is None:
            p.kill()
            p.wait()


def on_worker_exit(
    wid: str,
    returncode: int,
    restarts: int,
    max_restarts: int,
    *,
    outage_restarts: int = 0,
    run_finished: bool,
) -> Supervision:
    """What the launcher does when worker `wid` has exited with `returncode`.

    The trainer exiting 0 finishes the run (the caller checks that it reached total_steps:
    `trainer_finished`); another role exiting 0 is done once the run finished
    (`run_finished`: they stop on `run_finished`), and before that it was stopped from outside
    (a SIGTERM sent to it alone) and is restarted as a crash is;
    `EXIT_CONFIG` is deterministic and never restarted; `EXIT_BUS_UNAVAILABLE` (the server was
    away, not the worker's fault) is restarted without spending the budget, up to
    `MAX_OUTAGE_RESTARTS`; any other exit is restarted until `max_restarts`, then the run gives
    up. The caller resets both counts after a healthy period (`HEALTHY_S` of uptime)."""
    if returncode == 0 and (wid == TRAINER or run_finished):
        return "finished" if wid == TRAINER else "ignore"
    if returncode == EXIT_CONFIG:
        return "config_error"
    if returncode == EXIT_BUS_UNAVAILABLE:
        return "give_up" if outage_restarts >= MAX_OUTAGE_RESTARTS else "restart_free"
    return "give_up" if restarts >= max_restarts else "restart"


class Launcher:
    def __init__(
        self,
        settings: RunSettings,
        *,
        resume: bool = False,
        overwrite: bool = False,
        quiet: bool = False,
        max_restarts: int = 3,
    ) -> None:
        if resume and overwrite:
            raise ValueError("resume and overwrite exclude each other")
        self.s = settings
        self.out = Path(settings.out_dir)
        self.resume, self.overwrite, self.quiet = resume, overwrite, quiet
        self.max_restarts = max_restarts
        self.procs: dict[str, subprocess.Popen] = {}
        self.restarts: dict[str, int] = {}
        self.outage_restarts: dict[str, int] = {}
        self.started_at: dict[str, float] = {}  # worker id -> time.monotonic() of its start
        self.followers: list[str] = []  # the trainer group's ranks > 0 (train.nproc > 1)
        self.server_restarts = 0
        self._cfg_path: Path | None = None
        self._env: dict[str, str] = {}
        self.server: EmbeddedNats | None = None
        self.store_watch: StoreWatch | None = None  # restarts a server whose disk was full
        self._home_cpus: frozenset[int] | None = None  # cpu_affinity set: the launcher's cores
        self.stop_signal: int | None = None  # the SIGTERM that stopped the run, if one did
        self._stopping = False  # stop_all is due: a SIGTERM then changes nothing
        self.last_step = 0  # the highest step record the trainer published (seen live)
        self._new_out: bool | None = None  # a new run: whether --out did not exist before it
        self._weights_in_out = False  # a new run: its weights dir is <out>/weights
        self.resumed_from: run_dir.ResumePoint | None = None  # --resume: the checkpoint
        w = settings.watchdog
        self.watchdog = LauncherWatchdog(
            WatchdogPolicy(frozen_after_s=w.frozen_after_s, startup_s=w.startup_s),
            kill=self._kill_frozen,
        )

    def check(self) -> run_dir.ResumePoint | None:
        """Every check before anything starts; raises `ConfigError`. Returns the resume point
        when `--resume` finds the run already finished at `train.total_steps` (nothing to do).
        With `--overwrite` the old run's artifacts are deleted here, after all checks passed."""
        check_run(self.s)
        self._check_cpus()
        n = self.s.nats
        if not n.url and (n.credentials_file or n.credentials_dir):
            raise ConfigError(
                "config error: nats.credentials_file / nats.credentials_dir are for a server of "
                "your own (set nats.url); the embedded server makes its own accounts in "
                f"{self.out / NATS_KEYS_SUBDIR}: unset them"
            )
        if self.resume:
            point = self.resumed_from = run_dir.resume_point(self.out)
            if point.finished_at(self.s.train.total_steps):
                return point
        if n.url:  # a server of the user's: it answers, or nothing in --out is touched
            try:
                probe_server(self.s)
            except ConnectionError as e:  # AuthenticationFailed too: it names the fix
                raise ConfigError(f"error: {e}") from None
        if self.resume:
            run_dir.ensure_writable(self.out)
            return None
        self._new_out = not self.out.exists()
        self._weights_in_out = self.s.weights.dir is None
        gone = run_dir.prepare_new(
            self.out, overwrite=self.overwrite, weights_in_out=self._weights_in_out
        )
        run_dir.ensure_writable(self.out)
        if gone:
            names = ", ".join(p.name + ("/" if p.is_dir() else "") for p in gone)
            print(f"--overwrite: deleted the previous run's {names} in {self.out}", file=sys.stderr)
        return None

    def _undo_new_run(self) -> None:
        """Remove what this launch of a new run wrote in `--out` (its run artifacts, and the
        dir itself when it created it) after a failure before any worker started, so that the
        same command can simply be run again. A resumed run's dir is left as it was."""
        if self._new_out is None:  # --resume, or the checks failed before --out was touched
            return
        with contextlib.suppress(OSError):
            for p in run_dir.artifacts(self.out, weights_in_out=self._weights_in_out):
                if p.is_dir() and not p.is_symlink():
                    shutil.rmtree(p)
                else:
                    p.unlink()
            if self._new_out:
                self.out.rmdir()  # only when empty: nothing else was in it

    def _cpus(self, role: str) -> frozenset[int] | None:
        """Where a process of `role` runs: its `cpu_affinity` cores, else (when the launcher
        itself was pinned elsewhere) every core the launcher started with."""
        return self.s.cpus_of(role) or self._home_cpus

    def _check_cpus(self) -> None:
        """`cpu_affinity` names only cores this process may use (it can pin nothing else)."""
        if not self.s.cpu_affinity:
            return
        if not hasattr(os, "sched_setaffinity"):
            raise ConfigError(
                "config error: cpu_affinity needs Linux (os.sched_setaffinity); unset it here"
            )
        allowed = os.sched_getaffinity(0)
        for role in self.s.cpu_affinity:
            cpus = self.s.cpus_of(role) or frozenset()
            if not cpus <= allowed:
                raise ConfigError(
                    f"config error: cpu_affinity.{role}={self.s.cpu_affinity[role]!r} names "
                    f"cores {format_cpu_list(cpus - allowed)} that this host does not give "
                    f"`areal run` (it may use {format_cpu_list(allowed)}); pick among those"
                )

    def prepare(self) -> Path:
        (self.out / "logs").mkdir(parents=True, exist_ok=True)
        # the run's keys before any worker starts; kept when present (--resume keeps them), and
        # config.json names where they are
        keys_dir = keys_dir_of(self.s).resolve()
        ensure_run_keys(keys_dir)
        self.s.security.keys_dir = str(keys_dir)
        self.s.model.path = resolve_model_path(self.s)
        if not self.s.nats.url:
            n = self.s.nats
            authorization = ""
            if n.embedded_auth:  # one account per role; their files kept on --resume
                keys = (self.out / NATS_KEYS_SUBDIR).resolve()
                authorization = authorization_block(ensure_accounts(keys, [self.s.run_id]))
                n.credentials_dir = str(keys)  # each worker reads <role>.json there
            self.server = EmbeddedNats(
                store_dir=self.out / "nats",
                port=n.listen_port,
                host=n.listen_host,
                authorization=authorization,
                cpus=self._cpus("nats"),
                monitor_port=free_port(),
            ).start()
            self.store_watch = StoreWatch(self.server)
            self.s.nats.url = self.server.url
        # before any worker starts: a worker on another host joins from these files
        public_url = self.server.public_url if self.server else public_url_of(self.s.nats.url)
        self.s.weights.resolve_transport(other_hosts_can_join=public_url is not None)
        weights_dir = self.s.weights.file_dir(self.s.out_dir)
        if weights_dir is not None:  # absolute, and there before a worker starts: a joiner
            # on this host checks for it (`join._check_weights_dir`)
            self.s.weights.dir = str(Path(weights_dir).resolve())
            Path(self.s.weights.dir).mkdir(parents=True, exist_ok=True)
        # as the launcher (workers with accounts may not declare), then `run_started`: from
        # here on a `run_finished` on the bus is an earlier launch's (observers: `areal tap`)
        point = self.resumed_from
        declare_run_now(
            self.s,
            started={
                "resumed": self.resume,
                "step": (point.step or 0) if point else 0,
                "total_steps": self.s.train.total_steps,
            },
        )
        join_hint = share_run(self.s, public_url)
        if join_hint and not self.quiet:
            print(join_hint, file=sys.stderr)
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
        for key in RANK_ENV:
            env.pop(key, None)  # the trainer's rank group is this launcher's (train.nproc)
        self._env = env
        for role, i in roles:
            self._start(f"{role}-{i}")

    def _start(self, wid: str) -> None:
        if wid == TRAINER and self.s.train.nproc > 1:
            self._start_trainer_group()
        else:
            self._spawn(wid, wid.rsplit("-", 1)[0])

    def _start_trainer_group(self) -> None:
        """`train.nproc` trainer ranks on a fresh rendezvous port: rank 0 is `trainer-0` (the
        bus worker), rank r is `trainer-0.rank<r>` (`areal.launch.ranks`)."""
        n = self.s.train.nproc
        port = free_port()
        self.followers = [f"{TRAINER}.rank{r}" for r in range(1, n)]
        for r, wid in enumerate([TRAINER, *self.followers]):
            rank_env = {"RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": str(n)}
            rank_env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
            self._spawn(wid, "trainer", rank_env)
        log.info("trainer_group_started", ranks=n, master_port=port)

    def _spawn(self, wid: str, role: str, extra_env: dict[str, str] | None = None) -> None:
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
            env={**self._env, "OMP_NUM_THREADS": str(threads), **(extra_env or {})},
            preexec_fn=child_setup(self._cpus(role)),
        )
        logf.close()
        self.started_at[wid] = time.monotonic()
        if wid not in self.followers:  # ranks > 0 of a trainer group send no heartbeats
            self.watchdog.started(wid, role, self.procs[wid].pid)

    def _kill_frozen(self, wid: str) -> int | None:
        """SIGKILL worker `wid` (frozen) if this launcher runs it; its exit is then a crash
        (`_supervise` restarts it). The pid killed, or None."""
        p = self.procs.get(wid)
        if p is None or p.poll() is not None:
            return None
        with contextlib.suppress(ProcessLookupError):
            p.kill()  # a stopped (SIGSTOP) process dies of SIGKILL too
        return p.pid

    def _watch_server(self) -> int | None:
        """Restart the embedded nats-server on its store and port if it died (workers ride
        through the outage and reconnect); the run's exit code once that fails too often."""
        server = self.server
        if server is None or server.proc is None or server.proc.poll() is None:
            return None
        code = server.proc.returncode
        if self.server_restarts >= MAX_OUTAGE_RESTARTS:
            print(f"the embedded nats-server died again (exit {code}); giving up", file=sys.stderr)
            return 1
        self.server_restarts += 1
        log.warning("nats_server_died", exit_code=code, restarts=self.server_restarts)
        print(
            f"the embedded nats-server exited ({code}); restarting it on its store "
            f"({server.store_dir}); workers reconnect",
            file=sys.stderr,
        )
        server.start()
        log.warning("nats_server_restarted", url=server.url, restarts=self.server_restarts)
        return None

    def stop_all(self, timeout_s: float = 15.0) -> None:
        _terminate(list(self.procs.values()), timeout_s)
        if self.server:
            self.server.stop()
            self.server = None

    def _log_tail(self, wid: str, n: int = 25) -> str:
        lines = (self.out / "logs" / f"{wid}.log").read_text(errors="replace").splitlines()
        return "\n".join(lines[-n:])

    def _last_line(self, wid: str) -> str:
        lines = [ln for ln in self._log_tail(wid, 5).splitlines() if ln.strip()]
        return lines[-1] if lines else "(no output)"

    def _cause(self, wid: str) -> str:
        """What ended worker `wid`, for the restart warning: the last exception in the end of
        its log (type and message, from a console traceback or a JSON line's `exception`), else
        its last line."""
        try:
            tail = self._log_tail(wid, CAUSE_LINES).splitlines()
        except OSError:
            return "(no log)"
        for line in reversed(tail):
            if line.startswith("{"):
                with contextlib.suppress(ValueError, AttributeError):
                    exc = json.loads(line).get("exception")
                    if exc and exc.strip():
                        return exc.strip().splitlines()[-1][:CAUSE_CHARS]
            elif EXCEPTION_LINE.match(line):
                return line[:CAUSE_CHARS]
        lines = [ln for ln in tail if ln.strip()]
        return lines[-1][:CAUSE_CHARS] if lines else "(no output)"

    def _supervise(self) -> int | None:
        """One pass over the server and the workers: the run's exit code once it is decided,
        else None."""
        if (rc := self._watch_server()) is not None:
            return rc
        if self.store_watch is not None:
            self.store_watch.check()  # a store write error (full disk): restart once there is room
        # the trainer first: its clean exit ends the run whatever the others do meanwhile
        for wid, p in sorted(self.procs.items(), key=lambda kv: kv[0] != TRAINER):
            if wid in self.followers:
                continue  # judged with their group, as trainer-0
            # `src`: whose log tells why (the failed rank of a trainer group)
            src, returncode = self._trainer_group_exit() if wid == TRAINER else (wid, p.poll())
            if returncode is None:
                continue
            self.watchdog.exited(wid, p.pid)
            if time.monotonic() - self.started_at.get(wid, 0.0) >= HEALTHY_S:
                self.restarts.pop(wid, None)  # a healthy period: the budget is back
                self.outage_restarts.pop(wid, None)
            restarts = self.restarts.get(wid, 0)
            outages = self.outage_restarts.get(wid, 0)
            action = on_worker_exit(
                wid,
                returncode,
                restarts,
                self.max_restarts,
                outage_restarts=outages,
                run_finished=self._run_finished(),
            )
            if action == "finished":
                if trainer_finished(self.out, self.s.train.total_steps):
                    return 0
                step = None
                with contextlib.suppress(ConfigError):
                    step = run_dir.resume_point(self.out).step
                print(
                    f"worker {TRAINER} was stopped (a signal not from `areal run`) before "
                    f"train.total_steps={self.s.train.total_steps} (checkpoint at step {step}): "
                    "the run did not finish; --resume continues it",
                    file=sys.stderr,
                )
                return EXIT_NOT_FINISHED
            if action == "config_error":
                print(
                    f"worker {src} failed with a configuration error (not restarted): "
                    f"{self._last_line(src)}",
                    file=sys.stderr,
                )
                return EXIT_CONFIG
            if action == "give_up":
                print(
                    f"worker {src} exited with {returncode} after {restarts} restarts; "
                    f"last log lines:\n{self._log_tail(src)}",
                    file=sys.stderr,
                )
                return returncode or 1
            if action == "restart_free":
                self.outage_restarts[wid] = outages + 1
                log.warning("worker_restarted_after_outage", worker=wid, outages=outages + 1)
                self._start(wid)
            if action == "restart":
                # crash recovery: the bus redelivers its unfinished work; the trainer resumes
                # from its checkpoint, the controller from its KV cursor
                self.restarts[wid] = restarts + 1
                log.warning(
                    "worker_restarted",
                    worker=wid,
                    exit_code=returncode,
                    restarts=restarts + 1,
                    cause=self._exit_cause(wid, src, returncode),
                )
                self._start(wid)
        return None

    def _run_finished(self) -> bool:
        """The trainer reached `train.total_steps`: its summary says so, or its step record
        did (the controller stops on the trainer's `done`, which comes before the summary)."""
        total = self.s.train.total_steps
        return self.last_step >= total or trainer_finished(self.out, total)

    def _exit_cause(self, wid: str, src: str, returncode: int) -> str:
        """Why worker `wid` is restarted: the watchdog's kill, a clean exit mid-run, or its log."""
        frozen = self.watchdog.frozen.pop(wid, None)
        if frozen is not None:
            return (
                f"frozen: no heartbeat for {frozen.silent_s:.1f} s "
                "(watchdog.frozen_after_s); killed by the watchdog"
            )
        if returncode == 0:
            return "exited 0 before the run finished (stopped by a signal from elsewhere)"
        return self._cause(src)

    def _trainer_group_exit(self) -> tuple[str, int | None]:
        """The trainer's exit code, for a group of ranks the group's: rank 0's once it exited,
        or a follower's failure while rank 0 still runs; with the rank it comes from. A group
        that failed is stopped whole (its restart is the trainer's: `_start`); followers
        exiting 0 end with rank 0."""
        lead = self.procs[TRAINER].poll()
        if not self.followers or lead == 0:
            return TRAINER, lead
        rank, failed = TRAINER, lead
        if failed is None:
            codes = [(f, self.procs[f].poll()) for f in self.followers]
            bad = [(f, c) for f, c in codes if c not in (None, 0)]
            if not bad:
                return TRAINER, None
            rank, failed = bad[0]
            log.warning("trainer_rank_failed", worker=rank, exit_code=failed)
        t0 = time.monotonic()
        _terminate([self.procs[w] for w in (TRAINER, *self.followers)], 15.0)
        log.warning("trainer_group_stopped", exit_code=failed, stop_s=time.monotonic() - t0)
        return rank, failed

    def _on_sigterm(self, signum: int, _frame: object) -> None:
        """SIGTERM (a job scheduler, systemd, `timeout`) stops the run as Ctrl-C does, so
        `stop_all` stops the workers, then the server. Its default action killed the launcher
        at once: every child then got its die-with-parent signal together, the server too, and
        a trainer mid-write retried against the dead server for minutes, orphaned. Once the
        stop is under way another SIGTERM changes nothing (`stop_all` is bounded)."""
        if not self._stopping:
            self._stopping = True
            self.stop_signal = signum
            raise KeyboardInterrupt

    async def _watch(self) -> int:
        from areal.bus.client import Bus
        from areal.launch.progress import Start, StepProgress
        from schemas import MetricRecord

        point = self.resumed_from  # samples/s counts from there (`progress.samples_per_s`)
        start = Start(step=point.step or 0, wall_s=point.wall_s) if point else Start()
        progress = StepProgress(self.s.train.total_steps, quiet=self.quiet, start=start)
        assert self.s.nats.url is not None

        async def on_step(rec: MetricRecord) -> None:
            progress.update(rec.values)
            step = rec.values.get("step")
            if isinstance(step, int):
                self.last_step = max(self.last_step, step)
                self.watchdog.on_step(step)

        # the progress bar is a view: the run goes on without it (declare=False: the workers
        # own the run's streams)
        bus = await Bus.connect(
            self.s.nats.url, self.s.run_id, "launcher", "launcher", self.s.nats, declare=False
        )
        await bus.subscribe_metrics("trainer", "step", on_step)
        await self.watchdog.attach(bus)
        try:
            with progress:
                while (rc := self._supervise()) is None:
                    self.watchdog.tick()
                    await asyncio.sleep(0.2)
                return rc
        finally:
            await self.watchdog.close()
            await bus.close()

    def run(self) -> int:
        t0 = time.time()
        _honour_sigint()
        try:
            finished = self.check()
        except ConfigError as e:
            print(e, file=sys.stderr)
            return EXIT_CONFIG
        if finished is not None:
            print(
                f"run in {self.out} already finished at step {finished.step} "
                f"(train.total_steps={self.s.train.total_steps}); summary: {finished.summary}; "
                "to train further: --resume --set train.total_steps=<more>"
            )
            return 0
        # torch and transformers come in with the warm start: only once every check passed, so
        # a config error comes back at once
        from areal.data.warm_start import WarmStartLockTimeout

        if self.s.cpu_affinity:
            self._home_cpus = frozenset(os.sched_getaffinity(0))
            if (cpus := self.s.cpus_of("launcher")) is not None:
                os.sched_setaffinity(0, cpus)  # before any thread starts: they inherit it
        # only the main thread may set a handler; elsewhere the caller owns signals
        previous = None
        if threading.current_thread() is threading.main_thread():
            previous = signal.signal(signal.SIGTERM, self._on_sigterm)
        try:
            cfg = self.prepare()
            self.spawn(cfg)
            rc = asyncio.run(self._watch())
        except (WarmStartLockTimeout, StorageLimitError, RunConflictError) as e:
            print(f"error: {e}", file=sys.stderr)  # one line with the fix, no traceback
            rc = EXIT_CONFIG
        except KeysError as e:  # the run's keys dir is incomplete or unreadable
            print(e, file=sys.stderr)
            rc = EXIT_CONFIG
        except (ConnectionError, BusUnavailable, PermissionDenied) as e:  # the server (nats.url)
            print(f"error: {e}", file=sys.stderr)  # went away, or refused the launcher
            rc = EXIT_NOT_FINISHED
        except KeyboardInterrupt:  # Ctrl-C, or SIGTERM (`_on_sigterm`)
            how = "terminated" if self.stop_signal == signal.SIGTERM else "interrupted"
            print(f"\n{how}: stopping all workers", file=sys.stderr)
            rc = EXIT_TERMINATED if self.stop_signal == signal.SIGTERM else EXIT_INTERRUPTED
        finally:
            self._stopping = True
            self.stop_all()  # the workers first, the embedded server last
            if previous is not None:
                signal.signal(signal.SIGTERM, previous)
            if not self.procs:  # it failed before any worker started: a plain retry works
                self._undo_new_run()
        summary_path = self.out / "summary.json"
        if rc == 0 and summary_path.exists():
            summary = json.loads(summary_path.read_text())
            print(json.dumps(summary, indent=1))
            print(f"run finished in {time.time() - t0:.1f}s; artifacts in {self.out}/")
        elif rc not in (0, EXIT_INTERRUPTED, EXIT_TERMINATED):
            print(f"run failed (exit {rc}); logs in {self.out}/logs/", file=sys.stderr)
        for line in self.watchdog.report():  # what frozen workers cost the run
            print(line, file=sys.stdout if rc == 0 else sys.stderr)
        return rc

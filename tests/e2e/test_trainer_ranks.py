"""The trainer as a group of ranks, end to end: `areal run` with `train.nproc=2` and
`train.engine=fsdp` (two gloo ranks on this CPU; rank 0 alone on the bus).

The real pipeline must keep exact accounting; its steps, replayed through the 1-process torch
engine on the very batches the pipeline formed (`train.record_batches`), must give the same
losses and the same published weights within 1e-5; and a SIGKILL of rank 1 mid-run must cost a
restart of the whole group from the checkpoint with nothing lost and nothing trained twice.
Clocks only guard against hangs."""

from __future__ import annotations

import os
import re
import signal
import time
from pathlib import Path

import pytest

from areal.engines.record import replay
from tests.e2e.test_run import _worker_pid, check_invariants, records, start_run, wait_steps

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(1200)]
RANKS = ("train.engine=fsdp", "train.nproc=2")
FOLLOWER = "trainer-0.rank1"


def _log(out: Path, wid: str) -> str:
    return (out / "logs" / f"{wid}.log").read_text(errors="replace")


def assert_matches_one_process(
    out: Path, atol: float = 1e-5, weights_atol: float | None = None, rtol: float = 1e-3
) -> None:
    """Replay the run's recorded batches through the torch engine (one process) built from
    the run's own config: every step's loss as metrics.jsonl has it within `atol` plus
    `rtol` x the loss, and the final weights as the run published them (`out/final`; under
    `train.lora` the merged model) within `weights_atol` (`atol`).

    The ranks sum their gradients in another order than one process does, so the weights
    drift apart by ~5e-7 a step, and a later step's loss by more: a 2-rank FSDP run's step 10
    once differed by 1.4e-5 (2e-4 of its loss 0.0656). A wrong batch, a step trained twice or
    a lost one is off by percents, far outside 1e-3 of the loss."""
    from safetensors.torch import load_file

    from areal.config import load_settings
    from workers.trainer import make_engine

    one = ["train.engine=torch", "train.nproc=1", "train.record_batches=false"]
    reference = make_engine(load_settings(out / "config.json", one))
    recs = records(out)  # the steps that count (a step redone after a restart: its last run)
    stats = replay(reference, out / "batches", [r["version"] for r in recs])
    assert len(stats) == len(recs) > 0
    worst_loss = 0.0
    for got, ran in zip(stats, recs, strict=True):
        tol = atol + rtol * abs(ran["loss"])
        assert abs(got["loss"] - ran["loss"]) <= tol, (ran["step"], got["loss"], ran["loss"])
        worst_loss = max(worst_loss, abs(got["loss"] - ran["loss"]))
    final = load_file(str(out / "final" / "model.safetensors"))
    meta = getattr(reference, "adapter_meta", None)
    if meta is None:
        ref = reference.export_state_dict()
    else:  # train.lora: final/ holds the merged model, as save_lora_aware writes it
        from areal.engines.hf_io import export_plain
        from areal.engines.lora import merged_state_dict

        ref = export_plain(merged_state_dict(reference.model.state_dict(), meta.alpha / meta.r))
    assert final.keys() == ref.keys()
    worst = max((final[k].float() - ref[k].float()).abs().max().item() for k in ref)
    print(
        f"replayed {len(stats)} steps on one process: losses within {worst_loss:.2e}, "
        f"final weights within {worst:.2e}"
    )
    assert worst <= (atol if weights_atol is None else weights_atol)


@pytest.mark.slow  # a 10-step run with two trainer ranks: ~1 minute on 2 cores
def test_two_fsdp_ranks_train_with_exact_accounting(tmp_path):
    out = tmp_path / "ranks"
    proc = start_run(out, *RANKS, "train.total_steps=10", "train.record_batches=true")
    _, err = proc.communicate(timeout=900)  # hang guard
    assert proc.returncode == 0, err.decode()[-3000:]
    summary = check_invariants(out, eta=4, B=16)
    assert summary["steps"] == 10
    assert all(r["n_microbatches"] >= 2 for r in records(out))  # something to share out
    assert_matches_one_process(out)
    follower = _log(out, FOLLOWER)
    assert "trainer_rank_following" in follower
    assert re.search(r"trainer_rank_stopped\s+exit_code=0", follower)  # rank 0's stop call
    assert "rank_group_leading" in _log(out, "trainer-0")
    assert "worker_restarted" not in err.decode()


@pytest.mark.slow  # 24 steps and one group restart: ~2 minutes on 2 cores
def test_rank1_sigkilled_mid_run_restarts_the_group_and_nothing_is_lost(tmp_path):
    out = tmp_path / "kill"
    # a checkpoint every 4 steps (the example's 10 would leave none to resume from at 8)
    proc = start_run(
        out, *RANKS, "train.total_steps=24", "nats.ack_wait_s=4", "train.checkpoint_every=4"
    )
    try:
        wait_steps(proc, out, 8)
        pid = _worker_pid(proc.pid, FOLLOWER)
        assert pid is not None
        lead_pid = _worker_pid(proc.pid, "trainer-0")
        os.kill(pid, signal.SIGKILL)
        t_kill = time.monotonic()
        step_at_kill = len(records(out))
        # the group comes back: a new rank 0 resumes from the checkpoint and trains on
        deadline = t_kill + 600  # hang guard
        while _log(out, "trainer-0").count("trainer_resumed") < 1:
            assert proc.poll() is None, proc.stderr.read().decode()[-3000:]
            assert time.monotonic() < deadline, "the trainer group did not come back"
            time.sleep(0.2)
        restart_s = time.monotonic() - t_kill
        _, err = proc.communicate(timeout=900)  # hang guard
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err.decode()[-3000:]
    print(f"rank 1 killed after step {step_at_kill}; group resumed after {restart_s:.1f} s")
    assert lead_pid is not None and not Path(f"/proc/{lead_pid}").exists()  # rank 0 went too
    summary = check_invariants(out, eta=4, B=16)  # every step once, every task once
    assert summary["steps"] == 24
    stderr = err.decode()
    assert "worker_restarted" in stderr and "trainer_rank_failed" in stderr
    assert stderr.count("trainer_group_started") == 2  # the first start and the restart
    follower = _log(out, FOLLOWER)
    assert follower.count("trainer_rank_following") == 2


# `areal run` whose trainer is `torchrun --standalone --nproc-per-node 2 -m workers.trainer`
# (every other role as usual): the ranks read RANK / WORLD_SIZE / MASTER_* from torchrun.
TORCHRUN_LAUNCHER = """
import subprocess, sys, time
from areal.config import load_settings
from areal.launch import local
from areal.proc import die_with_parent

class TorchrunLauncher(local.Launcher):
    def _start(self, wid):
        if wid != local.TRAINER:
            return super()._start(wid)
        logf = open(self.out / "logs" / f"{wid}.log", "ab")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc-per-node", "2", "-m", "workers.trainer",
               "--config", str(self._cfg_path), "--worker-id", wid]
        self.procs[wid] = subprocess.Popen(
            cmd, stdout=logf, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            env={**self._env, "OMP_NUM_THREADS": "1"}, preexec_fn=die_with_parent)
        self.started_at[wid] = time.monotonic()

sets = [f"out_dir={sys.argv[2]}", "train.total_steps=6", "train.engine=fsdp"]
sys.exit(TorchrunLauncher(load_settings(sys.argv[1], sets), quiet=True).run())
"""


@pytest.mark.slow  # a 6-step run: ~1 minute on 2 cores
def test_the_trainer_worker_runs_as_two_ranks_under_torchrun(tmp_path):
    import subprocess
    import sys

    from tests.e2e.test_run import EXAMPLE, ROOT

    out = tmp_path / "torchrun"
    res = subprocess.run(
        [sys.executable, "-c", TORCHRUN_LAUNCHER, str(EXAMPLE), str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,  # hang guard
    )
    assert res.returncode == 0, res.stderr[-3000:]
    summary = check_invariants(out, eta=4, B=16)
    assert summary["steps"] == 6
    log = _log(out, "trainer-0")  # torchrun writes both ranks' output there
    assert "rank_group_leading" in log and "trainer_rank_following" in log
    assert re.search(r"trainer_rank_stopped\s+exit_code=0", log)

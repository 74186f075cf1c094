"""A user's objective and advantage end to end: `algo.loss: pkg.mod:fn` written to a temp dir
trains through the real `areal run` on the quickstart config (with RLOO advantages, Dr. GRPO's
constant normaliser and a KL term to the frozen initial weights), keeping every invariant; a
`pkg.mod:fn` that does not exist fails at start with one line, before anything is written."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path

import pytest

from tests.e2e.test_run import EXAMPLE, ROOT, check_invariants, records

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]

USER_LOSS = """
import os
from pathlib import Path

import torch

from areal.algo.loss import LossInput, reduce_tokens


def reinforce(inp: LossInput, cfg) -> torch.Tensor:
    # plain REINFORCE on the loss tokens, divided by the run's normaliser
    Path(os.environ["USER_LOSS_MARK"]).touch()  # the trainer really called it
    per_token = torch.where(inp.mask, -inp.adv * inp.logp, torch.zeros_like(inp.logp))
    return reduce_tokens(per_token, inp.loss_denominator, int(inp.mask.sum()))
"""


def run(tmp_path: Path, *sets: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    env["USER_LOSS_MARK"] = str(tmp_path / "called")
    args = [sys.executable, "-m", "areal.cli", "run", str(EXAMPLE), "--out", str(tmp_path / "run")]
    for kv in (f"run_id=uloss-{uuid.uuid4().hex[:6]}", *sets):
        args += ["--set", kv]
    return subprocess.run(
        [*args, "--quiet"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )


@pytest.mark.slow  # a short real run: ~1 minute on a 2-core CPU
def test_a_user_loss_runs_end_to_end(tmp_path: Path) -> None:
    (tmp_path / "user_rl_loss.py").write_text(textwrap.dedent(USER_LOSS))
    res = run(
        tmp_path,
        "algo.loss=user_rl_loss:reinforce",
        "algo.advantage=rloo",
        "algo.loss_norm=constant",
        "algo.kl_coef=0.05",  # + k3 KL to the frozen initial weights, after the user's loss
        "train.n_minibatches=1",  # so step 1 is all on the initial weights: KL exactly 0
        "train.total_steps=4",
        "train.checkpoint_every=1",
    )
    assert res.returncode == 0, res.stderr[-3000:]
    assert (tmp_path / "called").exists()
    out = tmp_path / "run"
    check_invariants(out, eta=1, B=16)
    resolved = json.loads((out / "config.json").read_text())["algo"]
    assert (resolved["loss"], resolved["advantage"]) == ("user_rl_loss:reinforce", "rloo")
    recs = records(out)
    for r in recs:
        assert r["clipfrac"] == 0.0  # a bare tensor: the generic stats, nothing clipped
    assert recs[0]["kl_ref"] == 0.0  # before the first update the policy is the reference
    assert all(r["kl_ref"] > 0.0 for r in recs[1:])  # k3 >= 0, and the policy has moved


def test_a_user_function_that_does_not_exist_fails_at_start_in_one_line(tmp_path: Path) -> None:
    (tmp_path / "user_rl_loss.py").write_text(textwrap.dedent(USER_LOSS))
    res = run(tmp_path, "algo.loss=user_rl_loss:no_such_fn")
    assert res.returncode == 2, res.stderr[-3000:]
    lines = [ln for ln in res.stderr.splitlines() if "config error" in ln]
    assert len(lines) == 1, res.stderr
    assert "algo.loss='user_rl_loss:no_such_fn'" in lines[0] and "no attribute" in lines[0]
    assert not (tmp_path / "run").exists()

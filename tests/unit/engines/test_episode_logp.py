"""Multi-turn episodes through all three train engines: a real episode (the torch inference
engine generates each turn of the tiny Qwen2; environment tokens are appended between turns),
sent as a `Sample` through the codec into `TrainSeq`s, then, at the weights that generated it:
- each engine's recomputed log-probs of the model tokens equal the behaviour log-probs within
  1e-5 (torch in this process; FSDP2 and DeepSpeed ZeRO-3 on 2 spawned gloo ranks each);
- each engine's train step on it reports the same loss and stats as the torch engine, over
  model tokens only (`n_tokens`), and lands on the same weights.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import traceback
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from areal.bus.embedded import free_port
from areal.engines.config import TrainEngineConfig
from tests.unit.engines.helpers import (
    generate_episodes,
    infer_engine,
    random_prompts,
)
from tests.unit.engines.test_loss_mask import wire_seqs

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]
HANG_GUARD_S = 600  # a wedged collective fails the test instead of hanging the suite
TEMPERATURE = 0.7
MAX_TOKENS_PER_MB = 24  # several micro-batches: more than the ranks
TOL = 1e-5
STAT_KEYS = ("loss", "clipfrac", "approx_kl", "entropy", "grad_norm", "behav_imp_weight_mean")


def _cfg(kind: str, model_dir: str, **kw) -> TrainEngineConfig:
    return TrainEngineConfig(
        kind=kind, model_path=model_dir, lr=1e-2, temperature=TEMPERATURE, n_minibatches=2, **kw
    )


def _worst(logps: list[torch.Tensor], seqs) -> float:
    """max |recomputed - behav| over the model tokens of `seqs`."""
    return max(
        float((lp[s.loss_mask] - s.behav_logp[s.loss_mask]).abs().max())
        for lp, s in zip(logps, seqs, strict=True)
    )


# ------------------------------------------------------------------ the ranks
def _rank_main(rank: int, world: int, port: int, job: dict, out: str) -> None:
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        DS_ACCELERATOR="cpu",
        TORCH_EXTENSIONS_DIR=job["ext_dir"],
    )
    torch.set_num_threads(1)
    try:
        if job["kind"] == "fsdp":
            from areal.engines.fsdp_train import FSDPTrainEngine

            eng = FSDPTrainEngine(_cfg("fsdp", job["model_dir"]))
        else:
            from areal.engines.deepspeed_train import DeepSpeedTrainEngine

            eng = DeepSpeedTrainEngine(_cfg("deepspeed", job["model_dir"], zero_stage=3))
        # every rank makes the same calls (what the rank group replays on the followers)
        logp = eng.compute_logp(job["seqs"], MAX_TOKENS_PER_MB)
        stats = eng.train_step(job["seqs"], MAX_TOKENS_PER_MB)
        weights = eng.export_safetensors()
        if rank == 0:
            torch.save({"logp": logp, "stats": stats, "weights": weights}, Path(out) / "res.pt")
        from areal.engines.rank_group import leave_group

        leave_group()
    except BaseException:
        (Path(out) / f"error-{rank}.txt").write_text(traceback.format_exc())
        raise


def run_ranks(kind: str, world: int, model_dir: str, seqs, tmp_path: Path) -> dict:
    out = tmp_path / kind
    out.mkdir()
    job = {
        "kind": kind,
        "model_dir": model_dir,
        "seqs": seqs,
        "ext_dir": str(tmp_path / "torch_extensions"),
    }
    ctx = mp.get_context("spawn")
    port = free_port()
    procs = [
        ctx.Process(target=_rank_main, args=(r, world, port, job, str(out))) for r in range(world)
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=HANG_GUARD_S)
    alive = [p for p in procs if p.is_alive()]
    for p in alive:
        p.kill()  # our own child, by its handle
        p.join()
    errors = "\n".join(f.read_text() for f in sorted(out.glob("error-*.txt")))
    assert not alive, f"ranks still running after {HANG_GUARD_S} s\n{errors}"
    assert all(p.exitcode == 0 for p in procs), f"{[p.exitcode for p in procs]}\n{errors}"
    return torch.load(out / "res.pt", weights_only=False)


def max_weight_diff(a: bytes, b: bytes) -> float:
    from safetensors.torch import load

    wa, wb = load(a), load(b)
    assert wa.keys() == wb.keys()
    return max(float((wa[k].float() - wb[k].float()).abs().max()) for k in wa)


# ---------------------------------------------------------------------- tests
@pytest.fixture(scope="module")
def episode_seqs(model_dir):
    prompts = random_prompts([4, 2, 7, 3], seed=9)
    engine = infer_engine(model_dir, max_batch_size=8, seed=11)
    eps = generate_episodes(engine, prompts, turns=3, max_new_tokens=6, temperature=TEMPERATURE)
    return wire_seqs(prompts, eps)


@pytest.fixture(scope="module")
def torch_ref(model_dir, episode_seqs):
    """The 1-process torch engine on the episode batch: log-probs, one step, its weights."""
    from areal.engines.torch_train import TorchTrainEngine

    eng = TorchTrainEngine(_cfg("torch", model_dir))
    logp = eng.compute_logp(episode_seqs, MAX_TOKENS_PER_MB)
    stats = eng.train_step([replace(s) for s in episode_seqs], MAX_TOKENS_PER_MB)  # copies:
    # the step fills their prox_logp
    return logp, stats, eng.export_safetensors()


@pytest.mark.parametrize("kind", ["fsdp", "deepspeed"])
def test_every_engine_recomputes_the_behaviour_logp_and_masks_the_loss(
    kind, model_dir, episode_seqs, torch_ref, tmp_path
):
    if kind == "deepspeed":
        pytest.importorskip("deepspeed", reason="the deepspeed extra")
    ref_logp, ref_stats, ref_weights = torch_ref
    n_model = sum(s.n_loss_tokens() for s in episode_seqs)
    assert n_model < sum(len(s.output_ids) for s in episode_seqs)  # env tokens are in the batch
    got = run_ranks(kind, 2, model_dir, episode_seqs, tmp_path)

    worst = {"torch": _worst(ref_logp, episode_seqs), kind: _worst(got["logp"], episode_seqs)}
    print(f"max |recomputed - behav| over model tokens: {worst}")
    assert max(worst.values()) <= TOL
    for a, b in zip(got["logp"], ref_logp, strict=True):
        torch.testing.assert_close(a, b, atol=TOL, rtol=0)  # env tokens' log-probs too

    stats = got["stats"]
    assert stats["n_tokens"] == ref_stats["n_tokens"] == n_model
    assert stats["tokens"] == ref_stats["tokens"]
    for k in STAT_KEYS:
        assert abs(stats[k] - ref_stats[k]) <= TOL * max(1.0, abs(ref_stats[k])), (
            k,
            stats,
            ref_stats,
        )
    diff = max_weight_diff(got["weights"], ref_weights)
    moved = max_weight_diff(got["weights"], torch_ref_start(model_dir))
    print(f"{kind}: max |weight - torch weight| after the step {diff:.2e} (moved {moved:.2e})")
    assert diff <= TOL
    assert moved > 1e-3  # the step really trained


def torch_ref_start(model_dir: str) -> bytes:
    """The starting weights, exported as the engines export theirs."""
    from areal.engines.torch_train import TorchTrainEngine

    return TorchTrainEngine(_cfg("torch", model_dir)).export_safetensors()

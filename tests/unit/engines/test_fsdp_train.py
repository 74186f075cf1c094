"""FSDPTrainEngine over real 2-process gloo groups, driven through the rank group
(`RankZeroEngine` on rank 0, `follow` on rank 1), against the 1-process TorchTrainEngine on
the same batches: log-probs, step stats and exported weights agree within 1e-5, a checkpoint
resumes on 2 or on 1 rank, a KL to a sharded frozen reference replays (kl_ref exactly 0 at
step 1), a non-finite minibatch is refused on every rank, and a rank that
dies is noticed by the other one."""

from __future__ import annotations

import multiprocessing as mp
import os
import sys
from pathlib import Path

import pytest
import torch

from areal.algo.loss import PPOLossConfig
from areal.bus.embedded import free_port
from areal.engines.config import LoraSpec, TrainEngineConfig
from tests.unit.engines.test_torch_train import make_seqs

SHAPES = [(3, 5), (7, 2), (1, 9), (4, 4), (2, 1), (5, 6), (6, 3)]
# seq lengths 8, 9, 10, 8 | 3, 11, 9 (two minibatches): FFD packs 3 + 2 micro-batches
MAX_TOKENS = 16
TOL = 1e-5
HANG_GUARD_S = 300


def batch(step: int, nan_seq: int | None = None):
    """The step's 7 sequences (fresh objects: train_step fills their prox_logp)."""
    seqs = make_seqs(SHAPES, seed=10 + step, adv=(-1.0) ** step)
    if nan_seq is not None:
        seqs[nan_seq].behav_logp[0] = float("nan")  # a non-finite loss in one minibatch
    return seqs


def engine_cfg(kind: str, model_dir: str, **kw) -> TrainEngineConfig:
    return TrainEngineConfig(kind=kind, model_path=model_dir, lr=1e-3, **{"n_minibatches": 2, **kw})


# scenario -> FSDP engine options (the others run with none)
ENGINE_OPTIONS = {
    "checkpointing": {"gradient_checkpointing": True, "activation_offload": True},
    "bf16": {"dtype": "bfloat16"},
    "lora": {"lora": LoraSpec(r=4, alpha=8.0, target_modules=("q_proj", "v_proj", "down_proj"))},
    # one minibatch: step 1 runs wholly on the initial weights, so its kl_ref is exactly 0
    "kl": {"loss_cfg": PPOLossConfig(kl_coef=0.1, kl_estimator="k3"), "n_minibatches": 1},
}
# lora + kl: the reference is the base model (no adapter), as on the torch engine
ENGINE_OPTIONS["kl_lora"] = ENGINE_OPTIONS["kl"] | ENGINE_OPTIONS["lora"]


# ----------------------------------------------------------------- the ranks' side
def _scenario(name: str, engine, out: Path) -> dict:
    """What rank 0 does with its (rank-group) engine; returns what it observed."""
    res: dict = {}
    if name == "train":
        res["logp"] = engine.compute_logp(batch(0), MAX_TOKENS)
        res["stats"] = [engine.train_step(batch(0), MAX_TOKENS)]
        res["stats"].append(engine.train_step(batch(1), MAX_TOKENS))
        engine.save_checkpoint(str(out / "ckpt"))
        res["stats"].append(engine.train_step(batch(2), MAX_TOKENS))
        res["weights"] = engine.export_safetensors()
        engine.save_pretrained(str(out / "final"))
    elif name == "resume":
        engine.load_checkpoint(str(out / "ckpt"))
        res["version"] = engine.version
        res["stats"] = [engine.train_step(batch(2), MAX_TOKENS)]
        res["weights"] = engine.export_safetensors()
    elif name in ENGINE_OPTIONS:
        res["stats"] = [engine.train_step(batch(s), MAX_TOKENS) for s in (0, 1)]
        res["weights"] = engine.export_safetensors()
        if name.startswith("kl"):
            res["logp"] = engine.compute_logp(batch(3), MAX_TOKENS)
            # one micro-batch: rank 1 has no output of its own, only a dummy pass
            res["one_mb"] = engine.train_step(batch(2)[:1], MAX_TOKENS)
        if name == "lora":
            res["logp"] = engine.compute_logp(batch(3), MAX_TOKENS)
            engine.save_pretrained(str(out / "final"))
            engine.save_checkpoint(str(out / "ckpt"))  # then step 2 twice: before and after
            engine.train_step(batch(2), MAX_TOKENS)  # loading the checkpoint back
            res["step2"] = engine.export_safetensors()
            engine.load_checkpoint(str(out / "ckpt"))
            res["version"] = engine.version
            engine.train_step(batch(2), MAX_TOKENS)
            res["step2_resumed"] = engine.export_safetensors()
    elif name == "nonfinite":
        res["stats"] = [engine.train_step(batch(0, nan_seq=5), MAX_TOKENS)]
        res["weights"] = engine.export_safetensors()
    return res


def _rank_main(rank: int, world: int, port: int, name: str, model_dir: str, out: str) -> None:
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    torch.set_num_threads(1)
    from areal.engines.fsdp_train import FSDPTrainEngine
    from areal.engines.rank_group import (
        RankEnv,
        RankZeroEngine,
        follow,
        init_rank_group,
        leave_group,
    )

    init_rank_group(RankEnv.from_env(), device="cpu", timeout_s=120)
    engine = FSDPTrainEngine(engine_cfg("fsdp", model_dir, **ENGINE_OPTIONS.get(name, {})))
    out_dir = Path(out)
    if name == "follower_dies":
        if rank == 1:
            os._exit(3)  # a follower that dies while rank 0 waits for data
        _rank0_sees_follower_die(RankZeroEngine(engine, ping_s=0.5), out_dir)
    if name == "leader_dies":
        _leader_dies(rank, engine, out_dir)
    if name == "missing":
        _missing_checkpoint(rank, engine, out_dir)
    if name.startswith("kl") and rank > 0:
        _record_steps(engine, out_dir / f"{name}-rank{rank}.pt")
    if rank > 0:
        rc = follow(engine)
        leave_group()  # as areal.launch.ranks does: exiting with the group up can abort (SIGABRT)
        sys.exit(rc)
    group = RankZeroEngine(engine)
    res = _scenario(name, group, out_dir)
    group.close(0)
    torch.save(res, out_dir / f"{name}-{world}.pt")


def _record_steps(engine, path: Path) -> None:
    """A follower's own step stats, saved after each step (what rank 0 returns is reduced),
    with what its reference model is (sharded per layer, frozen, in eval mode)."""
    from torch.distributed.fsdp import FSDPModule

    ref = engine.ref_fwd.model
    facts = {
        "fsdp_units": sum(isinstance(m, FSDPModule) for m in ref.modules()),
        "policy_fsdp_units": sum(isinstance(m, FSDPModule) for m in engine.model.modules()),
        "frozen": not any(p.requires_grad for p in ref.parameters()),
        "eval": not ref.training,
        "lora": any(".lora_" in n for n, _ in ref.named_parameters()),
    }
    train_step, seen = engine.train_step, []

    def recorded(*args, **kw):
        seen.append(train_step(*args, **kw))
        torch.save({"steps": seen, "ref": facts}, path)
        return seen[-1]

    engine.train_step = recorded


def _rank0_sees_follower_die(group, out: Path) -> None:
    import threading

    from areal.engines.rank_group import RankGroupError

    lost = threading.Event()
    group.on_lost = lambda _e: lost.set()
    res = {"lost": lost.wait(HANG_GUARD_S)}
    try:
        group.train_step(batch(0), MAX_TOKENS)
    except RankGroupError as e:
        res["refused"] = str(e)
    torch.save(res, out / "follower_dies.pt")
    os._exit(0)  # a broken gloo group may abort at interpreter exit


def _leader_dies(rank: int, engine, out: Path) -> None:
    from areal.engines.rank_group import RankZeroEngine, follow

    if rank == 0:
        RankZeroEngine(engine).compute_logp(batch(0), MAX_TOKENS)
        os._exit(0)  # gone without a stop call
    try:
        follow(engine)
        res = {"raised": None}
    except Exception as e:
        res = {"raised": type(e).__name__}
    torch.save(res, out / "leader_dies.pt")
    os._exit(0)


def _missing_checkpoint(rank: int, engine, out: Path) -> None:
    """Both ranks get the same FileNotFoundError (rank 0 alone looks at the file), and a failed
    call breaks the group: no later call runs on it."""
    from areal.engines.rank_group import RankGroupError, RankZeroEngine, follow

    res: dict = {}
    group = RankZeroEngine(engine) if rank == 0 else None
    try:
        if group is not None:
            group.load_checkpoint(str(out / "nowhere"))
        else:
            follow(engine)
    except FileNotFoundError as e:
        res["error"] = str(e)
    if group is not None:
        try:
            group.train_step(batch(0), MAX_TOKENS)
        except RankGroupError as e:
            res["refused"] = str(e)
    torch.save(res, out / f"missing-rank{rank}.pt")
    os._exit(0)


# ----------------------------------------------------------------- the test's side
def run_group(name: str, world: int, model_dir: str, out: Path) -> dict:
    ctx = mp.get_context("spawn")
    port = free_port()
    procs = [
        ctx.Process(target=_rank_main, args=(r, world, port, name, model_dir, str(out)))
        for r in range(world)
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join(HANG_GUARD_S)
    for p in procs:
        if p.is_alive():
            p.kill()
    codes = [p.exitcode for p in procs]
    assert codes == [0] * world, codes
    path = out / (f"{name}-{world}.pt" if (out / f"{name}-{world}.pt").exists() else f"{name}.pt")
    return torch.load(path, weights_only=False) if path.exists() else {}


def torch_reference(model_dir: str, steps: list[int], nan_seq: int | None = None, **kw) -> dict:
    from areal.engines.torch_train import TorchTrainEngine

    eng = TorchTrainEngine(engine_cfg("torch", model_dir, **kw))
    res = {"logp": eng.compute_logp(batch(0), MAX_TOKENS)}
    res["stats"] = [eng.train_step(batch(s, nan_seq), MAX_TOKENS) for s in steps]
    res["weights"] = eng.export_safetensors()
    res["logp_after"] = eng.compute_logp(batch(3), MAX_TOKENS)
    return res


def max_weight_diff(a: bytes, b: bytes) -> float:
    from safetensors.torch import load

    wa, wb = load(a), load(b)
    assert set(wa) == set(wb)
    assert all(wa[k].dtype == wb[k].dtype and wa[k].shape == wb[k].shape for k in wa)
    return max(float((wa[k] - wb[k]).abs().max()) for k in wa)


def assert_stats_close(ref: dict[str, float], got: dict[str, float]) -> None:
    assert set(ref) == set(got)
    for k in ref:
        if k != "time_s":
            assert abs(ref[k] - got[k]) <= TOL * max(1.0, abs(ref[k])), (k, ref[k], got[k])


@pytest.fixture(scope="module")
def trained(model_dir, tmp_path_factory):
    """The 2-rank FSDP run (3 steps, a checkpoint after step 2) and its torch reference."""
    out = tmp_path_factory.mktemp("fsdp2")
    return out, run_group("train", 2, model_dir, out), torch_reference(model_dir, [0, 1, 2])


@pytest.mark.slow  # two spawned ranks load torch + transformers: ~20-40 s on 2 busy cores
def test_two_ranks_match_one_torch_process_on_the_same_batches(trained):
    _, got, ref = trained
    for a, b in zip(ref["logp"], got["logp"], strict=True):
        torch.testing.assert_close(b, a, rtol=0, atol=TOL)
    for r, g in zip(ref["stats"], got["stats"], strict=True):
        assert_stats_close(r, g)
    assert got["stats"][0]["n_microbatches"] == 5  # 3 in one minibatch: rank 1 ran a dummy
    assert max_weight_diff(ref["weights"], got["weights"]) <= TOL


@pytest.mark.slow
def test_rank0_writes_the_hf_dir_with_the_exported_weights(trained):
    from safetensors.torch import load
    from transformers import AutoModelForCausalLM

    out, got, _ = trained
    model = AutoModelForCausalLM.from_pretrained(out / "final", local_files_only=True)
    exported = load(got["weights"])
    for name, t in model.state_dict().items():
        torch.testing.assert_close(t, exported[name], rtol=0, atol=0)
    assert (out / "final" / "tokenizer_config.json").exists()


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 1])
def test_a_checkpoint_resumes_on_two_or_one_rank_to_the_same_step(trained, model_dir, world):
    out, got, _ = trained
    resumed = run_group("resume", world, model_dir, out)
    assert resumed["version"] == 2
    assert_stats_close(got["stats"][2], resumed["stats"][0])
    assert max_weight_diff(got["weights"], resumed["weights"]) <= TOL


@pytest.mark.slow
def test_gradient_checkpointing_changes_no_number(trained, model_dir, tmp_path):
    _, _, ref = trained  # activation_offload is a no-op on CPU; it must not get in the way
    got = run_group("checkpointing", 2, model_dir, tmp_path)
    for r, g in zip(ref["stats"][:2], got["stats"], strict=True):
        assert_stats_close(r, g)
    two_steps = torch_reference(model_dir, [0, 1])
    assert max_weight_diff(two_steps["weights"], got["weights"]) <= TOL


@pytest.mark.slow
def test_bf16_compute_keeps_fp32_master_weights_and_exports_bf16(model_dir, tmp_path):
    from safetensors.torch import load

    got = run_group("bf16", 2, model_dir, tmp_path)
    weights = load(got["weights"])
    assert {t.dtype for t in weights.values()} == {torch.bfloat16}
    assert all(torch.isfinite(torch.tensor(s["loss"])) for s in got["stats"])
    assert all(s["skipped_minibatches"] == 0 for s in got["stats"])
    ref = torch_reference(model_dir, [0, 1])  # fp32: bf16 compute is close, not equal
    assert (
        abs(got["stats"][0]["loss"] - ref["stats"][0]["loss"])
        < 0.05 * abs(ref["stats"][0]["loss"]) + 1e-3
    )


@pytest.mark.slow
def test_lora_on_two_ranks_replays_through_one_torch_process(model_dir, tmp_path):
    """The adapter trained by 2 FSDP ranks is the 1-process one (the same tolerances); only the
    adapter is exported, and final/ holds the merged model and adapter/."""
    from safetensors.torch import load
    from transformers import AutoModelForCausalLM

    from areal.engines.lora import ADAPTER_KEY

    got = run_group("lora", 2, model_dir, tmp_path)
    ref = torch_reference(model_dir, [0, 1], **ENGINE_OPTIONS["lora"])
    for r, g in zip(ref["stats"], got["stats"], strict=True):
        assert_stats_close(r, g)
    assert max_weight_diff(ref["weights"], got["weights"]) <= TOL
    adapter = load(got["weights"])
    assert ADAPTER_KEY in adapter and all(".lora_" in k for k in set(adapter) - {ADAPTER_KEY})
    for a, b in zip(ref["logp_after"], got["logp"], strict=True):
        torch.testing.assert_close(b, a, rtol=0, atol=TOL)
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "final", local_files_only=True)
    assert not any("lora" in k for k in merged.state_dict())
    assert (tmp_path / "final" / "adapter" / "adapter_model.safetensors").exists()
    assert got["version"] == 2  # a LoRA run's checkpoint resumes to the same step
    assert max_weight_diff(got["step2"], got["step2_resumed"]) <= TOL


@pytest.mark.slow  # two spawned ranks with a policy and a reference each: ~20 s on 2 cores
@pytest.mark.parametrize("name", ["kl", "kl_lora"])
def test_kl_to_the_reference_on_two_ranks_replays_through_one_torch_process(
    model_dir, tmp_path, name
):
    """Each rank holds a sharded frozen reference: the stats (kl_ref too), the weights and the
    log-probs after are the 1-process torch engine's; kl_ref is exactly 0 at step 1 on both."""
    got = run_group(name, 2, model_dir, tmp_path)
    ref = torch_reference(model_dir, [0, 1], **ENGINE_OPTIONS[name])
    for r, g in zip(ref["stats"], got["stats"], strict=True):
        assert_stats_close(r, g)
    assert max_weight_diff(ref["weights"], got["weights"]) <= TOL
    for a, b in zip(ref["logp_after"], got["logp"], strict=True):
        torch.testing.assert_close(b, a, rtol=0, atol=TOL)
    rank1 = torch.load(tmp_path / f"{name}-rank1.pt", weights_only=False)
    facts = rank1["ref"]
    assert facts["fsdp_units"] == facts["policy_fsdp_units"] > 1
    assert facts["frozen"] and facts["eval"] and not facts["lora"]  # lora: the base model
    assert (
        got["stats"][0]["kl_ref"] == rank1["steps"][0]["kl_ref"] == ref["stats"][0]["kl_ref"] == 0.0
    )
    assert got["stats"][1]["kl_ref"] > 0.0  # k3 once the policy has moved
    assert got["one_mb"]["n_microbatches"] == 1 and got["one_mb"]["kl_ref"] > 0.0
    assert set(got["one_mb"]) == set(got["stats"][0])


@pytest.mark.slow
def test_a_non_finite_minibatch_is_refused_on_every_rank(model_dir, tmp_path):
    got = run_group("nonfinite", 2, model_dir, tmp_path)
    ref = torch_reference(model_dir, [0], nan_seq=5)
    assert ref["stats"][0]["skipped_minibatches"] == got["stats"][0]["skipped_minibatches"] == 1
    assert_stats_close(ref["stats"][0], got["stats"][0])
    # had one rank stepped on its shards, the gathered weights would differ from one process's
    assert max_weight_diff(ref["weights"], got["weights"]) <= TOL


@pytest.mark.slow
def test_a_missing_checkpoint_fails_alike_on_every_rank_and_breaks_the_group(model_dir, tmp_path):
    run_group("missing", 2, model_dir, tmp_path)
    rank0, rank1 = (
        torch.load(tmp_path / f"missing-rank{r}.pt", weights_only=False) for r in (0, 1)
    )
    assert "no checkpoint at" in rank0["error"] and rank0["error"] == rank1["error"]
    assert "rank group broke" in rank0["refused"]


@pytest.mark.slow
def test_a_follower_that_dies_is_noticed_while_rank0_idles(model_dir, tmp_path):
    ctx = mp.get_context("spawn")
    port = free_port()
    procs = [
        ctx.Process(target=_rank_main, args=(r, 2, port, "follower_dies", model_dir, str(tmp_path)))
        for r in range(2)
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join(HANG_GUARD_S)
    assert [p.exitcode for p in procs] == [0, 3]
    res = torch.load(tmp_path / "follower_dies.pt", weights_only=False)
    assert res["lost"] is True
    assert "rank group broke" in res["refused"]  # no call runs on a broken group


@pytest.mark.slow
def test_a_follower_raises_when_rank0_dies_without_a_stop_call(model_dir, tmp_path):
    got = run_group("leader_dies", 2, model_dir, tmp_path)
    assert got["raised"] is not None


def test_rank_share_gives_every_rank_the_same_number_of_passes():
    from areal.engines.fsdp_train import rank_share

    # 5 micro-batches over 2 ranks: rank 0 runs 0, 2, 4; rank 1 runs 1, 3 and one dummy
    assert rank_share(5, 0, 2) == ([0, 2, 4], 3)
    assert rank_share(5, 1, 2) == ([1, 3], 3)
    assert rank_share(1, 1, 2) == ([], 1)  # a rank with no share still runs one pass
    assert rank_share(0, 0, 2) == ([], 0)
    assert rank_share(4, 0, 1) == ([0, 1, 2, 3], 4)

"""DeepSpeedTrainEngine on CPU (gloo): 2 ranks equal 1 rank (ZeRO-1/2/3), checkpoints
resume exactly, the non-finite guard refuses a step on every rank, nothing is JIT-compiled.

Each scenario runs in fresh spawned processes (a rank per process, ``DS_ACCELERATOR=cpu``,
a free ``MASTER_PORT``, an empty ``TORCH_EXTENSIONS_DIR``); the reference is a 1-rank
``TorchTrainEngine`` fed the same batches in the test process.
"""

from __future__ import annotations

import math
import multiprocessing as mp
import os
import traceback
from pathlib import Path

import pytest
import torch

from areal.algo.loss import PPOLossConfig
from areal.bus.embedded import free_port
from areal.engines.base import TrainSeq
from areal.engines.config import TrainEngineConfig
from areal.engines.torch_infer import weights_from_safetensors
from areal.engines.torch_train import TorchTrainEngine

pytest.importorskip("deepspeed", reason="the deepspeed extra: DS_BUILD_OPS=0 pip install deepspeed")
pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]
HANG_GUARD_S = 600  # a wedged collective fails the test instead of hanging the suite
MAX_TOKENS_PER_MB = 16  # several micro-batches per minibatch, an odd count among them
# (prompt, output) lengths; one sample without output tokens (dropped from the loss)
SHAPES = [(3, 5), (7, 2), (1, 9), (4, 4), (2, 0), (5, 6), (2, 3)]
TOL = 1e-5


def make_batch(seed: int, adv_nan_at: int | None = None) -> list[TrainSeq]:
    g = torch.Generator().manual_seed(seed)
    seqs = []
    for k, (p, t) in enumerate(SHAPES):
        adv = float("nan") if k == adv_nan_at else float(torch.randn((), generator=g))
        seqs.append(
            TrainSeq(
                prompt_ids=torch.randint(1, 32, (p,), generator=g),
                output_ids=torch.randint(1, 32, (t,), generator=g),
                # off-policy by a little: ratios, weights and clipping all take part
                behav_logp=-3.5 + 0.3 * torch.rand(t, generator=g),
                versions=torch.zeros(t, dtype=torch.long),
                adv=adv,
            )
        )
    return seqs


def engine_cfg(kind: str, model_dir: str, **kw) -> TrainEngineConfig:
    kw.setdefault("lr", 1e-3)
    kw.setdefault("n_minibatches", 2)
    return TrainEngineConfig(kind=kind, model_path=model_dir, **kw)


def clone(seqs: list[TrainSeq]) -> list[TrainSeq]:
    return [
        TrainSeq(s.prompt_ids, s.output_ids, s.behav_logp.clone(), s.versions, s.adv) for s in seqs
    ]


# ------------------------------------------------------------------ the ranks
def _rank_main(rank: int, world: int, port: int, job: dict, out: str) -> None:
    """One rank: env of a launcher-less group, then the scenario; rank 0 saves its results
    (every rank saves an error file on failure)."""
    os.environ.update(DS_ACCELERATOR="cpu", TORCH_EXTENSIONS_DIR=job["ext_dir"])
    rendezvous = {
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
        "WORLD_SIZE": str(world),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
    }
    for k in rendezvous:
        os.environ.pop(k, None)
    if not job.get("no_env"):  # no_env: a lone process, the engine makes its own 1-rank group
        os.environ.update(rendezvous)
    torch.set_num_threads(1)
    try:
        if job.get("init_first"):  # as the rank group does: the engine joins the live group
            import torch.distributed as dist

            dist.init_process_group("gloo", rank=rank, world_size=world)
        result = SCENARIOS[job["scenario"]](job)
        if rank == 0:
            torch.save(result, Path(out) / "result.pt")
        from areal.engines.rank_group import leave_group

        leave_group()  # before exit: a rank left to exit-time gloo teardown can abort (-6)
    except BaseException:
        (Path(out) / f"error-{rank}.txt").write_text(traceback.format_exc())
        raise


def _ds_engine(job: dict, **kw):
    from areal.engines.deepspeed_train import DeepSpeedTrainEngine

    return DeepSpeedTrainEngine(engine_cfg("deepspeed", job["model_dir"], **job["cfg"], **kw))


def _steps(engine, batches: list[list[TrainSeq]]) -> list[dict[str, float]]:
    return [engine.train_step(clone(b), MAX_TOKENS_PER_MB) for b in batches]


def _count_passes(eng) -> dict[str, int]:
    """Counts of backward calls and of grad-enabled forwards of layer 0's attention (twice
    per backward when the layer is recomputed)."""
    counts = {"backward": 0, "grad_forward": 0}
    backward = eng.engine.backward

    def counting_backward(loss):
        counts["backward"] += 1
        return backward(loss)

    def on_forward(module, args):
        counts["grad_forward"] += int(torch.is_grad_enabled())

    eng.engine.backward = counting_backward
    eng.module.model.layers[0].self_attn.register_forward_pre_hook(on_forward)
    return counts


def _same_on_every_rank(value: object) -> bool:
    import torch.distributed as dist

    values: list[object] = [None] * dist.get_world_size()
    dist.all_gather_object(values, value)
    return all(repr(v) == repr(values[0]) for v in values)


def _scenario_parity(job: dict) -> dict:
    eng = _ds_engine(job)
    logp0 = eng.compute_logp(job["batches"][0], MAX_TOKENS_PER_MB)
    counts = _count_passes(eng)
    stats = _steps(eng, job["batches"])
    # every rank returns the same full log-probs and the same stats (wall time aside)
    agree = _same_on_every_rank(
        ([t.tolist() for t in logp0], [{**s, "time_s": 0.0} for s in stats])
    )
    return {
        "logp0": logp0,
        "stats": stats,
        "ranks_agree": agree,
        "weights": eng.export_safetensors(),
        **counts,
    }


def _scenario_bf16(job: dict) -> dict:
    eng = _ds_engine(job)
    stats = _steps(eng, job["batches"])
    return {
        "stats": stats,
        "module_dtypes": {str(p.dtype) for p in eng.module.parameters()},
        "master_dtypes": {
            str(p.dtype) for g in eng.optimizer.optimizer.param_groups for p in g["params"]
        },
        "weights": eng.export_safetensors(),
    }


def _scenario_checkpoint(job: dict) -> dict:
    first, rest = job["batches"][:1], job["batches"][1:]
    ckpt = str(Path(job["tmp"]) / "ckpt")
    eng = _ds_engine(job)
    _steps(eng, first)
    eng.save_checkpoint(ckpt)
    eng.save_checkpoint(ckpt)  # a second save replaces the first
    straight = _steps(eng, rest)
    weights = eng.export_safetensors()
    hf_dir = Path(job["tmp"]) / "hf"
    eng.save_pretrained(str(hf_dir))
    try:
        eng.load_checkpoint(str(Path(job["tmp"]) / "nowhere"))
        missing = ""
    except FileNotFoundError as e:
        missing = str(e)
    resumed = _ds_engine(job)
    resumed.load_checkpoint(ckpt)
    version = resumed.version
    again = _steps(resumed, rest)
    return {
        "version": version,
        "straight": straight,
        "again": again,
        "weights": weights,
        "missing": missing,
        "weights_again": resumed.export_safetensors(),
        "ckpt_dirs": sorted(p.name for p in Path(ckpt).iterdir() if p.is_dir()),
    }


def _scenario_guard(job: dict) -> dict:
    eng = _ds_engine(job)
    before = eng.export_safetensors()
    bad = eng.train_step(clone(job["bad"]), MAX_TOKENS_PER_MB)
    after_bad = eng.export_safetensors()
    good = _steps(eng, job["batches"][:1])
    return {
        "before": before,
        "bad": bad,
        "after_bad": after_bad,
        "good": good,
        "weights": eng.export_safetensors(),
    }


def _scenario_lora(job: dict) -> dict:
    """An adapter trained on the ranks: exports, checkpoint and resume, the HF dir."""
    first, rest = job["batches"][:1], job["batches"][1:]
    ckpt = str(Path(job["tmp"]) / "ckpt")
    eng = _ds_engine(job)
    n_trainable = sum(p.numel() for p in eng.module.parameters() if p.requires_grad)
    n_optimized = sum(p.numel() for g in eng.optimizer.param_groups for p in g["params"])
    stats = _steps(eng, first)
    eng.save_checkpoint(ckpt)
    straight = _steps(eng, rest)
    adapter = eng.export_safetensors()
    eng.save_pretrained(str(Path(job["tmp"]) / "hf"))
    resumed = _ds_engine(job)
    resumed.load_checkpoint(ckpt)
    again = _steps(resumed, rest)
    full = _ds_engine({**job, "cfg": {k: v for k, v in job["cfg"].items() if k != "lora"}})
    try:
        full.load_checkpoint(ckpt)
        refused = ""
    except ValueError as e:
        refused = str(e)
    return {
        "stats": stats + straight,
        "again": again,
        "adapter": adapter,
        "adapter_again": resumed.export_safetensors(),
        "n_trainable": n_trainable,
        "n_optimized": n_optimized,  # this rank's ZeRO-2 partition of what trains
        "refused": refused,
    }


SCENARIOS = {
    "lora": _scenario_lora,
    "bf16": _scenario_bf16,
    "parity": _scenario_parity,
    "checkpoint": _scenario_checkpoint,
    "guard": _scenario_guard,
}


def run_ranks(world: int, job: dict, tmp_path: Path) -> dict:
    """Run ``job`` on ``world`` spawned ranks; rank 0's result."""
    out = tmp_path / f"out-{job['scenario']}"
    out.mkdir()
    job = {**job, "tmp": str(tmp_path), "ext_dir": str(tmp_path / "torch_extensions")}
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
    assert not alive, f"ranks still running after {HANG_GUARD_S} s (a collective hung)\n{errors}"
    assert all(p.exitcode == 0 for p in procs), (
        f"exit codes {[p.exitcode for p in procs]}\n{errors}"
    )
    assert not any((tmp_path / "torch_extensions").rglob("*")), "DeepSpeed JIT-built an op"
    return torch.load(out / "result.pt", weights_only=False)


# ------------------------------------------------------------------ reference
def torch_reference(model_dir: str, cfg: dict, batches: list[list[TrainSeq]]):
    """The 1-rank TorchTrainEngine after ``batches``; its first log-probs and step stats."""
    eng = TorchTrainEngine(engine_cfg("torch", model_dir, **cfg))
    logp0 = eng.compute_logp(batches[0], MAX_TOKENS_PER_MB)
    stats = [eng.train_step(clone(b), MAX_TOKENS_PER_MB) for b in batches]
    return eng, logp0, stats


def max_weight_diff(a: bytes, b: bytes, *, same_keys: bool = True) -> float:
    """Max |a - b| over the tensors of two safetensors blobs (over b's keys if not same_keys:
    a model file on disk has no tied ``lm_head.weight``)."""
    wa, wb = weights_from_safetensors(a), weights_from_safetensors(b)
    if same_keys:
        assert wa.keys() == wb.keys()
    return max(float((wa[k].float() - wb[k].float()).abs().max()) for k in wb)


STAT_KEYS = ("loss", "clipfrac", "approx_kl", "entropy", "grad_norm", "behav_imp_weight_mean")
COUNT_KEYS = ("n_tokens", "tokens", "n_microbatches", "skipped_minibatches", "padding_frac")


def assert_stats_close(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    for k in STAT_KEYS:
        assert abs(got[k] - want[k]) <= TOL * max(1.0, abs(want[k])), (k, got[k], want[k])
    for k in COUNT_KEYS:
        assert got[k] == want[k], (k, got[k], want[k])


# ---------------------------------------------------------------------- tests
@pytest.mark.parametrize("zero_stage", [1, 2, 3])
def test_two_ranks_match_one_rank(model_dir, tmp_path, zero_stage):
    batches = [make_batch(seed) for seed in (11, 12, 13)]
    ref, ref_logp0, ref_stats = torch_reference(model_dir, {}, batches)
    job = {
        "scenario": "parity",
        "model_dir": model_dir,
        "cfg": {"zero_stage": zero_stage},
        "batches": batches,
        # ZeRO-2 joins a group its caller made (the rank group); ZeRO-3 makes it from the env
        "init_first": zero_stage == 2,
    }
    got = run_ranks(2, job, tmp_path)

    for a, b in zip(got["logp0"], ref_logp0, strict=True):
        torch.testing.assert_close(a, b, atol=TOL, rtol=0)
    for g, w in zip(got["stats"], ref_stats, strict=True):
        assert_stats_close(g, w)
    assert all(s["n_microbatches"] >= 3 for s in ref_stats)  # more micro-batches than ranks
    diff = max_weight_diff(got["weights"], ref.export_safetensors())
    moved = max_weight_diff(
        got["weights"], (Path(model_dir) / "model.safetensors").read_bytes(), same_keys=False
    )
    loss_diff = max(
        abs(g["loss"] - w["loss"]) for g, w in zip(got["stats"], ref_stats, strict=True)
    )
    print(f"zero{zero_stage}: max |loss diff| {loss_diff:.2e}, max |weight diff| {diff:.2e}")
    assert moved > 1e-3  # training really happened
    assert diff <= TOL
    assert got["grad_forward"] == got["backward"] > 0  # no recompute without checkpointing
    assert got["ranks_agree"]


def test_one_rank_matches_the_torch_engine(model_dir, tmp_path):
    batches = [make_batch(seed) for seed in (21, 22)]
    ref, _, ref_stats = torch_reference(model_dir, {}, batches)
    job = {
        "scenario": "parity",
        "model_dir": model_dir,
        "cfg": {"zero_stage": 2},
        "batches": batches,
        "no_env": True,  # no RANK / WORLD_SIZE / MASTER_*: the engine makes a 1-rank group
    }
    got = run_ranks(1, job, tmp_path)
    for g, w in zip(got["stats"], ref_stats, strict=True):
        assert_stats_close(g, w)
    assert max_weight_diff(got["weights"], ref.export_safetensors()) <= TOL


def test_gradient_checkpointing_changes_no_number(model_dir, tmp_path):
    batches = [make_batch(seed) for seed in (31, 32)]
    ref, _, ref_stats = torch_reference(model_dir, {}, batches)
    cfg = {"zero_stage": 3, "gradient_checkpointing": True}
    got = run_ranks(
        2, {"scenario": "parity", "model_dir": model_dir, "cfg": cfg, "batches": batches}, tmp_path
    )
    for g, w in zip(got["stats"], ref_stats, strict=True):
        assert_stats_close(g, w)
    assert max_weight_diff(got["weights"], ref.export_safetensors()) <= TOL
    assert got["grad_forward"] == 2 * got["backward"] > 0  # each layer ran again in backward


@pytest.mark.parametrize("zero_stage", [2, 3])
def test_checkpoint_resumes_exactly_with_optimizer_state(model_dir, tmp_path, zero_stage):
    batches = [make_batch(seed) for seed in (41, 42, 43)]
    job = {
        "scenario": "checkpoint",
        "model_dir": model_dir,
        "cfg": {"zero_stage": zero_stage},
        "batches": batches,
    }
    got = run_ranks(2, job, tmp_path)
    assert got["version"] == 1
    # one checkpoint directory left: the one `latest` names (the first save was replaced)
    assert got["ckpt_dirs"] == [(tmp_path / "ckpt" / "latest").read_text()]
    for a, b in zip(got["again"], got["straight"], strict=True):
        for k in STAT_KEYS:  # a fresh Adam would give other numbers from the first step on
            assert a[k] == b[k], (k, a[k], b[k])
    assert max_weight_diff(got["weights_again"], got["weights"]) == 0.0
    assert "no DeepSpeed checkpoint" in got["missing"] and "save_checkpoint" in got["missing"]
    hf = (tmp_path / "hf" / "model.safetensors").read_bytes()  # rank 0 wrote the HF dir
    assert max_weight_diff(got["weights"], hf, same_keys=False) == 0.0
    assert (tmp_path / "hf" / "tokenizer_config.json").exists()


@pytest.mark.parametrize("zero_stage", [2, 3])
def test_non_finite_loss_on_one_rank_changes_no_weight_anywhere(model_dir, tmp_path, zero_stage):
    bad = make_batch(51, adv_nan_at=0)  # one sample's loss is NaN: one rank sees it
    good = [make_batch(52)]
    cfg = {"n_minibatches": 1, "zero_stage": zero_stage, "loss_cfg": PPOLossConfig()}
    ref, _, (ref_bad, ref_good) = torch_reference(model_dir, cfg, [bad, good[0]])
    job = {"scenario": "guard", "model_dir": model_dir, "cfg": cfg, "batches": good, "bad": bad}
    got = run_ranks(2, job, tmp_path)

    assert ref_bad["step_skipped"] == 1.0  # the reference refuses it too
    assert got["bad"]["step_skipped"] == 1.0 and got["bad"]["skipped_minibatches"] == 1.0
    assert all(math.isfinite(v) for v in got["bad"].values())
    assert max_weight_diff(got["after_bad"], got["before"]) == 0.0
    assert_stats_close(got["good"][0], ref_good)  # Adam state untouched by the refused step
    assert max_weight_diff(got["weights"], ref.export_safetensors()) <= TOL


def test_bf16_trains_with_fp32_master_weights(model_dir, tmp_path):
    batches = [make_batch(seed) for seed in (61, 62)]
    _, _, ref_stats = torch_reference(model_dir, {}, batches)
    job = {
        "scenario": "bf16",
        "model_dir": model_dir,
        "cfg": {"zero_stage": 2, "dtype": "bfloat16"},
        "batches": batches,
    }
    got = run_ranks(2, job, tmp_path)
    assert got["module_dtypes"] == {"torch.bfloat16"}  # forward and backward in bf16
    assert got["master_dtypes"] == {"torch.float32"}  # AdamW steps fp32 master weights
    for g, w in zip(got["stats"], ref_stats, strict=True):
        assert math.isfinite(g["loss"]) and abs(g["loss"] - w["loss"]) < 5e-2, (g, w)
        assert g["step_skipped"] == 0.0
    assert {str(t.dtype) for t in weights_from_safetensors(got["weights"]).values()} == {
        "torch.bfloat16"
    }


@pytest.mark.parametrize("zero_stage", [2, 3])
def test_kl_to_the_reference_matches_the_torch_engine(model_dir, tmp_path, zero_stage):
    """`kl_coef` > 0: each rank's frozen reference (a plain copy under ZeRO-2, an optimizer-less
    partitioned engine under ZeRO-3) gives `kl_ref` exactly 0 at step 1, and then the 1-rank
    torch engine's KL, loss and weights within the same tolerance."""
    batches = [make_batch(seed) for seed in (71, 72, 73)]
    cfg = {
        "zero_stage": zero_stage,
        "n_minibatches": 1,  # step 1's one update comes after its loss: all of it at the start
        "loss_cfg": PPOLossConfig(kl_coef=0.5, kl_estimator="k3"),
    }
    ref, _, ref_stats = torch_reference(model_dir, cfg, batches)
    job = {"scenario": "parity", "model_dir": model_dir, "cfg": cfg, "batches": batches}
    got = run_ranks(2, job, tmp_path)

    assert got["stats"][0]["kl_ref"] == 0.0 == ref_stats[0]["kl_ref"]  # exactly, on every rank
    assert got["ranks_agree"]
    for g, w in zip(got["stats"], ref_stats, strict=True):
        assert_stats_close(g, w)
        assert abs(g["kl_ref"] - w["kl_ref"]) <= TOL * max(1.0, abs(w["kl_ref"]))
    assert got["stats"][-1]["kl_ref"] > 0.0  # the policy moved away from the reference
    assert max_weight_diff(got["weights"], ref.export_safetensors()) <= TOL


def test_lora_on_two_ranks_matches_the_torch_engine(model_dir, tmp_path):
    """train.lora on ZeRO-2: only the adapter is in the optimizer and on the wire; 2 ranks give
    the 1-process torch engine's stats and adapter; a checkpoint holds the adapter and its
    optimizer state (resume is exact), and a full-weights engine refuses it."""
    from areal.engines.config import LoraSpec
    from areal.engines.lora import ADAPTER_KEY

    batches = [make_batch(seed) for seed in (81, 82, 83)]
    lora = LoraSpec(r=4, alpha=8.0, target_modules=("q_proj", "v_proj", "down_proj"))
    cfg = {"zero_stage": 2, "lora": lora}
    ref, _, ref_stats = torch_reference(model_dir, cfg, batches)
    job = {"scenario": "lora", "model_dir": model_dir, "cfg": cfg, "batches": batches}
    got = run_ranks(2, job, tmp_path)

    for g, w in zip(got["stats"], ref_stats, strict=True):
        assert_stats_close(g, w)
    want = ref.export_safetensors()
    assert ADAPTER_KEY in weights_from_safetensors(got["adapter"])
    assert max_weight_diff(got["adapter"], want) <= TOL
    assert got["n_trainable"] == sum(
        p.numel() for p in ref.model.parameters() if p.requires_grad
    )  # the adapter alone
    assert 0 < got["n_optimized"] <= got["n_trainable"]  # no base weight in the optimizer
    for a, b in zip(got["again"], got["stats"][1:], strict=True):
        for k in STAT_KEYS:  # Adam's state came back with the adapter
            assert a[k] == b[k], (k, a[k], b[k])
    assert max_weight_diff(got["adapter_again"], got["adapter"]) == 0.0
    assert "a LoRA adapter (r 4" in got["refused"] and "train.lora" in got["refused"]
    hf = tmp_path / "hf"
    assert (hf / "model.safetensors").is_file() and (
        hf / "adapter" / "adapter_config.json"
    ).is_file()

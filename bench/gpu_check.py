"""GPU check: the engines' paths on a real accelerator, in one short prepared run (no downloads).

Parts, each in its own process (a distributed engine owns its process group):
- `generate`: the inference engine (`vllm` on a GPU) generates with sampling; at a token
  boundary `poll_weights` hands in the weights of another random model (an interruption and a
  reload). Checked: some sample switched mid-way (n_interrupts > 0, versions 0 then 1), the
  engine ends at version 1, and every token's behaviour log-prob matches an HF forward of the
  weights of the version that produced it (`log_softmax(logits / T)`, mean |diff| under the
  dtype's tolerance). Reported: generated tokens/s.
- `fsdp`, `deepspeed`: a 1-rank training engine of that kind does on-policy decoupled-PPO steps
  (`compute_logp` for the behaviour log-probs, then `train_step`); checked: a finite loss and
  grad norm, version + 1 per step, exported weights that changed. Reported: trained tokens/s.

Written against the engine Protocols (`areal.engines.base`) and the factory only. The model is
built from a config (random weights, the character tokenizer): Qwen2.5-0.5B's widths and depth
on a GPU; the tiny preset with `--dry-run`, which runs every part's plumbing on the CPU (the
torch inference engine stands in for vLLM in a `generate[torch]` part, and `vllm` is reported
SKIP). A part whose engine or extra is missing prints SKIP with the reason; a failure prints
FAIL with the error; the exit status is 1 if any part failed.

    bench/gpu_check.sh [--dry-run]     (or python bench/gpu_check.py ...)
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

_HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(_HERE), str(_HERE.parent)]

PART_TIMEOUT_S = {"generate": 240, "fsdp": 150, "deepspeed": 150}


@dataclass(frozen=True)
class Plan:
    """What one run does: sizes differ between the GPU run and the CPU dry run."""

    dry_run: bool
    model_dir: str
    new_model_dir: str  # the weights loaded mid-generation
    device: str
    dtype: str
    n_requests: int
    max_new_tokens: int
    switch_at_poll: int  # the poll (token boundary) at which new weights are handed in
    train_steps: int
    train_seqs: int
    seq_len: int
    logp_tol: float  # mean |behav_logp - reference| allowed

    @classmethod
    def of(cls, dry_run: bool, work: Path) -> Plan:
        from areal.data.tiny_model import TINY_PRESET, TinyPreset, build_tiny_model

        preset = TINY_PRESET
        if not dry_run:  # Qwen2.5-0.5B's widths and depth, the character vocabulary
            preset = TinyPreset(
                hidden_size=896,
                num_attention_heads=14,
                num_key_value_heads=2,
                num_hidden_layers=24,
                intermediate_size=4864,
                max_position_embeddings=4096,
            )
        build_tiny_model(work / "m0", seed=0, preset=preset)
        build_tiny_model(work / "m1", seed=1, preset=preset)
        return cls(
            dry_run=dry_run,
            model_dir=str(work / "m0"),
            new_model_dir=str(work / "m1"),
            device="cpu" if dry_run else "cuda",
            dtype="float32" if dry_run else "bfloat16",
            n_requests=4 if dry_run else 64,
            max_new_tokens=8 if dry_run else 256,
            switch_at_poll=3 if dry_run else 64,
            train_steps=1 if dry_run else 3,
            train_seqs=4 if dry_run else 64,
            seq_len=16 if dry_run else 512,
            logp_tol=1e-3 if dry_run else 0.05,
        )


@dataclass
class Result:
    part: str
    status: str  # PASS | FAIL | SKIP
    detail: str = ""
    tokens_per_s: float | None = None
    numbers: dict = field(default_factory=dict)


# ------------------------------------------------------------------ which parts, and why not
def _missing(module: str, extra: str) -> str | None:
    if importlib.util.find_spec(module) is None:
        return f"{module} is not installed (pip install 'areal-bus[{extra}]')"
    return None


def parts_of(plan: Plan) -> dict[str, str | None]:
    """part -> None to run it, or why it is skipped."""
    import torch

    no_gpu = None if torch.cuda.is_available() else "needs a CUDA GPU (none visible)"
    out: dict[str, str | None] = {}
    if plan.dry_run:
        out["generate[torch]"] = None
    out["generate[vllm]"] = _missing("vllm", "vllm") or (None if plan.dry_run else no_gpu)
    if plan.dry_run and out["generate[vllm]"] is None:
        out["generate[vllm]"] = "vLLM runs on a GPU only (run without --dry-run)"
    out["fsdp"] = None if plan.dry_run else no_gpu
    out["deepspeed"] = _missing("deepspeed", "deepspeed") or (None if plan.dry_run else no_gpu)
    return out


# ------------------------------------------------------------------ the parts (own process)
class _Reference:
    """HF forwards of each version's weights (loaded once): the log-probs a token should have."""

    def __init__(self, plan: Plan) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        self.plan = plan
        dtype = getattr(torch, plan.dtype)
        self.models = {
            v: AutoModelForCausalLM.from_pretrained(d, dtype=dtype).to(plan.device).eval()
            for v, d in ((0, plan.model_dir), (1, plan.new_model_dir))
        }

    def logp(self, version: int, prompt: list[int], out: list[int]):
        import torch

        dev = self.plan.device
        ids = torch.tensor([prompt + out], device=dev)
        with torch.no_grad():  # temperature 1: log_softmax(logits)
            logits = self.models[version](ids).logits[0, len(prompt) - 1 : -1].float()
        logp = torch.log_softmax(logits, -1)
        return logp.gather(1, torch.tensor(out, device=dev)[:, None])[:, 0].cpu()


def part_generate(plan: Plan, kind: str) -> Result:
    import torch
    from transformers import AutoModelForCausalLM

    from areal.engines.base import GenRequest, SamplingParams, WeightUpdate
    from areal.engines.config import InferenceEngineConfig
    from areal.engines.factory import make_inference_engine
    from areal.engines.torch_train import export_state_dict

    engine = make_inference_engine(
        InferenceEngineConfig(
            kind=kind,
            model_path=plan.model_dir,
            dtype=plan.dtype,
            device=plan.device,
            max_batch_size=plan.n_requests,
        )
    )
    new_state = export_state_dict(AutoModelForCausalLM.from_pretrained(plan.new_model_dir))
    polls = 0

    def poll_weights() -> WeightUpdate | None:
        nonlocal polls
        polls += 1
        return WeightUpdate(1, new_state) if polls == plan.switch_at_poll else None

    g = torch.Generator().manual_seed(0)
    reqs = [
        GenRequest(key=f"r{i}", prompt_ids=torch.randint(3, 60, (8,), generator=g).tolist())
        for i in range(plan.n_requests)
    ]
    params = SamplingParams(max_new_tokens=plan.max_new_tokens, temperature=1.0)
    t0 = time.perf_counter()
    outs = engine.generate(reqs, params=params, poll_weights=poll_weights)
    gen_s = time.perf_counter() - t0
    n_tokens = sum(len(o.output_ids) for o in outs)
    switched = [o for o in outs if 0 in o.versions and 1 in o.versions]
    reference, errors = _Reference(plan), []
    for req, o in list(zip(reqs, outs, strict=True))[:16]:  # 16 samples are enough to judge
        behav, versions = torch.tensor(o.behav_logp), torch.tensor(o.versions)
        for v in (0, 1):
            mask = versions == v
            if mask.any():
                ref = reference.logp(v, req.prompt_ids, o.output_ids)
                errors.append((behav[mask] - ref[mask]).abs())
    err = torch.cat(errors) if errors else torch.zeros(0)
    numbers = {
        "tokens": n_tokens,
        "generate_s": round(gen_s, 3),
        "samples_switched": len(switched),
        "n_interrupts": sum(o.n_interrupts for o in outs),
        "logp_abs_err_mean": float(err.mean()) if err.numel() else None,
        "logp_abs_err_max": float(err.max()) if err.numel() else None,
        "version": engine.version,
    }
    problems = []
    if engine.version != 1:
        problems.append(f"engine at version {engine.version}, not 1")
    if not switched or numbers["n_interrupts"] == 0:
        problems.append("no sample was interrupted mid-way by the reload")
    if not err.numel() or numbers["logp_abs_err_mean"] > plan.logp_tol:
        problems.append(
            f"log-probs off: mean |err| {numbers['logp_abs_err_mean']} > {plan.logp_tol}"
        )
    return Result(
        f"generate[{kind}]",
        "FAIL" if problems else "PASS",
        "; ".join(problems) or f"{len(switched)} samples switched v0->v1, log-probs match",
        n_tokens / gen_s,
        numbers,
    )


def _train_seqs(plan: Plan):
    import torch

    from areal.engines.base import TrainSeq

    g = torch.Generator().manual_seed(1)
    half = plan.seq_len // 2
    return [
        TrainSeq(
            prompt_ids=torch.randint(3, 60, (half,), generator=g),
            output_ids=torch.randint(3, 60, (half,), generator=g),
            behav_logp=torch.zeros(half),
            versions=torch.zeros(half, dtype=torch.long),
            adv=float(torch.randn((), generator=g)),
        )
        for _ in range(plan.train_seqs)
    ]


def part_train(plan: Plan, kind: str) -> Result:
    import math

    from areal.engines.config import TrainEngineConfig
    from areal.engines.factory import make_train_engine

    if kind == "fsdp":
        from areal.engines.rank_group import RankEnv, init_rank_group

        init_rank_group(RankEnv(), device=plan.device, timeout_s=120)
    cfg = TrainEngineConfig(
        kind=kind, model_path=plan.model_dir, lr=1e-5, device=plan.device, dtype=plan.dtype
    )
    engine = make_train_engine(cfg)
    max_tokens = plan.seq_len * 8
    before = engine.export_safetensors()
    tokens, train_s, stats = 0, 0.0, {}
    for _ in range(plan.train_steps):
        seqs = _train_seqs(plan)
        for s, lp in zip(seqs, engine.compute_logp(seqs, max_tokens), strict=True):
            s.behav_logp = lp.float().cpu()  # on-policy
        version = engine.version
        t0 = time.perf_counter()
        stats = engine.train_step(seqs, max_tokens)
        train_s += time.perf_counter() - t0
        tokens += sum(len(s.prompt_ids) + len(s.output_ids) for s in seqs)
        if engine.version != version + 1:
            return Result(kind, "FAIL", f"version {engine.version} after a step from {version}")
    changed = engine.export_safetensors() != before
    finite = all(math.isfinite(stats.get(k, float("nan"))) for k in ("loss", "grad_norm"))
    ok = finite and changed and not stats.get("step_skipped")
    detail = (
        f"loss {stats.get('loss'):.4g}, grad_norm {stats.get('grad_norm'):.4g}, weights changed"
        if ok
        else f"stats {stats}, weights changed: {changed}"
    )
    return Result(kind, "PASS" if ok else "FAIL", detail, tokens / train_s, dict(stats))


def part_main(name: str, plan_json: str) -> int:
    plan = Plan(**json.loads(plan_json))
    try:
        if name.startswith("generate["):
            res = part_generate(plan, name[len("generate[") : -1])
        else:
            res = part_train(plan, name)
    except Exception as e:  # the part's result, not the checker's crash
        import traceback

        traceback.print_exc()
        res = Result(name, "FAIL", f"{type(e).__name__}: {str(e)[:400]}")
    print("RESULT " + json.dumps(asdict(res)), flush=True)
    return 0


# ------------------------------------------------------------------ the driver
def _part_env(plan: Plan, name: str, work: Path) -> dict[str, str]:
    from areal.bus.embedded import free_port

    env = dict(os.environ, RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    env |= {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port("127.0.0.1"))}
    env["TORCH_EXTENSIONS_DIR"] = str(work / f"ext-{name}")
    if plan.dry_run:
        env["DS_ACCELERATOR"] = "cpu"
        env["CUDA_VISIBLE_DEVICES"] = ""
    return env


def run_part(plan: Plan, name: str, work: Path) -> Result:
    kind = name.split("[")[0]
    timeout_s = PART_TIMEOUT_S[kind] // (4 if plan.dry_run else 1)
    cmd = [sys.executable, __file__, "--_part", name, json.dumps(asdict(plan))]
    try:
        proc = subprocess.run(
            cmd, env=_part_env(plan, name, work), capture_output=True, text=True, timeout=timeout_s
        )
    except subprocess.TimeoutExpired:
        return Result(name, "FAIL", f"did not finish within {timeout_s} s")
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith("RESULT "):
            res = Result(**json.loads(line[len("RESULT ") :]))
            if res.status == "FAIL":
                sys.stderr.write(proc.stderr[-4000:])
            return res
    sys.stderr.write(proc.stderr[-4000:])
    return Result(name, "FAIL", f"exited {proc.returncode} without a result (stderr above)")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dry-run", action="store_true", help="CPU, tiny model, few tokens")
    ap.add_argument(
        "--out", type=Path, default=None, help="results JSON (default: in _common.RESULTS_DIR)"
    )
    ap.add_argument("--_part", nargs=2, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args._part:
        return part_main(*args._part)
    from _common import RESULTS_DIR, machine_header, md_table

    t_start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="areal-gpucheck-") as tmp:
        work = Path(tmp)
        plan = Plan.of(args.dry_run, work)
        print(f"# GPU check{' (dry run, CPU)' if args.dry_run else ''}\n\n{machine_header()}\n")
        results = []
        for name, skip in parts_of(plan).items():
            res = Result(name, "SKIP", skip) if skip else run_part(plan, name, work)
            tps = f"{res.tokens_per_s:.0f} tokens/s" if res.tokens_per_s else ""
            print(f"{res.status:4} {name:16} {tps:>16}  {res.detail}", flush=True)
            results.append(res)
    rows = [
        [r.part, r.status, f"{r.tokens_per_s:.0f}" if r.tokens_per_s else "-", r.detail]
        for r in results
    ]
    print("\n" + md_table(["part", "status", "tokens/s", "detail"], rows))
    print(f"\ntotal {time.perf_counter() - t_start:.0f} s")
    out = args.out or RESULTS_DIR / f"gpu_check{'_dry' if args.dry_run else ''}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps([asdict(r) for r in results], indent=1))
    print(f"wrote {out}")
    return 1 if any(r.status == "FAIL" for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())

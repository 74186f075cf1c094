"""LoRA adapters: train them (PEFT), publish only them, apply them on a rollout engine.

The wire form of an adapter is an ordinary weights state dict (so it is streamed, signed and
verified exactly as full weights are): for every adapted linear module ``M`` of the base model

    ``M.lora_A.weight``  [r, in_features]
    ``M.lora_B.weight``  [out_features, r]

plus ``ADAPTER_KEY``, a uint8 tensor holding the JSON of `AdapterMeta` (integer tensors travel
uncast). ``M`` is the module's name in the plain HF model (``model.layers.0.self_attn.q_proj``),
whatever wrapper the trainer uses (PEFT's ``base_layer``/``default`` names are normalised away).

Invariants:
- applying an adapter is ``W = W0 + (alpha / r) * B @ A`` from the pristine base weight ``W0``
  (never from the live one), so adapters of successive versions never accumulate;
- an adapter's metadata is checked as its tensors are: a rollout refuses one whose r is not
  an integer >= 1 matching A and B, whose alpha is not finite in (0, `MAX_LORA_ALPHA`], or
  whose update could leave float32's range, before it touches a weight;
- the base fingerprint (names, shapes and the first row of every weight, in bfloat16) is the
  same for the trainer's fp32 copy and a rollout's bf16 copy of one model dir; a rollout refuses
  an adapter whose fingerprint, module names or shapes do not match its own base.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass

import torch

from areal.config import MAX_LORA_ALPHA
from areal.engines.config import LoraSpec, TrainEngineConfig
from areal.engines.hf_io import export_plain, save_hf_dir
from areal.engines.weights_check import TensorSpec, WeightsMismatch, all_finite

__all__ = [
    "ADAPTER_KEY",
    "AdapterMeta",
    "LoraSpec",
    "adapter_of",
    "base_state_dict",
    "base_fingerprint",
    "check_adapter",
    "inject_lora",
    "is_adapter",
    "lora_setup",
    "merge_adapter",
    "merged_state_dict",
    "meta_of",
    "meta_problems",
    "save_lora_aware",
    "save_peft_adapter",
    "set_lora_dropout",
]

ADAPTER_KEY = "__lora_adapter__"
_PEFT_NAME = "default"  # PEFT's adapter name


@dataclass(frozen=True)
class AdapterMeta:
    """What travels with an adapter (JSON in ``ADAPTER_KEY``)."""

    base: str  # `base_fingerprint` of the model it was trained on
    r: int
    alpha: float
    target_modules: tuple[str, ...]

    def to_tensor(self) -> torch.Tensor:
        return torch.tensor(list(json.dumps(asdict(self)).encode()), dtype=torch.uint8)

    @classmethod
    def from_tensor(cls, t: torch.Tensor) -> AdapterMeta:
        try:
            raw = json.loads(bytes(t.to(torch.uint8).tolist()))
            r, alpha = raw["r"], raw["alpha"]
            if isinstance(r, bool) or not isinstance(r, int):  # no silent int(2.5) == 2
                raise ValueError(f"r {r!r} is not an integer")
            if isinstance(alpha, bool) or not isinstance(alpha, (int, float)):
                raise ValueError(f"alpha {alpha!r} is not a number")
            return cls(
                base=str(raw["base"]),
                r=r,
                alpha=float(alpha),
                target_modules=tuple(raw["target_modules"]),
            )
        except (ValueError, KeyError, TypeError) as e:
            raise WeightsMismatch(f"adapter metadata {ADAPTER_KEY} is unreadable: {e}") from None


def base_fingerprint(state_dict: Mapping[str, torch.Tensor]) -> str:
    """SHA-256 of the base model's names, shapes and the first row of each floating tensor in
    bfloat16 (the same for an fp32 and a bf16 load of one model dir; cheap: one row each).
    ``lm_head.weight`` is left out: a model dir leaves a tied head out, a loaded model has it."""
    h = hashlib.sha256()
    for name in sorted(k for k in state_dict if k != "lm_head.weight"):
        t = state_dict[name]
        h.update(f"{name}:{list(t.shape)};".encode())
        if t.is_floating_point() and t.numel():
            row = t.detach().reshape(t.shape[0], -1)[0] if t.dim() else t.detach().reshape(1)
            h.update(row.to("cpu", torch.bfloat16).view(torch.int16).numpy().tobytes())
    return h.hexdigest()


def is_adapter(state_dict: Mapping[str, object]) -> bool:
    return ADAPTER_KEY in state_dict


# ------------------------------------------------------------------ trainer side
def inject_lora(model: torch.nn.Module, spec: LoraSpec) -> None:
    """Wrap the target linear layers of ``model`` with PEFT LoRA layers in place (the model keeps
    its class; B starts at zero, so the function is the base's) and freeze everything else."""
    try:
        from peft import LoraConfig, inject_adapter_in_model
    except ImportError:
        raise RuntimeError("train.lora needs peft: pip install 'areal-bus[lora]'") from None
    cfg = LoraConfig(
        r=spec.r,
        lora_alpha=spec.alpha,
        lora_dropout=spec.dropout,
        target_modules=list(spec.target_modules),
        bias="none",
    )
    # a tied weight (the head of a tied-embedding model) is listed once, under its first name
    tied = {n for n, _ in model.named_parameters(remove_duplicate=False)}
    tied -= {n for n, _ in model.named_parameters()}
    if any(n.removesuffix(".weight").rsplit(".", 1)[-1] in spec.target_modules for n in tied):
        raise ValueError(
            f"lora.target_modules {list(spec.target_modules)} name a layer whose weight is tied "
            "to another (the head of a tied-embedding model): adapt the decoder's linear layers"
        )
    inject_adapter_in_model(cfg, model, adapter_name=_PEFT_NAME)
    n = 0
    for name, p in model.named_parameters():
        p.requires_grad_(".lora_" in name)
        if ".lora_" in name and ".lora_A." not in name and ".lora_B." not in name:
            raise ValueError(
                f"lora.target_modules {list(spec.target_modules)} adapt {name.split('.lora_')[0]}, "
                "not a linear layer (embeddings are not supported): adapt the linear layers"
            )
        n += ".lora_" in name
    if n == 0:
        raise ValueError(
            f"lora.target_modules {list(spec.target_modules)} match no linear layer of the model"
        )


def _plain(name: str) -> str:
    """PEFT's parameter name -> the plain model's (``q_proj.base_layer.weight`` ->
    ``q_proj.weight``, ``q_proj.lora_A.default.weight`` -> ``q_proj.lora_A.weight``)."""
    return name.replace(".base_layer.", ".").replace(f".{_PEFT_NAME}.", ".")


def adapter_of(
    state_dict: Mapping[str, torch.Tensor], meta: AdapterMeta
) -> dict[str, torch.Tensor]:
    """The wire form (module docstring) of the LoRA tensors of a PEFT-injected model's state
    dict (plain or gathered): contiguous CPU tensors of their own."""
    out = {
        _plain(k): v.detach().to("cpu").contiguous().clone()
        for k, v in state_dict.items()
        if ".lora_A." in k or ".lora_B." in k
    }
    out[ADAPTER_KEY] = meta.to_tensor()
    return out


def base_state_dict(state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The base model's tensors under their plain names (LoRA tensors left out)."""
    return {
        _plain(k): v for k, v in state_dict.items() if ".lora_A." not in k and ".lora_B." not in k
    }


def _delta(a: torch.Tensor, b: torch.Tensor, scaling: float) -> torch.Tensor:
    return scaling * (b.float() @ a.float())  # [out, r] @ [r, in] -> [out, in]


def merged_state_dict(
    state_dict: Mapping[str, torch.Tensor], scaling: float
) -> dict[str, torch.Tensor]:
    """The plain model's state dict with every adapter merged in (``W0 + s B A``, in W0's
    dtype): what a `final/` export and a full-weights publish hold."""
    base = base_state_dict(state_dict)
    plain = {_plain(k): v for k, v in state_dict.items()}
    for name in [k for k in plain if k.endswith(".lora_A.weight")]:
        module = name.removesuffix(".lora_A.weight")
        w = base[f"{module}.weight"]
        a, b = plain[name], plain[f"{module}.lora_B.weight"]
        base[f"{module}.weight"] = (w.float() + _delta(a, b, scaling).to(w.device)).to(w.dtype)
    return base


def meta_of(state_dict: Mapping[str, torch.Tensor]) -> AdapterMeta:
    return AdapterMeta.from_tensor(state_dict[ADAPTER_KEY])


def lora_setup(model: torch.nn.Module, cfg: TrainEngineConfig) -> AdapterMeta | None:
    """With ``cfg.lora``: fingerprint the base, inject the adapter (`areal.engines.lora`) and
    return what travels with it; None (the model untouched) without."""
    if cfg.lora is None:
        return None
    fingerprint = base_fingerprint(model.state_dict())
    inject_lora(model, cfg.lora)
    return AdapterMeta(
        base=fingerprint,
        r=cfg.lora.r,
        alpha=cfg.lora.alpha,
        target_modules=cfg.lora.target_modules,
    )


def save_lora_aware(
    model: torch.nn.Module,
    meta: AdapterMeta | None,
    model_path: str,
    path: str,
    state: dict[str, torch.Tensor] | None = None,
) -> None:
    """`save_hf_dir` of ``state`` (None: the model's own); with lora the merged weights, and
    the adapter as a PEFT dir in ``adapter/``."""
    if meta is None:
        save_hf_dir(model, state, model_path, path)
        return
    full = state if state is not None else model.state_dict()
    merged = export_plain(merged_state_dict(full, meta.alpha / meta.r))
    adapter = adapter_of(full, meta)
    save_hf_dir(
        model,
        merged,
        model_path,
        path,
        extra=lambda d: save_peft_adapter(d / "adapter", adapter, model_path),
    )


# ------------------------------------------------------------------ rollout side
def check_adapter(
    base_spec: Mapping[str, TensorSpec],
    fingerprint: str,
    state_dict: Mapping[str, torch.Tensor],
    *,
    what: str = "adapter",
) -> AdapterMeta:
    """Raise `WeightsMismatch` unless ``state_dict`` is an adapter for this base: the same
    fingerprint, metadata that can be merged (`meta_problems`), A and B of every module a
    [r, in] / [out, r] pair for a weight of the base, finite values, and an update
    ``(alpha / r) B A`` whose entries are bounded within float32 (``r * s * max|B| * max|A|``).
    Returns its metadata."""
    try:
        meta = meta_of(state_dict)
    except WeightsMismatch as e:
        raise WeightsMismatch(f"{what} does not fit the model: {e} (nothing was loaded)") from None
    problems = meta_problems(meta)
    mergeable = not problems
    if meta.base != fingerprint:
        problems.append(
            f"it was trained on another base model ({meta.base[:12]}, this one {fingerprint[:12]})"
        )
    names = set(state_dict) - {ADAPTER_KEY}
    modules = {n.removesuffix(".lora_A.weight") for n in names if n.endswith(".lora_A.weight")}
    expected = {f"{m}.lora_{x}.weight" for m in modules for x in "AB"}
    if names != expected or not modules:
        odd = sorted(names ^ expected)[:5]
        problems.append(f"tensors are not A/B pairs of modules: {odd or 'none at all'}")
    for m in sorted(modules):
        w = base_spec.get(f"{m}.weight")
        a, b = state_dict.get(f"{m}.lora_A.weight"), state_dict.get(f"{m}.lora_B.weight")
        if w is None or a is None or b is None or len(w.shape) != 2:
            problems.append(f"{m} is not a linear layer of the base")
            continue
        out_f, in_f = w.shape
        if tuple(a.shape) != (meta.r, in_f) or tuple(b.shape) != (out_f, meta.r):
            problems.append(
                f"{m}: A {list(a.shape)}, B {list(b.shape)} for r={meta.r} and a "
                f"[{out_f}, {in_f}] weight"
            )
            continue
        if not (a.is_floating_point() and b.is_floating_point() and all_finite(a)):
            problems.append(f"{m}: A is not finite floats")
        elif not all_finite(b):
            problems.append(f"{m}: NaN or inf in B")
        elif mergeable and (bound := _update_bound(a, b, meta)) >= _FLOAT32_MAX:
            problems.append(
                f"{m}: (alpha / r) B A would overflow float32 (|entries| <= {bound:.3g})"
            )
        if len(problems) >= 5:
            break
    if problems:
        raise WeightsMismatch(
            f"{what} does not fit the model: {'; '.join(problems)} (nothing was loaded; "
            "train the adapter on the rollout's model.path)"
        )
    return meta


def meta_problems(meta: AdapterMeta) -> list[str]:
    """Why an adapter's metadata cannot be merged (empty: it can): r an integer >= 1, alpha
    finite in (0, `MAX_LORA_ALPHA`] (the bound `train.lora.alpha` has), alpha / r finite."""
    problems = []
    if meta.r < 1:
        problems.append(f"r {meta.r} is below 1 (the update divides by it)")
    if not math.isfinite(meta.alpha):
        problems.append(f"alpha {_num(meta.alpha)} is not a finite number")
    elif not 0 < meta.alpha <= MAX_LORA_ALPHA:
        problems.append(f"alpha {_num(meta.alpha)} is not in (0, {MAX_LORA_ALPHA:g}]")
    elif meta.r >= 1 and not math.isfinite(meta.alpha / meta.r):
        problems.append(f"the scaling alpha / r = {_num(meta.alpha / meta.r)} is not finite")
    return problems


_FLOAT32_MAX = float(torch.finfo(torch.float32).max)


def _update_bound(a: torch.Tensor, b: torch.Tensor, meta: AdapterMeta) -> float:
    """An upper bound on ``|(alpha / r) B A|`` entrywise: r terms of at most s max|B| max|A|
    (float64 arithmetic; inf past float64)."""
    if not a.numel() or not b.numel():
        return 0.0
    max_a, max_b = float(a.detach().abs().max()), float(b.detach().abs().max())
    return meta.r * (meta.alpha / meta.r) * max_b * max_a


def _num(x: float) -> str:
    return "NaN" if math.isnan(x) else f"{x:g}"


@torch.no_grad()
def merge_adapter(
    params: Mapping[str, torch.Tensor],
    pristine: dict[str, torch.Tensor],
    state_dict: Mapping[str, torch.Tensor],
) -> None:
    """Set each adapted live weight ``params[M.weight]`` to ``W0 + s B A`` (in place; W0 from
    ``pristine``, which is filled on first use with a float32 copy of the live weight) and
    restore the weights this adapter leaves alone. ``state_dict`` must have passed
    `check_adapter`.

    The sum is one float32 ``addmm`` into W0 (as `merged_state_dict` computes it, rounded once
    to the live dtype): keeping W0 in float32 saves a cast of every adapted weight per version
    (the merge of SmolLM2-135M's q/k/v/o took 2.5x longer with a bf16 W0), and a bf16 matmul
    is not used because its speed on a CPU depends on the chip (~20x slower without bf16
    instructions)."""
    meta = meta_of(state_dict)
    scaling = meta.alpha / meta.r
    targets = {
        n.removesuffix(".lora_A.weight") + ".weight"
        for n in state_dict
        if n.endswith(".lora_A.weight")
    }
    for name in targets | set(pristine):
        live = params[name]
        if name not in pristine:
            pristine[name] = live.detach().to(torch.float32, copy=True)
        w0 = pristine[name]
        if name not in targets:
            live.copy_(w0)
            continue
        module = name.removesuffix(".weight")
        a = state_dict[f"{module}.lora_A.weight"].to(live.device, torch.float32)
        b = state_dict[f"{module}.lora_B.weight"].to(live.device, torch.float32)
        live.copy_(torch.addmm(w0, b * scaling, a))  # W0 + (s B) A, [out, in]


def save_peft_adapter(out_dir, adapter: Mapping[str, torch.Tensor], base_model_path: str) -> None:
    """Write ``adapter`` (wire form) as a PEFT adapter dir (``adapter_config.json`` +
    ``adapter_model.safetensors``), loadable by ``PeftModel.from_pretrained`` and vLLM."""
    from pathlib import Path

    from peft import LoraConfig
    from safetensors.torch import save_file

    meta = meta_of(adapter)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    LoraConfig(
        r=meta.r,
        lora_alpha=meta.alpha,
        target_modules=list(meta.target_modules),
        bias="none",
        base_model_name_or_path=base_model_path,
        task_type="CAUSAL_LM",
    ).save_pretrained(out)
    tensors = {f"base_model.model.{k}": v for k, v in adapter.items() if k != ADAPTER_KEY}
    save_file(tensors, out / "adapter_model.safetensors", metadata={"format": "pt"})


def set_lora_dropout(model: torch.nn.Module, on: bool) -> None:
    """LoRA dropout on (train mode) for the loss forwards, off otherwise: the engines keep the
    model in eval mode, so `compute_logp` and the rollouts see the adapter without dropout."""
    for name, m in model.named_modules():
        if name.endswith(f"lora_dropout.{_PEFT_NAME}"):
            m.train(on)

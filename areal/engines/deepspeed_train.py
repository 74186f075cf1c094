"""DeepSpeed ZeRO-1/2/3 training engine: one rank of a data-parallel group (CPU gloo or GPUs).

Follows the distributed-engine CONTRACT of ``areal.engines.rank_group``; ``TorchTrainEngine``
is the reference (same loss ``microbatch_loss``, same packing ``SeqForward``, same stats).

Invariants:
- Every rank holds the FULL arguments of every call (the rank group broadcasts them); the
  engine never broadcasts inputs. Built after ``torch.distributed`` is initialized, or it
  initializes it itself from ``RANK``/``WORLD_SIZE``/``MASTER_ADDR``/``MASTER_PORT`` (a 1-rank
  group when none is set); no ``deepspeed`` launcher needed.
- Device and backend come from ``deepspeed.accelerator.get_accelerator()``: ``cpu`` + gloo, or
  the accelerator's device ``$LOCAL_RANK`` + its backend (nccl on CUDA). ``cfg.device`` is
  ignored. Nothing is JIT-compiled: the optimizer is ``torch.optim.AdamW`` (``torch_adam``) and
  DeepSpeed's shared-memory CPU comm op (an inference-only all-reduce that would build a C++
  extension on first use: minutes on 2 cores, and a build killed midway leaves a ``lock`` file
  in ``$TORCH_EXTENSIONS_DIR`` that hangs every later run) is switched off, so collectives are
  plain ``torch.distributed``.
- A minibatch is packed exactly as ``TorchTrainEngine`` packs it (``SeqForward.micro_batches``
  over the whole minibatch); rank r runs micro-batches ``i`` with ``i % world == r``; a short
  rank runs zero-weight dummy passes, so every rank runs the same number of forward/backward
  passes (ZeRO collectives line up). ``compute_logp`` pads with dummies under ZeRO-3 too.
- Each loss is divided by the minibatch's GLOBAL loss-token count and multiplied by the world
  size, which undoes DeepSpeed's averaging: the reduced gradient is the 1-rank gradient.
- Non-finite guard: a non-finite local loss poisons its gradient with NaN, so DeepSpeed's
  global grad-norm check (all ranks) refuses the optimizer step on every rank; a refused step
  changes no weight and no optimizer state. The engine checks that DeepSpeed did skip.
- Stats are identical on every rank and equal to the 1-rank ones: each micro-batch's totals
  land in its own row of one tensor that is all-reduced with SUM (x + 0 is exact), then
  ``reduce_loss_stats`` runs over the rows in micro-batch order, as on one rank.
- bf16 keeps fp32 master weights and fp32 gradient accumulation (DeepSpeed's mixed precision);
  ``gradient_checkpointing`` recomputes each decoder layer in backward (same numbers).
- With ``loss_cfg.kl_coef`` > 0 every rank holds a frozen reference (the initial weights):
  under ZeRO-1/2 a plain replicated copy, under ZeRO-3 an optimizer-less DeepSpeed engine
  partitioned as the policy is (no rank holds the full reference). It is forwarded by the same
  `SeqForward` path in every pass, dummy passes too (ZeRO-3's gathers stay in step), so
  ``kl_ref`` is exactly 0 at step 1; its per-micro-batch sums travel in the stat rows.
- With ``lora`` (ZeRO-1/2; `areal.engines.lora`) the adapter is injected before
  ``deepspeed.initialize`` and is all the optimizer holds; exports are the adapter alone (what
  is published), the HF dir holds the merged model and ``adapter/``; checkpoints hold the
  adapter and its optimizer state (DeepSpeed's ``exclude_frozen_parameters``). ZeRO-3 with lora
  is refused by the config (the base fingerprint needs the whole base on a rank).
- Checkpoints are DeepSpeed directories (``<path>/<tag>/``, one optimizer shard per rank, on
  a filesystem every rank sees) with a ``latest`` pointer written atomically after every rank
  has written its shard: a crash mid-save leaves the previous checkpoint in force.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import shutil
import time
import uuid
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from areal.algo.loss import PPOLossOutput, reduce_loss_stats
from areal.engines.base import TrainSeq
from areal.engines.config import TrainEngineConfig
from areal.engines.lora import adapter_of, lora_setup, save_lora_aware, set_lora_dropout
from areal.engines.seq_forward import SeqForward, load_causal_lm, seq_len
from areal.engines.torch_infer import resolve_dtype
from areal.engines.torch_train import (
    check_seqs,
    export_state_dict,
    fill_prox_logp,
    microbatch_loss,
    minibatch_normaliser,
    minibatch_prox_mode,
    set_step_lr,
    split_contiguous,
)

__all__ = ["DeepSpeedTrainEngine", "build_ds_config"]

_SHM_COMM_OP = "deepspeed_shm_comm"  # DeepSpeed's name of the JIT-built shared-memory comm op
_LATEST = "latest"  # DeepSpeed's pointer file: the tag of the checkpoint in force
_CONTENT = "areal.json"  # in a tag's dir: what its module state is (full weights or an adapter)
# Per-micro-batch stat row: PPOLossOutput fields in this order (see `_row` / `_output`).
_ROW = (
    "loss",
    "n_tokens",
    "n_kept",
    "clip_count",
    "approx_kl_sum",
    "imp_weight_sum",
    "imp_weight_max",
    "n_imp_masked",
    "entropy_sum",
    "kl_ref_sum",  # 0 when kl_coef is 0 (`_output` gives None then)
    "behav_kl_sum",
    "behav_kl_k3_sum",
    "imp_weight_sq_sum",
)


def build_ds_config(cfg: TrainEngineConfig, *, on_cpu: bool) -> dict[str, Any]:
    """The DeepSpeed config dict of ``cfg`` (one micro-batch per ``backward``; the engine drives
    the accumulation boundaries itself)."""
    bf16 = cfg.dtype in ("bfloat16", "bf16")
    fp16 = cfg.dtype in ("float16", "fp16")
    zero: dict[str, Any] = {
        "stage": cfg.zero_stage,
        "overlap_comm": not on_cpu,  # no streams on CPU
        "contiguous_gradients": True,
        "compute_grad_norm": True,  # the non-finite guard and `grad_norm` read it
    }
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": max(cfg.grad_clip, 0.0),  # 0 = no clipping, like grad_clip <= 0
        "bf16": {"enabled": bf16, "check_grad_overflow": True},
        "fp16": {"enabled": fp16, "loss_scale": 0},  # dynamic loss scale
        "zero_optimization": zero,
        "optimizer": {
            "type": "AdamW",
            "params": {
                "lr": cfg.lr,
                "betas": list(cfg.betas),
                "weight_decay": cfg.weight_decay,
                "torch_adam": True,  # torch.optim.AdamW: no FusedAdam/CPUAdam build
            },
        },
        "steps_per_print": 2**31 - 1,
        "wall_clock_breakdown": False,
    }
    if bf16 or fp16:
        config["data_types"] = {"grad_accum_dtype": "fp32"}
    return config


def _disable_shm_comm() -> None:
    """Keep DeepSpeed's comm layer on plain torch.distributed: mark the shared-memory comm op
    incompatible before the comm backend is created (``deepspeed.comm.torch.build_shm_op``
    consults this table; DeepSpeed documents that edits to it persist)."""
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__[_SHM_COMM_OP] = False


def _init_process_group(backend: str) -> None:
    """``torch.distributed`` with ``backend`` (an existing group must use it), wrapped by
    DeepSpeed's comm layer. Not yet initialized: ``env://`` when ``WORLD_SIZE`` is set (RANK,
    MASTER_ADDR, MASTER_PORT), else a 1-rank group on an in-memory store (no port)."""
    import deepspeed

    if not dist.is_initialized() and "WORLD_SIZE" not in os.environ:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    if dist.is_initialized():
        have = str(dist.get_backend())
        if backend not in have:
            raise RuntimeError(
                f"torch.distributed uses backend {have!r} but the DeepSpeed accelerator needs "
                f"{backend!r}: initialize the rank group with backend={backend!r}"
            )
    deepspeed.init_distributed(dist_backend=backend, auto_mpi_discovery=False)


def _join_group() -> torch.device:
    """This rank's device (the accelerator's, ``$LOCAL_RANK``; set as current) after joining
    the process group with the accelerator's backend."""
    from deepspeed.accelerator import get_accelerator

    accel = get_accelerator()
    on_cpu = accel.device_name() == "cpu"
    if on_cpu:
        _disable_shm_comm()
    _init_process_group(accel.communication_backend_name())
    # deepspeed.initialize insists on LOCAL_RANK; without one this is a single host (as in
    # areal.engines.rank_group.RankEnv): the local rank is the rank
    local_rank = int(os.environ.setdefault("LOCAL_RANK", str(dist.get_rank())))
    if on_cpu:
        return torch.device("cpu")
    accel.set_device(local_rank)
    return torch.device(accel.device_name(local_rank))


def _enable_gradient_checkpointing(model: torch.nn.Module) -> None:
    """Recompute each decoder layer in backward (non-reentrant). Transformers checkpoints a
    layer only while ``layer.training``; only the layer objects get that flag, their children
    (attention, dropout) stay in eval mode, so the recomputed function is the eval one."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    layers = [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]
    if not layers:
        raise ValueError(
            f"{type(model).__name__} has no checkpointable layers: set gradient_checkpointing=false"
        )
    for layer in layers:
        layer.training = True


def _row(out: PPOLossOutput) -> list[float]:
    return [float(out.loss.detach())] + [float(getattr(out, k) or 0.0) for k in _ROW[1:]]


def _output(row: list[float], kl: bool) -> PPOLossOutput:
    fields = dict(zip(_ROW, row, strict=True))
    fields["loss"] = torch.tensor(fields["loss"], dtype=torch.float64)
    for k in ("n_tokens", "n_kept", "n_imp_masked"):
        fields[k] = int(fields[k])
    if not kl:
        fields["kl_ref_sum"] = None
    return PPOLossOutput(**fields)


class DeepSpeedTrainEngine:
    """Built from a ``TrainEngineConfig`` of kind "deepspeed" on every rank; ``version``
    starts at 0 (see the module invariants)."""

    def __init__(self, cfg: TrainEngineConfig) -> None:
        if cfg.kind != "deepspeed":
            raise ValueError(
                f"DeepSpeedTrainEngine needs a config of kind 'deepspeed', got {cfg.kind!r}"
            )
        import deepspeed

        self.device = _join_group()
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        torch.manual_seed(cfg.seed)
        self.cfg = cfg
        self.model_path = cfg.model_path
        self.ds_config = build_ds_config(cfg, on_cpu=self.device.type == "cpu")
        torch_dtype = resolve_dtype(cfg.dtype)
        model, varlen = self._load_model(torch_dtype)
        self.adapter_meta = lora_setup(model, cfg)  # None without lora: every weight trains
        self.engine, self.optimizer, _, _ = deepspeed.initialize(
            model=model,
            model_parameters=[p for p in model.parameters() if p.requires_grad],
            config=self.ds_config,
        )
        self.module: torch.nn.Module = self.engine.module
        self.module.eval()  # no dropout, as in TorchTrainEngine
        self.vocab_size: int = self.module.get_input_embeddings().num_embeddings
        self.max_seq_len: int | None = getattr(self.module.config, "max_position_embeddings", None)
        if cfg.gradient_checkpointing:
            _enable_gradient_checkpointing(self.module)
        self.version = 0
        self.fwd = SeqForward.of_config(
            self.engine, cfg, dtype=torch_dtype, device=self.device, varlen=varlen
        )
        self.ref_fwd = self._reference(torch_dtype) if cfg.loss_cfg.kl_coef > 0 else None

    def _load_model(
        self, dtype: torch.dtype, ds_config: dict[str, Any] | None = None
    ) -> tuple[torch.nn.Module, bool]:
        """The HF model; under ZeRO-3 built partitioned (``zero.Init`` via transformers'
        ``HfDeepSpeedConfig`` of ``ds_config``, the engine's by default, scoped to this load)
        so no rank holds the full weights."""
        cfg = self.cfg
        if cfg.zero_stage != 3:
            return load_causal_lm(cfg.model_path, dtype, cfg.attn_implementation)
        from transformers.integrations.deepspeed import HfDeepSpeedConfig, unset_hf_deepspeed_config

        hf_ds = HfDeepSpeedConfig(ds_config or self.ds_config)  # noqa: F841 (alive = zero3 on)
        try:
            return load_causal_lm(cfg.model_path, dtype, cfg.attn_implementation)
        finally:
            unset_hf_deepspeed_config()

    def _reference(self, dtype: torch.dtype) -> SeqForward:
        """The frozen reference policy (the initial weights) for ``kl_coef`` > 0, forwarded as
        the policy is: a plain copy on every rank under ZeRO-1/2 (the policy's weights are
        whole on every rank there too), an optimizer-less ZeRO-3 engine under ZeRO-3."""
        cfg = self.cfg
        if cfg.zero_stage != 3:
            ref, varlen = load_causal_lm(cfg.model_path, dtype, cfg.attn_implementation)
            ref = ref.to(self.device).eval().requires_grad_(False)
            return SeqForward.of_config(ref, cfg, dtype=dtype, device=self.device, varlen=varlen)
        import deepspeed

        ref_config = {k: v for k, v in self.ds_config.items() if k != "optimizer"}
        ref, varlen = self._load_model(dtype, ref_config)
        ref.requires_grad_(False)
        engine, *_ = deepspeed.initialize(model=ref, config=ref_config)
        engine.module.eval()
        return SeqForward.of_config(engine, cfg, dtype=dtype, device=self.device, varlen=varlen)

    # ---------------------------------------------------------------- protocol
    def compute_logp(self, seqs: list[TrainSeq], max_tokens_per_mb: int) -> list[torch.Tensor]:
        """Every rank returns the full list; rank r computes micro-batches ``i % world == r``."""
        if not seqs:
            return []
        sizes = [len(s.output_ids) for s in seqs]
        starts = [0, *itertools.accumulate(sizes)]
        flat = torch.zeros(starts[-1], dtype=torch.float32, device=self.device)  # [sum T_i]
        mbs = self.fwd.micro_batches(seqs, max_tokens_per_mb)
        n_pass = self._n_passes(len(mbs))
        dummy = [min(seqs, key=seq_len)]
        set_lora_dropout(self.module, False)
        with torch.no_grad():
            for k in range(n_pass):
                i = k * self.world + self.rank
                if i >= len(mbs):  # keeps ZeRO-3's parameter gathers in step
                    self.fwd.logp(dummy)
                    continue
                for j, lp in zip(mbs[i], self.fwd.logp([seqs[j] for j in mbs[i]]), strict=True):
                    flat[starts[j] : starts[j + 1]] = lp.float()
        if self.world > 1:
            dist.all_reduce(flat)  # every slot written by exactly one rank: exact
        return [t.cpu() for t in flat.split(sizes)]

    def _n_passes(self, n_mbs: int) -> int:
        """Passes per rank for ``n_mbs`` micro-batches; ZeRO-1/2 no-grad forwards need no
        dummies (ZeRO-3 gathers parameters in every forward)."""
        if self.cfg.zero_stage != 3:
            return len(range(self.rank, n_mbs, self.world))
        return math.ceil(n_mbs / self.world)

    def train_step(self, seqs: list[TrainSeq], max_tokens_per_mb: int) -> dict[str, float]:
        t0 = time.perf_counter()
        check_seqs(seqs)
        cfg = self.cfg.loss_cfg
        chunks = [c for c in split_contiguous(seqs, self.cfg.n_minibatches) if c]
        fill_prox_logp(chunks, cfg, self.cfg.prox_logp, self.compute_logp, max_tokens_per_mb)
        set_step_lr(self.optimizer, seqs, base_lr=self.cfg.lr, version=self.version, cfg=cfg)
        plans = [self._plan(chunk, max_tokens_per_mb) for chunk in chunks]
        set_lora_dropout(self.module, True)  # the loss forwards only (a no-op without lora)
        n_rows = sum(len(p) for p in plans)
        rows = torch.zeros(n_rows + self.world, len(_ROW), dtype=torch.float64, device=self.device)
        applied, grad_norms, offset = [], [], 0
        for k, (chunk, mbs) in enumerate(zip(chunks, plans, strict=True)):
            prox_mode = minibatch_prox_mode(cfg, self.cfg.prox_logp, k)
            step_ok, norm = self._minibatch(chunk, mbs, rows[offset : offset + len(mbs)], prox_mode)
            applied.append(step_ok)
            if step_ok:
                grad_norms.append(norm)
            offset += len(mbs)
        set_lora_dropout(self.module, False)
        self.version += 1

        rows[n_rows + self.rank, 0] = time.perf_counter() - t0  # this rank's time, for the max
        if self.world > 1:
            dist.all_reduce(rows)  # each row has exactly one writer
        table = rows.tolist()
        kl = self.ref_fwd is not None
        outs, offset = [], 0
        for mbs, ok in zip(plans, applied, strict=True):
            if ok:
                outs.extend(_output(r, kl) for r in table[offset : offset + len(mbs)])
            offset += len(mbs)
        all_mbs = [mb for mbs in plans for mb in mbs]
        tokens = sum(seq_len(s) for mb in all_mbs for s in mb)
        padded = sum(self.fwd.padded_tokens(mb) for mb in all_mbs)
        skipped = sum(1 for mbs, ok in zip(plans, applied, strict=True) if mbs and not ok)
        stats = reduce_loss_stats(outs)
        stats["loss"] /= max(len(chunks), 1)  # mean over minibatches of each one's token mean
        stats.update(
            grad_norm=sum(grad_norms) / max(len(grad_norms), 1),
            lr=float(self.optimizer.param_groups[0]["lr"]),
            padding_frac=(padded - tokens) / padded if padded else 0.0,
            n_microbatches=float(len(all_mbs)),
            skipped_minibatches=float(skipped),
            step_skipped=float(skipped > 0 and not outs),
            tokens=float(tokens),
            time_s=max(r[0] for r in table[n_rows:]),
        )
        return stats

    def _plan(self, chunk: list[TrainSeq], max_tokens_per_mb: int) -> list[list[TrainSeq]]:
        """The micro-batches of one minibatch exactly as ``TorchTrainEngine`` forms them
        (sequences without output tokens dropped, empty micro-batches skipped)."""
        mbs = []
        for mb in self.fwd.micro_batches(chunk, max_tokens_per_mb):
            mb_seqs = [chunk[i] for i in mb if len(chunk[i].output_ids) > 0]
            if mb_seqs:
                mbs.append(mb_seqs)
        return mbs

    def _minibatch(
        self, chunk: list[TrainSeq], mbs: list[list[TrainSeq]], rows: torch.Tensor, prox_mode: str
    ) -> tuple[bool, float]:
        """One optimizer step over ``mbs`` (this rank's share), writing this rank's rows of
        ``rows`` [len(mbs), len(_ROW)]; returns (step applied, global grad norm)."""
        if not mbs:
            return False, 0.0
        denom = minibatch_normaliser(chunk, self.cfg.loss_cfg)
        n_pass = math.ceil(len(mbs) / self.world)
        dummy = [min((s for mb in mbs for s in mb), key=seq_len)]
        bad_loss = torch.zeros((), device=self.device)
        skipped_before = self.engine.skipped_steps
        for k in range(n_pass):
            i = k * self.world + self.rank
            real = i < len(mbs)
            self.engine.set_gradient_accumulation_boundary(k == n_pass - 1)
            out = microbatch_loss(
                self.fwd,
                mbs[i] if real else dummy,
                self.cfg.loss_cfg,
                prox_mode,
                self.version,
                denom,
                self.device,
                ref_fwd=self.ref_fwd,
            )
            loss = out.loss * (float(self.world) if real else 0.0)
            if real:
                rows[i] = torch.tensor(_row(out), dtype=torch.float64)
                if not bool(torch.isfinite(out.loss)):
                    bad_loss.fill_(1.0)
                    loss = out.loss * float("nan")  # NaN gradient: DeepSpeed refuses the step
            self.engine.backward(loss)
            self.engine.step()
        applied = self.engine.skipped_steps == skipped_before
        self._check_guard(bad_loss, applied)
        norm = self.engine.get_global_grad_norm()
        return applied, float(norm) if norm is not None else 0.0

    def _check_guard(self, bad_loss: torch.Tensor, applied: bool) -> None:
        """Crash loudly if DeepSpeed applied a step whose loss was not finite on some rank."""
        if self.world > 1:
            dist.all_reduce(bad_loss, op=dist.ReduceOp.MAX)
        if applied and bool(bad_loss):
            raise RuntimeError(
                "DeepSpeed applied an optimizer step with a non-finite loss: its grad-norm "
                "overflow check is off (keep zero_optimization.compute_grad_norm=true)"
            )

    # ------------------------------------------------------------ serialisation
    def _full_state_dict(self) -> dict[str, torch.Tensor] | None:
        """Full CPU weights on rank 0 (None elsewhere); every rank must call this. ZeRO-3
        gathers one parameter at a time, so no rank holds more than one gathered tensor on
        the device."""
        if self.cfg.zero_stage != 3:
            return export_state_dict(self.module) if self.rank == 0 else None
        import deepspeed

        def to_cpu(t: torch.Tensor) -> torch.Tensor | None:
            return t.detach().to("cpu", copy=True).contiguous() if self.rank == 0 else None

        out: dict[str, torch.Tensor] = {}
        done: dict[int, torch.Tensor | None] = {}
        for name, t in self.module.state_dict(keep_vars=True).items():
            if id(t) not in done:
                if hasattr(t, "ds_id"):  # a partitioned parameter: every rank gathers it
                    with deepspeed.zero.GatheredParameters([t], modifier_rank=None):
                        done[id(t)] = to_cpu(t)
                else:
                    done[id(t)] = to_cpu(t)
                cpu = done[id(t)]
            else:  # a tied tensor: its own storage, as in export_state_dict
                cpu = done[id(t)].clone() if self.rank == 0 else None
            if cpu is not None:
                out[name] = cpu
        return out if self.rank == 0 else None

    def export_safetensors(self) -> bytes:
        """Full safetensors bytes on rank 0 (with lora: the adapter alone); b"" on the others
        (they take part in the gather)."""
        from safetensors.torch import save

        if self.adapter_meta is not None:  # ZeRO-1/2: the adapter is whole on every rank
            if self.rank != 0:
                return b""
            return save(adapter_of(self.module.state_dict(), self.adapter_meta))
        state = self._full_state_dict()
        return save(state) if state is not None else b""

    def save_pretrained(self, path: str) -> None:
        """Rank 0 writes the HF directory (``hf_io.save_hf_dir``; with lora the merged model
        and ``adapter/``); every rank must call this."""
        state = self._full_state_dict()
        if self.rank == 0:
            save_lora_aware(self.module, self.adapter_meta, self.model_path, path, state)
        self._barrier()

    def save_checkpoint(self, path: str) -> None:
        """Collective: ``<path>/<tag>/`` (model + this rank's optimizer shard), then rank 0
        points ``<path>/latest`` at it (atomic rename) and removes older tags."""
        root = Path(path)
        tag = self._same_on_all_ranks(f"v{self.version}-{uuid.uuid4().hex[:8]}")
        client = {"version": self.version, "rng_cpu": torch.get_rng_state()}
        self.engine.save_checkpoint(
            str(root),
            tag=tag,
            client_state=client,
            save_latest=False,
            exclude_frozen_parameters=self.adapter_meta is not None,  # lora: the adapter alone
        )
        if self.rank == 0:  # what the module state holds, read before a load touches it
            (root / tag / _CONTENT).write_text(json.dumps({"lora": self._lora_tag()}))
        self._barrier()  # every shard is on disk before the pointer moves
        if self.rank == 0:
            tmp = root / f".{_LATEST}.tmp-{tag}"
            tmp.write_text(tag)
            os.replace(tmp, root / _LATEST)
            for old in root.iterdir():
                if old.is_dir() and old.name != tag:
                    shutil.rmtree(old, ignore_errors=True)
        self._barrier()

    def load_checkpoint(self, path: str) -> None:
        """Collective: the checkpoint ``<path>/latest`` names; optimizer state included; lr and
        weight decay come from the config (a resume may change them)."""
        pointer = Path(path) / _LATEST
        if not pointer.is_file():
            raise FileNotFoundError(
                f"no DeepSpeed checkpoint at {path} (no {_LATEST} file; write one with "
                "save_checkpoint)"
            )
        tag = pointer.read_text().strip()
        content = Path(path) / tag / _CONTENT
        held = json.loads(content.read_text()).get("lora") if content.is_file() else None
        if held != self._lora_tag():
            raise ValueError(
                f"{path}/{tag}: a checkpoint of {held or 'full weights'}, this engine trains "
                f"{self._lora_tag() or 'full weights'}: resume with the train.lora the "
                "checkpoint was written with"
            )
        _, client = self.engine.load_checkpoint(
            path,
            tag=tag,
            load_optimizer_states=True,
            load_module_strict=self.adapter_meta is None,  # lora: the frozen base is not in it
        )
        if client is None:
            raise ValueError(f"{path}/{tag}: DeepSpeed could not load the checkpoint")
        for group in self.optimizer.param_groups:
            group["lr"], group["weight_decay"] = self.cfg.lr, self.cfg.weight_decay
        self.version = int(client["version"])
        torch.set_rng_state(client["rng_cpu"])

    # ------------------------------------------------------------------ helpers
    def _lora_tag(self) -> str | None:
        """What a checkpoint's module state is: None (full weights) or the adapter's shape."""
        m = self.adapter_meta
        if m is None:
            return None
        return f"a LoRA adapter (r {m.r}, alpha {m.alpha}, {', '.join(m.target_modules)})"

    def _barrier(self) -> None:
        if self.world > 1:
            dist.barrier()

    def _same_on_all_ranks(self, value: str) -> str:
        """Rank 0's ``value`` on every rank (internal coordination, not call arguments)."""
        if self.world == 1:
            return value
        box = [value]
        dist.broadcast_object_list(box, src=0)
        return str(box[0])

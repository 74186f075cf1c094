"""FSDP2 training engine (`torch.distributed.fsdp.fully_shard`): the primary multi-GPU engine.

It keeps the distributed-engine CONTRACT of `areal.engines.rank_group` (every rank gets the same
calls with the same full arguments; rank 0 alone talks to the bus) and reuses the torch engine's
pieces: `SeqForward` (packing, padding-free forward), `microbatch_loss` (decoupled PPO from
`areal.algo.loss`), `check_seqs`, `split_contiguous`. With one rank its numbers are the torch
engine's.

Invariants:
- Master weights and the AdamW state are fp32, sharded over the ranks; ``dtype`` bf16/fp16 is
  the compute dtype (``MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=float32)``).
- Each decoder layer (the model's ``_no_split_modules``) is its own FSDP unit; the root unit
  holds the embeddings, the (tied) head and the final norm.
- A minibatch is packed as the torch engine packs it; rank r runs micro-batches r, r + world,
  ...; a rank with fewer runs zero-weight dummy passes, so all ranks run the same number of
  forwards/backwards. Every loss is divided by the minibatch's GLOBAL loss-token count and
  gradients are summed over ranks (divide factor 1): the reduced gradient is the 1-rank one.
- The grad norm is the global one; a minibatch whose loss (on any rank) or gradient is not
  finite is refused on every rank (no weight changes). Stats are all-reduced: equal on every
  rank (but ``time_s``, each rank's own clock).
- Exported / saved weights are full tensors gathered to rank 0 and cast to ``dtype`` (what
  rollout workers load). Checkpoints hold the full fp32 model and optimizer state (rank 0
  writes one file), so a run may resume with another number of ranks.
- With ``lora`` (`areal.engines.lora`) the adapter is injected before sharding and is all the
  optimizer holds; exports gather the adapter's tensors alone (what is published), the HF dir
  holds the merged model and ``adapter/``; checkpoints stay full (model and optimizer).
- With ``loss_cfg.kl_coef`` > 0 every rank loads a frozen reference (the initial weights; the
  base model under ``lora``, as in the torch engine), sharded as the policy is (each decoder
  layer, then the root; same mixed precision) with no optimizer, and forwarded under no_grad by
  the same `SeqForward` path in every pass (dummies too), so ``kl_ref`` is exactly 0 at step 1.
- ``gradient_checkpointing`` recomputes each decoder layer in backward (same numbers, less
  memory); ``activation_offload`` keeps saved activations in pinned CPU memory (CUDA only; a
  no-op on CPU).
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from areal.algo.loss import PPOLossOutput, loss_stat_sums, stats_from_sums
from areal.engines.base import TrainSeq
from areal.engines.config import TrainEngineConfig
from areal.engines.hf_io import save_hf_dir
from areal.engines.lora import adapter_of, lora_setup, save_lora_aware, set_lora_dropout
from areal.engines.rank_group import ensure_rank_group, resolve_device
from areal.engines.seq_forward import SeqForward, load_causal_lm, seq_len
from areal.engines.torch_infer import resolve_dtype
from areal.engines.torch_train import (
    TorchTrainEngine,
    check_seqs,
    fill_prox_logp,
    microbatch_loss,
    minibatch_normaliser,
    minibatch_prox_mode,
    set_step_lr,
    split_contiguous,
)

__all__ = ["FSDPTrainEngine", "rank_share"]

CHECKPOINT_FORMAT = "fsdp-full-1"  # full (unsharded) model + optimizer state, FQN-keyed
_FULL_TO_RANK0 = StateDictOptions(full_state_dict=True, cpu_offload=True)
_FROM_RANK0 = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)


def rank_share(n_items: int, rank: int, world: int) -> tuple[list[int], int]:
    """Indices ``i`` of ``range(n_items)`` with ``i % world == rank``, and the number of passes
    every rank runs (the longest share: ``ceil(n_items / world)``).

    >>> rank_share(5, 1, 2)  # rank 1 of 2 gets items 1 and 3, and runs 3 passes (one dummy)
    ([1, 3], 3)
    """
    return list(range(rank, n_items, world)), -(-n_items // world)


@dataclass
class _StepTotals:
    """What one ``train_step`` adds up over its minibatches (this rank's loss outputs; the
    packing counts are global: every rank knows the whole packing)."""

    outs: list[PPOLossOutput] = field(default_factory=list)
    grad_norms: list[float] = field(default_factory=list)
    skipped: int = 0
    n_mb: int = 0
    tokens: int = 0
    padded_tokens: int = 0


class FSDPTrainEngine:
    """Built from a ``TrainEngineConfig`` of kind "fsdp" on every rank, after
    ``torch.distributed`` is initialized (a 1-rank group is made when it is not); ``version``
    starts at 0."""

    def __init__(self, cfg: TrainEngineConfig) -> None:
        if cfg.kind != "fsdp":
            raise ValueError(f"FSDPTrainEngine needs a config of kind 'fsdp', got {cfg.kind!r}")
        self.device = resolve_device(cfg.device)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)  # before the group and the mesh use it
        ensure_rank_group(self.device)
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        torch.manual_seed(cfg.seed)
        self.cfg = cfg
        self.model_path = cfg.model_path
        self.compute_dtype = resolve_dtype(cfg.dtype)
        model, varlen = load_causal_lm(cfg.model_path, torch.float32, cfg.attn_implementation)
        self.adapter_meta = lora_setup(model, cfg)  # before sharding: PEFT wraps the layers
        model.to(self.device).eval()  # eval: no dropout, as in the torch engine
        self.vocab_size: int = model.get_input_embeddings().num_embeddings
        self.max_seq_len: int | None = getattr(model.config, "max_position_embeddings", None)
        self.model = _shard(model, self.device, self.world, self.compute_dtype, cfg)
        self.optimizer = torch.optim.AdamW(
            [p for p in self.model.parameters() if p.requires_grad],
            lr=cfg.lr,
            betas=cfg.betas,
            weight_decay=cfg.weight_decay,
        )
        self.grad_clip = cfg.grad_clip
        self.loss_cfg = cfg.loss_cfg
        self.n_minibatches = cfg.n_minibatches
        self.prox_logp = cfg.prox_logp
        self.version = 0
        self.fwd = SeqForward.of_config(
            self.model, cfg, dtype=self.compute_dtype, device=self.device, varlen=varlen
        )
        self.ref_fwd: SeqForward | None = None
        if cfg.loss_cfg.kl_coef > 0:
            ref, _ = load_causal_lm(cfg.model_path, torch.float32, cfg.attn_implementation)
            ref.to(self.device).eval().requires_grad_(False)
            ref = _shard(ref, self.device, self.world, self.compute_dtype, cfg, checkpoint=False)
            self.ref_fwd = SeqForward.of_config(
                ref, cfg, dtype=self.compute_dtype, device=self.device, varlen=varlen
            )

    # ---------------------------------------------------------------- protocol
    def compute_logp(self, seqs: list[TrainSeq], max_tokens_per_mb: int) -> list[torch.Tensor]:
        """The full list on every rank: each rank fills its micro-batches' log-probs into one
        flat buffer of zeros, and a sum over ranks assembles it (adding zeros is exact)."""
        mbs = self.fwd.micro_batches(seqs, max_tokens_per_mb)
        mine, n_pass = rank_share(len(mbs), self.rank, self.world)
        sizes = [len(s.output_ids) for s in seqs]
        starts = [0]
        for n in sizes:
            starts.append(starts[-1] + n)
        flat = torch.zeros(starts[-1], dtype=torch.float32, device=self.device)  # [sum T_i]
        set_lora_dropout(self.model, False)
        with torch.no_grad():
            for k in range(n_pass):
                if k >= len(mine):  # a dummy forward keeps FSDP's all-gathers in step
                    self.fwd.logp([seqs[i] for i in mbs[0]])
                    continue
                mb = mbs[mine[k]]
                for i, lp in zip(mb, self.fwd.logp([seqs[i] for i in mb]), strict=True):
                    flat[starts[i] : starts[i + 1]] = lp.float()
        if self.world > 1:
            dist.all_reduce(flat)
        flat = flat.cpu()
        return [flat[starts[i] : starts[i + 1]].clone() for i in range(len(seqs))]

    def train_step(self, seqs: list[TrainSeq], max_tokens_per_mb: int) -> dict[str, float]:
        t0 = time.perf_counter()
        check_seqs(seqs)
        chunks = [c for c in split_contiguous(seqs, self.n_minibatches) if c]
        fill_prox_logp(chunks, self.loss_cfg, self.prox_logp, self.compute_logp, max_tokens_per_mb)
        set_step_lr(
            self.optimizer, seqs, base_lr=self.cfg.lr, version=self.version, cfg=self.loss_cfg
        )
        totals = _StepTotals()
        set_lora_dropout(self.model, True)  # the loss forwards only (a no-op without lora)
        for k, chunk in enumerate(chunks):
            prox_mode = minibatch_prox_mode(self.loss_cfg, self.prox_logp, k)
            self._train_minibatch(chunk, max_tokens_per_mb, totals, prox_mode)
        set_lora_dropout(self.model, False)
        self.version += 1
        stats = self._reduced_stats(totals.outs)
        stats["loss"] /= max(len(chunks), 1)  # mean over minibatches of each minibatch's mean
        padded = totals.padded_tokens
        stats.update(
            grad_norm=sum(totals.grad_norms) / max(len(totals.grad_norms), 1),
            lr=float(self.optimizer.param_groups[0]["lr"]),
            padding_frac=(padded - totals.tokens) / padded if padded else 0.0,
            n_microbatches=float(totals.n_mb),
            skipped_minibatches=float(totals.skipped),
            step_skipped=float(totals.skipped > 0 and not totals.outs),
            tokens=float(totals.tokens),
            time_s=time.perf_counter() - t0,
        )
        return stats

    # ---------------------------------------------------------------- training
    def _train_minibatch(
        self, chunk: list[TrainSeq], max_tokens: int, totals: _StepTotals, prox_mode: str
    ) -> None:
        """One optimizer step over ``chunk`` (this rank's share of its micro-batches)."""
        denom = minibatch_normaliser(chunk, self.cfg.loss_cfg)
        mbs = [
            [chunk[i] for i in mb if len(chunk[i].output_ids) > 0]
            for mb in self.fwd.micro_batches(chunk, max_tokens)
        ]
        mbs = [mb for mb in mbs if mb]
        if not mbs:
            return
        totals.n_mb += len(mbs)
        totals.tokens += sum(seq_len(s) for mb in mbs for s in mb)
        totals.padded_tokens += sum(self.fwd.padded_tokens(mb) for mb in mbs)
        mine, n_pass = rank_share(len(mbs), self.rank, self.world)
        self.optimizer.zero_grad(set_to_none=True)
        outs = []
        for k in range(n_pass):
            real = k < len(mine)
            mb = mbs[mine[k]] if real else mbs[0]  # a dummy: same collectives, zero weight
            with self._offload():
                out = microbatch_loss(
                    self.fwd,
                    mb,
                    self.loss_cfg,
                    prox_mode,
                    self.version,
                    denom,
                    self.device,
                    ref_fwd=self.ref_fwd,
                )
                (out.loss if real else out.loss * 0.0).backward()
            if real:
                outs.append(out)
        norm = self._clip_grad_norm()
        if math.isfinite(norm) and self._all_finite(outs):
            self.optimizer.step()
            totals.grad_norms.append(norm)
            totals.outs.extend(outs)
        else:  # refused on every rank: a non-finite loss or gradient changes nothing
            totals.skipped += 1
            self.optimizer.zero_grad(set_to_none=True)

    def _offload(self) -> contextlib.AbstractContextManager:
        if self.cfg.activation_offload and self.device.type == "cuda":
            return torch.autograd.graph.save_on_cpu(pin_memory=True)
        return contextlib.nullcontext()

    def _clip_grad_norm(self) -> float:
        """Clip to ``grad_clip`` by the GLOBAL grad L2 norm (over every shard); returns it."""
        params = [p for p in self.model.parameters() if p.grad is not None]
        if not params:
            return 0.0
        total = torch.nn.utils.get_total_norm([p.grad for p in params], norm_type=2.0)
        if isinstance(total, DTensor):
            total = total.full_tensor()
        max_norm = self.grad_clip if self.grad_clip > 0 else float("inf")
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
        return float(total)

    def _all_finite(self, outs: list[PPOLossOutput]) -> bool:
        """Every rank's losses are finite (the same answer on every rank)."""
        local_ok = all(bool(torch.isfinite(o.loss.detach())) for o in outs)
        bad = torch.tensor([0.0 if local_ok else 1.0], device=self.device)
        dist.all_reduce(bad, op=dist.ReduceOp.MAX)
        return float(bad) == 0.0

    def _reduced_stats(self, outs: list[PPOLossOutput]) -> dict[str, float]:
        """``reduce_loss_stats`` over every rank's outputs: additive totals summed, the
        imp-weight max maxed (so each ratio is defined as on one rank)."""
        sums = loss_stat_sums(outs)
        if self.ref_fwd is not None:  # the same keys on every rank, even one with no outputs
            sums.setdefault("kl_ref_sum", 0.0)
        keys = sorted(sums)
        vec = torch.tensor(
            [sums[k] for k in keys] + [float(len(outs))], dtype=torch.float64, device=self.device
        )
        mx = torch.tensor(
            [max((o.imp_weight_max for o in outs), default=0.0)],
            dtype=torch.float64,
            device=self.device,
        )
        if self.world > 1:
            dist.all_reduce(vec)
            dist.all_reduce(mx, op=dist.ReduceOp.MAX)
        *totals, n_outs = vec.tolist()
        sums = dict(zip(keys, totals, strict=True))
        if n_outs == 0:  # no output on any rank: no kl_ref, as on one process
            sums.pop("kl_ref_sum", None)
        return stats_from_sums(sums, float(mx))

    # ------------------------------------------------------------ serialisation
    def export_state_dict(self) -> dict[str, torch.Tensor]:
        """Full CPU weights in ``dtype`` on rank 0 ({} elsewhere); every rank must call this.
        Valid until the next ``train_step`` (a tensor may share the live weights' storage).
        With lora: the adapter alone (only its tensors are gathered)."""
        if self.adapter_meta is not None:
            return self._export_adapter()
        state = get_model_state_dict(self.model, options=_FULL_TO_RANK0)
        return _own_storage({k: _cast(v, self.compute_dtype) for k, v in state.items()})

    def _export_adapter(self) -> dict[str, torch.Tensor]:
        lora = {}
        for name, p in self.model.named_parameters():  # the same order on every rank
            if ".lora_" in name:
                full = p.full_tensor() if isinstance(p, DTensor) else p
                lora[name] = _cast(full.detach(), self.compute_dtype)
        if self.rank != 0:
            return {}
        assert self.adapter_meta is not None
        return adapter_of(lora, self.adapter_meta)

    def export_safetensors(self) -> bytes:
        from safetensors.torch import save

        state = self.export_state_dict()
        return save(state) if self.rank == 0 else b""

    def save_pretrained(self, path: str) -> None:
        """Rank 0 writes the HF directory (``hf_io.save_hf_dir``, the files the torch engine
        writes; with lora the merged model and ``adapter/``); every rank must call this (the
        gather)."""
        if self.adapter_meta is not None:
            state = get_model_state_dict(self.model, options=_FULL_TO_RANK0)
            if self.rank == 0:
                state = {k: _cast(v, self.compute_dtype) for k, v in state.items()}
                save_lora_aware(self.model, self.adapter_meta, self.model_path, path, state)
            return
        state = self.export_state_dict()
        if self.rank == 0:
            save_hf_dir(self.model, state, self.model_path, path)

    def snapshot_checkpoint(self) -> dict:
        """Collective: on rank 0 a detached full copy of what ``save_checkpoint`` writes (fp32
        model, optimizer, version, RNG); {} on the other ranks."""
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer, options=_FULL_TO_RANK0)
        if self.rank != 0:
            return {}
        return {
            "format": CHECKPOINT_FORMAT,
            "model": _detached(model_sd),
            "optimizer": _detached(optim_sd),
            "version": self.version,
            "rng_cpu": torch.get_rng_state(),
            "rng_cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
        }

    # rank 0 only, no collective: writes a snapshot atomically (temp file, then rename)
    write_checkpoint = staticmethod(TorchTrainEngine.write_checkpoint)

    def save_checkpoint(self, path: str) -> None:
        """Collective; rank 0 writes one file at ``path`` (atomically)."""
        snapshot = self.snapshot_checkpoint()
        if self.rank == 0:
            self.write_checkpoint(snapshot, path)

    def load_checkpoint(self, path: str) -> None:
        """Collective: rank 0 reads ``path`` and broadcasts it; a missing or foreign file raises
        the same error on every rank."""
        state, problem = _read_checkpoint(path) if self.rank == 0 else ({}, None)
        head = [
            {
                "problem": problem,
                "version": state.get("version"),
                "rng_cpu": state.get("rng_cpu"),
                "rng_cuda": state.get("rng_cuda"),
            }
        ]
        dist.broadcast_object_list(head, src=0)
        info = head[0]
        if info["problem"] is not None:
            kind, message = info["problem"]
            raise (FileNotFoundError if kind == "missing" else ValueError)(message)
        # two calls: `set_state_dict` skips the model on a rank that passes an empty one
        set_model_state_dict(self.model, state.get("model", {}), options=_FROM_RANK0)
        set_optimizer_state_dict(
            self.model, self.optimizer, state.get("optimizer", {}), options=_FROM_RANK0
        )
        for group in self.optimizer.param_groups:  # the config wins: a resume may change them
            group["lr"], group["weight_decay"] = self.cfg.lr, self.cfg.weight_decay
        self.version = int(info["version"])
        torch.set_rng_state(info["rng_cpu"])
        if info["rng_cuda"] and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(info["rng_cuda"])


def _shard(
    model: torch.nn.Module,
    device: torch.device,
    world: int,
    compute_dtype: torch.dtype,
    cfg: TrainEngineConfig,
    *,
    checkpoint: bool = True,
) -> torch.nn.Module:
    """``fully_shard`` each decoder layer, then the root; gradients summed over ranks.
    ``checkpoint`` False: no activation checkpointing (a frozen reference has no backward)."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(device.type, (world,))
    mp = MixedPrecisionPolicy(
        param_dtype=None if compute_dtype == torch.float32 else compute_dtype,
        reduce_dtype=torch.float32,
    )
    layers = _decoder_layers(model)
    if cfg.gradient_checkpointing and checkpoint:
        from torch.distributed._composable import checkpoint as checkpoint_layer

        for layer in layers:
            checkpoint_layer(layer)
    for layer in layers:
        fully_shard(layer, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    for m in _iter_fsdp_modules(model):
        m.set_gradient_divide_factor(1.0)  # a sum over ranks: the losses carry the 1/N
        m.set_force_sum_reduction_for_comms(True)  # plain SUM (gloo has no PREMUL_SUM)
    return model


def _decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules an HF model says must not be split (its decoder layers)."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    return [m for m in model.modules() if type(m).__name__ in names]


def _cast(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return t.to(dtype) if t.is_floating_point() else t


def _own_storage(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Contiguous tensors, none sharing storage (tied weights are cloned): safetensors takes
    them and a fresh model's strict ``load_state_dict`` does too."""
    out: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for name, t in state.items():
        t = t.detach().contiguous()
        if t.data_ptr() in seen:
            t = t.clone()
        seen.add(t.data_ptr())
        out[name] = t
    return out


def _detached(x):
    """A deep copy of a (nested) state dict's tensors, so later steps cannot change it."""
    if isinstance(x, torch.Tensor):
        return x.detach().clone()
    if isinstance(x, dict):
        return {k: _detached(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return type(x)(_detached(v) for v in x)
    return x


def _read_checkpoint(path: str) -> tuple[dict, tuple[str, str] | None]:
    """(state, None), or ({}, (kind, message)) for a file that is missing or not ours."""
    if not Path(path).is_file():
        return {}, ("missing", f"no checkpoint at {path} (write one with save_checkpoint)")
    state = torch.load(path, map_location="cpu", weights_only=True)
    if state.get("format") != CHECKPOINT_FORMAT:
        return {}, (
            "foreign",
            f"{path}: checkpoint format {state.get('format')!r} is not the fsdp engine's "
            f"({CHECKPOINT_FORMAT!r}); resume with the train.engine that wrote it",
        )
    return state, None


def _iter_fsdp_modules(model: torch.nn.Module) -> Iterator[FSDPModule]:
    for m in model.modules():
        if isinstance(m, FSDPModule):
            yield m

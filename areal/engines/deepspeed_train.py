"""DeepSpeed ZeRO-2/3 training engine (multi-GPU, launched with the ``deepspeed`` launcher).

UNTESTED ON THIS MACHINE: written against the DeepSpeed (>= 0.15) API without GPUs or deepspeed
installed here. ``TorchTrainEngine`` is the reference: same loss (``microbatch_loss``), same
packing (``SeqForward``), same stats; run a multi-GPU smoke test before relying on it.

Invariants:
- Every rank calls every method with the same arguments; rank 0's ``seqs`` are broadcast, so
  only rank 0 needs to read the bus. Each minibatch is sharded round-robin over ranks.
- The loss denominator is the loss-token count of the whole minibatch (all ranks); DeepSpeed
  averages gradients over ranks, so each rank scales its loss by the world size.
- Every rank runs the same number of micro-batches per minibatch (short ranks run zero-weight
  dummies), so ZeRO's gradient collectives line up.
- ``export_safetensors`` / ``save_pretrained`` gather full weights (ZeRO-3) and return / write on
  rank 0 only (other ranks get b"" / write nothing).
"""

from __future__ import annotations

import os
import shutil
import time
import uuid
from pathlib import Path

import torch

from areal.algo.loss import loss_stat_sums, stats_from_sums
from areal.engines.base import TrainSeq
from areal.engines.config import TrainEngineConfig
from areal.engines.hf_io import save_hf_dir
from areal.engines.seq_forward import SeqForward, load_causal_lm, seq_len
from areal.engines.torch_infer import resolve_dtype
from areal.engines.torch_train import (
    check_seqs,
    export_state_dict,
    microbatch_loss,
    split_contiguous,
)

__all__ = ["DeepSpeedTrainEngine"]


class DeepSpeedTrainEngine:
    """Built from a ``TrainEngineConfig`` of kind "deepspeed" (``cfg.device`` is ignored: each
    rank runs on ``cuda:$LOCAL_RANK``); ``version`` starts at 0."""

    def __init__(self, cfg: TrainEngineConfig) -> None:
        import deepspeed
        import torch.distributed as dist

        if cfg.kind != "deepspeed":
            raise ValueError(
                f"DeepSpeedTrainEngine needs a config of kind 'deepspeed', got {cfg.kind!r}"
            )
        deepspeed.init_distributed()
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(self.device)
        torch.manual_seed(cfg.seed)
        self.cfg = cfg
        self.model_path = cfg.model_path
        self.zero_stage = cfg.zero_stage
        zero = {"stage": cfg.zero_stage, "overlap_comm": True, "contiguous_gradients": True}
        if cfg.zero_stage == 3:
            zero["stage3_gather_16bit_weights_on_model_save"] = True
        self.ds_config = {
            "train_micro_batch_size_per_gpu": 1,
            "gradient_accumulation_steps": 1,  # boundaries are driven explicitly below
            # DeepSpeed reads 0 as "no clipping", like grad_clip <= 0 in TorchTrainEngine.
            "gradient_clipping": max(cfg.grad_clip, 0.0),
            "bf16": {"enabled": cfg.dtype in ("bfloat16", "bf16")},
            "fp16": {"enabled": cfg.dtype in ("float16", "fp16")},
            "zero_optimization": zero,
            "optimizer": {
                "type": "AdamW",
                "params": {
                    "lr": cfg.lr,
                    "betas": list(cfg.betas),
                    "weight_decay": cfg.weight_decay,
                },
            },
            "steps_per_print": 10**9,
        }
        torch_dtype = resolve_dtype(cfg.dtype)
        if cfg.zero_stage == 3:
            with deepspeed.zero.Init(config_dict_or_path=self.ds_config):
                model, varlen = load_causal_lm(cfg.model_path, torch_dtype, cfg.attn_implementation)
        else:
            model, varlen = load_causal_lm(cfg.model_path, torch_dtype, cfg.attn_implementation)
        model.eval()
        self.engine, self.optimizer, _, _ = deepspeed.initialize(
            model=model, model_parameters=model.parameters(), config=self.ds_config
        )
        self.module = self.engine.module
        self.loss_cfg = cfg.loss_cfg
        self.n_minibatches = cfg.n_minibatches
        self.prox_logp = cfg.prox_logp
        self.temperature = cfg.temperature
        self.version = 0
        self.fwd = SeqForward(
            self.engine,
            dtype=torch_dtype,
            device=self.device,
            temperature=cfg.temperature,
            packing=cfg.packing,
            fixed_mb_size=cfg.fixed_mb_size,
            varlen=varlen,
        )

    # ------------------------------------------------------------------ helpers
    def _broadcast(self, obj):
        import torch.distributed as dist

        box = [obj if self.rank == 0 else None]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def _shard(self, seqs: list[TrainSeq]) -> list[int]:
        return list(range(self.rank, len(seqs), self.world))

    # ---------------------------------------------------------------- protocol
    def compute_logp(self, seqs: list[TrainSeq], max_tokens_per_mb: int) -> list[torch.Tensor]:
        import torch.distributed as dist

        seqs = self._broadcast(seqs)
        mine = self._shard(seqs)
        local: dict[int, torch.Tensor] = {}
        with torch.no_grad():
            for mb in self.fwd.micro_batches([seqs[i] for i in mine], max_tokens_per_mb):
                for j, lp in zip(mb, self.fwd.logp([seqs[mine[j]] for j in mb]), strict=True):
                    local[mine[j]] = lp.cpu()
        gathered: list[dict[int, torch.Tensor]] = [{} for _ in range(self.world)]
        dist.all_gather_object(gathered, local)
        merged = {k: v for part in gathered for k, v in part.items()}
        return [merged[i] for i in range(len(seqs))]

    def train_step(self, seqs: list[TrainSeq], max_tokens_per_mb: int) -> dict[str, float]:
        import torch.distributed as dist

        t0 = time.perf_counter()
        seqs = self._broadcast(seqs)
        check_seqs(seqs)
        cfg = self.loss_cfg
        if cfg.decoupled and self.prox_logp == "recompute":
            for s, lp in zip(seqs, self.compute_logp(seqs, max_tokens_per_mb), strict=True):
                s.prox_logp = lp
        chunks = [c for c in split_contiguous(seqs, self.n_minibatches) if c]
        outs, grad_norms, n_mb, tokens, padded = [], [], 0, 0, 0
        for chunk in chunks:
            denom = float(sum(len(s.output_ids) for s in chunk))
            mine = [chunk[i] for i in self._shard(chunk) if len(chunk[i].output_ids) > 0]
            mbs = self.fwd.micro_batches(mine, max_tokens_per_mb) if mine else []
            n_local = torch.tensor(len(mbs), device=self.device)
            dist.all_reduce(n_local, op=dist.ReduceOp.MAX)
            n_total = int(n_local)
            for k in range(n_total):
                dummy = k >= len(mbs)
                mb_seqs = [chunk[0]] if dummy else [mine[i] for i in mbs[k]]
                self.engine.set_gradient_accumulation_boundary(k == n_total - 1)
                out = microbatch_loss(
                    self.fwd, mb_seqs, cfg, self.prox_logp, self.version, denom, self.device
                )
                loss = out.loss * (0.0 if dummy else float(self.world))
                self.engine.backward(loss)
                self.engine.step()
                if not dummy:
                    n_mb += 1
                    tokens += sum(seq_len(s) for s in mb_seqs)
                    padded += self.fwd.padded_tokens(mb_seqs)
                    outs.append(out)
            grad_norms.append(float(self.engine.get_global_grad_norm() or 0.0))
        self.version += 1

        # Combine across ranks from additive totals, so every ratio has the same definition as
        # on one rank (reduce_loss_stats): sums all-reduced with SUM, the imp-weight max with MAX.
        sums = loss_stat_sums(outs)
        keys = sorted(sums)
        vec = torch.tensor(
            [sums[k] for k in keys] + [float(n_mb), float(tokens), float(padded)],
            device=self.device,
            dtype=torch.float64,
        )
        dist.all_reduce(vec)
        mx = torch.tensor(
            [max((o.imp_weight_max for o in outs), default=0.0)],
            device=self.device,
            dtype=torch.float64,
        )
        dist.all_reduce(mx, op=dist.ReduceOp.MAX)
        v = vec.tolist()
        stats = stats_from_sums(dict(zip(keys, v[: len(keys)], strict=True)), float(mx))
        stats["loss"] /= max(len(chunks), 1)  # mean over minibatches of each minibatch's mean
        n_mb_all, tokens_all, padded_all = v[len(keys) :]
        stats.update(
            grad_norm=sum(grad_norms) / max(len(grad_norms), 1),
            lr=float(self.optimizer.param_groups[0]["lr"]),
            padding_frac=(padded_all - tokens_all) / padded_all if padded_all else 0.0,
            n_microbatches=n_mb_all,
            tokens=tokens_all,
            time_s=time.perf_counter() - t0,
        )
        return stats

    # ------------------------------------------------------------ serialisation
    def _full_state_dict(self) -> dict[str, torch.Tensor] | None:
        """Full weights on rank 0 (None elsewhere); every rank must call this."""
        if self.zero_stage == 3:
            import deepspeed

            params = list(self.module.parameters())
            with deepspeed.zero.GatheredParameters(params, modifier_rank=None):
                return export_state_dict(self.module) if self.rank == 0 else None
        return export_state_dict(self.module) if self.rank == 0 else None

    def export_safetensors(self) -> bytes:
        from safetensors.torch import save

        state = self._full_state_dict()
        return save(state) if state is not None else b""

    def save_pretrained(self, path: str) -> None:
        """Rank 0 writes the HF directory (``hf_io.save_hf_dir``, the same files as
        ``TorchTrainEngine.save_pretrained``); every rank must call this (ZeRO-3 gather)."""
        state = self._full_state_dict()
        if self.rank == 0:
            save_hf_dir(self.module, state, self.model_path, path)

    def save_checkpoint(self, path: str) -> None:
        """A DeepSpeed checkpoint directory (sharded model + optimizer), swapped in atomically."""
        import torch.distributed as dist

        dst = Path(path)
        tmp = Path(self._broadcast(str(dst.with_name(f".{dst.name}.tmp-{uuid.uuid4().hex[:8]}"))))
        client = {"version": self.version, "rng_cpu": torch.get_rng_state()}
        self.engine.save_checkpoint(str(tmp), tag="state", client_state=client)
        dist.barrier()
        if self.rank == 0:
            if dst.exists():
                shutil.rmtree(dst)
            os.replace(tmp, dst)
        dist.barrier()

    def load_checkpoint(self, path: str) -> None:
        if not Path(path).is_dir():
            raise FileNotFoundError(
                f"no DeepSpeed checkpoint at {path} (write one with save_checkpoint)"
            )
        _, client = self.engine.load_checkpoint(path, tag="state")
        if client is None:
            raise ValueError(f"{path}: DeepSpeed could not load the checkpoint")
        self.version = int(client["version"])
        torch.set_rng_state(client["rng_cpu"])

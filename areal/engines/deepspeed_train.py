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

from areal.algo.loss import PPOLossConfig, reduce_loss_stats
from areal.engines.base import TrainSeq
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
    def __init__(
        self,
        model_path: str,
        *,
        lr: float = 1e-5,
        weight_decay: float = 0.0,
        betas: tuple[float, float] = (0.9, 0.999),
        grad_clip: float = 1.0,
        loss_cfg: PPOLossConfig | None = None,
        temperature: float = 1.0,
        n_minibatches: int = 1,
        prox_logp: str = "recompute",
        dtype: str = "bfloat16",
        zero_stage: int = 2,
        seed: int = 0,
        version: int = 0,
        packing: str = "ffd",
        fixed_mb_size: int = 8,
        attn_implementation: str = "varlen",
    ) -> None:
        import deepspeed
        import torch.distributed as dist

        deepspeed.init_distributed()
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(self.device)
        torch.manual_seed(seed)
        self.model_path = model_path
        self.zero_stage = zero_stage
        zero = {"stage": zero_stage, "overlap_comm": True, "contiguous_gradients": True}
        if zero_stage == 3:
            zero["stage3_gather_16bit_weights_on_model_save"] = True
        self.ds_config = {
            "train_micro_batch_size_per_gpu": 1,
            "gradient_accumulation_steps": 1,  # boundaries are driven explicitly below
            "gradient_clipping": grad_clip,
            "bf16": {"enabled": dtype in ("bfloat16", "bf16")},
            "fp16": {"enabled": dtype in ("float16", "fp16")},
            "zero_optimization": zero,
            "optimizer": {
                "type": "AdamW",
                "params": {"lr": lr, "betas": list(betas), "weight_decay": weight_decay},
            },
            "steps_per_print": 10**9,
        }
        torch_dtype = resolve_dtype(dtype)
        if zero_stage == 3:
            with deepspeed.zero.Init(config_dict_or_path=self.ds_config):
                model, varlen = load_causal_lm(model_path, torch_dtype, attn_implementation)
        else:
            model, varlen = load_causal_lm(model_path, torch_dtype, attn_implementation)
        model.eval()
        self.engine, self.optimizer, _, _ = deepspeed.initialize(
            model=model, model_parameters=model.parameters(), config=self.ds_config
        )
        self.module = self.engine.module
        self.loss_cfg = loss_cfg if loss_cfg is not None else PPOLossConfig()
        self.n_minibatches = n_minibatches
        self.prox_logp = prox_logp
        self.temperature = temperature
        self.version = version
        self.fwd = SeqForward(
            self.engine,
            dtype=torch_dtype,
            device=self.device,
            temperature=temperature,
            packing=packing,
            fixed_mb_size=fixed_mb_size,
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

        local = reduce_loss_stats(outs)
        local["loss"] /= max(len(chunks), 1)
        # Combine across ranks: sums for counts/loss, weighted means for per-token stats.
        vec = torch.tensor(
            [
                local["loss"],
                local["clipfrac"] * local["n_tokens"],
                local["approx_kl"] * local["n_tokens"],
                local["behav_imp_weight_mean"] * local["n_tokens"],
                local["behav_imp_weight_masked_frac"] * local["n_tokens"],
                local["n_tokens"],
                float(n_mb),
                float(tokens),
                float(padded),
            ],
            device=self.device,
            dtype=torch.float64,
        )
        dist.all_reduce(vec)
        mx = torch.tensor([local["behav_imp_weight_max"]], device=self.device)
        dist.all_reduce(mx, op=dist.ReduceOp.MAX)
        v = vec.tolist()
        n_tok = max(v[5], 1.0)
        return {
            "loss": v[0],
            "clipfrac": v[1] / n_tok,  # per masked token here (per kept token on one rank)
            "approx_kl": v[2] / n_tok,
            "behav_imp_weight_mean": v[3] / n_tok,
            "behav_imp_weight_max": float(mx),
            "behav_imp_weight_masked_frac": v[4] / n_tok,
            "n_tokens": v[5],
            "grad_norm": sum(grad_norms) / max(len(grad_norms), 1),
            "lr": float(self.optimizer.param_groups[0]["lr"]),
            "padding_frac": (v[8] - v[7]) / v[8] if v[8] else 0.0,
            "n_microbatches": v[6],
            "tokens": v[7],
            "time_s": time.perf_counter() - t0,
        }

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
        state = self._full_state_dict()
        if self.rank != 0:
            return
        dst = Path(path)
        tmp = dst.with_name(f".{dst.name}.tmp-{uuid.uuid4().hex[:8]}")
        self.module.save_pretrained(tmp, state_dict=state)
        for f in Path(self.model_path).iterdir():
            if (
                f.is_file()
                and f.suffix not in (".safetensors", ".bin")
                and not (tmp / f.name).exists()
            ):
                shutil.copy2(f, tmp / f.name)
        if dst.exists():
            shutil.rmtree(dst)
        os.replace(tmp, dst)

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

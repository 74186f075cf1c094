"""Single-process training engine on a transformers causal LM (CPU or one GPU).

Invariants:
- Log-probs are ``log_softmax(logits / temperature)`` at the next token, the same policy the
  rollout engine samples from (``TorchInferenceEngine`` records ``log_softmax(logits / T)``);
  build the trainer with the rollout temperature (1.0 when rollouts are greedy).
- The model always runs in eval mode (no dropout), so ``compute_logp`` and the loss pass see the
  same function of the weights; gradients flow regardless.
- Micro-batching and the padding-free packed forward live in ``seq_forward.SeqForward``
  (``packing="ffd"``: FFD + one packed row per micro-batch; ``"fixed"``: right-padded chunks).
- One ``train_step`` = ``n_minibatches`` optimizer steps over contiguous minibatches, each
  averaging over its own loss tokens; ``version`` goes up by exactly one per ``train_step``.
- Its stats come from ``reduce_loss_stats`` over the micro-batches: k3 ``approx_kl`` against the
  PPO reference and ``entropy``, the mean per-token entropy of the training forward's
  temperature-scaled distribution (computed without grad, before that minibatch's update).
- The RL math (decoupled PPO loss, log-linear proximal policy, packing) comes from ``areal.algo``.
- With ``lora`` only the adapter trains (`areal.engines.lora`): the optimizer holds its tensors,
  `export_state_dict` (what is published) is the adapter alone, a checkpoint holds the adapter
  and its optimizer state, and `save_pretrained` writes the merged model plus ``adapter/``.
"""

from __future__ import annotations

import math
import os
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import torch

from areal.algo.loss import (
    LossInput,
    LossSettings,
    PPOLossOutput,
    loglinear_prox_logp,
    reduce_loss_stats,
)
from areal.algo.loss_norm import Normaliser
from areal.algo.registry import compute_loss
from areal.algo.stale_step import lr_scale, mean_token_lag
from areal.engines.base import TrainSeq
from areal.engines.config import TrainEngineConfig
from areal.engines.hf_io import export_plain
from areal.engines.lora import (
    AdapterMeta,
    adapter_of,
    lora_setup,
    save_lora_aware,
    set_lora_dropout,
)
from areal.engines.seq_forward import SeqForward, load_causal_lm, seq_len
from areal.engines.torch_infer import resolve_dtype

__all__ = [
    "TorchTrainEngine",
    "check_seqs",
    "export_state_dict",
    "fill_prox_logp",
    "microbatch_loss",
    "minibatch_normaliser",
    "minibatch_prox_mode",
    "split_contiguous",
]

_CHECKPOINT_FORMAT = 1


def export_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Contiguous CPU copies of every key of ``model.state_dict()``; tied tensors get their own
    storage, so safetensors accepts them and a fresh model's strict ``load_state_dict`` does too."""
    return export_plain(model.state_dict())


class TorchTrainEngine:
    """Built from a ``TrainEngineConfig`` of kind "torch"; ``version`` starts at 0."""

    def __init__(self, cfg: TrainEngineConfig) -> None:
        if cfg.kind != "torch":
            raise ValueError(f"TorchTrainEngine needs a config of kind 'torch', got {cfg.kind!r}")
        torch.manual_seed(cfg.seed)
        self.cfg = cfg
        self.model_path = cfg.model_path
        self.device = torch.device(cfg.device)
        model, varlen = load_causal_lm(
            cfg.model_path, resolve_dtype(cfg.dtype), cfg.attn_implementation
        )
        self.adapter_meta = lora_setup(model, cfg)
        self.model = model.to(self.device)
        self.model.eval()
        self.vocab_size: int = self.model.get_input_embeddings().num_embeddings
        self.max_seq_len: int | None = getattr(self.model.config, "max_position_embeddings", None)
        self.optimizer = torch.optim.AdamW(
            [p for p in self.model.parameters() if p.requires_grad],
            lr=cfg.lr,
            betas=cfg.betas,
            weight_decay=cfg.weight_decay,
        )
        self.grad_clip = cfg.grad_clip
        self.loss_cfg = cfg.loss_cfg
        self.temperature = cfg.temperature
        self.n_minibatches = cfg.n_minibatches
        self.prox_logp = cfg.prox_logp
        self.version = 0
        self.fwd = SeqForward.of_config(
            self.model, cfg, dtype=self.model.dtype, device=self.device, varlen=varlen
        )
        # algo.kl_coef > 0: a frozen reference policy, the initial weights, forwarded exactly as
        # the policy is (same SeqForward), so its KL is exactly 0 before the first update
        self.ref_fwd: SeqForward | None = None
        if cfg.loss_cfg.kl_coef > 0:
            ref, _ = load_causal_lm(
                cfg.model_path, resolve_dtype(cfg.dtype), cfg.attn_implementation
            )
            ref = ref.to(self.device).eval().requires_grad_(False)
            self.ref_fwd = SeqForward.of_config(
                ref, cfg, dtype=ref.dtype, device=self.device, varlen=varlen
            )

    # ---------------------------------------------------------------- protocol
    def compute_logp(self, seqs: list[TrainSeq], max_tokens_per_mb: int) -> list[torch.Tensor]:
        out: list[torch.Tensor | None] = [None] * len(seqs)
        set_lora_dropout(self.model, False)
        with torch.no_grad():
            for mb in self.fwd.micro_batches(seqs, max_tokens_per_mb):
                for i, lp in zip(mb, self.fwd.logp([seqs[i] for i in mb]), strict=True):
                    out[i] = lp.cpu()
        return out  # type: ignore[return-value]

    def train_step(self, seqs: list[TrainSeq], max_tokens_per_mb: int) -> dict[str, float]:
        if not seqs:
            raise ValueError("train_step needs at least one sequence")
        t0 = time.perf_counter()
        cfg = self.loss_cfg
        check_seqs(seqs)
        chunks = [c for c in split_contiguous(seqs, self.n_minibatches) if c]
        fill_prox_logp(chunks, cfg, self.prox_logp, self.compute_logp, max_tokens_per_mb)
        set_step_lr(self.optimizer, seqs, base_lr=self.cfg.lr, version=self.version, cfg=cfg)
        set_lora_dropout(self.model, True)  # the loss forwards only (a no-op without lora)
        outs, grad_norms, skipped = [], [], 0
        n_mb, tokens, padded_tokens = 0, 0, 0
        params = [p for p in self.model.parameters() if p.requires_grad]
        for k, chunk in enumerate(chunks):
            prox_mode = minibatch_prox_mode(cfg, self.prox_logp, k)
            denom = minibatch_normaliser(chunk, cfg)
            self.optimizer.zero_grad(set_to_none=True)
            chunk_outs = []
            for mb in self.fwd.micro_batches(chunk, max_tokens_per_mb):
                mb_seqs = [chunk[i] for i in mb if len(chunk[i].output_ids) > 0]
                if not mb_seqs:
                    continue
                n_mb += 1
                tokens += sum(seq_len(s) for s in mb_seqs)
                padded_tokens += self.fwd.padded_tokens(mb_seqs)
                out = microbatch_loss(
                    self.fwd,
                    mb_seqs,
                    cfg,
                    prox_mode,
                    self.version,
                    denom,
                    self.device,
                    ref_fwd=self.ref_fwd,
                )
                out.loss.backward()
                chunk_outs.append(out)
            max_norm = self.grad_clip if self.grad_clip > 0 else float("inf")
            norm = float(torch.nn.utils.clip_grad_norm_(params, max_norm))
            losses = [o.loss.detach() for o in chunk_outs]
            if math.isfinite(norm) and bool(torch.isfinite(torch.stack(losses)).all()):
                grad_norms.append(norm)
                outs.extend(chunk_outs)
                self.optimizer.step()
            elif losses:  # refuse the update: a non-finite loss or gradient changes nothing
                skipped += 1
                self.optimizer.zero_grad(set_to_none=True)
        set_lora_dropout(self.model, False)
        self.version += 1

        stats = reduce_loss_stats(outs)
        stats["loss"] /= max(len(chunks), 1)  # mean over minibatches of each minibatch's token mean
        stats.update(
            grad_norm=sum(grad_norms) / max(len(grad_norms), 1),
            lr=float(self.optimizer.param_groups[0]["lr"]),
            padding_frac=(padded_tokens - tokens) / padded_tokens if padded_tokens else 0.0,
            n_microbatches=float(n_mb),
            skipped_minibatches=float(skipped),
            step_skipped=float(skipped > 0 and not outs),
            tokens=float(tokens),
            time_s=time.perf_counter() - t0,
        )
        return stats

    # ------------------------------------------------------------ serialisation
    def export_state_dict(self) -> dict[str, torch.Tensor]:
        """The weights as CPU tensors (what `weights_stream.export_blob` streams to the wire,
        cast block by block: no second, whole blob in memory). With lora: the adapter alone."""
        if self.adapter_meta is not None:
            return adapter_of(self.model.state_dict(), self.adapter_meta)
        return export_state_dict(self.model)

    def export_safetensors(self) -> bytes:
        from safetensors.torch import save

        return save(self.export_state_dict())

    def save_pretrained(self, path: str) -> None:
        """HF directory at ``path`` (``hf_io.save_hf_dir``: config + safetensors + tokenizer and
        other non-weight files of ``model_path``), swapped into place atomically. With lora:
        the merged weights, and the adapter as a PEFT dir in ``adapter/``."""
        save_lora_aware(self.model, self.adapter_meta, self.model_path, path)

    def save_checkpoint(self, path: str) -> None:
        """One file: model, optimizer, version, RNG; written to a temp file and renamed."""
        self.write_checkpoint(self.snapshot_checkpoint(), path)

    def snapshot_checkpoint(self) -> dict:
        """A detached copy of everything `save_checkpoint` writes (cheap next to writing it), so
        the file can be written while the next step already updates the live tensors."""

        def detach(x):
            if isinstance(x, torch.Tensor):
                return x.detach().clone()
            if isinstance(x, dict):
                return {k: detach(v) for k, v in x.items()}
            if isinstance(x, list | tuple):
                return type(x)(detach(v) for v in x)
            return x

        return {
            "format": _CHECKPOINT_FORMAT,
            "model": detach(trained_state(self.model, self.adapter_meta)),
            "optimizer": detach(self.optimizer.state_dict()),
            "version": self.version,
            "rng_cpu": torch.get_rng_state(),
            "rng_cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
        }

    @staticmethod
    def write_checkpoint(snapshot: dict, path: str) -> None:
        """Write a `snapshot_checkpoint()` to `path` atomically (temp file, then rename)."""
        dst = Path(path)
        dst.parent.mkdir(parents=True, exist_ok=True)
        tmp = dst.with_name(f".{dst.name}.tmp-{uuid.uuid4().hex[:8]}")
        try:
            # a Python file object: a full disk or an unwritable dir raises OSError (torch's own
            # path-based writer raises a RuntimeError that says less), and the caller retries
            with open(tmp, "wb") as f:
                torch.save(snapshot, f)
            os.replace(tmp, dst)
        finally:
            tmp.unlink(missing_ok=True)

    def load_checkpoint(self, path: str) -> None:
        if not Path(path).is_file():
            raise FileNotFoundError(f"no checkpoint at {path} (write one with save_checkpoint)")
        state = torch.load(path, map_location="cpu", weights_only=True)
        if state.get("format") != _CHECKPOINT_FORMAT:
            raise ValueError(f"{path}: unknown checkpoint format {state.get('format')!r}")
        load_trained_state(self.model, self.adapter_meta, state["model"], path)
        self.optimizer.load_state_dict(state["optimizer"])
        for group in self.optimizer.param_groups:  # the config wins: a resume may change them
            group["lr"], group["weight_decay"] = self.cfg.lr, self.cfg.weight_decay
        self.version = int(state["version"])
        torch.set_rng_state(state["rng_cpu"])
        if state["rng_cuda"] and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(state["rng_cuda"])


def trained_state(model: torch.nn.Module, meta: AdapterMeta | None) -> dict[str, torch.Tensor]:
    """What a checkpoint holds of the model: everything, or with lora the adapter tensors."""
    state = model.state_dict()
    if meta is None:
        return state
    return {k: v for k, v in state.items() if ".lora_" in k}


def load_trained_state(
    model: torch.nn.Module, meta: AdapterMeta | None, state: dict, path: str
) -> None:
    """Load a `trained_state` back; a full-model checkpoint into a lora engine (or back) is
    refused with the fix."""
    if meta is None:
        if any(".lora_" in k for k in state):
            raise ValueError(f"{path}: a LoRA adapter's checkpoint; resume with its train.lora")
        model.load_state_dict(state, strict=True)
        return
    missing, unexpected = model.load_state_dict(state, strict=False)
    if unexpected or any(".lora_" in k for k in missing):
        raise ValueError(
            f"{path}: not a checkpoint of this LoRA adapter (unexpected {unexpected[:3]}, "
            f"missing {[k for k in missing if '.lora_' in k][:3]}); resume with the train.lora "
            "that wrote it"
        )


def check_seqs(seqs: list[TrainSeq]) -> None:
    if not seqs:
        raise ValueError("train_step needs at least one sequence")
    for s in seqs:
        if s.output_ids.shape != s.behav_logp.shape or s.output_ids.shape != s.versions.shape:
            raise ValueError(
                "TrainSeq output_ids, behav_logp and versions must have the same shape"
            )
        if s.loss_mask is not None and s.loss_mask.shape != s.output_ids.shape:
            raise ValueError("TrainSeq loss_mask must have the shape of output_ids")
        if len(s.prompt_ids) == 0:
            raise ValueError("TrainSeq with an empty prompt")


def loss_tokens(chunk: list[TrainSeq]) -> float:
    """The token denominator of a minibatch's loss: its loss-mask tokens (DESIGN section 5:
    sum over loss-mask tokens / their number), so environment tokens dilute nothing."""
    return float(sum(s.n_loss_tokens() for s in chunk))


def minibatch_normaliser(chunk: list[TrainSeq], cfg: LossSettings) -> Normaliser:
    """The loss normaliser of one minibatch (``algo.loss_norm``, `areal.algo.loss_norm`): the one
    function every engine calls, once per minibatch, for all of its micro-batches."""
    return Normaliser.of([s.n_loss_tokens() for s in chunk], cfg.loss_norm, cfg.loss_norm_tokens)


def fill_prox_logp(
    chunks: list[list[TrainSeq]],
    cfg: LossSettings,
    prox_mode: str,
    compute_logp: Callable[[list[TrainSeq], int], list[torch.Tensor]],
    max_tokens_per_mb: int,
) -> None:
    """Set ``prox_logp`` (decoupled PPO, "recompute") on the minibatches after the first.

    Proximal policy = the current weights, evaluated before any update of this step. The first
    minibatch's are its own training forward's log-probs (detached: the same weights, no
    update yet; ``minibatch_prox_mode``), so only the later minibatches need a no-grad forward
    now. Every engine (and every rank of one) calls this with the same chunks."""
    if not (cfg.decoupled and prox_mode == "recompute"):
        return
    later = [s for c in chunks[1:] for s in c]
    if later:
        for s, lp in zip(later, compute_logp(later, max_tokens_per_mb), strict=True):
            s.prox_logp = lp


def set_step_lr(
    optimizer: torch.optim.Optimizer,
    seqs: list[TrainSeq],
    *,
    base_lr: float,
    version: int,
    cfg: LossSettings,
) -> float:
    """Set every param group's lr for this step (`areal.algo.stale_step`: ``base_lr`` scaled
    down by the mean lag of the step's loss tokens behind ``version``); returns it."""
    scale = lr_scale(
        mean_token_lag([s.versions for s in seqs], [s.loss_mask for s in seqs], version),
        cfg.lr_lag_decay,
    )
    for group in optimizer.param_groups:
        group["lr"] = base_lr * scale
    return base_lr * scale


def minibatch_prox_mode(cfg: LossSettings, prox_mode: str, k: int) -> str:
    """The ``microbatch_loss`` prox mode of minibatch ``k`` (see ``fill_prox_logp``)."""
    return "current" if cfg.decoupled and prox_mode == "recompute" and k == 0 else prox_mode


def microbatch_loss(
    fwd: SeqForward,
    seqs: list[TrainSeq],
    cfg: LossSettings,
    prox_mode: str,
    version: int,
    denom: float | Normaliser,
    device: torch.device,
    ref_fwd: SeqForward | None = None,
) -> PPOLossOutput:
    """Forward one micro-batch with grad and return its loss (not yet backwarded): the objective
    ``cfg.loss`` (`areal.algo.registry`) on a `LossInput`, divided by the minibatch's
    normaliser ``denom`` (``minibatch_normaliser``; a number: that token denominator).

    Per-token adv = the seq's adv on every output token; loss mask = each seq's `loss_mask`
    (model tokens; all output tokens when None), which keeps environment tokens out of the
    loss, its gradient and every stat. The per-token entropy of the same forward goes into the
    stats (no grad). `prox_mode`:
    "recompute" takes each seq's `prox_logp`; "current" the detached log-probs of this very
    forward (the proximal policy when no update happened yet this step); "loglinear"
    interpolates between behaviour and current log-probs by version. `ref_fwd` (``kl_coef`` >
    0): the frozen reference, whose log-probs of the same micro-batch go into the loss's KL.
    """
    logps, ents = fwd.logp_and_entropy(seqs)
    logp, entropy = torch.cat(logps), torch.cat(ents)  # [N], [N]
    behav = torch.cat([s.behav_logp for s in seqs]).to(device, torch.float32)
    adv = torch.cat([torch.full((len(s.output_ids),), float(s.adv)) for s in seqs]).to(device)
    mask = torch.cat(
        [
            s.loss_mask.bool()
            if s.loss_mask is not None
            else torch.ones(len(s.output_ids), dtype=torch.bool)
            for s in seqs
        ]
    ).to(device)  # [N]
    versions = torch.cat([s.versions for s in seqs]).to(device)  # [N]
    if not cfg.decoupled:
        prox = behav  # unused by the loss
    elif prox_mode == "current":  # the weights being trained, before their first update
        prox = logp.detach()
    elif prox_mode == "recompute":
        prox = torch.cat([s.prox_logp for s in seqs]).to(device, torch.float32)
    else:
        prox = loglinear_prox_logp(behav, logp.detach(), versions, version)
    lengths = [len(s.output_ids) for s in seqs]
    if isinstance(denom, Normaliser):
        denom = denom.denominator([s.n_loss_tokens() for s in seqs], lengths)
    inp = LossInput(
        logp=logp,
        prox_logp=prox,
        behav_logp=behav,
        adv=adv,
        mask=mask,
        seq_ids=torch.repeat_interleave(torch.arange(len(seqs)), torch.tensor(lengths)).to(device),
        versions=versions,
        loss_denominator=denom,
        entropy=entropy,
        ref_logp=ref_logp(ref_fwd, seqs) if ref_fwd is not None else None,
    )
    return compute_loss(inp, cfg)


def ref_logp(ref_fwd: SeqForward, seqs: list[TrainSeq]) -> torch.Tensor:
    """``[N]`` log-probs of the reference policy, by the very code path of the policy's loss
    forward (``logp_and_entropy``), so equal weights give bitwise equal log-probs."""
    with torch.no_grad():
        return torch.cat(ref_fwd.logp_and_entropy(seqs)[0])


def split_contiguous(seqs: list[TrainSeq], n: int) -> list[list[TrainSeq]]:
    """``n`` contiguous chunks whose sizes differ by at most one."""
    q, r = divmod(len(seqs), n)
    out, start = [], 0
    for i in range(n):
        end = start + q + (1 if i < r else 0)
        out.append(seqs[start:end])
        start = end
    return out

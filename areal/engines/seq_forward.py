"""Per-token log-probs of training sequences, micro-batched and (by default) padding-free.

Invariants:
- ``logp(seqs)[i][t] = log_softmax(logits / temperature)`` at output token t of seq i, where the
  logits come from position ``P_i + t - 1`` (position p predicts token p + 1).
- ``packing="ffd"``: micro-batches from ``pack_ffd`` under ``max_tokens_per_mb``, each run as ONE
  row: sequences concatenated, position ids restarting at 0 per sequence, attention kept inside
  each sequence. With ``varlen_attn`` (default) that is causal sdpa per segment (cost
  sum(len_i^2)); with ``sdpa``/``eager`` transformers (>= 5) builds a block-diagonal mask from the
  restarting position ids (cost L^2) and older versions get an explicit 4-D additive mask;
  ``flash_attention_2`` handles restarting position ids natively.
- Shared prompts (``share_prompts``, default on with ``varlen_attn``): within a packed micro-batch
  the seqs with the same prompt (a GRPO group's G samples) carry that prompt once, followed by
  their completions; each completion attends to the prompt and to its own tokens only, so the
  log-probs and gradients are those of the separate sequences while the prompt's tokens go
  through the model's layers once instead of G times. Micro-batches then come from
  ``pack_ffd_shared``, which keeps a group together where the budget allows.
- ``packing="fixed"``: consecutive chunks of ``fixed_mb_size``, right-padded (the baseline).
- Only the logits of output positions are computed (``logits_to_keep``) in the packed path.
- ``logp_and_entropy`` also returns each output position's entropy ``-sum_v p_v log p_v`` of the
  same temperature-scaled distribution, computed without grad (a statistic, never a loss term).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from areal.algo.packing import pack_ffd, pack_ffd_shared, pack_fixed
from areal.engines import varlen_attn
from areal.engines.base import TrainSeq

if TYPE_CHECKING:
    from areal.engines.config import TrainEngineConfig

__all__ = ["SeqForward", "load_causal_lm", "seq_len"]


def seq_len(s: TrainSeq) -> int:
    return len(s.prompt_ids) + len(s.output_ids)


def load_causal_lm(model_path: str, dtype: torch.dtype, attn_implementation: str):
    """Load an HF causal LM from a local dir; returns (model, uses_varlen_attention)."""
    from transformers import AutoModelForCausalLM

    varlen = attn_implementation == "varlen" and varlen_attn.register()
    kw = {}
    if varlen:
        kw["attn_implementation"] = varlen_attn.NAME
    elif attn_implementation != "varlen":
        kw["attn_implementation"] = attn_implementation
    model = AutoModelForCausalLM.from_pretrained(
        model_path, dtype=dtype, local_files_only=True, **kw
    )
    return model, varlen


def _packed_detection_builtin() -> bool:
    try:
        from transformers.masking_utils import find_packed_sequence_indices  # noqa: F401
    except ImportError:
        return False
    return True


class SeqForward:
    """Runs ``model`` (an HF causal LM, or a wrapper such as a DeepSpeed engine that forwards
    the same keyword arguments) over micro-batches of ``TrainSeq``."""

    def __init__(
        self,
        model: Callable,
        *,
        dtype: torch.dtype,
        device: torch.device,
        temperature: float,
        packing: str,
        fixed_mb_size: int,
        varlen: bool,
        share_prompts: bool = True,
    ) -> None:
        if packing not in ("ffd", "fixed"):
            raise ValueError(f"packing must be 'ffd' or 'fixed', got {packing!r}")
        self.model, self.dtype, self.device = model, dtype, device
        self.temperature = temperature
        self.packing = packing
        self.fixed_mb_size = fixed_mb_size
        self.varlen = varlen
        self.share_prompts = share_prompts and varlen  # needs our attention (areal_blocks)
        self.builtin_packed = _packed_detection_builtin()

    @classmethod
    def of_config(
        cls,
        model: Callable,
        cfg: TrainEngineConfig,
        *,
        dtype: torch.dtype,
        device: torch.device,
        varlen: bool,
    ) -> SeqForward:
        """A trainer engine's forward of `model` as its config sets it up (temperature,
        packing, shared prompts)."""
        return cls(
            model,
            dtype=dtype,
            device=device,
            temperature=cfg.temperature,
            packing=cfg.packing,
            fixed_mb_size=cfg.fixed_mb_size,
            varlen=varlen,
            share_prompts=cfg.share_prompts,
        )

    def micro_batches(self, seqs: list[TrainSeq], max_tokens_per_mb: int) -> list[list[int]]:
        if self.packing == "fixed":
            return pack_fixed(len(seqs), self.fixed_mb_size)
        if self.share_prompts:  # keep a group together: its prompt is then run once
            return pack_ffd_shared(
                [_prompt_key(s) for s in seqs],
                [len(s.prompt_ids) for s in seqs],
                [len(s.output_ids) for s in seqs],
                max_tokens_per_mb,
            )
        return pack_ffd([seq_len(s) for s in seqs], max_tokens_per_mb)

    def padded_tokens(self, seqs: list[TrainSeq]) -> int:
        """Token slots one micro-batch of ``seqs`` occupies (real + padding)."""
        lens = [seq_len(s) for s in seqs]
        return max(lens) * len(lens) if self.packing == "fixed" else sum(lens)

    def logp(self, seqs: list[TrainSeq]) -> list[torch.Tensor]:
        """Log-probs ``[T_i]`` of each seq's output tokens, one micro-batch (grad follows the
        caller)."""
        return self._gather(self._output_logits(seqs), seqs, entropy=False)[0]

    def logp_and_entropy(
        self, seqs: list[TrainSeq]
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """``logp`` plus the per-token entropy ``[T_i]`` (nats, no grad) at the same positions."""
        logp, ent = self._gather(self._output_logits(seqs), seqs, entropy=True)
        assert ent is not None
        return logp, ent

    def _output_logits(self, seqs: list[TrainSeq]) -> torch.Tensor:
        """Logits ``[K, V]`` predicting every output token of ``seqs`` in order (K = sum T_i)."""
        if self.packing == "fixed":
            return self._padded(seqs)
        return self._packed(seqs)

    def _packed(self, seqs: list[TrainSeq]) -> torch.Tensor:
        if self.share_prompts:
            return self._packed_shared(seqs)
        ids = torch.cat([torch.cat([s.prompt_ids, s.output_ids]) for s in seqs])  # [L]
        pos = torch.cat([torch.arange(seq_len(s)) for s in seqs])  # [L]
        keep, offset = [], 0
        for s in seqs:
            p, t = len(s.prompt_ids), len(s.output_ids)
            keep.append(torch.arange(offset + p - 1, offset + p + t - 1))
            offset += p + t
        kwargs = {}
        if self.varlen:
            kwargs["areal_seg_lens"] = [seq_len(s) for s in seqs]
        elif not self.builtin_packed:
            kwargs["attention_mask"] = _block_causal_mask(seqs, self.dtype).to(self.device)
        return self._row(ids, pos, torch.cat(keep), kwargs)

    def _packed_shared(self, seqs: list[TrainSeq]) -> torch.Tensor:
        """``_packed`` with each distinct prompt once: the seqs that share a prompt (a GRPO
        group) become one block, prompt then completions (``varlen_attn`` ``areal_blocks``).
        Logits come back in ``seqs`` order; a completion's first token is predicted from the
        prompt's last position, shared by the block."""
        by_prompt: dict[tuple[int, ...], list[int]] = {}
        for i, s in enumerate(seqs):
            by_prompt.setdefault(_prompt_key(s), []).append(i)
        ids, pos, blocks = [], [], []
        keep: list[torch.Tensor | None] = [None] * len(seqs)
        offset = 0
        for members in by_prompt.values():
            prompt = seqs[members[0]].prompt_ids
            p = len(prompt)
            ids.append(prompt)
            pos.append(torch.arange(p))
            last_prompt, offset = offset + p - 1, offset + p
            for i in members:
                out = seqs[i].output_ids
                t = len(out)
                ids.append(out)
                pos.append(torch.arange(p, p + t))
                # token j is predicted from the position before it: the prompt's last for j = 0
                keep[i] = torch.cat(
                    [torch.tensor([last_prompt]), torch.arange(offset, offset + max(t - 1, 0))]
                )[:t]
                offset += t
            blocks.append((p, tuple(len(seqs[i].output_ids) for i in members)))
        kwargs = {"areal_blocks": blocks}
        return self._row(torch.cat(ids), torch.cat(pos), torch.cat(keep), kwargs)  # type: ignore[arg-type]

    def _row(
        self, ids: torch.Tensor, pos: torch.Tensor, keep: torch.Tensor, kwargs: dict
    ) -> torch.Tensor:
        """Logits ``[K, V]`` at row positions ``keep`` of one packed row."""
        return self.model(
            input_ids=ids[None].to(self.device),
            position_ids=pos[None].to(self.device),
            use_cache=False,
            logits_to_keep=keep.to(self.device),
            **kwargs,
        ).logits[0]  # [K, V]

    def _padded(self, seqs: list[TrainSeq]) -> torch.Tensor:
        length = max(seq_len(s) for s in seqs)
        ids = torch.zeros(len(seqs), length, dtype=torch.long)
        attn = torch.zeros(len(seqs), length, dtype=torch.long)
        rows, cols = [], []
        for i, s in enumerate(seqs):
            n, p, t = seq_len(s), len(s.prompt_ids), len(s.output_ids)
            ids[i, :n] = torch.cat([s.prompt_ids, s.output_ids])
            attn[i, :n] = 1
            rows.append(torch.full((t,), i))
            cols.append(torch.arange(p - 1, p + t - 1))
        logits = self.model(
            input_ids=ids.to(self.device), attention_mask=attn.to(self.device), use_cache=False
        ).logits  # [B, S, V]
        return logits[torch.cat(rows).to(self.device), torch.cat(cols).to(self.device)]  # [K, V]

    def _gather(
        self, logits: torch.Tensor, seqs: list[TrainSeq], entropy: bool
    ) -> tuple[list[torch.Tensor], list[torch.Tensor] | None]:
        sizes = [len(s.output_ids) for s in seqs]
        targets = torch.cat([s.output_ids for s in seqs]).to(self.device)  # [K]
        logprobs = torch.log_softmax(logits.float() / self.temperature, dim=-1)  # [K, V]
        logp = logprobs.gather(-1, targets[:, None]).squeeze(-1)  # [K]
        if not entropy:
            return list(logp.split(sizes)), None
        with torch.no_grad():
            ent = torch.special.entr(logprobs.detach().exp()).sum(dim=-1)  # [K], entr(0) = 0
        return list(logp.split(sizes)), list(ent.split(sizes))


def _prompt_key(s: TrainSeq) -> tuple[int, ...]:
    return tuple(s.prompt_ids.tolist())


def _block_causal_mask(seqs: list[TrainSeq], dtype: torch.dtype) -> torch.Tensor:
    """[1, 1, L, L] additive mask: causal inside each sequence, nothing across sequences."""
    seg = torch.cat([torch.full((seq_len(s),), i) for i, s in enumerate(seqs)])  # [L]
    n = len(seg)
    allowed = (seg[:, None] == seg[None, :]) & torch.ones(n, n, dtype=torch.bool).tril()
    mask = torch.zeros(n, n, dtype=dtype).masked_fill(~allowed, torch.finfo(dtype).min)
    return mask[None, None]

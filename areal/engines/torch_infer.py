"""Inference engine on a plain transformers causal LM: KV-cache batched decoding on CPU or GPU.

Invariants:
- Behaviour log-prob: every sampled token gets ``log_softmax(logits / T)[token]`` with ``T`` the
  sampling temperature (``T = 1`` for greedy, temperature 0). The trainer evaluates
  ``log_softmax(logits / T)`` with the same ``T`` (``TrainEngineConfig.temperature``), so the
  behaviour and training policies are the same distribution. Top-p only changes which token is
  drawn, never the recorded log-prob.
- Every recorded token carries the version of the weights whose logits it was sampled from.
- Continuous batching: at most ``max_batch_size`` rows are in the batch; a finished row leaves
  the batch and the KV cache at once and is reported through ``on_finished`` at once; waiting
  requests are prefilled and merged into the running batch when rows are free.
- Interruptible: ``poll_weights`` is called at every token boundary. A returned update is loaded,
  the KV cache is discarded and every active row is re-prefilled (prompt + tokens so far) under
  the new weights; tokens already generated keep their log-probs and versions.
- A row finishes with "stop" when it samples a stop token (kept, with its log-prob), else with
  "length" at its ``max_new_tokens`` (the request's, else ``SamplingParams``') or when prompt +
  output reach the model's ``max_position_embeddings`` (a prompt already that long finishes at
  once with no output).
- Prefill runs each distinct token sequence once (a GRPO group's G requests share one prompt)
  and copies its cache rows; decoding then samples every row independently.
- A LoRA adapter (`areal.engines.lora`) loads like full weights, through the same check and the
  same token-boundary switch: the adapted weights become ``W0 + s B A`` from a pristine float32
  copy of ``W0`` (kept for the adapted weights only: 4 bytes a parameter, e.g. 106 MB for
  SmolLM2-135M's q/k/v/o); full weights drop that copy.
- Thread-safety: ``generate`` holds the engine lock for its whole run; ``poll_weights`` is the
  only way to hand weights in mid-generation (a ``load_weights`` from another thread waits).

The cache is HF's ``DynamicCache`` with every row left-padded to a common length; each row keeps
its own position ids and a 2-D attention mask marks the padding. Rows are added or removed by
editing the per-layer K/V tensors along the batch dimension.
"""

from __future__ import annotations

import inspect
import threading
from collections import deque
from dataclasses import dataclass, field

import torch

from areal.engines.base import (
    GenOutput,
    GenRequest,
    OnFinished,
    PollRequests,
    PollWeights,
    SamplingParams,
    WeightUpdate,
)
from areal.engines.config import InferenceEngineConfig
from areal.engines.lora import base_fingerprint, check_adapter, is_adapter, merge_adapter
from areal.engines.weights_check import check_state_dict, spec_of

__all__ = ["TorchInferenceEngine", "resolve_dtype", "sample_tokens", "weights_from_safetensors"]


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    try:
        return {
            "float32": torch.float32,
            "fp32": torch.float32,
            "bfloat16": torch.bfloat16,
            "bf16": torch.bfloat16,
            "float16": torch.float16,
            "fp16": torch.float16,
        }[dtype]
    except KeyError:
        raise ValueError(f"unknown dtype {dtype!r}; use float32, bfloat16 or float16") from None


def weights_from_safetensors(data: bytes) -> dict[str, torch.Tensor]:
    """Decode a safetensors blob (as published by the trainer) into a CPU state dict."""
    from safetensors.torch import load

    return load(data)


def sample_tokens(
    logits: torch.Tensor, temperature: float, top_p: float, generator: torch.Generator | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row of ``logits`` [B, V]; return (tokens [B], logp [B]).

    ``logp`` is ``log_softmax(logits / T)`` at the token (T = 1 when greedy), before top-p.
    """
    t = temperature if temperature > 0 else 1.0
    logprobs = torch.log_softmax(logits.float() / t, dim=-1)  # [B, V]
    if temperature <= 0:
        tokens = logits.argmax(dim=-1)
    else:
        probs = logprobs.exp()
        if top_p < 1.0:
            sorted_p, order = probs.sort(dim=-1, descending=True)
            # Keep the smallest prefix whose mass reaches top_p (the top token is always kept).
            drop = (sorted_p.cumsum(dim=-1) - sorted_p) >= top_p
            sorted_p = sorted_p.masked_fill(drop, 0.0)
            probs = torch.zeros_like(probs).scatter_(-1, order, sorted_p)
        tokens = torch.multinomial(probs, 1, generator=generator).squeeze(-1)
    return tokens, logprobs.gather(-1, tokens[:, None]).squeeze(-1)


@dataclass
class _Row:
    idx: int  # position in the request list
    req: GenRequest
    out_ids: list[int]
    out_logp: list[float]
    out_versions: list[int]
    n_interrupts: int = 0
    n_reprefill_tokens: int = 0
    ids: list[int] = field(default_factory=list)  # prompt + output, the tokens fed so far

    def output(self, reason: str) -> GenOutput:
        return GenOutput(
            key=self.req.key,
            output_ids=list(self.out_ids),
            behav_logp=list(self.out_logp),
            versions=list(self.out_versions),
            finish_reason=reason,
            n_interrupts=self.n_interrupts,
            n_reprefill_tokens=self.n_reprefill_tokens,
        )


def _kv(cache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per-layer (keys [B, H, S, D], values) of a DynamicCache (transformers 4.5x and 5.x)."""
    if hasattr(cache, "layers"):
        return [(layer.keys, layer.values) for layer in cache.layers]
    return list(zip(cache.key_cache, cache.value_cache, strict=True))


def _set_kv(cache, kv: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    if hasattr(cache, "layers"):
        for layer, (k, v) in zip(cache.layers, kv, strict=True):
            layer.keys, layer.values = k, v
    else:
        cache.key_cache = [k for k, _ in kv]
        cache.value_cache = [v for _, v in kv]


class _Batch:
    """Active rows plus their left-padded KV cache, attention mask and next-token logits."""

    def __init__(self) -> None:
        self.rows: list[_Row] = []
        self.cache = None  # DynamicCache | None
        self.attn: torch.Tensor | None = None  # [B, S] long, 0 = padding
        self.pos: torch.Tensor | None = None  # [B] position id of the next fed token
        self.logits: torch.Tensor | None = None  # [B, V] logits for the next token

    def keep(self, keep: list[int]) -> None:
        if len(keep) == len(self.rows):
            return
        self.rows = [self.rows[i] for i in keep]
        if not keep:
            self.cache = self.attn = self.pos = self.logits = None
            return
        ix = torch.tensor(keep, device=self.attn.device)
        self.attn, self.pos, self.logits = self.attn[ix], self.pos[ix], self.logits[ix]
        start = int(self.attn.any(dim=0).nonzero()[0])  # drop columns that are padding for all
        self.attn = self.attn[:, start:]
        _set_kv(self.cache, [(k[ix, :, start:], v[ix, :, start:]) for k, v in _kv(self.cache)])

    def merge(self, other: _Batch) -> None:
        if not self.rows:
            self.rows, self.cache, self.attn, self.pos, self.logits = (
                other.rows,
                other.cache,
                other.attn,
                other.pos,
                other.logits,
            )
            return
        s = max(self.attn.shape[1], other.attn.shape[1])
        kv = []
        for (ka, va), (kb, vb) in zip(_kv(self.cache), _kv(other.cache), strict=True):
            kv.append(
                (
                    torch.cat([_pad_left(ka, s, 2), _pad_left(kb, s, 2)], dim=0),
                    torch.cat([_pad_left(va, s, 2), _pad_left(vb, s, 2)], dim=0),
                )
            )
        _set_kv(self.cache, kv)
        self.attn = torch.cat([_pad_left(self.attn, s, 1), _pad_left(other.attn, s, 1)], dim=0)
        self.pos = torch.cat([self.pos, other.pos])
        self.logits = torch.cat([self.logits, other.logits])
        self.rows = self.rows + other.rows


def _pad_left(x: torch.Tensor, length: int, dim: int) -> torch.Tensor:
    n = length - x.shape[dim]
    if n == 0:
        return x
    shape = list(x.shape)
    shape[dim] = n
    return torch.cat([x.new_zeros(shape), x], dim=dim)


class TorchInferenceEngine:
    """Built from an ``InferenceEngineConfig`` of kind "torch"; ``version`` starts at 0."""

    def __init__(self, cfg: InferenceEngineConfig) -> None:
        from transformers import AutoModelForCausalLM

        if cfg.kind != "torch":
            raise ValueError(
                f"TorchInferenceEngine needs a config of kind 'torch', got {cfg.kind!r}"
            )
        self.cfg = cfg
        self.device = torch.device(cfg.device)
        self.model = AutoModelForCausalLM.from_pretrained(
            cfg.model_path, dtype=resolve_dtype(cfg.dtype), local_files_only=True
        ).to(self.device)
        self.model.eval()
        self._live = self.model.state_dict()  # views of the parameters, by plain name
        self._spec = spec_of(self._live)  # what a weights blob must match
        self._base_fingerprint = base_fingerprint(self._live)  # what an adapter must match
        self._pristine: dict[str, torch.Tensor] = {}  # W0 (float32) of weights an adapter changed
        self.max_batch_size = cfg.max_batch_size
        self.max_seq_len: int | None = getattr(self.model.config, "max_position_embeddings", None)
        self.vocab_size: int = self.model.get_input_embeddings().num_embeddings  # ids must be below
        self.version = 0
        self.generator = torch.Generator(device=self.device)
        self.generator.manual_seed(cfg.seed)
        self._lock = threading.RLock()
        # transformers 5.2x renamed `past_key_values` to `cache`; accept both.
        params = inspect.signature(self.model.forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"

    # ------------------------------------------------------------------ weights
    def check_weights(self, state_dict: dict[str, torch.Tensor], version: int) -> None:
        """Raise `WeightsMismatch` unless `state_dict` fits the model whole (names, shapes,
        dtypes, finite values: `areal.engines.weights_check`), or is an adapter for this base
        model (`areal.engines.lora.check_adapter`); touches no parameter."""
        if is_adapter(state_dict):
            check_adapter(
                self._spec, self._base_fingerprint, state_dict, what=f"adapter v{version}"
            )
            return
        check_state_dict(self._spec, state_dict, what=f"weights v{version}")

    def load_weights(self, update: WeightUpdate) -> None:
        """Check the whole state dict, then copy it: a refused one changes no parameter."""
        self.check_weights(update.state_dict, update.version)
        with self._lock:
            if is_adapter(update.state_dict):
                merge_adapter(self._live, self._pristine, update.state_dict)
            else:
                self.model.load_state_dict(update.state_dict, strict=True)
                self._pristine = {}  # the new weights are the base from now on
            self.version = update.version

    # --------------------------------------------------------------- generation
    @torch.inference_mode()
    def generate(
        self,
        requests: list[GenRequest],
        *,
        params: SamplingParams,
        poll_weights: PollWeights | None = None,
        on_finished: OnFinished | None = None,
        poll_requests: PollRequests | None = None,
    ) -> list[GenOutput]:
        """See ``InferenceEngine.generate``; the module docstring states the invariants."""
        with self._lock:
            return self._generate(requests, params, poll_weights, on_finished, poll_requests)

    def _generate(
        self,
        requests: list[GenRequest],
        params: SamplingParams,
        poll_weights: PollWeights | None,
        on_finished: OnFinished | None,
        poll_requests: PollRequests | None,
    ) -> list[GenOutput]:
        results: list[GenOutput | None] = [None] * len(requests)
        stop_ids = set(params.stop_token_ids)

        def finish(row: _Row, reason: str) -> None:
            out = row.output(reason)
            results[row.idx] = out
            if on_finished is not None:
                on_finished(out)

        waiting: deque[_Row] = deque()

        def admit(i: int, req: GenRequest) -> None:
            row = self._new_row(i, req)
            reason = self._finish_reason(row, params, stop_ids)
            if reason is not None:  # prompt already at the context limit, or a cap of 0
                finish(row, reason)
            else:
                waiting.append(row)

        for i, req in enumerate(requests):
            admit(i, req)

        batch = _Batch()
        while True:
            if poll_requests is not None and len(batch.rows) + len(waiting) < self.max_batch_size:
                for req in poll_requests():  # continuous batching across calls
                    results.append(None)
                    admit(len(results) - 1, req)
            if not (batch.rows or waiting):
                break
            # Token boundary: apply a pending weight update, then re-prefill everyone.
            update = poll_weights() if poll_weights is not None else None
            if update is not None:
                self.load_weights(update)
                if batch.rows:
                    rows, batch = batch.rows, _Batch()
                    for row in rows:
                        row.n_interrupts += 1
                        row.n_reprefill_tokens += len(row.ids)
                    batch.merge(self._prefill(rows))
            n_free = self.max_batch_size - len(batch.rows)
            if waiting and n_free > 0:
                new = [waiting.popleft() for _ in range(min(n_free, len(waiting)))]
                batch.merge(self._prefill(new))
            if not batch.rows:
                continue

            tokens, logp = sample_tokens(
                batch.logits, params.temperature, params.top_p, self.generator
            )
            keep = []
            for j, (row, tok, lp) in enumerate(
                zip(batch.rows, tokens.tolist(), logp.tolist(), strict=True)
            ):
                row.out_ids.append(tok)
                row.out_logp.append(lp)
                row.out_versions.append(self.version)
                row.ids.append(tok)
                reason = self._finish_reason(row, params, stop_ids)
                if reason is not None:
                    finish(row, reason)
                else:
                    keep.append(j)
            # Feed the sampled tokens of the surviving rows (finished rows leave first).
            ix = torch.tensor(keep, dtype=torch.long)
            batch.keep(keep)
            if batch.rows:
                self._decode(batch, tokens[ix].to(self.device))
        return results  # type: ignore[return-value]

    def _new_row(self, i: int, req: GenRequest) -> _Row:
        if not req.prompt_ids:
            raise ValueError(f"request {req.key!r} has an empty prompt")
        return _Row(
            idx=i, req=req, out_ids=[], out_logp=[], out_versions=[], ids=list(req.prompt_ids)
        )

    def _finish_reason(self, row: _Row, params: SamplingParams, stop_ids: set[int]) -> str | None:
        if row.out_ids and row.out_ids[-1] in stop_ids:
            return "stop"
        if len(row.out_ids) >= (row.req.max_new_tokens or params.max_new_tokens):
            return "length"
        if self.max_seq_len is not None and len(row.ids) >= self.max_seq_len:
            return "length"
        return None

    def _prefill(self, rows: list[_Row]) -> _Batch:
        """Run the prompts (+ tokens so far) of `rows` as one left-padded batch with a fresh cache.

        Rows with the same tokens (a group's G samples of one prompt, before their first token)
        are run once; their cache entries, mask and logits are copied to every such row."""
        from transformers import DynamicCache

        slot: dict[tuple[int, ...], int] = {}
        which = [slot.setdefault(tuple(r.ids), len(slot)) for r in rows]  # row -> unique input
        uniq = [list(k) for k in slot]
        length = max(len(x) for x in uniq)
        ids = torch.zeros(len(uniq), length, dtype=torch.long)
        attn = torch.zeros(len(uniq), length, dtype=torch.long)
        for j, x in enumerate(uniq):
            ids[j, length - len(x) :] = torch.tensor(x)
            attn[j, length - len(x) :] = 1
        ids, attn = ids.to(self.device), attn.to(self.device)
        position_ids = (attn.cumsum(dim=1) - 1).clamp(min=0)  # [n, S]
        try:
            cache = DynamicCache(config=self.model.config)
        except TypeError:  # transformers < 4.56
            cache = DynamicCache()
        out = self.model(
            input_ids=ids,
            attention_mask=attn,
            position_ids=position_ids,
            use_cache=True,
            logits_to_keep=1,
            **{self._cache_kw: cache},
        )
        logits = out.logits[:, -1, :]
        if len(uniq) < len(rows):  # the cache is filled in place; copy shared entries out
            ix = torch.tensor(which, device=attn.device)
            _set_kv(cache, [(k[ix], v[ix]) for k, v in _kv(cache)])
            attn, logits = attn[ix], logits[ix]
        batch = _Batch()
        batch.rows, batch.cache, batch.attn = rows, cache, attn
        batch.pos = attn.sum(dim=1)  # [n] next position = number of real tokens
        batch.logits = logits
        return batch

    def _decode(self, batch: _Batch, tokens: torch.Tensor) -> None:
        """Feed one token per active row [B]; refresh the cache and the next-token logits."""
        batch.attn = torch.cat([batch.attn, batch.attn.new_ones(len(batch.rows), 1)], dim=1)
        out = self.model(
            input_ids=tokens[:, None],
            attention_mask=batch.attn,
            position_ids=batch.pos[:, None],
            use_cache=True,
            **{self._cache_kw: batch.cache},
        )
        batch.pos = batch.pos + 1
        batch.logits = out.logits[:, -1, :]

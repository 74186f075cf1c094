"""Padding-free ("varlen") attention for packed rows, on any device, without flash-attn.

A packed micro-batch is one row of several sequences. HF's sdpa path turns restarting position
ids into a dense block-diagonal [L, L] mask and computes attention over all L x L pairs, so a
packed row costs O(L^2) instead of the sum of O(len_i^2). This attention function instead runs
causal sdpa once per sequence segment and concatenates the results: exactly the per-sequence
computation, with no mask and no padding.

Segments come from the ``areal_seg_lens`` forward kwarg (a list of ints that transformers passes
down to the attention function), else from ``position_ids`` restarting at 0. Anything else
(a mask, a cache, several rows, sliding windows) goes to the stock sdpa function unchanged, so
right-padded batches (causal attention never sees the right padding) stay exact too.
"""

from __future__ import annotations

import torch

NAME = "areal_varlen_sdpa"
_registered = False


def varlen_sdpa_forward(
    module: torch.nn.Module,
    query: torch.Tensor,  # [B, H, L, D]
    key: torch.Tensor,  # [B, Hkv, L, D]
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    seg_lens = kwargs.pop("areal_seg_lens", None)
    position_ids = kwargs.get("position_ids")
    plain = (
        attention_mask is not None
        or kwargs.get("sliding_window") is not None
        or query.shape[0] != 1
        or query.shape[2] != key.shape[2]  # decoding with a cache
    )
    if seg_lens is None and not plain and position_ids is not None:
        starts = (position_ids[0] == 0).nonzero().flatten().tolist() + [query.shape[2]]
        seg_lens = [b - a for a, b in zip(starts, starts[1:], strict=False) if b > a]
    if plain or seg_lens is None or len(seg_lens) <= 1:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    outs = []
    start = 0
    for n in seg_lens:
        sl = slice(start, start + n)
        out, _ = sdpa_attention_forward(
            module,
            query[:, :, sl],
            key[:, :, sl],
            value[:, :, sl],
            None,
            dropout=dropout,
            scaling=scaling,
            is_causal=True,
        )
        outs.append(out)  # [1, n, H, D]
        start += n
    return torch.cat(outs, dim=1), None


def register() -> bool:
    """Register ``NAME`` with transformers' AttentionInterface; False where that API is missing.

    No mask function is registered on purpose: transformers then builds no attention mask at
    all for this implementation (segments and causality are handled here).
    """
    global _registered
    if _registered:
        return True
    try:
        from transformers import AttentionInterface
    except ImportError:
        return False
    AttentionInterface.register(NAME, varlen_sdpa_forward)
    _registered = True
    return True

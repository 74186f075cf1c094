"""Padding-free ("varlen") attention for packed rows, on any device, without flash-attn.

A packed micro-batch is one row of several sequences. HF's sdpa path turns restarting position
ids into a dense block-diagonal [L, L] mask and computes attention over all L x L pairs, so a
packed row costs O(L^2) instead of the sum of O(len_i^2). This attention function instead
gathers the segments into a few length buckets (segments within 2x of each other in length),
right-pads each bucket to its longest segment, runs one causal sdpa per bucket ([k, H, L_b, D])
and scatters the real positions back. Causality makes the right padding invisible to every real
query, so the result is exactly the per-sequence computation; the cost is a handful of kernels
per layer instead of one per sequence (per-sequence calls made a 128-sequence training step
overhead-bound on CPU), and padded attention FLOPs are bounded by the 2x bucket rule.

Segments come from the ``areal_seg_lens`` forward kwarg (a list of ints that transformers passes
down to the attention function), else from ``position_ids`` restarting at 0. Anything else
(a mask, a cache, several rows, sliding windows) goes to the stock sdpa function unchanged, so
right-padded batches (causal attention never sees the right padding) stay exact too.
"""

from __future__ import annotations

import functools

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
    return _bucketed_causal_sdpa(
        sdpa_attention_forward, module, query, key, value, seg_lens, dropout, scaling
    ), None


def length_buckets(seg_lens: list[int], ratio: float = 2.0) -> list[list[int]]:
    """Segment indices grouped so that within a group the longest is < `ratio` x the shortest
    (longest first). Padding each group to its longest bounds wasted attention work."""
    order = sorted(range(len(seg_lens)), key=lambda i: -seg_lens[i])
    groups: list[list[int]] = []
    for i in order:
        if groups and seg_lens[i] * ratio > seg_lens[groups[-1][0]]:
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups


@functools.lru_cache(maxsize=32)
@torch.inference_mode(False)  # cached tensors must stay usable by autograd later
def _bucket_plan(seg_lens: tuple[int, ...], device: torch.device) -> tuple[list, torch.Tensor]:
    """Gather indices per length bucket, and the inverse permutation back to packed order.

    Cached: every layer of a forward (and the backward's replay) sees the same segments, so
    the index tensors are built once per micro-batch layout, not once per layer."""
    starts = [0]
    for n in seg_lens[:-1]:
        starts.append(starts[-1] + n)
    buckets, positions = [], []
    for group in length_buckets(list(seg_lens)):
        width = seg_lens[group[0]]
        t = torch.arange(width, device=device)
        lens = torch.tensor([seg_lens[i] for i in group], device=device)
        first = torch.tensor([starts[i] for i in group], device=device)
        # [k, width] packed positions; right padding repeats the segment's last position (any
        # real position works: causal queries never look right, and padded queries are dropped)
        idx = first[:, None] + torch.minimum(t[None, :], lens[:, None] - 1)
        valid = t[None, :] < lens[:, None]
        buckets.append((idx.reshape(-1), (len(group), width), valid))
        positions.append(idx[valid])
    order = torch.cat(positions)
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel(), device=device)
    return buckets, inverse


def _bucketed_causal_sdpa(sdpa, module, query, key, value, seg_lens, dropout, scaling):
    """[1, L, H, D] output of causal attention within each segment of the packed row."""
    buckets, inverse = _bucket_plan(tuple(seg_lens), query.device)
    outs = []
    for flat, shape, valid in buckets:

        def rows(x: torch.Tensor, flat=flat, shape=shape) -> torch.Tensor:
            # [1, H, L, D] -> [k, H, width, D]
            return x[0].index_select(1, flat).unflatten(1, shape).transpose(0, 1)

        out, _ = sdpa(
            module,
            rows(query),
            rows(key),
            rows(value),
            None,
            dropout=dropout,
            scaling=scaling,
            is_causal=True,
        )  # [k, width, H, D]
        outs.append(out[valid])  # [sum(lens), H, D], segment by segment
    return torch.cat(outs).index_select(0, inverse).unsqueeze(0)


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

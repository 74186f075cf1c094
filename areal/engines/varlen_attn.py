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
down to the attention function), else from ``position_ids`` restarting at 0.

Shared prompts (``areal_blocks``, GRPO's G samples of one prompt): a block ``(P, (T_1, ..,
T_G))`` lays out one prompt of P tokens followed by its G completions, so the prompt's tokens go
through the model once instead of G times. Completion i attends to the prompt and to its own
earlier tokens only: attention gathers, for each completion, the "view" prompt + completion i (a
plain causal sequence again) into the length buckets, and keeps the prompt's outputs from the
first view only. A block ``(n, ())`` is a plain segment of n tokens. Anything else
(a mask, a cache, several rows) goes to the stock sdpa function, so right-padded batches
(causal attention never sees the right padding) stay exact too.

Sliding windows (``sliding_window`` kwarg, e.g. Mistral's ``config.sliding_window``) follow HF's
semantics: query position q sees key position k iff ``0 <= q - k < window``.

Invariants:
- Packed rows: output = each segment's causal (windowed, if set) attention computed alone; no
  query ever sees a key of another segment, with or without a sliding window.
- A window that no key length exceeds (every segment, or the row's key length on the stock
  path, <= window) cannot mask anything and is dropped: the fast ``is_causal`` kernels run.
- A window that does matter is applied as an explicit boolean band mask (AND-ed with a given
  4-D mask), never silently ignored; ``sliding_window`` never reaches the stock sdpa function.
- Positions on the stock path are row positions with the queries at the end of the keys (the
  cache layout); a caller's 4-D mask is otherwise used as given.
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
    blocks = kwargs.pop("areal_blocks", None)
    window = _check_window(kwargs.pop("sliding_window", None))
    position_ids = kwargs.get("position_ids")
    plain = (
        attention_mask is not None
        or query.shape[0] != 1
        or query.shape[2] != key.shape[2]  # decoding with a cache
    )
    if blocks is not None:
        if plain:
            raise ValueError(
                "areal_blocks (shared prompts) need one packed row without a mask or a cache"
            )
        total = sum(int(p) + sum(ts) for p, ts in blocks)
        if total != query.shape[2]:
            raise ValueError(
                f"areal_blocks cover {total} tokens but the packed row has {query.shape[2]}"
            )
        return _bucketed_causal_sdpa(
            sdpa_attention_forward, module, query, key, value, blocks, dropout, scaling, window
        ), None
    if seg_lens is None and not plain and position_ids is not None:
        starts = (position_ids[0] == 0).nonzero().flatten().tolist() + [query.shape[2]]
        seg_lens = [b - a for a, b in zip(starts, starts[1:], strict=False) if b > a]
    if plain or seg_lens is None or len(seg_lens) <= 1:
        if window is not None and key.shape[2] > window:
            attention_mask = _with_window(attention_mask, query.shape[2], key.shape[2], window)
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    if sum(seg_lens) != query.shape[2]:
        raise ValueError(
            f"areal_seg_lens sum to {sum(seg_lens)} but the packed row has {query.shape[2]} tokens"
        )
    return _bucketed_causal_sdpa(
        sdpa_attention_forward, module, query, key, value, seg_lens, dropout, scaling, window
    ), None


def _as_blocks(layout) -> tuple[tuple[int, tuple[int, ...]], ...]:
    """``areal_seg_lens`` (ints: plain segments) or ``areal_blocks`` as a tuple of blocks."""
    return tuple(
        (int(x), ()) if isinstance(x, int) else (int(x[0]), tuple(int(t) for t in x[1]))
        for x in layout
    )


def block_views(blocks) -> list[tuple[list[int], int]]:
    """The causal sequences ("views") attention runs for a packed row of ``blocks``: each is
    (row positions in sequence order, how many leading positions' outputs it does not keep).

    Every row position is kept by exactly one view: a plain segment is one view; a block's
    first completion view keeps the prompt and itself, every later one only its own tokens."""
    views, off = [], 0
    for p, ts in blocks:
        prompt = list(range(off, off + p))
        off += p
        if not ts:
            if p:
                views.append((prompt, 0))
            continue
        for i, t in enumerate(ts):
            comp = list(range(off, off + t))
            off += t
            if i == 0 and prompt + comp:
                views.append((prompt + comp, 0))
            elif i > 0 and t:
                views.append((prompt + comp, p))
    return views


def _check_window(window) -> int | None:
    if window is None:
        return None
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ValueError(
            f"sliding_window must be a positive int or None, got {window!r} (check the model "
            "config's `sliding_window`)"
        )
    return window


def window_mask(q_len: int, kv_len: int, window: int | None, device=None) -> torch.Tensor:
    """[q_len, kv_len] bool, True where attention is allowed: causal, and (with a window)
    ``q - k < window``. The queries are the last ``q_len`` of the ``kv_len`` key positions."""
    q = torch.arange(kv_len - q_len, kv_len, device=device)[:, None]
    k = torch.arange(kv_len, device=device)[None, :]
    allowed = k <= q
    if window is not None:
        allowed &= q - k < window
    return allowed


def _with_window(
    attention_mask: torch.Tensor | None, q_len: int, kv_len: int, window: int
) -> torch.Tensor:
    """A 4-D sdpa mask: `attention_mask` (bool, additive float, or None = causal) further
    restricted to keys within `window` of each query."""
    device = None if attention_mask is None else attention_mask.device
    band = window_mask(q_len, kv_len, window, device)[None, None]  # [1, 1, q, kv]
    if attention_mask is None:
        return band
    if attention_mask.ndim != 4:
        raise ValueError(
            f"varlen attention got a {attention_mask.ndim}-D attention mask with a sliding window; "
            "expected a 4-D [B, 1|H, q, kv] mask"
        )
    band = band[..., -attention_mask.shape[-1] :] if attention_mask.shape[-1] < kv_len else band
    if attention_mask.dtype == torch.bool:
        return attention_mask & band
    return attention_mask.masked_fill(~band, torch.finfo(attention_mask.dtype).min)


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
def _bucket_plan(blocks: tuple, device: torch.device) -> tuple[list, torch.Tensor]:
    """Gather indices per length bucket of the views (``block_views``), and the inverse
    permutation from the kept outputs back to packed order.

    Cached: every layer of a forward (and the backward's replay) sees the same layout, so
    the index tensors are built once per micro-batch layout, not once per layer."""
    views = block_views(blocks)
    lens = [len(v) for v, _ in views]
    buckets, positions = [], []
    for group in length_buckets(lens):
        width = lens[group[0]]
        # [k, width] packed positions; right padding repeats the view's last position (any
        # real position works: causal queries never look right, and padded queries are dropped)
        idx = torch.tensor(
            [views[i][0] + [views[i][0][-1]] * (width - lens[i]) for i in group], device=device
        )
        t = torch.arange(width, device=device)
        n = torch.tensor([lens[i] for i in group], device=device)
        skip = torch.tensor([views[i][1] for i in group], device=device)
        valid = (t[None, :] < n[:, None]) & (t[None, :] >= skip[:, None])
        buckets.append((idx.reshape(-1), (len(group), width), valid))
        positions.append(idx[valid])
    order = torch.cat(positions)
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel(), device=device)
    return buckets, inverse


def _bucketed_causal_sdpa(
    sdpa, module, query, key, value, layout, dropout, scaling, window: int | None = None
):
    """[1, L, H, D] output of causal attention within each segment of the packed row; with a
    `window`, query q of a segment sees only its keys k with q - k < window. `layout`: segment
    lengths, or blocks with shared prompts (see the module docstring)."""
    window = _check_window(window)
    buckets, inverse = _bucket_plan(_as_blocks(layout), query.device)
    outs = []
    for flat, shape, valid in buckets:

        def rows(x: torch.Tensor, flat=flat, shape=shape) -> torch.Tensor:
            # [1, H, L, D] -> [k, H, width, D]
            return x[0].index_select(1, flat).unflatten(1, shape).transpose(0, 1)

        width = shape[1]
        # Every view of a bucket starts at row position 0, so one [width, width] mask fits
        # all of them; a window no segment of the bucket exceeds changes nothing.
        mask = None
        if window is not None and width > window:
            mask = window_mask(width, width, window, query.device)[None, None]
        out, _ = sdpa(
            module,
            rows(query),
            rows(key),
            rows(value),
            mask,
            dropout=dropout,
            scaling=scaling,
            is_causal=mask is None,
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

"""Bucketed varlen attention: exactly per-segment causal attention, values and gradients."""

from __future__ import annotations

import pytest
import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from areal.engines.varlen_attn import _bucketed_causal_sdpa, length_buckets


class _Mod(torch.nn.Module):
    num_key_value_groups = 2  # GQA: 4 query heads over 2 kv heads
    is_causal = True
    training = False


def test_length_buckets_cover_every_segment_once_within_2x():
    lens = [1, 2, 3, 4, 7, 8, 9, 16, 17, 33, 100, 51, 50, 1]
    groups = length_buckets(lens)
    assert sorted(i for g in groups for i in g) == list(range(len(lens)))
    for g in groups:
        longest = lens[g[0]]
        assert all(lens[i] <= longest and 2 * lens[i] > longest for i in g)
    assert [lens[g[0]] for g in groups] == sorted({lens[g[0]] for g in groups}, reverse=True)


@pytest.mark.parametrize("lens", [[5, 3, 9, 1, 9, 2, 17, 4], [1, 1, 1], [40, 2]])
def test_bucketed_attention_equals_each_segment_alone(lens):
    g = torch.Generator().manual_seed(0)
    L, D = sum(lens), 8
    q = torch.randn(1, 4, L, D, generator=g, requires_grad=True)
    k = torch.randn(1, 2, L, D, generator=g, requires_grad=True)
    v = torch.randn(1, 2, L, D, generator=g, requires_grad=True)
    out = _bucketed_causal_sdpa(sdpa_attention_forward, _Mod(), q, k, v, lens, 0.0, None)
    refs, start = [], 0
    for n in lens:
        s = slice(start, start + n)
        ref, _ = sdpa_attention_forward(
            _Mod(), q[:, :, s], k[:, :, s], v[:, :, s], None, is_causal=True
        )
        refs.append(ref)
        start += n
    assert_same_values_and_grads(out, torch.cat(refs, dim=1), (q, k, v), g, atol=1e-6)


def assert_same_values_and_grads(out, ref, inputs, g, atol):
    """`out` equals `ref`, and so do the gradients of a random projection of both."""
    torch.testing.assert_close(out, ref, atol=atol, rtol=0)
    w = torch.randn(ref.shape, generator=g)
    grads = torch.autograd.grad((out * w).sum(), inputs)
    ref_grads = torch.autograd.grad((ref * w).sum(), inputs)
    for a, b in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)


def test_index_plan_cached_under_inference_mode_still_serves_autograd():
    # the inference engine's prefill may build a layout's plan first (inference mode); the
    # trainer reusing that cached plan must still be able to backpropagate
    lens = [3, 7, 2, 6]
    q = torch.randn(1, 4, sum(lens), 8)
    kv = torch.randn(1, 2, sum(lens), 8)
    with torch.inference_mode():
        _bucketed_causal_sdpa(sdpa_attention_forward, _Mod(), q, kv, kv, lens, 0.0, None)
    q.requires_grad_(True)
    out = _bucketed_causal_sdpa(sdpa_attention_forward, _Mod(), q, kv, kv, lens, 0.0, None)
    out.sum().backward()
    assert q.grad is not None and torch.isfinite(q.grad).all()


def _windowed_reference(q, k, v, lens, window):
    """Each segment alone, with HF's sliding-window rule (q sees k iff 0 <= q - k < window),
    written out as a plain masked softmax (GQA: each kv head serves 2 query heads)."""
    k, v = k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1)
    outs, start = [], 0
    for n in lens:
        s = slice(start, start + n)
        pos = torch.arange(n)
        allowed = (pos[:, None] >= pos[None, :]) & (pos[:, None] - pos[None, :] < window)
        scores = q[:, :, s] @ k[:, :, s].transpose(-1, -2) / q.shape[-1] ** 0.5
        probs = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
        outs.append((probs @ v[:, :, s]).transpose(1, 2))  # [1, n, H, D]
        start += n
    return torch.cat(outs, dim=1)


@pytest.mark.parametrize(
    ("lens", "window"),
    [([5, 3, 9, 1, 9, 2, 17, 4], 4), ([12, 12], 1), ([7, 30, 2], 16), ([6, 5], 4096)],
)
def test_sliding_window_packed_rows_equal_each_segment_alone(lens, window):
    # Mistral-style configs set sliding_window: packed rows must still keep segments apart and
    # apply the window inside each one (a window wider than every segment changes nothing).
    from areal.engines.varlen_attn import varlen_sdpa_forward

    g = torch.Generator().manual_seed(1)
    L, D = sum(lens), 8
    q = torch.randn(1, 4, L, D, generator=g)
    k = torch.randn(1, 2, L, D, generator=g)
    v = torch.randn(1, 2, L, D, generator=g)
    out, _ = varlen_sdpa_forward(
        _Mod(), q, k, v, None, areal_seg_lens=list(lens), sliding_window=window
    )
    torch.testing.assert_close(out, _windowed_reference(q, k, v, lens, window), atol=1e-5, rtol=0)


def test_sliding_window_on_the_stock_path_and_bad_windows():
    from areal.engines.varlen_attn import varlen_sdpa_forward

    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(1, h, 10, 8, generator=g) for h in (4, 2, 2))
    # one segment goes to stock sdpa: the window becomes an explicit band mask
    out, _ = varlen_sdpa_forward(_Mod(), q, k, v, None, areal_seg_lens=[10], sliding_window=3)
    torch.testing.assert_close(out, _windowed_reference(q, k, v, [10], 3), atol=1e-5, rtol=0)
    for bad in (0, -1, 2.5, True):
        with pytest.raises(ValueError, match="sliding_window must be a positive int"):
            varlen_sdpa_forward(_Mod(), q, k, v, None, areal_seg_lens=[10], sliding_window=bad)
    with pytest.raises(ValueError, match="areal_seg_lens sum to 9"):
        varlen_sdpa_forward(_Mod(), q, k, v, None, areal_seg_lens=[4, 5])


@pytest.mark.parametrize(
    "blocks",
    [
        [(3, (2, 4, 1))],
        [(5, ()), (2, (3, 0, 6, 1)), (4, (1,)), (1, ())],
        [(6, (0,)), (2, (9, 9))],
    ],
)
@pytest.mark.parametrize("window", [None, 3])
def test_shared_prompt_blocks_equal_each_prompt_plus_completion(blocks, window):
    """`areal_blocks`: a prompt then its completions in one row; each completion sees the prompt
    and its own earlier tokens, as if prompt + completion ran alone (values and gradients)."""
    from areal.engines.varlen_attn import varlen_sdpa_forward

    g = torch.Generator().manual_seed(3)
    L, D = sum(p + sum(ts) for p, ts in blocks), 8
    q = torch.randn(1, 4, L, D, generator=g, requires_grad=True)
    k = torch.randn(1, 2, L, D, generator=g, requires_grad=True)
    v = torch.randn(1, 2, L, D, generator=g, requires_grad=True)
    out, _ = varlen_sdpa_forward(_Mod(), q, k, v, None, areal_blocks=blocks, sliding_window=window)
    # reference: each prompt + completion alone; the prompt's outputs from its first completion
    ref = [None] * L
    off = 0
    for p, ts in blocks:
        prompt = list(range(off, off + p))
        off += p
        comps = []
        for t in ts or (0,):
            comps.append(list(range(off, off + t)))
            off += t
        for i, comp in enumerate(comps):
            ix = torch.tensor(prompt + comp, dtype=torch.long)
            if len(ix) == 0:
                continue
            o = _windowed_reference(q[:, :, ix], k[:, :, ix], v[:, :, ix], [len(ix)], window or L)
            for j, pos in enumerate(ix.tolist()):
                if i == 0 or j >= p:
                    ref[pos] = o[0, j]
    assert_same_values_and_grads(out, torch.stack(ref)[None], (q, k, v), g, atol=1e-5)


def test_shared_prompt_blocks_are_checked():
    from areal.engines.varlen_attn import varlen_sdpa_forward

    q, k, v = (torch.randn(1, h, 10, 8) for h in (4, 2, 2))
    with pytest.raises(ValueError, match="areal_blocks cover 9 tokens"):
        varlen_sdpa_forward(_Mod(), q, k, v, None, areal_blocks=[(3, (4, 2))])
    with pytest.raises(ValueError, match="one packed row without a mask"):
        varlen_sdpa_forward(_Mod(), q, k, v, torch.ones(1, 1, 10, 10), areal_blocks=[(4, (6,))])

"""Dynamic micro-batching: pack sequences into micro-batches under a token budget (DESIGN s. 6).

``pack_ffd`` is first-fit-decreasing with a balancing twist: sequences are taken longest first
and each goes to the micro-batch that still fits it and holds the FEWEST sequences (ties: the
lowest micro-batch index); if none fits, a new micro-batch is opened.

Invariants:
- Every input index appears in exactly one micro-batch; nothing is dropped or split.
- A micro-batch's total length is ``<= max_tokens_per_mb``, except a micro-batch holding a
  single sequence that alone is longer than the budget.
- The result is deterministic: equal lengths keep their input order (stable sort).

``pack_ffd_shared`` packs prompt groups instead (for rows that carry a shared prompt once,
``SeqForward`` with ``share_prompts``): a group of sequences with one prompt weighs its prompt
once plus its outputs, and stays in one micro-batch when it fits the budget; a group over the
budget is cut into consecutive parts that each fit (each part carries the prompt again).
Every index still appears exactly once.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

__all__ = ["pack_ffd", "pack_ffd_shared", "pack_fixed", "padding_fraction"]


def pack_ffd(lengths: Sequence[int], max_tokens_per_mb: int) -> list[list[int]]:
    """Indices of ``lengths`` grouped into micro-batches of at most ``max_tokens_per_mb`` tokens."""
    if max_tokens_per_mb <= 0:
        raise ValueError(f"max_tokens_per_mb must be > 0, got {max_tokens_per_mb}")
    if any(n < 0 for n in lengths):
        raise ValueError("sequence lengths must be >= 0")
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])  # stable: ties by index
    mbs: list[list[int]] = []
    totals: list[int] = []
    for i in order:
        n = lengths[i]
        best = -1
        if n <= max_tokens_per_mb:
            for j, total in enumerate(totals):
                if total + n <= max_tokens_per_mb and (best < 0 or len(mbs[j]) < len(mbs[best])):
                    best = j
        if best < 0:  # nothing fits, or over-long: a micro-batch of its own
            mbs.append([i])
            totals.append(n)
        else:
            mbs[best].append(i)
            totals[best] += n
    return mbs


def pack_ffd_shared(
    prompt_keys: Sequence[Hashable],
    prompt_lens: Sequence[int],
    output_lens: Sequence[int],
    max_tokens_per_mb: int,
) -> list[list[int]]:
    """``pack_ffd`` over prompt groups: sequence i has prompt ``prompt_keys[i]`` (equal keys =
    the same prompt, of ``prompt_lens[i]`` tokens) and ``output_lens[i]`` output tokens. A group
    costs its prompt once; one that does not fit the budget is cut into consecutive parts."""
    if not len(prompt_keys) == len(prompt_lens) == len(output_lens):
        raise ValueError("prompt_keys, prompt_lens and output_lens must have the same length")
    groups: dict[Hashable, list[int]] = {}
    for i, key in enumerate(prompt_keys):
        groups.setdefault(key, []).append(i)
    units: list[list[int]] = []
    weights: list[int] = []
    for members in groups.values():
        p = prompt_lens[members[0]]
        part: list[int] = []
        size = p
        for i in members:
            if part and size + output_lens[i] > max_tokens_per_mb:
                units.append(part)
                weights.append(size)
                part, size = [], p
            part.append(i)
            size += output_lens[i]
        units.append(part)
        weights.append(size)
    return [[i for u in mb for i in units[u]] for mb in pack_ffd(weights, max_tokens_per_mb)]


def pack_fixed(n: int, mb_size: int) -> list[list[int]]:
    """Naive baseline: consecutive chunks of ``mb_size`` sequence indices."""
    if mb_size <= 0:
        raise ValueError(f"mb_size must be > 0, got {mb_size}")
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    return [list(range(s, min(s + mb_size, n))) for s in range(0, n, mb_size)]


def padding_fraction(lengths: Sequence[int], micro_batches: Sequence[Sequence[int]]) -> float:
    """Pad tokens / all tokens if each micro-batch were padded to its longest sequence.

    0.0 when there is nothing to pad (including no sequences or only empty ones).
    """
    padded = 0
    real = 0
    for mb in micro_batches:
        if not mb:
            continue
        longest = max(lengths[i] for i in mb)
        padded += longest * len(mb)
        real += sum(lengths[i] for i in mb)
    return (padded - real) / padded if padded > 0 else 0.0

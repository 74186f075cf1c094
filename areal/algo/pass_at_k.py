"""pass@k: the chance that at least one of k samples of a problem is correct.

The unbiased estimator of Chen et al. 2021 ("Evaluating Large Language Models Trained on Code",
the HumanEval paper, eq. 1): draw n >= k samples per problem, count the c correct ones, and
estimate pass@k = 1 - C(n - c, k) / C(n, k), the chance that a k-subset drawn without
replacement from the n samples holds a correct one. Averaged over problems.

Invariants:
- 0 <= pass@k <= 1; pass@k = 0 when c = 0 and 1 when n - c < k (every k-subset has a correct
  sample); pass@1 = c / n; pass@k never decreases in k.
- Exact: binomials are Python integers, so large n loses nothing to rounding of products.
"""

from __future__ import annotations

from collections.abc import Sequence
from math import comb


def pass_at_k(n: int, c: int, k: int) -> float:
    """pass@k of one problem with `c` correct samples out of `n` (module docstring)."""
    if not 0 <= c <= n:
        raise ValueError(f"need 0 <= c <= n, got c={c}, n={n}")
    if not 1 <= k <= n:
        raise ValueError(f"need 1 <= k <= n, got k={k}, n={n}")
    if n - c < k:
        return 1.0
    return 1.0 - comb(n - c, k) / comb(n, k)


def mean_pass_at_k(n: int, correct: Sequence[int], k: int) -> float:
    """pass@k averaged over problems; `correct[i]` = correct samples of problem i (of `n`)."""
    if not correct:
        raise ValueError("pass@k of no problems")
    return sum(pass_at_k(n, c, k) for c in correct) / len(correct)

"""The staleness-aware step (`areal.algo.stale_step`) against hand-worked numbers."""

from __future__ import annotations

import pytest
import torch

from areal.algo.stale_step import lr_scale, mean_token_lag


def test_mean_lag_counts_loss_tokens_only() -> None:
    # trainer at version 5; seq a: versions 3, 3, 4 (lags 2, 2, 1); seq b: 5, 1 with the 1 an
    # environment token (masked out) -> lags 2 + 2 + 1 + 0 over 4 tokens = 1.25
    versions = [torch.tensor([3, 3, 4]), torch.tensor([5, 1])]
    masks = [None, torch.tensor([True, False])]
    assert mean_token_lag(versions, masks, 5) == pytest.approx(1.25)
    # a token from the future counts as lag 0, not -2; no token at all: lag 0
    assert mean_token_lag([torch.tensor([7, 3])], [None], 5) == pytest.approx(1.0)
    assert mean_token_lag([], [], 5) == 0.0


def test_lr_scale_hand_values() -> None:
    assert lr_scale(3.0, 0.0) == 1.0  # off: AReaL's step
    assert lr_scale(0.0, 1.0) == 1.0  # fresh data: a full step
    assert lr_scale(3.0, 1.0) == pytest.approx(0.25)  # 1 / (1 + 3)
    assert lr_scale(1.25, 0.4) == pytest.approx(1 / 1.5)  # 1 / (1 + 0.5)
    assert lr_scale(4.0, 1.0) < lr_scale(2.0, 1.0) < 1.0  # never grows with the lag
    with pytest.raises(ValueError, match=">= 0"):
        lr_scale(1.0, -0.1)

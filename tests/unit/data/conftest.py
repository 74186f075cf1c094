"""One torch thread for the data tests: the tiny model gains nothing from more, and on a shared
2-core machine two OpenMP threads per process slow every step down by an order of magnitude."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True)
def _one_torch_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)

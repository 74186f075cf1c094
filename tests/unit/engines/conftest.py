"""A random tiny Qwen2 saved to disk once per session; engines load it like any HF model dir."""

from __future__ import annotations

import pytest
import torch

from tests.unit.engines.helpers import tiny_model

# The tiny model gains nothing from intra-op threads, and on a shared 2-core box spinning
# threads make every op 100x slower.
torch.set_num_threads(1)


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("tiny_qwen2")
    tiny_model(0).save_pretrained(path)
    (path / "tokenizer_config.json").write_text("{}")  # stands in for tokenizer files
    return str(path)


@pytest.fixture(scope="session")
def ref_model(model_dir):
    """The same weights as `model_dir`, for independent full-sequence forwards."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True).eval()

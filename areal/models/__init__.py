"""Real models: import a GGUF / HF checkpoint as a plain HF dir, build random-weight models of
real architectures with a real tokenizer (for tests)."""

from areal.models.importer import (
    ImportReport,
    ModelImportError,
    ModelSource,
    cached_import,
    import_model,
    read_import_report,
    resolve_source,
)
from areal.models.random_model import build_random_model

__all__ = [
    "ImportReport",
    "ModelImportError",
    "ModelSource",
    "build_random_model",
    "cached_import",
    "import_model",
    "read_import_report",
    "resolve_source",
]

"""The manifest of a run's shared files: what a worker on another host joins with.

`areal run` uploads the run's portable config, its model dir and its data file to the run's
`files` object store (`RunNames.files_bucket`); a worker started with `--join RUN_ID` downloads
them (`areal.bus.run_files`). The manifest is the one object a reader trusts: it is written
after every file it names, and each download is checked against its size and sha256.

Object names: `config.json`, `model/<path inside the model dir>`, `data/<file name>`.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import PurePosixPath

from pydantic import BaseModel, ConfigDict, Field, field_validator

MANIFEST_SCHEMA_VERSION = 1
MANIFEST_NAME = "manifest.json"
CONFIG_NAME = "config.json"
MODEL_PREFIX = "model/"
DATA_PREFIX = "data/"


class SharedFile(BaseModel):
    """One object of the bucket: a relative POSIX path, its size and digest."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    name: str = Field(description="object name = relative path under the download dir")
    bytes: int = Field(ge=0, description="size (bytes)")
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$", description="hex sha256 of the content")

    @field_validator("name")
    @classmethod
    def _relative(cls, name: str) -> str:
        p = PurePosixPath(name)
        if not name or p.is_absolute() or ".." in p.parts or "\\" in name:
            raise ValueError(f"shared file name {name!r} must be a relative path without '..'")
        return name


class RunFilesManifest(BaseModel):
    """Every shared file of one run. Readers ignore unknown fields."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    schema_version: int = MANIFEST_SCHEMA_VERSION
    run_id: str
    files: tuple[SharedFile, ...]

    @field_validator("schema_version")
    @classmethod
    def _supported(cls, v: int) -> int:
        if v > MANIFEST_SCHEMA_VERSION:
            raise ValueError(
                f"run files manifest version {v} is newer than this areal-bus reads "
                f"({MANIFEST_SCHEMA_VERSION}): upgrade areal-bus on this host"
            )
        return v

    def get(self, name: str) -> SharedFile | None:
        return next((f for f in self.files if f.name == name), None)

    def under(self, prefix: str) -> tuple[SharedFile, ...]:
        return tuple(f for f in self.files if f.name.startswith(prefix))

    @property
    def digest(self) -> str:
        """sha256 over the sorted (name, bytes, sha256) entries: equal digests, equal files."""
        entries = sorted((f.name, f.bytes, f.sha256) for f in self.files)
        return hashlib.sha256(json.dumps(entries).encode()).hexdigest()

    @property
    def total_bytes(self) -> int:
        return sum(f.bytes for f in self.files)

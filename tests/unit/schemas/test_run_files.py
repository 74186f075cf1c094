"""The run files manifest (`schemas.run_files`): names stay inside the download dir, the digest
identifies the set of files whatever their order, and a newer manifest is refused clearly."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from schemas.run_files import MANIFEST_SCHEMA_VERSION, RunFilesManifest, SharedFile

SHA_A, SHA_B = "a" * 64, "b" * 64


def test_the_digest_depends_on_the_files_not_their_order():
    a = SharedFile(name="model/w.bin", bytes=3, sha256=SHA_A)
    b = SharedFile(name="config.json", bytes=2, sha256=SHA_B)
    one = RunFilesManifest(run_id="r", files=(a, b))
    two = RunFilesManifest(run_id="r", files=(b, a))
    assert one.digest == two.digest
    changed = RunFilesManifest(run_id="r", files=(a, b.model_copy(update={"sha256": SHA_A})))
    assert changed.digest != one.digest
    assert one.total_bytes == 5
    assert one.get("config.json") == b and one.get("nope") is None
    assert one.under("model/") == (a,)


@pytest.mark.parametrize("name", ["", "/etc/passwd", "../x", "model/../../x", "a\\b"])
def test_a_name_that_could_leave_the_download_dir_is_refused(name):
    with pytest.raises(ValidationError, match="relative path"):
        SharedFile(name=name, bytes=0, sha256=SHA_A)


def test_a_newer_manifest_is_refused_with_the_fix_and_unknown_fields_are_ignored():
    newer = {"schema_version": MANIFEST_SCHEMA_VERSION + 1, "run_id": "r", "files": []}
    with pytest.raises(ValidationError, match="upgrade areal-bus on this host"):
        RunFilesManifest.model_validate(newer)
    extra = {"run_id": "r", "files": [], "created_by": "a later launcher"}
    assert RunFilesManifest.model_validate(extra).files == ()

"""A user folder's files never lead out of it (`areal.data.contained`): each escaping form is
refused naming the path, and the links a Hugging Face cache snapshot holds stay allowed."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from areal.data.contained import (
    EscapingPath,
    check_contained_file,
    contained_files,
    share_root,
)


@pytest.fixture
def secret(tmp_path: Path) -> Path:
    keys = tmp_path / "out" / "keys"
    keys.mkdir(parents=True)
    (keys / "weights_signing.key").write_bytes(b"SECRET")
    return keys / "weights_signing.key"


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    d = tmp_path / "model"
    (d / "sub").mkdir(parents=True)
    (d / "config.json").write_text("{}")
    (d / "sub" / "w.bin").write_bytes(b"w")
    return d


def test_plain_files_and_links_inside_are_listed_by_their_own_names(folder: Path) -> None:
    (folder / "alias.json").symlink_to("config.json")  # a link inside: allowed
    (folder / "again").symlink_to("sub", target_is_directory=True)  # the same folder twice
    got = [p.relative_to(folder).as_posix() for p in contained_files(folder)]
    # `again` and `sub` are one real folder: walked once, under its first name in order
    assert got == ["again/w.bin", "alias.json", "config.json"]


def test_a_link_to_the_signing_key_is_refused_naming_the_link(folder: Path, secret: Path) -> None:
    (folder / "tokenizer.json").symlink_to(secret)
    with pytest.raises(EscapingPath, match=r"model/tokenizer\.json is a link to .*outside"):
        contained_files(folder)


def test_a_link_to_a_folder_outside_is_refused(folder: Path, secret: Path) -> None:
    (folder / "sub" / "keys").symlink_to(secret.parent, target_is_directory=True)
    with pytest.raises(EscapingPath, match=r"sub/keys is a link to"):
        contained_files(folder)


def test_a_relative_link_climbing_out_is_refused(folder: Path, secret: Path) -> None:
    (folder / "sub" / "up").symlink_to(Path("..") / ".." / "out" / "keys" / secret.name)
    with pytest.raises(EscapingPath, match="outside"):
        contained_files(folder)


def test_dangling_links_and_loops_are_refused(folder: Path) -> None:
    (folder / "gone").symlink_to(folder / "nowhere")
    with pytest.raises(EscapingPath, match="dangling"):
        contained_files(folder)
    (folder / "gone").unlink()
    (folder / "a").symlink_to(folder / "b")
    (folder / "b").symlink_to(folder / "a")
    with pytest.raises(EscapingPath, match="loop|dangling"):
        contained_files(folder)


def test_special_files_are_refused(folder: Path) -> None:
    os.mkfifo(folder / "pipe")  # reading it would block the launcher forever
    with pytest.raises(EscapingPath, match=r"pipe is not a regular file"):
        contained_files(folder)


def test_a_forbidden_folder_is_refused_even_inside(tmp_path: Path) -> None:
    out = tmp_path / "out"
    (out / "keys" / "nats").mkdir(parents=True)
    (out / "keys" / "nats" / "trainer.json").write_text("{}")
    (out / "model.bin").write_bytes(b"m")
    with pytest.raises(EscapingPath, match="leads to the run's secret"):
        contained_files(out, forbidden=[out / "keys", None])
    assert contained_files(out) == [out / "keys" / "nats" / "trainer.json", out / "model.bin"]


def test_a_hub_snapshot_may_link_into_its_own_blobs_only(tmp_path: Path, secret: Path) -> None:
    repo = tmp_path / "hub" / "datasets--me--tiny"
    snap = repo / "snapshots" / "abc123"
    (repo / "blobs").mkdir(parents=True)
    (snap / "data").mkdir(parents=True)
    (repo / "blobs" / "f00d").write_bytes(b"rows")
    (snap / "data" / "train.parquet").symlink_to(Path("..") / ".." / ".." / "blobs" / "f00d")
    assert share_root(snap) == repo.resolve()
    assert contained_files(snap) == [snap / "data" / "train.parquet"]
    (snap / "data" / "key").symlink_to(secret)
    with pytest.raises(EscapingPath, match="outside"):
        contained_files(snap)


def test_a_named_file_may_be_a_link_but_not_a_secret(tmp_path: Path, secret: Path) -> None:
    data = tmp_path / "elsewhere" / "train.jsonl"
    data.parent.mkdir()
    data.write_text("{}\n")
    link = tmp_path / "train.jsonl"
    link.symlink_to(data)
    assert check_contained_file(link) == link  # the user named this file
    with pytest.raises(EscapingPath, match="outside"):
        check_contained_file(link, within=tmp_path / "model")
    bad = tmp_path / "data.jsonl"
    bad.symlink_to(secret)
    with pytest.raises(EscapingPath, match="leads to the run's secret"):
        check_contained_file(bad, forbidden=[secret.parent])

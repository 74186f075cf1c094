"""The run's secrets never reach its files store (`areal_<run>_files`), whatever a shared
folder links to: on a real server with the run's per-role accounts (what `areal run` starts),
sharing a model dir, an `hf:` save_to_disk folder, a hub cache snapshot or a glob that holds a
link to the signing key or a role's NATS credentials fails naming the link, and no role reads
a byte of either from the store. A snapshot's links into its own `blobs/` are shared as usual.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from areal.bus.auth import load_credentials
from areal.bus.embedded import EmbeddedNats
from areal.bus.errors import PermissionDenied
from areal.bus.nats_config import ROLES, authorization_block, ensure_accounts
from areal.bus.run_files import RunFilesMissing, fetch_run_files
from areal.config import RunSettings, load_settings
from areal.data.contained import EscapingPath
from areal.launch.join import share_run
from areal.security.keys import SIGNING_KEY_FILE, ensure_run_keys

pytestmark = pytest.mark.integration
GUARD_S = 60.0  # hang guard of every store read (never a timing assertion)


@dataclass
class Run:
    out: Path
    server: EmbeddedNats
    run_id: str

    @property
    def signing_key(self) -> Path:
        return self.out / "keys" / SIGNING_KEY_FILE

    @property
    def nats_keys(self) -> Path:
        return self.out / "keys" / "nats"

    def secrets(self) -> list[bytes]:
        return [self.signing_key.read_bytes(), (self.nats_keys / "trainer.json").read_bytes()]

    def settings(self, *sets: str) -> RunSettings:
        return load_settings(
            None,
            [
                f"run_id={self.run_id}",
                f"out_dir={self.out}",
                f"nats.url={self.server.url}",
                f"nats.credentials_dir={self.nats_keys}",
                f"security.keys_dir={self.out / 'keys'}",
                *sets,
            ],
        )


@pytest.fixture
def run(tmp_path: Path, run_id: str) -> Iterator[Run]:
    """A run's keys and per-role accounts laid out as the launcher does, and its server."""
    out = tmp_path / "runs" / "exp"
    ensure_run_keys(out / "keys")
    accounts = ensure_accounts(out / "keys" / "nats", [run_id])
    server = EmbeddedNats(
        store_dir=tmp_path / "nats", authorization=authorization_block(accounts)
    ).start()
    try:
        yield Run(out=out, server=server, run_id=run_id)
    finally:
        server.stop()


def model_dir(root: Path) -> Path:
    d = root / "model"
    d.mkdir(parents=True)
    (d / "config.json").write_text("{}")
    (d / "model.safetensors").write_bytes(b"weights")
    return d


def save_to_disk_dir(root: Path) -> Path:
    from datasets import Dataset

    d = root / "saved"
    Dataset.from_dict({"prompt": ["1+1="], "answer": ["2"]}).save_to_disk(str(d))
    return d


def hub_snapshot(root: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """`me/tiny` in the hub cache's own layout: the snapshot's shard is a link into `blobs/`."""
    from datasets import Dataset

    monkeypatch.setenv("HF_HUB_CACHE", str(root / "hub"))
    repo = root / "hub" / "datasets--me--tiny"
    snap = repo / "snapshots" / ("ab" * 20)
    (repo / "blobs").mkdir(parents=True)
    (snap / "data").mkdir(parents=True)
    Dataset.from_dict({"prompt": ["1+1="], "answer": ["2"]}).to_parquet(str(repo / "blobs" / "f0"))
    (snap / "data" / "train-00000-of-00001.parquet").symlink_to(
        Path("..") / ".." / ".." / "blobs" / "f0"
    )
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("ab" * 20)
    return snap


async def read_as_every_role(run: Run, dest: Path) -> dict[str, list[bytes]]:
    """What each role can read of the run's files store (nothing, when it holds no manifest or
    the role may not read it)."""
    got: dict[str, list[bytes]] = {}
    for role in ROLES:
        creds = load_credentials(run.nats_keys / f"{role}.json")
        try:
            _, where = await asyncio.wait_for(
                fetch_run_files(run.server.url, run.run_id, dest / role, credentials=creds),
                GUARD_S,
            )
        except (RunFilesMissing, PermissionDenied, TimeoutError):
            got[role] = []  # no manifest, or the role may not read the store (the monitor's
            continue  # stream info is refused: the library reports it as a timeout)
        got[role] = [p.read_bytes() for p in sorted(where.rglob("*")) if p.is_file()]
    return got


def assert_no_secret_readable(run: Run, got: dict[str, list[bytes]]) -> None:
    secrets = run.secrets()
    for role, contents in got.items():
        for content in contents:
            assert not any(s in content for s in secrets), f"{role} read a secret"


Form = Callable[[Run, Path, pytest.MonkeyPatch], list[str]]


def linked_model_key(run: Run, root: Path, mp: pytest.MonkeyPatch) -> list[str]:
    d = model_dir(root)
    (d / "tokenizer.json").symlink_to(run.signing_key)
    return [f"model.path={d}"]


def linked_model_credentials(run: Run, root: Path, mp: pytest.MonkeyPatch) -> list[str]:
    d = model_dir(root)
    (d / "extra").symlink_to(run.nats_keys, target_is_directory=True)  # a folder link
    return [f"model.path={d}"]


def linked_save_to_disk(run: Run, root: Path, mp: pytest.MonkeyPatch) -> list[str]:
    d = save_to_disk_dir(root)
    (d / "notes.txt").symlink_to(run.nats_keys / "trainer.json")
    return [f"model.path={model_dir(root)}", f"data.source=hf:{d}"]


def linked_hub_snapshot(run: Run, root: Path, mp: pytest.MonkeyPatch) -> list[str]:
    snap = hub_snapshot(root, mp)
    (snap / "README.md").symlink_to(run.signing_key)
    return [f"model.path={model_dir(root)}", "data.source=hf:me/tiny"]


def linked_glob(run: Run, root: Path, mp: pytest.MonkeyPatch) -> list[str]:
    d = root / "shards"
    d.mkdir(parents=True)
    (d / "leak.parquet").symlink_to(run.signing_key)
    return [f"model.path={model_dir(root)}", f"data.eval_source=hf:{d}/*.parquet"]


@pytest.mark.parametrize(
    ("form", "link"),
    [
        (linked_model_key, "tokenizer.json"),
        (linked_model_credentials, "extra"),
        (linked_save_to_disk, "notes.txt"),
        (linked_hub_snapshot, "README.md"),
        (linked_glob, "leak.parquet"),
    ],
    ids=["model-dir-key", "model-dir-credentials", "save-to-disk", "hub-snapshot", "glob"],
)
async def test_a_link_to_a_secret_is_refused_and_no_role_reads_it(
    run: Run, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, form: Form, link: str
) -> None:
    settings = run.settings(*form(run, tmp_path / "user", monkeypatch))
    with pytest.raises(EscapingPath, match=rf"{link} (is a link to|leads to the run's secret)"):
        await asyncio.to_thread(share_run, settings, None)
    got = await read_as_every_role(run, tmp_path / "joined")
    assert_no_secret_readable(run, got)
    assert not any(got.values())  # nothing was shared at all: the share failed before it


async def test_a_snapshot_linking_into_its_own_blobs_is_shared(
    run: Run, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    hub_snapshot(tmp_path / "user", monkeypatch)
    settings = run.settings(f"model.path={model_dir(tmp_path / 'user')}", "data.source=hf:me/tiny")
    await asyncio.to_thread(share_run, settings, None)
    got = await read_as_every_role(run, tmp_path / "joined")
    assert_no_secret_readable(run, got)
    shard = (tmp_path / "user" / "hub" / "datasets--me--tiny" / "blobs" / "f0").read_bytes()
    assert shard in got["rollout"] and b"weights" in got["rollout"]  # a joining worker's view

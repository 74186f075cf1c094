"""Per-run keys: created once (0700 dir, 0600 files), kept as they are on every later call (a
resumed run keeps its keys), refused rather than repaired when inconsistent, and loaded by a
worker only as its role needs (the trainer alone with the signing key)."""

from __future__ import annotations

import stat

import pytest

from areal.config import load_settings
from areal.security.keys import (
    IDS_SECRET_FILE,
    SIGNING_KEY_FILE,
    VERIFY_KEY_FILE,
    KeysError,
    RunKeys,
    ensure_run_keys,
    keys_dir_of,
    keys_for_worker,
    load_ids_secret,
    load_run_keys,
)

FILES = (SIGNING_KEY_FILE, VERIFY_KEY_FILE, IDS_SECRET_FILE)


def contents(d) -> dict[str, bytes]:
    return {name: (d / name).read_bytes() for name in FILES}


def test_keys_are_created_private_and_never_regenerated(tmp_path):
    d = tmp_path / "out" / "keys"
    first = ensure_run_keys(d)
    assert stat.S_IMODE(d.stat().st_mode) == 0o700
    for name in FILES:
        assert stat.S_IMODE((d / name).stat().st_mode) == 0o600
    before = contents(d)
    again = ensure_run_keys(d)  # what `--resume` does: the same files, byte for byte
    assert contents(d) == before
    assert again.fingerprint == first.fingerprint and again.ids_secret == first.ids_secret
    assert len(load_ids_secret(d)) == 32
    assert sorted(p.name for p in d.iterdir()) == sorted(FILES)  # no temp file left behind


def test_a_signature_verifies_only_with_the_runs_key_and_the_same_bytes(tmp_path):
    keys = ensure_run_keys(tmp_path / "keys")
    sig = keys.sign(b"payload")
    assert keys.verify(b"payload", sig)
    assert keys.public().verify(b"payload", sig)  # a reader needs no signing key
    assert not keys.verify(b"payload!", sig)
    assert not keys.verify(b"payload", "00" * 64)
    assert not keys.verify(b"payload", "not hex")
    assert not RunKeys.generate().verify(b"payload", sig)  # another run's key
    with pytest.raises(RuntimeError, match="only the trainer signs"):
        keys.public().sign(b"payload")


def test_a_verify_key_without_its_signing_key_is_refused_not_replaced(tmp_path):
    d = tmp_path / "keys"
    ensure_run_keys(d)
    (d / SIGNING_KEY_FILE).unlink()
    pub = (d / VERIFY_KEY_FILE).read_bytes()
    with pytest.raises(KeysError, match=f"no {SIGNING_KEY_FILE}"):
        ensure_run_keys(d)
    assert (d / VERIFY_KEY_FILE).read_bytes() == pub
    assert not (d / SIGNING_KEY_FILE).exists()


def test_a_lost_verify_key_is_derived_from_the_signing_key(tmp_path):
    d = tmp_path / "keys"
    fp = ensure_run_keys(d).fingerprint
    (d / VERIFY_KEY_FILE).unlink()  # a crash between the two writes
    assert ensure_run_keys(d).fingerprint == fp


def test_keys_of_two_runs_do_not_mix(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    ensure_run_keys(a)
    ensure_run_keys(b)
    (a / VERIFY_KEY_FILE).write_bytes((b / VERIFY_KEY_FILE).read_bytes())
    with pytest.raises(KeysError, match="not one key pair"):
        load_run_keys(a, signing=True)


def test_a_corrupt_ids_secret_names_the_file(tmp_path):
    d = tmp_path / "keys"
    ensure_run_keys(d)
    (d / IDS_SECRET_FILE).write_text("abcd\n")
    with pytest.raises(KeysError, match=IDS_SECRET_FILE):
        load_ids_secret(d)


def test_workers_load_what_their_role_needs(tmp_path):
    settings = load_settings(None, [f"out_dir={tmp_path}"])
    assert keys_dir_of(settings) == tmp_path / "keys"
    with pytest.raises(KeysError) as e:
        keys_for_worker(settings, "rollout")  # started by hand, no keys dir: a config error
    msg = str(e.value)
    assert msg.startswith("config error: security.keys_dir") and "sign_weights=false" in msg
    assert keys_for_worker(settings, "controller") is None  # needs no weights keys
    ensure_run_keys(tmp_path / "keys")
    assert keys_for_worker(settings, "trainer").signing_key is not None
    assert keys_for_worker(settings, "rollout").signing_key is None
    assert keys_for_worker(settings, "reward").signing_key is None


def test_a_host_with_a_copy_without_the_signing_key_cannot_run_the_trainer(tmp_path):
    launcher = tmp_path / "launcher-keys"
    ensure_run_keys(launcher)
    copy = tmp_path / "copy"
    copy.mkdir(mode=0o700)
    for name in (VERIFY_KEY_FILE, IDS_SECRET_FILE):
        (copy / name).write_bytes((launcher / name).read_bytes())
    settings = load_settings(None, [f"security.keys_dir={copy}"])
    assert (
        keys_for_worker(settings, "rollout").fingerprint
        == load_run_keys(launcher, signing=False).fingerprint
    )
    with pytest.raises(KeysError, match="run the trainer there"):
        keys_for_worker(settings, "trainer")


def test_unsigned_weights_are_an_explicit_opt_out(tmp_path):
    settings = load_settings(None, [f"out_dir={tmp_path}", "security.sign_weights=false"])
    assert keys_for_worker(settings, "rollout") is None
    assert keys_for_worker(settings, "trainer") is None

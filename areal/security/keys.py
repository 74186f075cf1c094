"""Per-run keys: who may announce weights, and the secret that keys message ids.

A run's keys dir (`security.keys_dir`; default `<out_dir>/keys`) holds three files:

- `weights_signing.key`: the trainer's Ed25519 private key (PEM, PKCS#8). Only the trainer
  loads it, and it never has to leave the launcher's host: a copy for another host leaves it out.
- `weights_verify.pub`: its public key (PEM). Every role that reads weights loads it and refuses
  an announcement it does not verify (`areal.bus.run_weights`).
- `ids_secret`: 32 random bytes (hex), a per-run secret to key message ids with, so that no one
  without it can predict an id and take it first in JetStream's de-duplication window.

Invariants:
- `ensure_run_keys` (the launcher, before any worker starts) creates what is missing and never
  replaces a file that exists, so a resumed run keeps its keys; a verify key without its signing
  key, or two that do not match, is refused, never repaired (new keys would not be the ones the
  run's workers trust);
- the dir is 0700 and every file 0600, each created exclusively (a file that exists is kept);
- every loading failure is a `KeysError` (a `ConfigError`): one line naming the setting and the fix.
"""

from __future__ import annotations

import hashlib
import os
import secrets
import stat
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING

import structlog
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from areal.config import ConfigError

if TYPE_CHECKING:
    from areal.config import RunSettings

log = structlog.get_logger()

SIGNING_KEY_FILE = "weights_signing.key"
VERIFY_KEY_FILE = "weights_verify.pub"
IDS_SECRET_FILE = "ids_secret"
IDS_SECRET_BYTES = 32
KEYS_SUBDIR = "keys"  # under out_dir, when security.keys_dir is unset
WEIGHTS_ROLES = frozenset({"trainer", "rollout"})  # the roles that sign or read weights

__all__ = [
    "KeysError",
    "RunKeys",
    "ensure_run_keys",
    "keys_dir_of",
    "keys_for_worker",
    "load_ids_secret",
    "load_run_keys",
]


class KeysError(ConfigError):
    """The run's keys are missing, unreadable or inconsistent; the message names the fix."""


def _raw(key: Ed25519PublicKey) -> bytes:
    return key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


@dataclass(frozen=True)
class RunKeys:
    """One run's keys as a worker holds them; `signing_key` only in the trainer."""

    verify_key: Ed25519PublicKey
    ids_secret: bytes = field(repr=False)
    signing_key: Ed25519PrivateKey | None = field(default=None, repr=False)

    @classmethod
    def generate(cls) -> RunKeys:
        """Fresh keys in memory (tests, or code that builds a run without a launcher)."""
        sk = Ed25519PrivateKey.generate()
        return cls(sk.public_key(), secrets.token_bytes(IDS_SECRET_BYTES), sk)

    def public(self) -> RunKeys:
        """These keys without the signing key: what every role but the trainer holds."""
        return replace(self, signing_key=None)

    @property
    def fingerprint(self) -> str:
        """Short id of the verify key, for logs (the first 16 hex digits of its sha256)."""
        return hashlib.sha256(_raw(self.verify_key)).hexdigest()[:16]

    def sign(self, payload: bytes) -> str:
        """Ed25519 signature of `payload`, hex; only keys loaded with the signing key sign."""
        if self.signing_key is None:
            raise RuntimeError(
                "these run keys have no signing key: only the trainer signs weights "
                "(load_run_keys(..., signing=True) on the launcher's host)"
            )
        return self.signing_key.sign(payload).hex()

    def verify(self, payload: bytes, signature: str) -> bool:
        """True only when `signature` (hex) is the trainer's signature of `payload`."""
        try:
            self.verify_key.verify(bytes.fromhex(signature), payload)
        except (ValueError, InvalidSignature):
            return False
        return True


# ------------------------------------------------------------------ files
def _write_new(path: Path, data: bytes) -> bool:
    """Create `path` (0600) holding `data` unless it exists; True when this call created it.
    Written to a temp file first and linked into place, so `path` is never seen half written."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}-{secrets.token_hex(4)}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "wb") as f:
            os.fchmod(f.fileno(), 0o600)
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        try:
            os.link(tmp, path)
        except FileExistsError:
            return False
        return True
    finally:
        tmp.unlink(missing_ok=True)


def _read(path: Path, what: str) -> bytes:
    try:
        return path.read_bytes()
    except FileNotFoundError:
        raise KeysError(_missing(path.parent, path.name, what)) from None
    except OSError as e:
        raise KeysError(
            f"config error: security.keys_dir: cannot read {path} ({e.strerror}); make it "
            "readable by the user the workers run as"
        ) from None


def _missing(d: Path, name: str, what: str) -> str:
    if name == SIGNING_KEY_FILE:
        return (
            f"config error: security.keys_dir: {d} has no {name} ({what}); the trainer signs "
            "weights with it and only the launcher's host has it: run the trainer there, with "
            "the run's keys dir, or set security.sign_weights=false for unsigned weights"
        )
    return (
        f"config error: security.keys_dir: no {name} ({what}) in {d}; `areal run` creates the "
        f"run's keys in <out_dir>/{KEYS_SUBDIR} before any worker starts: a worker started by "
        f"hand or on another host needs a copy of that dir without {SIGNING_KEY_FILE} "
        "(--set security.keys_dir=DIR), or security.sign_weights=false to accept unsigned "
        "weights (only on a bus no one else can write to)"
    )


def _bad(path: Path, e: Exception) -> KeysError:
    return KeysError(
        f"config error: security.keys_dir: {path} is not a valid key file ({e}); restore it "
        "from the launcher's host, or start a new run (--overwrite) for new keys"
    )


def _load_private(path: Path) -> Ed25519PrivateKey:
    data = _read(path, "the trainer's weights signing key")
    try:
        key = serialization.load_pem_private_key(data, password=None)
    except (ValueError, TypeError) as e:
        raise _bad(path, e) from None
    if not isinstance(key, Ed25519PrivateKey):
        raise _bad(path, TypeError("not an Ed25519 key"))
    mode = path.stat().st_mode
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        log.warning("signing_key_readable_by_others", path=str(path), mode=oct(mode & 0o777))
    return key


def _load_public(path: Path) -> Ed25519PublicKey:
    data = _read(path, "the trainer's weights verify key")
    try:
        key = serialization.load_pem_public_key(data)
    except (ValueError, TypeError) as e:
        raise _bad(path, e) from None
    if not isinstance(key, Ed25519PublicKey):
        raise _bad(path, TypeError("not an Ed25519 key"))
    return key


def load_ids_secret(keys_dir: str | os.PathLike) -> bytes:
    """The run's 32-byte message-id secret from `keys_dir`; `KeysError` when absent or bad."""
    path = Path(keys_dir) / IDS_SECRET_FILE
    text = _read(path, "the run's message-id secret").decode(errors="replace").strip()
    try:
        secret = bytes.fromhex(text)
    except ValueError as e:
        raise _bad(path, e) from None
    if len(secret) != IDS_SECRET_BYTES:
        raise _bad(path, ValueError(f"{len(secret)} bytes, expected {IDS_SECRET_BYTES}"))
    return secret


def load_run_keys(keys_dir: str | os.PathLike, *, signing: bool) -> RunKeys:
    """The run's keys from `keys_dir`; with `signing` (the trainer) also the signing key,
    checked to match the verify key. Raises `KeysError` naming the fix."""
    d = Path(keys_dir)
    verify_key = _load_public(d / VERIFY_KEY_FILE)
    ids_secret = load_ids_secret(d)
    signing_key = None
    if signing:
        signing_key = _load_private(d / SIGNING_KEY_FILE)
        if _raw(signing_key.public_key()) != _raw(verify_key):
            raise KeysError(
                f"config error: security.keys_dir: {SIGNING_KEY_FILE} and {VERIFY_KEY_FILE} in "
                f"{d} are not one key pair; restore both from the same run, or start a new run "
                "(--overwrite) for new keys"
            )
    return RunKeys(verify_key, ids_secret, signing_key)


def ensure_run_keys(keys_dir: str | os.PathLike) -> RunKeys:
    """Create the run's keys in `keys_dir` where missing (never replacing a file), then load
    them with the signing key. The launcher calls this before any worker starts."""
    d = Path(keys_dir)
    d.mkdir(parents=True, exist_ok=True, mode=0o700)
    try:
        os.chmod(d, 0o700)
    except PermissionError:
        log.warning("keys_dir_mode_unchanged", path=str(d), reason="not the owner")
    sk_path, pk_path = d / SIGNING_KEY_FILE, d / VERIFY_KEY_FILE
    if not sk_path.exists():
        if pk_path.exists():
            raise KeysError(
                f"config error: security.keys_dir: {d} has {VERIFY_KEY_FILE} but no "
                f"{SIGNING_KEY_FILE}, so the trainer could not sign weights the run's workers "
                f"trust; restore {SIGNING_KEY_FILE} from the launcher's host, or start a new run "
                "(--overwrite, or another --out)"
            )
        pem = Ed25519PrivateKey.generate().private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
        if _write_new(sk_path, pem):
            log.info("run_keys_created", keys_dir=str(d))
    if not pk_path.exists():  # derived from the signing key (a crash between the two writes)
        public = _load_private(sk_path).public_key()
        _write_new(
            pk_path,
            public.public_bytes(
                serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
            ),
        )
    _write_new(d / IDS_SECRET_FILE, secrets.token_bytes(IDS_SECRET_BYTES).hex().encode() + b"\n")
    return load_run_keys(d, signing=True)


# ------------------------------------------------------------------ settings
def keys_dir_of(settings: RunSettings) -> Path:
    """`security.keys_dir`, else `<out_dir>/keys`."""
    return Path(settings.security.keys_dir or Path(settings.out_dir) / KEYS_SUBDIR)


def secret_paths(settings: RunSettings) -> tuple[Path, ...]:
    """What a run must never share or copy into a model: its keys dir, `<out_dir>/keys` (where
    the embedded server's per-role NATS credentials go, whatever `security.keys_dir` says), and
    the NATS credentials and TLS key files it was given."""
    n = settings.nats
    named = (n.credentials_dir, n.credentials_file, n.tls_key_file)
    default = Path(settings.out_dir) / KEYS_SUBDIR
    return (keys_dir_of(settings), default, *(Path(p) for p in named if p))


def keys_for_worker(settings: RunSettings, role: str) -> RunKeys | None:
    """The keys a worker of `role` holds: the trainer with its signing key, every other role
    without it. A role that signs or reads weights (`WEIGHTS_ROLES`) needs them while
    `security.sign_weights` is on (`KeysError` otherwise); other roles load them when present
    (for `ids_secret`) and get None when not."""
    d = keys_dir_of(settings)
    if role in WEIGHTS_ROLES and not settings.security.sign_weights:
        log.warning(
            "weights_unsigned",
            reason="security.sign_weights=false: weight announcements are neither signed nor "
            "verified; anyone who can publish on the bus can replace the policy",
        )
    if role in WEIGHTS_ROLES and settings.security.sign_weights:
        return load_run_keys(d, signing=role == "trainer")
    if (d / VERIFY_KEY_FILE).is_file():
        return load_run_keys(d, signing=False)
    return None

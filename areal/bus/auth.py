"""Who a client is to the NATS server: credentials files, TLS, and the server's refusals.

A credentials file is what `areal nats-config` (and `areal run`, for its embedded server)
writes for one role of one run, mode 0600: JSON `{"user", "password", "inbox_prefix", "role",
"run_id"}`. A NATS `.creds` file (operator mode: a user JWT and its nkey seed) is taken as is.
Which file a process uses: `nats.credentials_file` when set, else `<nats.credentials_dir>/
<role>.json` (`credentials_for`); TLS comes from `nats.tls_*`.

Invariants:
- a secret never appears in a repr, a log line or an error message (the file's path does);
- a client whose credentials name an `inbox_prefix` uses it for every reply subject: its user
  may subscribe only under that prefix, so no other account reads the replies it gets;
- a refusal is reported with the subject and never mistaken for an outage: `Denials` records
  the permission violations the server reports on a connection (it reports them
  asynchronously, as `-ERR 'Permissions Violation for Publish to "SUBJECT"'`), so a publish
  waiting for its ack fails at once with `PermissionDenied` instead of being retried.
"""

from __future__ import annotations

import collections
import json
import re
import ssl
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from areal.bus.errors import PermissionDenied
from areal.config import ConfigError, NatsSettings

JWT_MARKER = "-----BEGIN NATS USER JWT-----"
_VIOLATION = re.compile(r'permissions violation for (publish|subscription) to "([^"]+)"', re.I)
_REMEMBERED = 256  # denied subjects a connection remembers (the newest)


class CredentialsError(ConfigError):
    """A credentials file that is missing or malformed (the message names it and the fix)."""


@dataclass(frozen=True)
class Credentials:
    """How one client proves who it is, and which server certificates it trusts."""

    user: str | None = None
    password: str | None = field(default=None, repr=False)
    jwt_creds: str | None = None  # a NATS .creds file (user JWT + nkey seed)
    inbox_prefix: str | None = None
    tls_ca_file: str | None = None
    tls_cert_file: str | None = None
    tls_key_file: str | None = None
    source: str | None = None  # the file they were read from (named in errors)

    @property
    def given(self) -> bool:
        return self.user is not None or self.jwt_creds is not None

    def describe(self) -> str:
        """For errors and logs: who, and from which file; never the secret."""
        if self.jwt_creds is not None:
            return f"the NATS credentials {self.jwt_creds}"
        if self.user is None:
            return "no credentials"
        return f"user {self.user!r}" + (f" from {self.source}" if self.source else "")

    def ssl_context(self) -> ssl.SSLContext | None:
        """A client TLS context when a CA or a client certificate is configured."""
        if self.tls_ca_file is None and self.tls_cert_file is None:
            return None
        ctx = ssl.create_default_context(cafile=self.tls_ca_file)
        if self.tls_cert_file is not None:
            ctx.load_cert_chain(self.tls_cert_file, self.tls_key_file)
        return ctx

    def connect_options(self) -> dict[str, Any]:
        """Keyword arguments of `nats.aio.client.Client.connect`."""
        opts: dict[str, Any] = {}
        if self.user is not None:
            opts.update(user=self.user, password=self.password)
        if self.jwt_creds is not None:
            opts["user_credentials"] = self.jwt_creds
        if self.inbox_prefix:
            opts["inbox_prefix"] = self.inbox_prefix
        tls = self.ssl_context()
        if tls is not None:
            opts["tls"] = tls
        return opts


NO_CREDENTIALS = Credentials()


def load_credentials(path: str | Path) -> Credentials:
    """The credentials in `path` (an areal JSON credentials file or a NATS `.creds` file)."""
    p = Path(path).expanduser()
    try:
        text = p.read_text()
    except OSError as e:
        raise CredentialsError(
            f"config error: NATS credentials file {p} cannot be read ({e.strerror or e}): "
            "pass the file `areal run` wrote in <out>/keys/nats/ or `areal nats-config` made"
        ) from None
    if JWT_MARKER in text:
        return Credentials(jwt_creds=str(p), source=str(p))
    try:
        data = json.loads(text)
        user, password = data["user"], data["password"]
    except (ValueError, KeyError, TypeError):
        raise CredentialsError(
            f"config error: {p} is not a NATS credentials file (expected JSON with user and "
            "password, as `areal nats-config` writes, or a NATS .creds file)"
        ) from None
    return Credentials(
        user=str(user),
        password=str(password),
        inbox_prefix=data.get("inbox_prefix"),
        source=str(p),
    )


def credentials_for(nats: NatsSettings, role: str) -> Credentials:
    """The credentials a process of `role` connects with (see the module docstring)."""
    creds = NO_CREDENTIALS
    if nats.credentials_file:
        creds = load_credentials(nats.credentials_file)
    elif nats.credentials_dir:
        path = Path(nats.credentials_dir).expanduser() / f"{role}.json"
        if not path.is_file():
            raise CredentialsError(
                f"config error: nats.credentials_dir {nats.credentials_dir} has no {path.name} "
                f"for role {role!r}: generate it with `areal nats-config`, or set "
                "nats.credentials_file"
            )
        creds = load_credentials(path)
    return with_tls(creds, nats)


def with_tls(creds: Credentials, tls: Any) -> Credentials:
    """`creds` with the TLS files of `tls` (anything with `tls_ca_file`, `tls_cert_file` and
    `tls_key_file`: the run's `NatsSettings`, a monitor's settings)."""
    return replace(
        creds,
        tls_ca_file=tls.tls_ca_file,
        tls_cert_file=tls.tls_cert_file,
        tls_key_file=tls.tls_key_file,
    )


def same_subject(reported: str, subject: str) -> bool:
    """Whether a subject `Denials` reported (lower-cased) is `subject`."""
    return reported.lower() == subject.lower()


def permission_violation(err: BaseException | str) -> tuple[str, str] | None:
    """("publish" | "subscription", subject) of a server's permissions-violation error."""
    m = _VIOLATION.search(str(err))
    return (m.group(1).lower(), m.group(2)) if m else None


def is_authorization_violation(err: BaseException | None) -> bool:
    """Whether the server refused the credentials (`-ERR 'Authorization Violation'`)."""
    if err is None:
        return False
    text = f"{type(err).__name__}: {err}".lower()
    return "authorization violation" in text or "authorizationerror" in text


class Denials:
    """Permission violations the server reported on one connection, newest kept."""

    def __init__(self) -> None:
        self._subjects: collections.OrderedDict[str, str] = collections.OrderedDict()
        self._listeners: list[Callable[[str, str], None]] = []
        self.credentials = NO_CREDENTIALS  # whose connection (for error messages)

    def report(self, op: str, subject: str) -> None:
        subject = subject.lower()  # the client library lower-cases the server's error line
        self._subjects[subject] = op
        self._subjects.move_to_end(subject)
        while len(self._subjects) > _REMEMBERED:
            self._subjects.popitem(last=False)
        for listener in list(self._listeners):
            listener(op, subject)

    def listen(self, fn: Callable[[str, str], None]) -> None:
        """`fn(op, subject)` on every violation from now on (`subject` lower-cased, as the
        client library reports it: compare with `same_subject`)."""
        self._listeners.append(fn)

    def denied(self, subject: str) -> bool:
        return subject.lower() in self._subjects

    def any(self) -> bool:
        return bool(self._subjects)

    def last(self) -> str:
        """The subject refused most recently ("" when none was)."""
        return next(reversed(self._subjects), "")

    def error(self, subject: str, op: str = "publish") -> PermissionDenied:
        """The `PermissionDenied` of `subject`, naming the account and the fix."""
        what = "publishing to" if op == "publish" else "subscribing to"
        return PermissionDenied(
            f"the NATS server refused {self.credentials.describe()} {what} {subject!r}: this "
            "role's account may not (each role's permissions: `areal nats-config --show`); "
            "check that the worker runs with its own role's credentials"
        )

"""Errors the bus raises to its callers (no nats import: cheap to import anywhere)."""

from __future__ import annotations

import errno


class RunConflictError(RuntimeError):
    """A stream or consumer with this run's name exists on the server and belongs to something
    else (other subjects, another consumer layout). Nothing was modified."""


class StateDecodeError(ValueError):
    """A run-state KV value that does not validate as the model the caller asked for."""


class MessageTooLarge(ValueError):
    """A message over the server's `max_payload`."""


class BusUnavailable(RuntimeError):
    """The NATS server stayed unreachable past `nats.outage_tolerance_s`."""


class PermissionDenied(PermissionError):
    """The NATS server refused this client's account a publish or a subscription (its role may
    not do that: `areal nats-config` lists each role's permissions). Never retried."""


class AuthenticationFailed(ConnectionError):
    """The NATS server refused the client's credentials (`Authorization Violation`)."""


class WeightsRejected(ValueError):
    """An announcement or weights blob this worker does not trust (no valid signature, a file
    outside the weights dir, another size or digest than announced); nothing of it was loaded."""


class ServerStorageError(OSError):
    """The NATS server could not store a message: its JetStream storage is full (errno ENOSPC)
    or its disk failed (EIO). An `OSError` with that errno, so a writer's storage guard
    (`areal.services.storage`) pauses and retries on it as on a local disk's."""


# JetStream API errors that mean "no room": insufficient storage resources (the server's or the
# account's `max_file_store`), insufficient resources
STORAGE_FULL_CODES = frozenset({10047, 10023})
STORE_FAILED_CODE = 10051  # the store's own write error, its text as the description
FULL_TEXTS = ("no space left on device", "disk quota exceeded")


def server_storage_error(
    err_code: int | None, description: str | None, what: str
) -> ServerStorageError | None:
    """The `ServerStorageError` a JetStream API error (`err_code`, `description`) means for
    `what` (e.g. "storing weights v3 in bucket X"), or None when it is not about storage."""
    text = description or ""
    if err_code in STORAGE_FULL_CODES or (
        err_code == STORE_FAILED_CODE and any(t in text.lower() for t in FULL_TEXTS)
    ):
        code = errno.ENOSPC
    elif err_code == STORE_FAILED_CODE:
        code = errno.EIO
    else:
        return None
    return ServerStorageError(
        code, f"{what}: the NATS server could not store it (JetStream error {err_code}: {text})"
    )

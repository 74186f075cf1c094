"""Errors the bus raises to its callers (no nats import: cheap to import anywhere)."""

from __future__ import annotations


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

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

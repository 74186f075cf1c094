"""The only package that imports `nats`: connection, streams, codec, the `Bus` and observers.

Importing `areal.bus` itself is cheap (errors only); import `areal.bus.client` for the `Bus`.
"""

from areal.bus.errors import (
    AuthenticationFailed,
    BusUnavailable,
    MessageTooLarge,
    PermissionDenied,
    RunConflictError,
    StateDecodeError,
)

__all__ = [
    "AuthenticationFailed",
    "BusUnavailable",
    "MessageTooLarge",
    "PermissionDenied",
    "RunConflictError",
    "StateDecodeError",
]

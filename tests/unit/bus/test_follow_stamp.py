"""`parse_stamp`: the server's RFC 3339 timestamps (nanoseconds, Z) as epoch seconds."""

from __future__ import annotations

import pytest

from areal.bus.follow import parse_stamp


@pytest.mark.parametrize(
    ("text", "epoch"),
    [
        ("1970-01-01T00:00:00Z", 0.0),
        ("1970-01-01T00:00:01.5Z", 1.5),
        ("2026-12-06T19:51:28.255264779Z", 1796586688.255264779),
        ("2026-12-06T19:51:28Z", 1796586688.0),
    ],
)
def test_parse_stamp(text, epoch):
    assert parse_stamp(text) == pytest.approx(epoch, abs=1e-6)

"""A log on a full disk costs log lines, never the worker (issue 42): the writer under structlog
drops a line its file refuses and says how many were lost once a line gets through again."""

from __future__ import annotations

import errno
import io
import sys

from areal.logging import _CurrentStderr


class FullThenFree(io.StringIO):
    full = True

    def write(self, text: str) -> int:
        if self.full:
            raise OSError(errno.ENOSPC, "No space left on device")
        return super().write(text)

    def flush(self) -> None:
        if self.full:
            raise OSError(errno.ENOSPC, "No space left on device")


def test_lines_the_full_log_refuses_are_dropped_and_counted(monkeypatch):
    log = FullThenFree()
    monkeypatch.setattr(sys, "stderr", log)
    out = _CurrentStderr()
    assert out.write("one\n") == 0 and out.write("two\n") == 0  # no exception into the caller
    out.flush()
    log.full = False
    out.write("three\n")
    assert log.getvalue() == "(2 log lines lost: the log could not be written)\nthree\n"

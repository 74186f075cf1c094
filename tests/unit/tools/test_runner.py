"""ToolRunner: every outcome of a call becomes a record (never an exception), off the event loop,
within a time limit and an output cap; simulated latency is a seeded asyncio.sleep.

No test decides anything by wall-clock speed: waits use events and barriers with generous hang
guards, and latencies are checked as lower bounds (a sleep never ends early)."""

from __future__ import annotations

import asyncio
import statistics
import threading

import pytest
from pydantic import ValidationError

from areal.tools import (
    SimulatedLatency,
    Tool,
    ToolArgumentError,
    ToolCall,
    ToolError,
    ToolRunner,
    tool,
)
from areal.tools.runner import as_text, cap_bytes

HANG_GUARD_S = 30.0


def upper(text: str) -> str:
    """Upper-case the text."""
    return text.upper()


async def aupper(text: str) -> str:
    await asyncio.sleep(0)
    return text.upper()


def runner(*fns, **kw) -> ToolRunner:
    tools = {t.name: t for t in (f if isinstance(f, Tool) else tool(f) for f in fns)}
    return ToolRunner(tools, **kw)


@pytest.mark.parametrize("fn", [upper, aupper])
async def test_a_sync_or_async_tool_answers(fn):
    rec = await runner(fn).run(ToolCall(fn.__name__, "abc"), turn=3)
    assert (rec.name, rec.arguments, rec.output, rec.error, rec.turn) == (
        fn.__name__,
        "abc",
        "ABC",
        None,
        3,
    )
    assert rec.latency_s >= 0.0


async def test_a_tool_that_raises():
    def boom(text: str) -> str:
        raise KeyError("no such key")

    async def aboom(text: str) -> str:
        raise RuntimeError("remote\nservice down")

    def leaves(text: str) -> str:
        raise SystemExit(3)

    r = runner(boom, aboom, leaves)
    rec = await r.run(ToolCall("boom", "x"))
    assert rec.error == "raised: KeyError: 'no such key'"
    assert rec.output == "error: KeyError: 'no such key'"
    rec = await r.run(ToolCall("aboom", "x"))
    assert rec.error == "raised: RuntimeError: remote service down"  # one line
    rec = await r.run(ToolCall("leaves", "x"))
    assert rec.error == "raised: SystemExit: 3"


async def test_a_tool_error_keeps_what_was_written_before_it():
    def partial(text: str) -> str:
        raise ToolError("ValueError: bad (line 2)", output=b"step 1\n")

    rec = await runner(partial).run(ToolCall("partial", "x"))
    assert rec.error == "raised: ValueError: bad (line 2)"
    assert rec.output == "step 1\nerror: ValueError: bad (line 2)"


async def test_unknown_tool_and_bad_arguments():
    def picky(text: str) -> str:
        raise ToolArgumentError("picky: wants digits")

    r = runner(upper, picky)
    rec = await r.run(ToolCall("search", "x"))
    assert rec.error == "unknown_tool"
    assert rec.output == "error: unknown tool 'search' (tools: picky, upper)"
    rec = await r.run(ToolCall("upper", "{}", bad_arguments='upper takes {"text": "<text>"}'))
    assert rec.error == "bad_arguments" and "upper takes" in rec.output
    rec = await r.run(ToolCall("picky", "abc"))
    assert rec.error == "bad_arguments"
    assert rec.output == "error: bad arguments: picky: wants digits"


async def test_a_sync_tool_that_hangs_is_abandoned_at_its_timeout():
    release = threading.Event()

    def hang(text: str) -> str:
        release.wait(HANG_GUARD_S)  # stands for a call that never returns
        return "late"

    try:
        rec = await runner(hang, timeout_s=0.2).run(ToolCall("hang", "x"))
    finally:
        release.set()
    assert rec.error == "timeout"
    assert rec.output == "error: timed out after 0.2s"
    assert rec.latency_s >= 0.2


async def test_an_async_tool_that_hangs_times_out_and_is_cancelled():
    cancelled = asyncio.Event()

    async def ahang(text: str) -> str:
        try:
            await asyncio.sleep(HANG_GUARD_S)
        except asyncio.CancelledError:
            cancelled.set()
            raise
        return "late"

    rec = await runner(ahang, timeout_s=0.1).run(ToolCall("ahang", "x"))
    assert rec.error == "timeout"
    await asyncio.wait_for(cancelled.wait(), HANG_GUARD_S)


async def test_a_tools_own_timeout_wins_over_the_runners():
    release = threading.Event()

    def hang(text: str) -> str:
        release.wait(HANG_GUARD_S)
        return "late"

    t = Tool(name="hang", description="", fn=hang, timeout_s=0.1)
    try:
        rec = await ToolRunner({"hang": t}, timeout_s=HANG_GUARD_S).run(ToolCall("hang", "x"))
    finally:
        release.set()
    assert rec.error == "timeout" and rec.output == "error: timed out after 0.1s"


async def test_huge_output_is_cut_with_a_marker():
    def huge(text: str) -> str:
        return "é" * 100_000  # 200,000 bytes

    rec = await runner(huge, max_output_bytes=1001).run(ToolCall("huge", ""))
    assert rec.error is None
    head, marker = rec.output.split("\n")
    assert head == "é" * 500  # 1000 bytes: the 1001st byte would split a character
    assert marker == "[... 199000 more bytes cut]"


async def test_binary_output_is_replaced():
    def blob(text: str) -> bytes:
        return bytes(range(256)) * 4

    def latin1(text: str) -> bytes:
        return "the café is open\n".encode("latin-1")  # one undecodable byte

    def bell(text: str) -> str:
        return "ding\x07 dong\x1b[0m, done\tok\r\n"

    r = runner(blob, latin1, bell)
    assert (await r.run(ToolCall("blob", ""))).output == "[binary output: 1024 bytes]"
    assert (await r.run(ToolCall("latin1", ""))).output == "the caf\ufffd is open\n"
    assert (await r.run(ToolCall("bell", ""))).output == "ding\ufffd dong\ufffd[0m, done\tok\r\n"


def test_text_helpers():
    assert as_text(None) == "" and as_text(42) == "42"
    assert as_text(b"\x00abc") == "[binary output: 4 bytes]"  # a NUL is binary
    assert cap_bytes("abc", 3) == "abc"
    assert cap_bytes("abcd", 3) == "abc\n[... 1 more bytes cut]"


async def test_n_slow_sync_calls_run_concurrently():
    # Each call waits at a barrier for all the others: only calls that run at the same time
    # get through it (a runner that ran them one by one would break the barrier: timeout).
    n = 8
    barrier = threading.Barrier(n, timeout=HANG_GUARD_S)
    inside, most = 0, 0
    lock = threading.Lock()

    def slow(text: str) -> str:
        nonlocal inside, most
        with lock:
            inside += 1
            most = max(most, inside)
        barrier.wait()
        with lock:
            inside -= 1
        return text

    r = runner(slow, timeout_s=HANG_GUARD_S * 2)
    recs = await asyncio.gather(*(r.run(ToolCall("slow", str(i))) for i in range(n)))
    assert [rec.output for rec in recs] == [str(i) for i in range(n)]
    assert all(rec.error is None for rec in recs)
    assert most == n


async def test_a_sync_call_does_not_block_the_event_loop():
    started, release = threading.Event(), threading.Event()

    def blocking(text: str) -> str:
        started.set()
        release.wait(HANG_GUARD_S)
        return "done"

    task = asyncio.create_task(runner(blocking).run(ToolCall("blocking", "")))
    while not started.is_set():  # the loop keeps turning while the tool blocks its thread
        await asyncio.sleep(0.01)
    assert not task.done()
    release.set()
    assert (await asyncio.wait_for(task, HANG_GUARD_S)).output == "done"


# --- simulated latency -------------------------------------------------------------------------


class SleepSpy:
    """asyncio.sleep itself, counting the waits that overlap."""

    def __init__(self) -> None:
        self.waits: list[float] = []
        self.inside = self.most = 0

    async def __call__(self, seconds: float) -> None:
        self.waits.append(seconds)
        self.inside += 1
        self.most = max(self.most, self.inside)
        try:
            await asyncio.sleep(seconds)
        finally:
            self.inside -= 1


async def test_fixed_latency_is_an_asyncio_sleep_added_to_the_latency():
    spy = SleepSpy()
    n = 6
    r = runner(aupper, latency=SimulatedLatency(kind="fixed", seconds=0.2), sleep=spy)
    recs = await asyncio.gather(*(r.run(ToolCall("aupper", "a")) for _ in range(n)))
    assert spy.waits == [0.2] * n
    assert spy.most == n  # all n waits were in flight at once: none held the loop
    assert all(rec.output == "A" and rec.latency_s >= 0.2 * 0.99 for rec in recs)


async def test_no_latency_sleeps_never():
    spy = SleepSpy()
    await runner(aupper, sleep=spy).run(ToolCall("aupper", "a"))
    assert spy.waits == []


async def test_a_latency_past_the_limit_is_a_timeout():
    r = runner(aupper, timeout_s=0.05, latency=SimulatedLatency(kind="fixed", seconds=5.0))
    assert (await r.run(ToolCall("aupper", "a"))).error == "timeout"


@pytest.mark.parametrize(
    "latency",
    [
        SimulatedLatency(kind="lognormal", seconds=2.0, sigma=1.0, seed=7),
        SimulatedLatency(kind="pareto", seconds=1.0, alpha=1.5, seed=7),
    ],
)
def test_heavy_tailed_latency_is_seeded_and_has_its_median(latency):
    a, b = latency.sampler(), latency.sampler()
    first = [a() for _ in range(4001)]
    assert first == [b() for _ in range(4001)]  # the same seed, the same waits
    other = latency.model_copy(update={"seed": 8}).sampler()
    assert [other() for _ in range(10)] != first[:10]
    # lognormal: median = seconds = 2.0; pareto: median = seconds * 2**(1/alpha) = 1.587
    med = statistics.median(first)
    assert 0.9 * latency.median_s() < med < 1.1 * latency.median_s()
    assert max(first) > 5 * latency.median_s()  # a heavy tail
    assert min(first) > 0


def test_latency_cap_and_validation():
    capped = SimulatedLatency(kind="pareto", seconds=1.0, alpha=1.1, max_s=3.0).sampler()
    assert max(capped() for _ in range(1000)) == 3.0
    assert SimulatedLatency().sampler()() == 0.0
    with pytest.raises(ValidationError, match="needs seconds > 0"):
        SimulatedLatency(kind="fixed")
    with pytest.raises(ValidationError):
        SimulatedLatency(kind="gamma", seconds=1.0)


async def test_a_tool_that_enforces_its_limit_gets_what_the_latency_left():
    def report(text: str, *, timeout_s: float) -> str:
        return f"{timeout_s:g}"

    t = Tool(name="report", description="", fn=report, enforces_timeout=True)
    r = ToolRunner(
        {"report": t}, timeout_s=10.0, latency=SimulatedLatency(kind="fixed", seconds=0.25)
    )
    assert (await r.run(ToolCall("report", ""))).output == "9.75"

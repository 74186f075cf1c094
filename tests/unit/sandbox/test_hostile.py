"""Hostile programs in the code sandbox: each scores 0 with a reason, leaves nothing running,
writes nothing outside its directory, reaches no socket and no secret; the worker lives on.

Every program runs under each isolation this machine offers (`namespaces` where unshare is
allowed, always the `hooks` fallback). A program first writes its work dir to stderr
(`CWD=...`): that path is its HOME, so a process left behind is found by its environment.
Timeouts here are the sandbox's own limits for the hanging programs, not speed assertions.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
import uuid
from pathlib import Path

import pytest

from areal.rewards.code import SandboxViolation, code_reward, code_reward_detail
from areal.rewards.scoring import score_items
from areal.sandbox import SandboxResult, own_uid_per_run, resolve_isolation, run_sandboxed

MODES = sorted({resolve_isolation("auto"), "hooks"})
# RLIMIT_NPROC binds a run's own uid, or a non-root worker's; root ignores it (`hooks` as root
# with a Python under /root keeps root's uid): no fork bomb there.
NPROC_HOLDS = {m: own_uid_per_run(m) or os.geteuid() != 0 for m in MODES}

ADD = "def add(a, b):\n    return a + b\n"
TESTS = "assert add(2, 3) == 5\nassert add(-1, 1) == 0\n"
MARK = "import os\nos.write(2, ('CWD=' + os.getcwd() + '\\n').encode())\n"


def run(mode: str, solution: str, tests: str = TESTS, marked: bool = True, **kw) -> SandboxResult:
    """`solution` after MARK; `marked=False` for a program whose mark never shows (it does not
    compile, or its output scrolls the mark out of the stderr tail)."""
    result = run_sandboxed(MARK + textwrap.dedent(solution), tests, isolation=mode, **kw)
    assert_nothing_left(result, marked)
    return result


def assert_nothing_left(result: SandboxResult, marked: bool = True) -> None:
    """No process anywhere still has the run's work dir as its HOME, and the dir is gone."""
    marks = [line for line in result.stderr_tail.splitlines() if line.startswith("CWD=")]
    if not marked:
        return
    assert marks, result
    cwd = marks[0][4:]
    assert "areal-code-" in cwd and not os.path.exists(cwd)
    token = f"HOME={cwd}".encode()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes()
        except OSError:
            continue
        assert token not in env.split(b"\0"), f"process {pid} of the run survived"


def assert_zero(result: SandboxResult, *verdicts: str, reason: str = "") -> None:
    assert not result.passed, result
    assert result.verdict in verdicts, result
    assert result.reason and reason.lower() in result.reason.lower(), result


@pytest.fixture(params=MODES)
def mode(request) -> str:
    return request.param


# --- exiting early, faking the verdict ---------------------------------------------------------


def test_os_exit_0_before_the_tests(mode):
    r = run(mode, "import os\nos._exit(0)\n", "assert False\n")
    assert_zero(r, "violation", reason="exited with status 0 before the tests reported")


def test_sys_exit_0_and_systemexit_from_the_function_the_tests_call(mode):
    assert_zero(run(mode, "import sys\nsys.exit(0)\n"), "violation", reason="SystemExit(0)")
    r = run(mode, "def add(a, b):\n    raise SystemExit(0)\n")
    assert_zero(r, "violation", reason="SystemExit(0)")


def test_atexit_handlers_never_run(mode):
    program = """
        import atexit, os
        atexit.register(os._exit, 0)
        atexit.register(lambda: (_ for _ in ()).throw(SystemExit(0)))
        def add(a, b):
            return a - b
    """
    assert_zero(run(mode, program), "failed", reason="a test failed: AssertionError")


def test_fake_success_output_and_forged_records_on_every_fd(mode):
    program = """
        import os, sys
        print("all tests passed"); sys.stderr.write("OK passed\\n")
        for fd in range(3, 64):
            for guess in (b"passed\\n", b"0" * 32 + b" passed all\\n", b"\\n passed ok\\n"):
                try:
                    os.write(fd, guess)
                except OSError:
                    pass
        def add(a, b):
            return None
    """
    assert_zero(run(mode, program), "failed", reason="a test failed")


def test_closing_or_replacing_the_verdict_fd(mode):
    closed = "import os\nos.closerange(3, 1024)\n" + ADD
    assert_zero(run(mode, closed), "violation", reason="before the tests reported")
    program = """
        import os
        r, w = os.pipe()
        for fd in range(3, 64):
            if fd not in (r, w):
                try:
                    os.dup2(w, fd)
                except OSError:
                    pass
    """
    assert_zero(
        run(mode, textwrap.dedent(program) + ADD), "violation", reason="before the tests reported"
    )


def test_killing_the_harness_itself(mode):
    program = "import signal\nsignal.raise_signal(signal.SIGKILL)\ndef add(a, b):\n    return 0\n"
    r = run(mode, program)
    if mode == "hooks":
        assert_zero(r, "violation", reason="died of SIGKILL")
    else:  # the harness is PID 1 of its namespace: its own SIGKILL does not reach it
        assert_zero(r, "failed", reason="a test failed")


def test_a_forked_copy_that_passes_does_not_report(mode):
    # each branch answers differently: the child's copy of the tests passes, the parent's fails
    program = """
        import os, time
        def add(a, b):
            if os.fork() == 0:
                return a + b
            time.sleep(0.2)
            return 0
    """
    assert_zero(run(mode, program), "failed", reason="a test failed")


# --- overriding the test harness ---------------------------------------------------------------


def test_patching_builtins_and_the_modules_the_tests_use(mode):
    tests = "import math\nassert math.isclose(add(2, 3), 5)\nassert abs(add(1, 1) - 2) < 1e-9\n"
    program = """
        import builtins, math, sys, threading
        builtins.abs = lambda x: 0
        builtins.AssertionError = type("Never", (Exception,), {})
        math.isclose = lambda *a, **k: True
        class Fake:
            def find_spec(self, name, path=None, target=None):
                return None
        sys.meta_path.insert(0, Fake())
        def repatch():
            while True:
                math.isclose = lambda *a, **k: True
        threading.Thread(target=repatch, daemon=True).start()
        def abs(x):
            return 0
        def add(a, b):
            math.isclose = lambda *a, **k: True  # patched again while the tests run
            return 42
    """
    assert_zero(run(mode, program, tests), "failed", reason="a test failed")


def test_patching_the_import_machinery(mode):
    tests = "import math\nfrom collections import Counter\n"
    tests += "assert math.isclose(add(2, 3), 5)\nassert Counter('aa')['a'] == add(1, 1)\n"
    program = """
        import sys, types
        fake_math = types.ModuleType("math")
        fake_math.isclose = lambda *a, **k: True
        fake_collections = types.ModuleType("collections")
        fake_collections.Counter = lambda s: {"a": 42}
        sys.modules["math"] = fake_math
        bootstrap = sys.modules["_frozen_importlib"]
        bootstrap._handle_fromlist = lambda module, fromlist, *a, **k: fake_collections
        def add(a, b):
            return 42
    """
    assert_zero(run(mode, program, tests), "failed", reason="a test failed")


def test_patching_unittest_and_redefining_the_tests_helpers(mode):
    tests = """
import unittest
class T(unittest.TestCase):
    def test_add(self):
        self.assertEqual(add(2, 3), 5)
result = unittest.TextTestRunner(stream=open("/dev/null", "w")).run(
    unittest.defaultTestLoader.loadTestsFromTestCase(T))
assert result.wasSuccessful()
def check(candidate):
    assert candidate(1, 1) == 2
check(add)
"""
    program = """
        import unittest
        unittest.TestCase.assertEqual = lambda *a, **k: None
        unittest.TestResult.wasSuccessful = lambda self: True
        def check(candidate):
            pass
        def add(a, b):
            return 0
    """
    assert_zero(run(mode, program, tests), "failed")


def test_an_unclosed_string_cannot_swallow_the_tests(mode):
    r = run(mode, 'def add(a, b):\n    return a + b\nx = """\n', TESTS + '"""\n', marked=False)
    assert_zero(r, "failed", reason="SyntaxError")


def test_looking_for_the_nonce_in_frames_gc_and_memory(mode):
    program = """
        import sys
        seen = []
        def attempt(f):
            try:
                seen.append(f())
            except Exception as e:
                seen.append(type(e).__name__)
        attempt(lambda: sys._getframe(1).f_locals)
        def tb():
            try:
                raise ValueError
            except ValueError as e:
                return e.__traceback__.tb_frame.f_back.f_locals
        attempt(tb)
        attempt(lambda: __import__("gc").get_objects())
        attempt(lambda: __import__("gc").set_debug(32))
        attempt(lambda: __import__("signal").signal(14, lambda s, f: seen.append(f)))
        attempt(lambda: sys.settrace(lambda *a: None))
        attempt(lambda: __import__("ctypes"))
        attempt(lambda: open("/proc/self/mem", "rb"))
        attempt(lambda: (lambda: 0).__code__.replace(co_code=b""))
        attempt(lambda: __import__("marshal").loads(b"\\xe3"))
        def add(a, b):
            return a + b
    """
    r = run(mode, program)
    assert_zero(r, "violation", reason="refused")  # the tests pass: refused acts still cost it


# --- escaping the directory, the environment, the network, the parent --------------------------


def test_reading_etc_passwd_to_pass(mode):
    program = """
        def add(a, b):
            try:
                open("/etc/passwd").read()
            except OSError:
                return None
            return a + b
    """
    assert_zero(run(mode, program), "violation", reason="/etc/passwd")


def test_writing_outside_its_directory(mode, tmp_path):
    targets = [tmp_path / "escape.txt", Path.home() / f"areal-escape-{uuid.uuid4().hex}.txt"]
    targets.append(Path("/tmp") / f"areal-escape-{uuid.uuid4().hex}")
    program = f"""
        import os
        for path in {[str(t) for t in targets]!r}:
            for attempt in (lambda: open(path, "w").write("x"), lambda: os.mkdir(path),
                            lambda: os.symlink("/etc/passwd", "link"), lambda: os.mkfifo(path)):
                try:
                    attempt()
                except Exception:
                    pass
        open("inside.txt", "w").write("fine")  # its own directory is writable
    """
    r = run(mode, textwrap.dedent(program) + ADD)
    assert_zero(r, "violation", reason="outside the sandbox")
    for target in targets:
        assert not target.exists(), target


def test_the_environment_holds_no_secret(mode, monkeypatch):
    monkeypatch.setenv("AREAL_TEST_SECRET", "hunter2-env")
    program = """
        import os, sys
        sys.stderr.write(repr(dict(os.environ)) + "\\n")
        def add(a, b):
            return a + b if "AREAL_TEST_SECRET" in os.environ else None
    """
    r = run(mode, program)
    assert_zero(r, "failed", reason="a test failed")
    assert "hunter2" not in r.stderr_tail and "AREAL_TEST_SECRET" not in r.stderr_tail


_ENVIRON_PROBE = """
import os
found = []
for path in [f"/proc/{os.getppid()}/environ", "/proc/1/environ", "/proc/self/environ"]:
    try:
        if b"AREAL_TEST_SECRET" in open(path, "rb").read():
            found.append(path)
    except Exception:
        pass
try:
    for pid in os.listdir("/proc"):
        try:
            if b"hunter2" in open(f"/proc/{pid}/environ", "rb").read():
                found.append(pid)
        except Exception:
            pass
except Exception:
    pass
os.write(2, repr(found).encode() + b"\\n")
def add(a, b):
    return a + b if found else None
"""


def test_proc_environ_of_the_worker_is_out_of_reach(tmp_path):
    # The worker is a separate process started with the secret in its environment, so the
    # secret really is in /proc/<worker>/environ; the program looks there and everywhere else.
    script = textwrap.dedent(f"""
        import json, sys
        from areal.sandbox import run_sandboxed
        out = []
        for mode in {MODES!r}:
            r = run_sandboxed(sys.argv[1], "assert add(2, 3) == 5", isolation=mode)
            out.append([mode, r.verdict, r.reason, r.stderr_tail])
        print(json.dumps(out))
    """)
    env = {**os.environ, "AREAL_TEST_SECRET": "hunter2-proc"}
    worker = subprocess.run(
        [sys.executable, "-c", script, _ENVIRON_PROBE],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,  # hang guard
        cwd=Path(__file__).parents[3],
    )
    assert worker.returncode == 0, worker.stderr  # the worker lived through it
    results = json.loads(worker.stdout.strip().splitlines()[-1])
    assert [m for m, *_ in results] == MODES
    for _, verdict, reason, stderr in results:
        assert verdict in ("failed", "violation") and reason
        assert "hunter2" not in stderr and "hunter2" not in reason
        assert "[]" in stderr  # found nothing


def test_signalling_its_parent(mode):
    program = """
        import os, signal
        for sig in (signal.SIGTERM, signal.SIGKILL):
            for pid in (os.getppid(), 0):
                try:
                    os.kill(pid, sig)
                except Exception:
                    pass
    """
    assert_zero(run(mode, textwrap.dedent(program) + ADD), "violation", reason="os.kill")
    assert os.getppid() > 1  # this worker still stands


def test_raw_sockets_to_a_local_server(mode):
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]
        program = f"""
            import socket
            for family, addr in ((socket.AF_INET, ("127.0.0.1", {port})),
                                 (socket.AF_INET, ("127.0.0.1", 4222))):
                try:
                    s = socket.socket(family, socket.SOCK_STREAM)
                    s.settimeout(1)
                    s.connect(addr)
                    s.sendall(b"PUB x 1\\r\\nx\\r\\n")
                except Exception:
                    pass
            try:
                import _socket
                _socket.socket().connect(("127.0.0.1", {port}))
            except Exception:
                pass
        """
        r = run(mode, textwrap.dedent(program) + ADD)
        assert_zero(r, "violation", reason="socket")
        server.setblocking(False)
        with pytest.raises(BlockingIOError):
            server.accept()  # no connection ever reached the server


# --- resource bombs and stragglers ---------------------------------------------------------------


def test_fork_bomb_is_bounded_and_dies(mode):
    if not NPROC_HOLDS[mode]:
        pytest.skip("hooks as root without a uid of its own: RLIMIT_NPROC does not bind root")
    program = """
        import os
        while True:
            try:
                os.fork()
            except OSError:
                pass
    """
    r = run(mode, program, timeout_s=2.0)
    assert_zero(r, "timeout", "failed", "violation")


def test_memory_bomb(mode):
    program = """
        hoard = []
        while True:
            hoard.append(bytearray(1 << 24))
    """
    r = run(mode, program, memory_bytes=512 << 20)
    assert_zero(r, "failed", reason="MemoryError")


def test_infinite_loop_hits_the_time_limit(mode):
    r = run(mode, "while True:\n    pass\n", timeout_s=1.0)
    assert_zero(r, "timeout", "failed", reason="time")


def test_huge_output(mode):
    program = """
        import os, sys
        chunk = "x" * (1 << 20)
        for _ in range(256):
            sys.stdout.write(chunk)
        for _ in range(32):
            sys.stderr.write(chunk)
    """
    r = run(mode, textwrap.dedent(program) + ADD, marked=False)  # the tail is all x
    assert_zero(r, "failed", reason="File too large")
    assert len(r.stderr_tail) <= 4096


def test_huge_files(mode):
    one = "with open('big', 'wb') as f:\n    for _ in range(1024):\n"
    one += "        f.write(b'x' * (1 << 20))\n"  # 1 GiB, 1 MiB at a time
    assert_zero(run(mode, one + ADD), "failed", reason="File too large")
    many = "for i in range(6):\n    open(f'f{i}', 'wb').write(b'x' * (15 << 20))\n"
    r = run(mode, many + ADD)
    if mode == "hooks":  # on the worker's disk: 90 MB written, removed with the dir
        assert r.passed
    else:  # a 64 MiB tmpfs
        assert_zero(r, "failed", reason="No space left")


def test_fifty_setsid_children_all_die(mode):
    program = """
        import os, time
        for i in range(50):
            if os.fork() == 0:
                os.setsid()
                if i % 5 == 0 and os.fork() != 0:
                    os._exit(0)  # its child, setsid too, is orphaned at once
                time.sleep(600)
        time.sleep(600)
    """
    r = run(mode, program, timeout_s=1.5)
    assert_zero(r, "timeout", reason="timed out")


def test_a_killed_worker_leaves_nothing_running(mode):
    # The worker runs the sandbox with its temporary dirs under a parent of our own, so the
    # run's HOME names that parent; SIGKILL the worker while six setsid sleepers run.
    parent = tempfile.mkdtemp(prefix="areal-hostile-", dir="/tmp")
    os.chmod(parent, 0o755)  # a run's own uid must reach its work dir
    script = textwrap.dedent(f"""
        import sys, tempfile
        from areal.sandbox import run_sandboxed
        tempfile.tempdir = {parent!r}
        program = (
            "import os, time\\nfor _ in range(5):\\n    if os.fork() == 0:\\n"
            "        os.setsid()\\n        time.sleep(600)\\ntime.sleep(600)\\n"
        )
        run_sandboxed(program, "", isolation={mode!r}, timeout_s=600)
    """)
    token = f"HOME={parent}/areal-code-".encode()

    def running() -> int:
        n = 0
        for pid in filter(str.isdigit, os.listdir("/proc")):
            with contextlib.suppress(OSError):
                env = Path(f"/proc/{pid}/environ").read_bytes()
                n += any(e.startswith(token) for e in env.split(b"\0"))
        return n

    worker = subprocess.Popen([sys.executable, "-c", script], cwd=Path(__file__).parents[3])
    try:
        deadline = time.monotonic() + 60  # hang guard: the sleepers start in well under a second
        while running() < 6 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert running() == 6  # the harness and its five sleepers
    finally:
        worker.kill()
        worker.wait()
    deadline = time.monotonic() + 30  # hang guard: C reacts to its PDEATHSIG at once
    while running() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert running() == 0
    shutil.rmtree(parent, ignore_errors=True)


# --- through the reward API --------------------------------------------------------------------


def test_the_reason_reaches_the_scoring_error():
    hostile = [
        ("```python\nimport os\nos._exit(0)\n```", "assert False"),
        ("import sys\nsys.exit(0)", TESTS),
        ("def add(a, b):\n    open('/etc/passwd')\n    return a + b", TESTS),
    ]
    scored = score_items("code", [*hostile, (ADD, TESTS)], timeout_s=30.0)
    for reward, error, _ in scored[:3]:
        assert reward == 0.0 and error.startswith("SandboxViolation: "), error
    assert scored[3][:2] == (1.0, None)
    with pytest.raises(SandboxViolation, match="before the tests"):
        code_reward(*hostile[0])
    reward, detail = code_reward_detail(*hostile[0])
    assert reward == 0.0 and detail["verdict"] == "violation" and detail["reason"]


def test_legit_solutions_still_score_1(mode):
    program = """
        import collections, functools, heapq, itertools, math, re, string
        from dataclasses import dataclass
        from typing import List, NamedTuple
        class P(NamedTuple):
            x: int
        @dataclass
        class Q:
            y: int
        def add(a: int, b: int) -> int:
            assert P(1).x == 1 and Q(2).y == 2
            open("scratch.txt", "w").write(str(a))
            return int(open("scratch.txt").read()) + b
    """
    assert run(mode, program).passed

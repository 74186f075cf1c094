"""The code sandbox: run an untrusted solution, then its tests; only the harness can pass it.

Three processes per run. The supervisor is the caller (a reward worker). Its `Popen` child C is a
forked copy of it that never execs: C enters the namespaces (or becomes a child subreaper),
forks G and watches it. G execs `python -I -S -B` (no site, no user paths, an environment of
PATH, LANG, HOME and TMPDIR only) and runs the trusted harness: the task's preamble, then the
solution, then the tests, in one interpreter, then the verdict. This module is the supervisor
and C; the harness, the code that runs inside G, is `areal/sandbox/harness.py`, which
states the invariants it keeps (the verdict record, the nonce's secrecy, the audit hook, what
the tests see, what the containment costs honest code).

Invariants:
- The verdict comes from the harness's own channel. The supervisor sends a fresh random nonce
  on G's stdin (a file read, then replaced by /dev/null, before any untrusted code) and passes
  an inherited pipe fd, where the harness writes `<nonce> <passed|failed|violation> <reason>`
  once (when and how: `harness`). Exactly one record must carry the nonce: an exit, a
  signal or a killed harness leave none, printed success lines and bytes written to any fd lack
  the nonce, and a second record fails the run. The exit status decides nothing.
- Limits, set by the harness before the preamble from the values this module sends: CPU seconds
  (`timeout_s` + 1, SIGXCPU, then SIGKILL a second later), address space, file size, open
  files, processes (RLIMIT_NPROC counts a uid, so as root every run gets its own unprivileged
  uid from a high range: runs never share that budget and cannot signal each other), no core
  dumps. The wall-clock `timeout_s` is the supervisor's; C enforces its own deadline a second
  later in case the supervisor is gone.
- Nothing outlives the run. With namespaces G is PID 1 of a PID namespace (its death kills
  every process in it, setsid or not) and dies with C (PR_SET_PDEATHSIG), C with the
  supervisor (it gets SIGTERM, kills G, reports, exits). Without them C is a child subreaper
  that kills the tree it inherits, round after round, until /proc shows none left.
- `namespaces` (root with CAP_SYS_ADMIN) or `userns` (an unprivileged user namespace, the uid
  mapped to 65534): mount, network, PID, IPC and UTS namespaces; the root is a read-only tmpfs
  with read-only binds of /usr (and /bin, /lib* when they are real directories), the Python
  prefix, /etc/ld.so.cache and /dev/{null,zero,random,urandom}; the work dir is a fresh 64 MiB
  noexec tmpfs at the path of the supervisor's temporary directory (removed afterwards). No
  /proc, no /etc, no home, no other process, no network (a loopback that is down).
- `hooks` (no namespaces allowed; warned once) keeps the same audit hook, limits, uid and
  subreaper, and the hook is then all the filesystem and network containment there is (what it
  allows: `harness`). As root with a Python other users cannot reach (under /root), the
  run keeps root's uid there (warned once), and root ignores RLIMIT_NPROC.
- Output: the program's stdout goes to /dev/null, or (`stdout_bytes` > 0: the python tool) to a
  temporary file of the supervisor's, with `python -u` so that nothing printed waits in a buffer
  when the harness leaves by `os._exit`; it is output only, never part of the verdict.
- Verdicts: `passed`; `failed` (an exception in the solution or the tests, the CPU or memory
  limit, a value compared or returned to the tests that is not plain data); `timeout`;
  `violation` (something was refused, SystemExit or another BaseException escaped, or the
  program ended or died before the harness reported).
- Not contained (the whole list, for this module and `harness`; a Python-level filter is no
  security boundary): a memory-safety bug of CPython reachable from pure Python lets a solution read
  the nonce and forge a pass, and in `hooks` mode get past every filter; so would a C extension that
  opens files itself (refused: `_posixshmem`, `_multiprocessing`, `_ssl`, `_dbm`, `_gdbm`, sqlite
  extensions). Tests that hand their own functions to the solution expose their globals to it, and
  with them the plain-data guard; a function the tests call can still patch a class or a module's
  internals while the tests run; comparisons made inside library code (unittest's `assertEqual`,
  `sorted`, `max`) are guarded only for values the solution's functions return, not for objects
  of a class the solution defines; and raising `unittest.SkipTest` passes `result.wasSuccessful()`
  (check `result.skipped` too). In
  `hooks` mode the work dir is on the supervisor's disk (capped per file only) and a C that is
  SIGKILLed before its cleanup leaves G's orphans to init.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
import secrets
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from typing import Literal

import structlog

from areal.proc import die_with_parent
from areal.sandbox.harness import BOOT, harness_code

log = structlog.get_logger()

DEFAULT_TIMEOUT_S = 5.0
DEFAULT_MEMORY_BYTES = 1 << 30
MAX_FILE_BYTES = 16 << 20
MAX_OPEN_FILES = 256
MAX_PROCESSES = 64  # RLIMIT_NPROC of a run's own uid: a fork bomb stops here
WORKDIR_BYTES = 64 << 20  # the work dir's tmpfs (namespaces)
KILL_GRACE_S = 5.0  # hang guard: how long C may take to clean up after the supervisor's SIGTERM
STDERR_TAIL_BYTES = 2048
_UID_BASE, _UID_SPAN = 1_500_000_000, 1 << 24  # per-run uids, far above any real account

Verdict = Literal["passed", "failed", "violation", "timeout"]
Isolation = Literal["namespaces", "userns", "hooks"]


@dataclass(frozen=True)
class SandboxResult:
    verdict: Verdict
    reason: str  # one line: why it passed or not
    returncode: int | None  # the harness's exit status (negative: its signal); None on timeout
    stderr_tail: str  # last ~2 KB of the program's stderr (the harness prints tracebacks there)
    isolation: Isolation
    stdout: bytes = b""  # the first `stdout_bytes` bytes the program wrote to fd 1 (0: none kept)

    @property
    def passed(self) -> bool:
        return self.verdict == "passed"


def run_sandboxed(
    solution: str,
    tests: str = "",
    preamble: str = "",
    *,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    memory_bytes: int = DEFAULT_MEMORY_BYTES,
    isolation: Literal["auto"] | Isolation = "auto",
    stdout_bytes: int = 0,
) -> SandboxResult:
    """Run `preamble`, then `solution`, then `tests` in one sandboxed interpreter (see module).
    `stdout_bytes` > 0 keeps the head of the program's stdout (unbuffered, `python -u`, so what
    was printed before a kill is there); 0 sends it to /dev/null. Raises only when the sandbox
    itself cannot be set up (e.g. out of file descriptors)."""
    mode = resolve_isolation(isolation)
    nonce = secrets.token_hex(16)
    uid = _run_uid(mode)
    work = tempfile.mkdtemp(prefix="areal-code-")
    fds: list[int] = []
    try:
        if mode == "hooks" and uid >= 0:
            os.chown(work, uid, uid)
        verdict_r, verdict_w = os.pipe()
        fds += [verdict_r, verdict_w]
        status_r, status_w = os.pipe()
        fds += [status_r, status_w]
        job = _job(
            nonce=nonce,
            verdict_fd=verdict_w,
            work=work,
            timeout_s=timeout_s,
            memory_bytes=memory_bytes,
            count_own_processes=mode == "hooks" and uid < 0,
            sources=(preamble, solution, tests),
        )
        spawn = _Spawn(
            isolation=mode,
            work=work,
            uid=uid,
            parent_pid=os.getpid(),
            status_fd=status_w,
            deadline_s=timeout_s + 1.0,
            binds=_host_layout(),
        )
        with (
            tempfile.TemporaryFile() as job_file,
            tempfile.TemporaryFile() as stderr_file,
            tempfile.TemporaryFile() if stdout_bytes > 0 else contextlib.nullcontext() as out_file,
        ):
            job_file.write(job)
            job_file.seek(0)
            proc = _start(spawn, job_file, stderr_file, verdict_w, out_file)
            try:
                for fd in (verdict_w, status_w):  # only C and G hold the write ends now
                    fds.remove(fd)
                    os.close(fd)
                timed_out = not _wait_unreaped(proc.pid, timeout_s)
            finally:
                _stop(proc)
            stderr_file.seek(max(0, os.fstat(stderr_file.fileno()).st_size - STDERR_TAIL_BYTES))
            tail = stderr_file.read().decode("utf-8", errors="replace")
            stdout = b""
            if out_file is not None:
                out_file.seek(0)
                stdout = out_file.read(stdout_bytes)
        record, report = _read_all(verdict_r), _read_all(status_r, limit=4096)
    finally:
        for fd in fds:
            with contextlib.suppress(OSError):
                os.close(fd)
        shutil.rmtree(work, ignore_errors=True)
    verdict, reason, code = _judge(record, nonce, timed_out, report, timeout_s)
    return SandboxResult(verdict, reason, code, tail, mode, stdout)


# --- isolation: which mechanisms this machine allows -------------------------------------------

_CLONE_NEWNS, _CLONE_NEWUTS, _CLONE_NEWIPC = 0x00020000, 0x04000000, 0x08000000
_CLONE_NEWUSER, _CLONE_NEWPID, _CLONE_NEWNET = 0x10000000, 0x20000000, 0x40000000
_MS_RDONLY, _MS_NOSUID, _MS_NODEV, _MS_NOEXEC = 1, 2, 4, 8
_MS_REMOUNT, _MS_BIND, _MS_REC, _MS_PRIVATE = 32, 4096, 16384, 1 << 18
_MS_NOATIME, _MS_NODIRATIME, _MS_RELATIME = 1024, 2048, 1 << 21
_MNT_DETACH = 2
_PR_SET_DUMPABLE, _PR_SET_CHILD_SUBREAPER = 4, 36
_SYS_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41}.get(os.uname().machine)
_WAITED = {signal.SIGCHLD, signal.SIGTERM, signal.SIGINT, signal.SIGHUP}
_LIBC = ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None
_resolved: dict[str, Isolation] = {}
_resolving = threading.Lock()


def resolve_isolation(isolation: str = "auto") -> Isolation:
    """The isolation a run gets: `auto` is the strongest this process can set up (probed once,
    with a warning when it is only `hooks`); naming one that is not available raises."""
    if isolation == "hooks":
        return "hooks"
    with _resolving:
        if "auto" not in _resolved:
            _resolved["auto"] = _probe()
        best = _resolved["auto"]
        if isolation in ("auto", best):
            return best
        if isolation == "userns" and best == "namespaces":
            if "userns" not in _resolved:
                _resolved["userns"] = _probe(only="userns")
            if _resolved["userns"] == "userns":
                return "userns"
    raise RuntimeError(f"code sandbox: isolation {isolation!r} is not available here ({best!r} is)")


def _probe(only: str | None = None) -> Isolation:
    """Set up each kind of namespace sandbox in a throwaway child; the first that works wins."""
    kinds = [only] if only else (["namespaces", "userns"] if os.geteuid() == 0 else ["userns"])
    why = "not Linux"
    for kind in kinds if _LIBC is not None else []:
        work = tempfile.mkdtemp(prefix="areal-probe-")
        try:
            pid = os.fork()
            if pid == 0:  # pragma: no cover - the child
                code = 1
                try:
                    _drop_for_userns(kind, _UID_BASE if os.geteuid() == 0 else -1)
                    _enter_namespaces(kind, work, _host_layout(), 0)
                    code = 0
                finally:
                    os._exit(code)
            _, status = os.waitpid(pid, 0)
        finally:
            shutil.rmtree(work, ignore_errors=True)
        if os.waitstatus_to_exitcode(status) == 0:
            return kind  # type: ignore[return-value]
        why = f"unshare/mount refused for {kind}"
    if only is None:
        log.warning(
            "code_sandbox_without_namespaces",
            why=why,
            fallback="audit hook, rlimits, subreaper, a per-run uid when root",
            not_contained="no network namespace: network, files and /proc are filtered only at "
            "the Python level (C code and CPython bugs get past it); see areal/sandbox/run.py",
        )
    return "hooks"


def own_uid_per_run(isolation: Isolation) -> bool:
    """Whether each run gets an unprivileged uid of its own (so RLIMIT_NPROC binds it): as root,
    unless without namespaces the interpreter is closed to other users."""
    return os.geteuid() == 0 and (isolation != "hooks" or _python_open_to_others())


def _run_uid(mode: Isolation) -> int:
    """A fresh unprivileged uid for the run, else -1: the worker's own uid."""
    return _UID_BASE + secrets.randbelow(_UID_SPAN) if own_uid_per_run(mode) else -1


@functools.cache
def _python_open_to_others() -> bool:
    """Can a uid of no group run the interpreter and read its standard library? (Without a
    mount namespace the run's uid sees the host's permissions; a Python under /root cannot.)"""
    stdlib = os.path.dirname(os.__file__)
    for path in (_python(), stdlib):
        parts = os.path.realpath(path).split("/")
        for i in range(2, len(parts) + 1):
            mode = os.stat("/".join(parts[:i]) or "/").st_mode
            need = 0o005 if i < len(parts) or path == stdlib else 0o001
            if mode & need != need:
                log.warning(
                    "code_sandbox_runs_as_root",
                    why=f"{'/'.join(parts[:i])} is closed to other users, so a run's own uid "
                    "could not start Python; without namespaces the program runs as root",
                )
                return False
    return True


@functools.cache
def _host_layout() -> tuple[tuple[str, str], ...]:
    """What the sandbox's root holds: ("bind", path) read-only binds, ("link", path->target)."""
    out: list[tuple[str, str]] = []
    for top in ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32"):
        if os.path.islink(top):
            out.append(("link", f"{top}\0{os.readlink(top)}"))
        elif os.path.isdir(top):
            out.append(("bind", top))
    prefix = os.path.realpath(sys.base_prefix)
    if not any(kind == "bind" and _under(prefix, p) for kind, p in out):
        out.append(("bind", prefix))
    if os.path.exists("/etc/ld.so.cache"):
        out.append(("file", "/etc/ld.so.cache"))
    for dev in ("/dev/null", "/dev/zero", "/dev/random", "/dev/urandom"):
        out.append(("file", dev))
    return tuple(out)


def _under(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip("/") + "/")


# --- C: the forked supervisor-side process (runs in Popen's preexec_fn, never returns) ----------


@dataclass(frozen=True)
class _Spawn:
    isolation: Isolation
    work: str
    uid: int  # the run's uid (root only), else -1
    parent_pid: int
    status_fd: int  # C reports G's wait status and the leftovers it killed here
    deadline_s: float  # C's own hang guard, in case the supervisor is gone
    binds: tuple[tuple[str, str], ...]


def _middle(spawn: _Spawn) -> None:
    """In C: enter the isolation, fork G (which returns here and execs the harness), then watch
    G and clean up. C itself never returns: it `_exit`s with 0 and reports on `status_fd`."""
    die_with_parent(signal.SIGTERM, spawn.parent_pid)  # C cleans up when the supervisor dies
    old_mask = signal.pthread_sigmask(signal.SIG_BLOCK, _WAITED)
    if spawn.isolation == "hooks":
        _check(_LIBC.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0), "prctl(PR_SET_CHILD_SUBREAPER)")
    else:
        _drop_for_userns(spawn.isolation, spawn.uid)
        _enter_namespaces(spawn.isolation, spawn.work, spawn.binds, spawn.uid)
    c_pid = os.getpid()
    pid = os.fork()
    if pid == 0:  # G: back to _posixsubprocess, which closes the other fds and execs the harness
        # In a PID namespace getppid() is 0, so C's death is caught by PDEATHSIG alone.
        die_with_parent(signal.SIGKILL, None if spawn.isolation != "hooks" else c_pid)
        if spawn.uid >= 0 and spawn.isolation != "userns":
            _drop_to(spawn.uid)
        os.chdir(spawn.work)
        signal.pthread_sigmask(signal.SIG_SETMASK, old_mask)
        return
    report = b"-1 0\n"
    try:
        os.closerange(3, spawn.status_fd)  # Popen's error pipe: its parent waits for our exec
        os.closerange(spawn.status_fd + 1, os.sysconf("SC_OPEN_MAX"))
        status, killed = _watch(pid, spawn)
        report = f"{status} {killed}\n".encode()
    finally:
        with contextlib.suppress(OSError):
            os.write(spawn.status_fd, report)
        os._exit(0)


def _watch(pid: int, spawn: _Spawn) -> tuple[int, int]:
    """Wait for G (or the supervisor's SIGTERM, or C's own deadline), then kill what is left.
    Returns G's raw wait status (-1 if it had to be killed) and how many leftovers died."""
    deadline = time.monotonic() + spawn.deadline_s
    status = None
    while status is None:
        left = deadline - time.monotonic()
        info = signal.sigtimedwait(_WAITED, left) if left > 0 else None
        if info is None or info.si_signo != signal.SIGCHLD:
            break
        status = _reap(pid)
    if status is None:  # the supervisor's SIGTERM or C's own deadline: G dies unreported
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, 0)  # with namespaces: returns once G's whole namespace is gone
        status = -1
    killed = 0 if spawn.isolation != "hooks" else _kill_tree(os.getpid())
    return status, killed


def _reap(pid: int) -> int | None:
    """Reap every exited child (G and, as a subreaper, orphans); G's wait status if it exited."""
    status = None
    while True:
        try:
            got, st = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return status
        if got == 0:
            return status
        if got == pid:
            status = st


def _kill_tree(root: int) -> int:
    """SIGKILL every descendant of `root` (a subreaper: orphans come back to it), round after
    round until none is left; returns how many were killed."""
    try:  # G is reaped and its orphans came back to us: no child means no descendant at all
        os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except ChildProcessError:
        return 0
    killed: set[int] = set()
    for _ in range(10_000):
        alive = _descendants(root)
        if not alive:
            _reap(-2)
            break
        for pid in alive:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            killed.add(pid)
        _reap(-2)
        time.sleep(0.001)
    return len(killed)


def _descendants(root: int) -> list[int]:
    """Live (non-zombie) descendants of `root`, from the PPid of every process in /proc."""
    children: dict[int, list[int]] = {}
    zombies: set[int] = set()
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(name))
        if fields[0] == b"Z":
            zombies.add(int(name))
    out, todo = [], [root]
    while todo:
        for child in children.get(todo.pop(), []):
            todo.append(child)
            if child not in zombies:
                out.append(child)
    return out


def _check(ret: int, what: str) -> None:
    if ret != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _mount(
    src: str | None, dst: str, fstype: str | None, flags: int, data: str | None = None
) -> None:
    enc = lambda s: None if s is None else s.encode()  # noqa: E731
    _check(
        _LIBC.mount(enc(src), enc(dst), enc(fstype), ctypes.c_ulong(flags), enc(data)),
        f"mount {dst}",
    )


def _drop_to(uid: int) -> None:
    os.setgroups([])
    os.setresgid(uid, uid, uid)
    os.setresuid(uid, uid, uid)


def _drop_for_userns(kind: str, uid: int) -> None:
    # As root, become the run's uid first: an unprivileged user namespace can then map only that
    # uid, never root's (a namespace mapped to root would own root's files).
    if kind == "userns" and uid >= 0 and os.geteuid() == 0:
        _drop_to(uid)
        # A uid change makes the process non-dumpable, which hands /proc/self (uid_map) to root.
        _check(_LIBC.prctl(_PR_SET_DUMPABLE, 1, 0, 0, 0), "prctl(PR_SET_DUMPABLE)")


def _enter_namespaces(kind: str, work: str, binds: tuple[tuple[str, str], ...], uid: int) -> None:
    """Unshare and build the read-only root described in the module docstring, with `work` as
    a fresh tmpfs (owned by the run's uid) at the same path; chdir into it."""
    flags = _CLONE_NEWNS | _CLONE_NEWNET | _CLONE_NEWPID | _CLONE_NEWIPC | _CLONE_NEWUTS
    owner = uid if kind == "namespaces" and uid >= 0 else 0
    if kind == "userns":
        outer_uid, outer_gid = os.geteuid(), os.getegid()
        _check(_LIBC.unshare(flags | _CLONE_NEWUSER), "unshare")
        for path, text in (
            ("/proc/self/setgroups", "deny"),
            ("/proc/self/uid_map", f"65534 {outer_uid} 1"),
            ("/proc/self/gid_map", f"65534 {outer_gid} 1"),
        ):
            with open(path, "w") as f:
                f.write(text)
        owner = 65534
    else:
        _check(_LIBC.unshare(flags), "unshare")
    _mount(None, "/", None, _MS_REC | _MS_PRIVATE)
    root = work  # the supervisor's temporary dir is the mount point of the new root
    _mount("tmpfs", root, "tmpfs", _MS_NOSUID | _MS_NODEV, "size=1m,mode=0755")
    for kind_, spec in binds:
        if kind_ == "link":
            path, target = spec.split("\0")
            os.symlink(target, root + path)
            continue
        dst = root + spec
        if kind_ == "file":
            os.makedirs(os.path.dirname(dst), exist_ok=True)
            open(dst, "w").close()  # noqa: SIM115 - a mount point
            _mount(spec, dst, None, _MS_BIND)
            continue
        os.makedirs(dst, exist_ok=True)
        _mount(spec, dst, None, _MS_BIND | _MS_REC)
        _mount(None, dst, None, _MS_BIND | _MS_REMOUNT | _MS_RDONLY | _locked_flags(spec))
    inner_work = root + work
    os.makedirs(inner_work)
    _mount(
        "tmpfs",
        inner_work,
        "tmpfs",
        _MS_NOSUID | _MS_NODEV | _MS_NOEXEC,
        f"size={WORKDIR_BYTES},mode=0700,uid={owner},gid={owner}",
    )
    os.mkdir(root + "/.old")
    os.chdir(root)
    if _SYS_PIVOT_ROOT is not None:
        _check(_LIBC.syscall(_SYS_PIVOT_ROOT, b".", b".old"), "pivot_root")
        os.chdir("/")
        _check(_LIBC.umount2(b"/.old", _MNT_DETACH), "umount the old root")
        os.rmdir("/.old")
    else:  # pragma: no cover - other architectures: move the new root over / and chroot
        _mount(root, "/", None, 1 << 13)  # MS_MOVE
        os.chroot(".")
    _mount(None, "/", None, _MS_BIND | _MS_REMOUNT | _MS_RDONLY | _MS_NOSUID | _MS_NODEV)
    os.chdir(work)


def _locked_flags(path: str) -> int:
    # In a user namespace a bind remount must keep the flags of the mount it came from.
    f = os.statvfs(path).f_flag
    out = _MS_NOSUID | _MS_NODEV
    for st, ms in (
        (8, _MS_NOEXEC),
        (1024, _MS_NOATIME),
        (2048, _MS_NODIRATIME),
        (4096, _MS_RELATIME),
    ):
        if f & st:
            out |= ms
    return out


# --- the supervisor's side of a run --------------------------------------------------------------


def _job(
    *,
    nonce: str,
    verdict_fd: int,
    work: str,
    timeout_s: float,
    memory_bytes: int,
    count_own_processes: bool,
    sources: tuple[str, str, str],
) -> bytes:
    """G's stdin: the marshalled harness, a header line, then preamble, solution and tests."""
    srcs = [s.encode("utf-8", "surrogatepass") for s in sources]
    header = " ".join(
        str(x)
        for x in (
            nonce,
            verdict_fd,
            work.encode().hex(),
            max(1, int(timeout_s) + 1),  # RLIMIT_CPU, s
            memory_bytes,
            MAX_FILE_BYTES,
            MAX_OPEN_FILES,
            MAX_PROCESSES,
            int(count_own_processes),  # no uid of its own: the limit adds the uid's processes
            *(len(s) for s in srcs),
        )
    )
    code = harness_code()
    return b"%016d" % len(code) + code + header.encode() + b"\n" + b"".join(srcs)


def _start(spawn: _Spawn, job_file, stderr_file, verdict_w: int, out_file=None) -> subprocess.Popen:
    env = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": spawn.work, "TMPDIR": spawn.work}
    unbuffered = ["-u"] if out_file is not None else []  # the harness leaves by os._exit
    return subprocess.Popen(
        [_python(), "-I", "-S", "-B", *unbuffered, "-c", BOOT],
        stdin=job_file,
        stdout=subprocess.DEVNULL if out_file is None else out_file,
        stderr=stderr_file,
        env=env,
        pass_fds=(verdict_w,),
        start_new_session=True,
        close_fds=True,
        preexec_fn=functools.partial(_middle, spawn),
    )


def _stop(proc: subprocess.Popen) -> None:
    """End C (and with it G's tree) and reap it. C is alive or an unreaped zombie until
    `proc.wait()`, so neither its pid nor its process group id can have been reused."""
    if not _wait_unreaped(proc.pid, 0):
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGTERM)  # C kills G's tree, reports and exits
        if not _wait_unreaped(proc.pid, KILL_GRACE_S):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


@functools.cache
def _python() -> str:
    """The base interpreter (not a venv's): the sandbox gets the standard library only."""
    return os.path.realpath(getattr(sys, "_base_executable", None) or sys.executable)


def _wait_unreaped(pid: int, timeout_s: float) -> bool:
    """Wait up to `timeout_s` for child `pid` to exit WITHOUT reaping it; True if it exited."""
    if os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None:
        return True
    if timeout_s <= 0:
        return False
    try:
        pidfd = os.pidfd_open(pid)
    except (AttributeError, OSError):  # no pidfd (Python or kernel too old): poll
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None:
                return True
            time.sleep(0.005)
        return False
    try:
        poller = select.poll()
        poller.register(pidfd, select.POLLIN)
        return bool(poller.poll(max(1, int(timeout_s * 1000))))
    finally:
        os.close(pidfd)


def _read_all(fd: int, limit: int = 1 << 20) -> bytes:
    os.set_blocking(fd, False)
    out = b""
    with contextlib.suppress(BlockingIOError):
        while len(out) < limit:
            chunk = os.read(fd, 65536)
            if not chunk:
                break
            out += chunk
    return out


def _judge(
    record: bytes, nonce: str, timed_out: bool, report: bytes, timeout_s: float
) -> tuple[Verdict, str, int | None]:
    """The verdict of a run from the harness's record and C's report (see the module)."""
    fields = report.split()
    status = int(fields[0]) if len(fields) == 2 else -1  # G's wait status; -1: killed or unknown
    killed = int(fields[1]) if len(fields) == 2 else 0
    code = None if status < 0 else os.waitstatus_to_exitcode(status)
    left = f"; {killed} leftover processes killed" if killed else ""
    if timed_out:
        return "timeout", f"timed out after {timeout_s:g}s{left}", None
    key = nonce.encode()
    n = record.count(key)
    if n == 1:
        line = record[record.index(key) :].split(b"\n", 1)[0].decode("utf-8", errors="replace")
        parts = line.split(" ", 2) + [""]
        if parts[1] in ("passed", "failed", "violation"):
            return parts[1], parts[2] + left, code  # type: ignore[return-value]
        return "violation", "the harness's record is garbled" + left, code
    if n > 1:
        return "violation", f"{n} records carry the verdict nonce (only one may){left}", code
    if code is None:
        return "violation", "the harness was killed before the tests reported" + left, code
    if code < 0:
        name = signal.Signals(-code).name
        if name == "SIGXCPU":
            return "failed", f"the CPU-time limit was hit ({name}){left}", code
        return "violation", f"the program died of {name} before the tests reported{left}", code
    return (
        "violation",
        f"the program exited with status {code} before the tests reported (an early exit or a "
        f"killed harness: exiting never passes){left}",
        code,
    )

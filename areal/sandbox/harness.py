"""The sandbox's harness: the trusted code that G (`python -I -S -B`) runs around the solution.

The supervisor side (namespaces, subreaper, the process-tree kill, the job it sends, reading the
verdict) and the invariants it keeps are `areal/sandbox/run.py`; its docstring also holds
the complete list of what the sandbox does not contain. This module holds the code that runs
inside G: `BOOT` (G's `-c` program), `_harness_exposed`, `_harness_plain` and `_harness`.
`harness_code()`, on the supervisor's side, compiles the three functions from this file's source
(`inspect.getsource`) and marshals them: G loads them from its stdin and never imports this
module or `areal`.

Invariants:
- The verdict record. G's stdin (the harness, a header with the nonce, the sources) is read
  whole, then replaced by /dev/null, before any untrusted code. The harness writes
  `<nonce> <passed|failed|violation> <reason>` to the inherited fd once, in one write of less
  than PIPE_BUF bytes, from its original process, after the tests; "passed" only if the
  solution and every test ran without an exception and nothing was refused. So `os._exit(0)`,
  `sys.exit`, SystemExit in atexit (the harness leaves by `os._exit`), a signal or a killed
  harness leave no record; closing or replacing the fd loses the record; a forked copy of the
  harness writes nothing.
- The nonce stays secret while the solution cannot reach the harness's memory. It is a local of
  `_harness`, which runs in globals and builtins of its own that nothing reachable refers to;
  the harness objects the solution can reach come from `_harness_exposed` and hold no secret.
  Every route from Python code to a frame, to the collector's object lists or to raw memory is
  refused by the audit hook (`sys.addaudithook`: it cannot be removed) once the trusted phase
  (preamble, the tests' imports) is over: `sys._getframe` (ValueError, which the stdlib
  expects), tracebacks' `tb_frame` and generators' `gi_frame` / `cr_frame` / `ag_frame`
  (AttributeError), `sys._current_frames`, trace and profile functions (clearing one is
  allowed), new audit hooks, `gc.get_objects` / `get_referrers` / `get_referents` and
  `gc.set_debug` (DEBUG_SAVEALL keeps dead frames), signal handlers (they get the current
  frame), `ctypes` and the CPython test modules, native code from outside the standard
  library, hand-made code objects (`code.__new__`, `marshal.loads`, assigning `__code__`), and
  every path outside the allowlist below (/proc/self/mem).
- What the tests see is what the solution found: builtins and every module loaded before the
  solution are private copies taken then (patching `math.isclose`, `builtins.abs`,
  `sys.meta_path` or a module's class changes nothing the tests look up, even from a thread or
  from a function the tests call), the modules the tests import get their globals and classes
  back, names of the solution that shadow a builtin are left out, the preamble's names win, and
  solution and tests are compiled apart (an open string cannot swallow the tests).
- What the tests compare is plain data (`_harness_plain`, built before the solution runs, in
  globals of its own). The tests are compiled then, every comparison but `is` / `is not` turned
  into a call of the guard, which compares private copies made of exact builtin types (int,
  float, complex, bool, str, bytes, None, range, classes, and list, tuple, dict, set, frozenset
  of them; a chain evaluates all its operands first). Each function or other callable the
  solution leaves in the tests' globals, classes aside, returns such a copy to them. Anything
  else, an object whose `__eq__` always says yes, a subclass of int, str or list, a generator,
  is a refusal: the run fails (`not plain data: ...`), even when the tests catch the TypeError.
- Limits: the harness sets the rlimits it is sent (see `run.py`) before the preamble.
- The filesystem and network filter, all the containment there is in `hooks` mode: reads only from
  the standard library, the work dir and /dev/{null,zero,random,urandom}; writes only in the work
  dir and to those devices; no directory fds (a `dir_fd` would escape the path check), no chdir out
  of the work dir, no symlinks, hard links or FIFOs, no path objects other than str and bytes in os
  functions (a `__fspath__` could answer twice, differently); no sockets or name lookups, no exec or
  spawn (fork is allowed: the child keeps the hook), no signals to other processes, no
  `resource.prlimit`.
- Not contained: see the list in `run.py` (a Python-level filter is no security boundary).
- Costs of the containment to honest code: tracebacks cannot be walked (`traceback.print_exc`
  raises AttributeError; `traceback.clear_frames`, which unittest's assertRaises calls, is a
  no-op), no signal handlers, subprocesses, sockets or multiprocessing semaphores, and modules
  the solution imports first compile from source (`.pyc` loading needs `marshal.loads`). The
  tests compare plain data only: a function of the solution that returns a generator, a function
  or an instance of its own class fails, a returned value reaches the tests as a copy (`is` on
  it is False), and tests that compare other objects (a `Fraction`, `sys.version_info`) fail.
"""

from __future__ import annotations

import functools
import inspect
import marshal
import textwrap

__all__ = ["BOOT", "harness_code"]


@functools.cache
def harness_code() -> bytes:
    """The harness, compiled once per worker (marshal: same interpreter) and sent on stdin."""
    codes = []
    for fn, name in (
        (_harness_exposed, "<areal-sandbox-exposed>"),
        (_harness_plain, "<areal-sandbox-plain>"),
        (_harness, "<areal-sandbox>"),
    ):
        codes.append(
            compile(textwrap.dedent(inspect.getsource(fn)), name, "exec", dont_inherit=True)
        )
    return marshal.dumps(tuple(codes))


# G's -c program: read stdin, run the harness in its own globals and a private copy of the
# builtins (so nothing the solution reaches can change what the harness calls); the same for the
# plain-data guard, apart from both.
BOOT = """\
def _boot():
    import builtins, marshal, os
    data = bytearray()
    while True:
        chunk = os.read(0, 1 << 20)
        if not chunk:
            break
        data += chunk
    n = int(data[:16])
    exposed_code, plain_code, harness_code = marshal.loads(bytes(data[16 : 16 + n]))
    job = bytes(data[16 + n :])
    del data
    b = {"__builtins__": dict(builtins.__dict__), "__name__": "areal_sandbox_exposed"}
    exec(exposed_code, b)
    c = {"__builtins__": dict(builtins.__dict__), "__name__": "areal_sandbox_plain"}
    exec(plain_code, c)
    a = {"__builtins__": dict(builtins.__dict__), "__name__": "areal_sandbox"}
    exec(harness_code, a)
    a["_harness"](b["_harness_exposed"], c["_harness_plain"], job)
_boot()
"""


def _harness_exposed(audit):  # pragma: no cover - runs inside the sandbox
    """The objects of the harness that the solution can reach (they replace functions in
    `_imp`, `_signal`, `gc`, ...). They run in their own globals and hold no secret: each only
    asks the audit hook, which holds the real functions, to act."""

    class Made(BaseException):
        """Carries a module created by the audit hook out of `sys.audit`."""

    def create_builtin(spec):
        try:
            audit("areal.sandbox.create", "builtin", spec)
        except Made as made:
            return made.args[0]
        raise ImportError("sandbox: module creation refused")

    def create_dynamic(spec, file=None):
        try:
            audit("areal.sandbox.create", "dynamic", spec)
        except Made as made:
            return made.args[0]
        raise ImportError("sandbox: module creation refused")

    def refused(name, allow_none=False):
        def call(*args, **kwargs):
            if allow_none and len(args) == 1 and args[0] is None and not kwargs:
                return None  # clearing a trace function (doctest does) is harmless
            audit("areal.sandbox.refused", name)
            raise PermissionError(f"sandbox: {name} is not allowed")

        return call

    def clear_frames(tb):
        """traceback.clear_frames without touching frames (it only frees memory)."""

    def private_import(real_import, copies, by_name, _id=id, _all=all):
        """The tests' `__import__`: the private copy of a module loaded before the solution,
        without going through the (patchable) import machinery when it can."""

        def __import__(name, globals=None, locals=None, fromlist=(), level=0):  # noqa: A001
            names = fromlist or ()  # None for a plain `import x`
            if level == 0 and name in by_name:
                copy = by_name.get(name if names else name.partition(".")[0])
                if copy is not None and _all(f == "*" or f in copy.__dict__ for f in names):
                    return copy
            module = real_import(name, globals, locals, fromlist, level)
            entry = copies.get(_id(module))
            return entry[1] if entry is not None and entry[0] is module else module

        return __import__

    return Made, create_builtin, create_dynamic, refused, private_import, clear_frames


def _harness_plain():  # noqa: C901  # pragma: no cover - runs inside the sandbox
    """The plain-data guard, built in the trusted phase: `(compile_tests, compare, wrap,
    refusals)`. It runs in globals of its own that no object the solution can reach refers to
    (only a function the tests hand to the solution leads here), and every name its closures
    call is bound below, before the solution runs: nothing the solution patches (builtins,
    `isinstance`, a metaclass's `__eq__` or `__hash__`) changes what it checks.

    `plain(value)` is a private copy of `value` made of exact builtin types only: `int`,
    `float`, `complex`, `bool`, `str`, `bytes`, `None`, `range`, classes whose metaclass is
    `type` (compared by identity), and `list`, `tuple`, `dict`, `set`, `frozenset` of them at
    any depth (`collections`' `OrderedDict`, `defaultdict` and `Counter` become a `dict`). Any
    other object, a subclass of these included, is refused: it is recorded in `refusals` (the
    harness fails the run on any, even when the tests catch the TypeError raised with it).
    Only the types are tested (by identity, never `==`, `in` or `hash` on a type the solution
    made) and only exact builtin types' own C code runs; the copy is the harness's alone, so
    neither a thread nor a later call of the solution can change it after the check."""
    import ast
    import collections

    type_of, id_of, len_, range_, callable_ = type, id, len, range, callable
    issubclass_ = issubclass
    str_, tuple_, frozenset_, set_, list_ = str, tuple, frozenset, set, list
    type_error, recursion_error, memory_error = TypeError, RecursionError, MemoryError
    base_exception = BaseException
    type_name = type.__dict__["__name__"].__get__
    list_copy, list_append, set_add, dict_items = list.copy, list.append, set.add, dict.items
    range_start = range.__dict__["start"].__get__
    range_stop = range.__dict__["stop"].__get__
    range_step = range.__dict__["step"].__get__
    module_type, none_type, class_type = type_of(ast), type_of(None), type
    scalars = (int, float, complex, bool, str, bytes, none_type)
    dict_types = (dict, collections.OrderedDict, collections.defaultdict, collections.Counter)
    max_depth, max_refusals = 200, 16
    refusals = []
    allowed = (
        "the tests see only exact int, float, complex, bool, str, bytes, None, range, classes,"
        " and list, tuple, dict, set, frozenset of them"
    )

    def one_of(t, types):  # `is`, never `in`: a metaclass answers `==`
        for x in types:  # noqa: SIM110 - no builtin looked up at run time
            if x is t:
                return True
        return False

    def name_of(t):
        try:
            name = type_name(t)
        except base_exception:  # a hostile metaclass
            return "?"
        return name if type_of(name) is str_ else "?"

    class NotPlain(Exception):
        pass

    def copy(value, memo, depth):
        t = type_of(value)
        if one_of(t, scalars) or t is class_type:
            return value
        if depth > max_depth:
            raise NotPlain(f"data nested deeper than {max_depth}")
        key = id_of(value)
        seen = memo.get(key)
        if seen is not None and seen[0] is value:
            return seen[1]
        if t is list_:
            out = []
            memo[key] = (value, out)
            for item in list_copy(value):
                list_append(out, copy(item, memo, depth + 1))
            return out
        if t is tuple_:
            out = tuple_([copy(item, memo, depth + 1) for item in value])
        elif t is set_ or t is frozenset_:
            out = set_()
            for item in value:
                set_add(out, copy(item, memo, depth + 1))
            if t is frozenset_:
                out = frozenset_(out)
        elif one_of(t, dict_types):
            out = {}
            memo[key] = (value, out)
            for k, v in list_(dict_items(value)):
                out[copy(k, memo, depth + 1)] = copy(v, memo, depth + 1)
            return out
        elif t is range_:
            parts = (range_start(value), range_stop(value), range_step(value))
            if not (type_of(parts[0]) is int and type_of(parts[1]) is int):
                raise NotPlain("a range of " + name_of(type_of(parts[0])))
            if type_of(parts[2]) is not int:
                raise NotPlain("a range of " + name_of(type_of(parts[2])))
            out = range_(*parts)
        else:
            raise NotPlain(name_of(t))
        memo[key] = (value, out)
        return out

    def plain(value, what):
        """A private plain copy of `value`, else a refusal (recorded, then TypeError)."""
        try:
            return copy(value, {}, 0)
        except NotPlain as e:
            found = e.args[0]
        except (recursion_error, memory_error):
            found = "data too deep or too large to copy"
        except base_exception as e:  # e.g. a thread changed a dict while it was copied
            found = "data that changed while it was copied (" + name_of(type_of(e)) + ")"
        reason = f"{what} {found} ({allowed})"
        if len_(refusals) < max_refusals:
            list_append(refusals, reason)
        raise type_error("sandbox: " + reason)

    def compare_one(left, op, right):
        if op == 8:
            return left is right
        if op == 9:
            return left is not right
        a = plain(left, "the tests compared")
        b = plain(right, "the tests compared")
        if op == 0:
            return a == b
        if op == 1:
            return a != b
        if op == 2:
            return a < b
        if op == 3:
            return a <= b
        if op == 4:
            return a > b
        if op == 5:
            return a >= b
        if op == 6:
            return a in b
        return a not in b

    def compare(*args):
        """`left op right [op right ...]`: the tests' comparisons, rewritten (see
        `compile_tests`); a chain evaluates all of its operands first."""
        left, result = args[0], True
        for i in range_(1, len_(args), 2):
            result = compare_one(left, args[i], args[i + 1])
            if not result:
                return result
            left = args[i + 1]
        return result

    wrapped = {}  # id(wrapper) -> (wrapper, the solution's function)

    def unwrapped(value):
        entry = wrapped.get(id_of(value))
        return entry[1] if entry is not None and entry[0] is value else value

    def wrap(fn, name):
        """`fn` as the tests call it: what it returns reaches them as a plain copy. A wrapper
        the tests pass it (`apply(add, 2, 3)`) is passed as the function it wraps: the
        solution never holds one (its closure leads to the guard)."""
        what = f"{name}() returned"

        def call(*args, **kwargs):
            args = tuple_([unwrapped(a) for a in args])
            kwargs = {k: unwrapped(v) for k, v in dict_items(kwargs)}
            return plain(fn(*args, **kwargs), what)

        wrapped[id_of(call)] = (call, fn)
        return call

    def wanted(value):
        """A function or other callable of the solution (classes and modules are not)."""
        t = type_of(value)
        plain_callable = not issubclass_(t, class_type) and not issubclass_(t, module_type)
        return plain_callable and callable_(value)

    codes = {ast.Eq: 0, ast.NotEq: 1, ast.Lt: 2, ast.LtE: 3, ast.Gt: 4, ast.GtE: 5}
    codes.update({ast.In: 6, ast.NotIn: 7, ast.Is: 8, ast.IsNot: 9})

    class Guard(ast.NodeTransformer):
        def visit_Compare(self, node):
            self.generic_visit(node)
            ops = [codes[type_of(op)] for op in node.ops]
            if all(op >= 8 for op in ops):
                return node  # identity only: nothing to copy
            args = [node.left]
            for op, right in zip(ops, node.comparators, strict=True):
                args += [ast.Constant(op), right]
            call = ast.Call(ast.Name("_areal_compare", ast.Load()), args, [])
            return ast.copy_location(call, node)

    def compile_tests(src):
        """The tests' code object, every comparison but `is` / `is not` a call of `compare`."""
        tree = compile(src, "<tests>", "exec", ast.PyCF_ONLY_AST, dont_inherit=True)
        tree = ast.fix_missing_locations(Guard().visit(tree))
        return compile(tree, "<tests>", "exec", dont_inherit=True, optimize=0)

    return compile_tests, compare, wrap, wanted, refusals


def _harness(exposed, plain_guard, job):  # noqa: C901  # pragma: no cover - runs inside the sandbox
    """The trusted side of G: limits, the audit hook, then preamble, solution, tests, verdict.
    Everything it calls once the solution has run is bound here first (see the module)."""
    import _imp
    import _signal
    import builtins
    import os
    import resource
    import sys

    write, getpid, exit_, getcwd = os.write, os.getpid, os._exit, os.getcwd
    lstat, stat, readlink = os.lstat, os.stat, os.readlink
    type_dict = type.__dict__["__dict__"].__get__
    type_name = type.__dict__["__name__"].__get__
    type_setattr, type_delattr = type.__setattr__, type.__delattr__
    exc_args = BaseException.__dict__["args"].__get__
    exc_tb = BaseException.__dict__["__traceback__"].__get__
    module_type, namespace, modules = type(sys), type(sys.implementation), sys.modules
    module_dict = module_type.__dict__["__dict__"].__get__

    # -- the job: header line, then the sources -------------------------------------------------
    head, _, body = job.partition(b"\n")
    fields = head.split(b" ")
    nonce, verdict_fd = fields[0], int(fields[1])
    work = os.path.realpath(bytes.fromhex(fields[2].decode()).decode())
    cpu_s, as_bytes, fsize, nofile, nproc, count_own = (int(x) for x in fields[3:9])
    sizes = [int(x) for x in fields[9:12]]
    sources, at = [], 0
    for n in sizes:
        sources.append(body[at : at + n].decode("utf-8", "surrogatepass"))
        at += n
    preamble, solution, tests = sources
    del job, head, body, fields, sources

    null = os.open("/dev/null", os.O_RDWR)
    os.dup2(null, 0)
    os.close(null)
    os.set_inheritable(verdict_fd, False)
    os.chdir(work)

    # -- limits ------------------------------------------------------------------------------------
    if count_own:  # no uid of its own: RLIMIT_NPROC counts every process of this uid
        uid_line = f"Uid:\t{os.getuid()}\t".encode()
        for name in os.listdir("/proc"):
            if name.isdigit():
                try:
                    with open(f"/proc/{name}/status", "rb") as f:
                        nproc += uid_line in f.read()
                except OSError:
                    pass
    for lim, soft, hard in (
        (resource.RLIMIT_CPU, cpu_s, cpu_s + 1),  # SIGXCPU first, SIGKILL a second later
        (resource.RLIMIT_AS, as_bytes, as_bytes),
        (resource.RLIMIT_FSIZE, fsize, fsize),
        (resource.RLIMIT_NOFILE, nofile, nofile),
        (resource.RLIMIT_NPROC, nproc, nproc),
        (resource.RLIMIT_CORE, 0, 0),
    ):
        cur = resource.getrlimit(lim)[1]
        if cur != resource.RLIM_INFINITY:
            soft, hard = min(soft, cur), min(hard, cur)
        resource.setrlimit(lim, (soft, hard))
    reserve = bytes(16 << 20)  # calloc: untouched pages; freed after the solution, as headroom

    # -- the audit hook ----------------------------------------------------------------------------
    stdlib = tuple(
        os.path.realpath(p).rstrip("/") + "/" for p in sys.path if p and os.path.isdir(p)
    )
    work_root = work.rstrip("/") + "/"
    fast_roots = (work_root, *stdlib)
    devices = frozenset(("/dev/null", "/dev/zero", "/dev/random", "/dev/urandom"))
    writing_flags = os.O_WRONLY | os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_TRUNC
    refused_names = (
        "ctypes _ctypes _ctypes_test _testcapi _testinternalcapi _testbuffer _testmultiphase "
        "_testimportmultiple _testsinglephase _testclinic _xxsubinterpreters _xxinterpchannels "
        "_xxtestfuzz _imp _frozen_importlib _frozen_importlib_external cffi _cffi_backend"
    )
    refused_imports = frozenset(refused_names.split())
    unavailable = frozenset(("_posixshmem", "_multiprocessing", "_ssl", "_dbm", "_gdbm"))
    neutered = {
        "_signal": ("signal",),  # a handler gets the current frame
        "gc": ("set_debug",),  # DEBUG_SAVEALL keeps dead frames in gc.garbage
        "_posixsubprocess": ("fork_exec",),  # execs without an audit event
        "posix": ("mkfifo", "mknod"),  # create files without an audit event
        "os": ("mkfifo", "mknod"),
    }
    frame_attrs = frozenset(("tb_frame", "gi_frame", "cr_frame", "ag_frame"))
    made_cls, new_builtin, new_dynamic, refused_fn, private_import, clear_frames = exposed(
        sys.audit
    )
    real_create_builtin, real_create_dynamic = _imp.create_builtin, _imp.create_dynamic
    refusals = []
    state = {"locked": False, "frames": False}

    def refuse(what):
        if len(refusals) < 16:
            refusals.append(what)
        raise PermissionError(f"sandbox: {what} is not allowed")

    def plain(path, what):
        """`path` as an exact str (a str or bytes subclass cannot answer differently twice)."""
        t = type(path)
        if t is str:
            return path
        if t is bytes:
            return bytes.decode(path, "utf-8", "surrogateescape")
        if issubclass(t, str):
            return str.__add__("", path)
        if issubclass(t, bytes):
            return bytes.decode(bytes.__add__(b"", path), "utf-8", "surrogateescape")
        raise TypeError(f"sandbox: {what} takes a str or bytes path here (use os.fspath)")

    def resolve(p):
        """An absolute path without symlinks, `.` or `..` (os.path.realpath, from C calls only)."""
        if not p.startswith("/"):
            p = getcwd() + "/" + p
        if "/." not in p and (p.startswith(fast_roots) or p == work):
            return p  # the work dir holds no symlinks (refused); the stdlib's are the host's
        todo, out, links = p.split("/")[::-1], [], 0
        while todo:
            name = todo.pop()
            if name in ("", "."):
                continue
            if name == "..":
                if out:
                    out.pop()
                continue
            path = "/" + "/".join([*out, name])
            try:
                mode = lstat(path).st_mode
            except OSError:
                out.append(name)
                continue
            if mode & 0o170000 == 0o120000:
                links += 1
                if links > 40:
                    refuse(f"a symlink loop at {path!r}")
                target = readlink(path)
                if target.startswith("/"):
                    out = []
                todo.extend(target.split("/")[::-1])
            else:
                out.append(name)
        return "/" + "/".join(out)

    def check(path, writing, what):
        if path is None or issubclass(type(path), int):
            return None  # the cwd (in the work dir) or an fd already open
        p = resolve(plain(path, what))
        if p == work or p.startswith(work_root):
            return p
        if p in devices or (not writing and any(p.startswith(r) for r in stdlib)):
            return p
        refuse(f"{what} {p!r} ({'write' if writing else 'read'}) outside the sandbox")

    def on_open(args):
        path, mode, flags = args
        writing = not issubclass(type(flags), int) or bool(flags & writing_flags)
        if type(mode) is str:
            writing = writing or any(c in mode for c in "wax+")
        p = check(path, writing, "open")
        if p is not None and mode is None:  # os.open: no directory fds (dir_fd paths escape)
            try:
                is_dir = stat(p).st_mode & 0o170000 == 0o040000
            except OSError:
                is_dir = False
            if is_dir:
                raise PermissionError("sandbox: directory file descriptors are not available")

    def on_chdir(args):
        path = args[0]
        if not issubclass(type(path), int):
            p = resolve(plain(path, "chdir"))
            if p != work and not p.startswith(work_root):
                raise PermissionError("sandbox: chdir outside the work dir is not available")

    def on_create(args):
        kind, spec = args[0], args[1]
        name = plain(getattr(spec, "name", None), "module creation")
        top = name.partition(".")[0]
        if top in refused_imports or name in ("sys", "builtins"):
            refuse(f"creating module {name}")
        if name in unavailable:
            raise ImportError(f"sandbox: {name} is not available")
        if kind == "dynamic":
            origin = resolve(plain(getattr(spec, "origin", None), "module creation"))
            if not any(origin.startswith(r) for r in stdlib):
                refuse(f"native code from {origin!r}")
            module = real_create_dynamic(namespace(name=name, origin=origin))
        else:
            module = real_create_builtin(namespace(name=name, origin="built-in"))
        neuter(name, module)
        raise made_cls(module)

    def on_import(args):
        name = plain(args[0], "import")
        if name in refused_imports or name.partition(".")[0] in refused_imports:
            refuse(f"import {name}")
        if name in unavailable:
            raise ImportError(f"sandbox: {name} is not available")

    def on_getattr(args):  # `types` itself reads a tb_frame at import: the trusted phase may
        if args[1] in frame_attrs and state["locked"] and not state["frames"]:
            raise AttributeError(f"sandbox: {args[1]} is not available")

    def on_setattr(args):
        if args[1] == "__code__":
            refuse("assigning __code__")

    def on_getframe(args):
        if state["locked"] and not state["frames"]:
            raise ValueError("sandbox: frames are not available")

    def on_marshal(args):
        if state["locked"]:
            refuse("marshal.loads (hand-made code objects)")

    def on_sqlite(args):
        if plain(args[0], "sqlite3.connect") not in (":memory:", ""):
            check(args[0], True, "sqlite3.connect")

    def hard(event):
        return lambda args: refuse(event)

    def paths(indices, writing, what):
        def handler(args):
            for i in indices:
                check(args[i], writing, what)

        return handler

    handlers = {
        "open": on_open,
        "os.chdir": on_chdir,
        "os.listdir": paths((0,), False, "listing"),
        "os.scandir": paths((0,), False, "listing"),
        "os.getxattr": paths((0,), False, "getxattr"),
        "os.listxattr": paths((0,), False, "listxattr"),
        "os.rename": paths((0, 1), True, "rename"),
        "shutil.rmtree": paths((0,), True, "rmtree"),
        "tempfile.mkstemp": paths((0,), True, "mkstemp"),
        "tempfile.mkdtemp": paths((0,), True, "mkdtemp"),
        "areal.sandbox.create": on_create,
        "areal.sandbox.refused": lambda args: refuse(plain(args[0], "refusal")),
        "import": on_import,
        "object.__getattr__": on_getattr,
        "object.__setattr__": on_setattr,
        "sys._getframe": on_getframe,
        "marshal.loads": on_marshal,
        "marshal.load": on_marshal,
        "sqlite3.connect": on_sqlite,
    }
    write_events = (
        "os.mkdir os.rmdir os.remove os.truncate os.utime os.chmod os.chown os.chflags "
        "os.lchflags os.setxattr os.removexattr"
    )
    for event in write_events.split():
        handlers[event] = paths((0,), True, event[3:])
    refused_events = (
        "os.link os.symlink os.exec os.posix_spawn os.spawn os.system os.startfile os.forkpty "
        "subprocess.Popen pty.spawn os.kill os.killpg signal.pthread_kill resource.prlimit "
        "sys.settrace sys.setprofile sys._settraceallthreads sys._setprofileallthreads "
        "sys._current_frames sys._current_exceptions sys.remote_exec "
        "sys.addaudithook gc.get_objects gc.get_referrers gc.get_referents code.__new__ "
        "sys.monitoring.register_callback sqlite3.enable_load_extension sqlite3.load_extension "
        "webbrowser.open"
    )
    for event in refused_events.split():
        handlers[event] = hard(event)
    get_handler = handlers.get

    def hook(event, args):
        handler = get_handler(event)
        if handler is not None:
            handler(args)
        elif event.startswith(("socket.", "ctypes.")):
            refuse(event)

    def neuter(name, module):
        for attr in neutered.get(name, ()):
            if attr in module.__dict__:
                module.__dict__[attr] = refused_fn(f"{name}.{attr}")

    sys.addaudithook(hook)
    _imp.create_builtin, _imp.create_dynamic = new_builtin, new_dynamic
    for name, module in (("_signal", _signal), ("posix", sys.modules["posix"]), ("os", os)):
        neuter(name, module)
    for name in ("settrace", "setprofile", "_settraceallthreads", "_setprofileallthreads"):
        if hasattr(sys, name):  # a tracer sees every frame; clearing one is harmless
            setattr(sys, name, refused_fn(f"sys.{name}", allow_none=True))
    del _signal, _imp, resource

    # -- preamble (the task's), the tests' imports, then the snapshot the tests will see ---------
    main = module_type("__main__")
    g = main.__dict__
    g["__builtins__"] = builtins
    sys.modules["__main__"] = main
    failure = None  # (status, reason, exception) of the first thing that went wrong

    phase = ["preamble"]  # what is running: the line numbers in reasons are its own

    def line_of(exc):
        tb = exc_tb(exc)
        tb = tb.tb_next if tb is not None else None  # skip the harness's own exec frame
        return f" (line {tb.tb_lineno} of the {phase[0]})" if tb is not None else ""

    def describe(exc):
        """`Type: message (line N)`, computed without running the solution's code."""
        try:
            name = type_name(type(exc))
        except BaseException:  # noqa: BLE001 - a hostile metaclass
            name = "exception"
        msg, line = "", line_of(exc)
        try:
            args = exc_args(exc)
            if len(args) >= 1 and type(args[0]) is str:
                msg = ": " + args[0][:300]
            elif len(args) >= 2 and type(args[0]) is int and type(args[1]) is str:
                msg = f": [Errno {args[0]}] {args[1][:300]}"  # an OSError
            elif name == "SystemExit":
                msg = f"({args[0]!r})" if len(args) == 1 and type(args[0]) is int else "()"
            loc = args[1] if len(args) == 2 and type(args[1]) is tuple else ()
            if issubclass(type(exc), SyntaxError) and len(loc) > 1 and type(loc[1]) is int:
                line = f" (line {loc[1]})"
        except BaseException:  # noqa: BLE001, S110
            pass
        return f"{name}{msg}{line}"

    def run(src, filename, globals_):
        """None if `src` (source, or a code object) ran to its end, else the exception."""
        try:
            if type(src) is str:
                src = compile(src, filename, "exec", dont_inherit=True, optimize=0)
            exec(src, globals_)
        except BaseException as exc:  # noqa: BLE001 - every way out is a verdict
            return exc
        return None

    def imported(src):
        names = []
        for line in src.splitlines():
            s = line.strip()
            if s.startswith("import "):
                names += [n.split(" as ")[0].strip() for n in s[7:].split(",")]
            elif s.startswith("from ") and not s.startswith("from ."):
                names.append(s[5:].split(" import", 1)[0].strip())
        return [n for n in names if n and n.replace(".", "").replace("_", "").isalnum()]

    exc = run(preamble, "<preamble>", g)
    if exc is not None:
        failure = ("failed", "the task's preamble raised " + describe(exc), exc)
    test_modules = ["types", *imported(preamble), *imported(tests)]  # types: see on_getattr
    for name in test_modules:
        try:
            __import__(name)
        except Exception:  # noqa: BLE001, S112 - the tests will fail on it themselves
            continue
    # the plain-data guard (imports ast and collections), and the tests compiled through it
    compile_tests, compare, wrap, wanted, not_plain = plain_guard()
    try:
        tests_code = compile_tests(tests)
    except Exception as e:  # noqa: BLE001 - a SyntaxError: reported when the tests would run
        tests_code = e
    if "traceback" in sys.modules:  # unittest's assertRaises calls it: tb_frame is refused
        sys.modules["traceback"].clear_frames = clear_frames
    pre_g = dict(g)
    builtins_snap = dict(builtins.__dict__)
    modules_snap = {
        n: (m, dict(m.__dict__))
        for n, m in sys.modules.items()
        if type(m) is module_type and n != "__main__"
    }
    classes_snap, tested_snap = [], []
    import_machinery = ("_frozen_importlib", "_frozen_importlib_external", "importlib")
    for name, (module, d) in modules_snap.items():
        if name in import_machinery or any(
            name == t or name.startswith(t + ".") for t in test_modules
        ):
            tested_snap.append((name, module, d))
            for v in d.values():
                if issubclass(type(v), type) and v.__flags__ & (1 << 9):  # heap types only
                    classes_snap.append((v, dict(type_dict(v))))
    del refusals[:]  # what the task's own code did is not the solution's doing
    state["locked"] = True  # from here on no frames, no hand-made code objects (marshal)
    sys.pycache_prefix = work_root + ".no-pycache"  # imports compile sources, never read .pyc

    # -- the solution, then the tests -----------------------------------------------------------
    pid = getpid()
    if failure is None:
        phase[0] = "solution"
        exc = run(solution, "<solution>", g)
        del reserve
        if exc is not None:
            if issubclass(type(exc), Exception):
                failure = ("failed", "the solution raised " + describe(exc), exc)
            else:
                what = describe(exc)
                failure = ("violation", f"the solution raised {what} before the tests ran", exc)
    if failure is None:
        try:
            copies = {}
            for name, (module, d) in modules_snap.items():
                copy = module_type(name)
                copy.__dict__.update(d)
                copies[id(module)] = (module, copy)
            for _, copy in copies.values():
                cd = copy.__dict__
                for k, v in list(cd.items()):
                    entry = copies.get(id(v)) if type(v) is module_type else None
                    if entry is not None and entry[0] is v:
                        cd[k] = entry[1]
            for name, module, snap in tested_snap:  # their functions read these globals
                d = module_dict(module)
                for k, v in snap.items():
                    if d.get(k, snap) is not v:
                        d[k] = v
                if modules.get(name) is not module:
                    modules[name] = module
            for cls, snap in classes_snap:
                d = type_dict(cls)
                for k, v in snap.items():
                    if d.get(k, snap) is not v:
                        type_setattr(cls, k, v)
                for k in [k for k in d if k not in snap]:
                    type_delattr(cls, k)
            tg = {
                k: v
                for k, v in g.items()
                if type(k) is str and not (k in builtins_snap and k not in pre_g)
            }
            tg.update(pre_g)
            for k, v in list(tg.items()):
                entry = copies.get(id(v)) if type(v) is module_type else None
                if entry is not None and entry[0] is v:
                    tg[k] = entry[1]
            tb = dict(builtins_snap)
            by_name = {name: copies[id(m)][1] for name, (m, _) in modules_snap.items()}
            tb["__import__"] = private_import(builtins_snap["__import__"], copies, by_name)
            tg["__builtins__"] = tb
            for k, v in list(tg.items()):  # the solution's functions return plain copies
                if k not in pre_g and wanted(v):
                    tg[k] = wrap(v, k)
            tg["_areal_compare"] = compare  # what the tests' comparisons call
        except BaseException as e:  # noqa: BLE001 - the solution broke something we copy
            failure = (
                "failed",
                "the sandbox could not set up the tests: " + describe(e),
                e,
            )
    if failure is None:
        phase[0] = "tests"
        exc = tests_code if issubclass(type(tests_code), Exception) else None
        if exc is None:
            exc = run(tests_code, "<tests>", tg)
        if exc is None:
            failure = ("passed", "the solution and all its tests ran", None)
        elif issubclass(type(exc), AssertionError):
            failure = ("failed", "a test failed: " + describe(exc), exc)
        elif issubclass(type(exc), Exception):
            failure = ("failed", "the tests raised " + describe(exc), exc)
        else:
            failure = (
                "violation",
                f"{describe(exc)} was raised during the tests",
                exc,
            )

    # -- the verdict: once, from this process, with the nonce -------------------------------------
    status, reason, exc = failure
    if not_plain and status != "violation":  # even when the tests caught the TypeError
        status, reason = "failed", "not plain data: " + not_plain[0]
    if refusals:
        more = f" (+{len(refusals) - 3} more)" if len(refusals) > 3 else ""
        status, reason = "violation", f"refused: {'; '.join(refusals[:3])}{more}; then {reason}"
    if getpid() != pid:
        exit_(1)  # a forked copy of the harness: only the original reports
    try:  # one write of < PIPE_BUF bytes: atomic, whatever else writes to the pipe
        line = " ".join(reason.split()).encode("utf-8", "replace")[:2048]
        write(verdict_fd, nonce + b" " + status.encode() + b" " + line + b"\n")
    except BaseException:  # noqa: BLE001 - a full or broken pipe: no verdict, no pass
        exit_(1)
    del nonce

    # -- after the verdict: what plain Python would print, for the stderr tail --------------------
    state["frames"] = True
    code = 0 if status == "passed" else 1
    try:
        if exc is not None and type(exc) is SystemExit:
            arg = exc_args(exc)[0] if exc_args(exc) else None
            if arg is None or type(arg) is int:
                code = (arg or 0) & 0xFF
            else:
                write(2, f"{arg}\n".encode("utf-8", "replace"))
        elif exc is not None:
            out, tb = ["Traceback (most recent call last):\n"], exc_tb(exc)
            tb = tb.tb_next if tb is not None else None
            while tb is not None:
                c = tb.tb_frame.f_code
                out.append(f'  File "{c.co_filename}", line {tb.tb_lineno}, in {c.co_name}\n')
                tb = tb.tb_next
            text = str(exc)
            out.append(f"{type_name(type(exc))}{': ' + text if text else ''}\n")
            write(2, "".join(out)[-8192:].encode("utf-8", "replace"))
    except BaseException:  # noqa: BLE001, S110 - the verdict is written; printing is a courtesy
        pass
    exit_(code)

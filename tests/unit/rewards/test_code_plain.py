"""The code reward's tests compare plain data: a solution cannot pass them with an object that
says yes to every comparison (the attacker's always-equal object, a subclass of int, str, list,
...), whatever else it patches first; honest returns of every plain type still pass.

Each program runs in the sandbox (`auto` isolation: the guard is the harness's, the same in
every mode).
"""

from __future__ import annotations

import textwrap

import pytest

from areal.rewards.code import code_reward
from areal.sandbox import SandboxResult, run_sandboxed

ALWAYS_EQUAL = """
class AlwaysEqual:
    def __eq__(self, other): return True
    def __ne__(self, other): return False
    def __hash__(self): return 0
    def __bool__(self): return True
    def __lt__(self, other): return True
    __le__ = __gt__ = __ge__ = __lt__
    def __sub__(self, other): return self
    __rsub__ = __add__ = __radd__ = __sub__
    def __abs__(self): return 0.0
    def __float__(self): return 0.0
    def __index__(self): return 0
    def __len__(self): return 0
    def __iter__(self): return iter(())
    def __contains__(self, item): return True
"""
EQ = "    def __eq__(self, other): return True\n    def __ne__(self, other): return False\n"
TESTS = "assert add(2, 3) == 5\nassert add(-1, 1) == 0\n"


def run(solution: str, tests: str = TESTS) -> SandboxResult:
    return run_sandboxed(textwrap.dedent(solution), textwrap.dedent(tests))


def assert_refused(r: SandboxResult, found: str = "") -> None:
    assert r.verdict == "failed" and r.reason.startswith("not plain data: "), r
    assert found in r.reason, r


# --- what a solution's function returns -------------------------------------------------------


@pytest.mark.parametrize(
    ("solution", "found"),
    [
        (ALWAYS_EQUAL + "def add(a, b):\n    return AlwaysEqual()\n", "add() returned AlwaysEqual"),
        (f"class I(int):\n{EQ}    __hash__ = int.__hash__\ndef add(a, b):\n    return I(0)\n", "I"),
        ("class I(int):\n    pass\ndef add(a, b):\n    return I(a + b)\n", "I"),  # even honest
        (f"class S(str):\n{EQ}    __hash__ = str.__hash__\ndef add(a, b):\n    return S()\n", "S"),
        (f"class F(float):\n{EQ}    __hash__ = float.__hash__\ndef add(a, b):\n    return F()\n", "F"),
        (f"class L(list):\n{EQ}\ndef add(a, b):\n    return L()\n", "L"),
        (f"class T(tuple):\n{EQ}    __hash__ = tuple.__hash__\ndef add(a, b):\n    return T()\n", "T"),
        (f"class D(dict):\n{EQ}\ndef add(a, b):\n    return D()\n", "D"),
        # the object hides inside plain containers, at any depth
        (ALWAYS_EQUAL + "def add(a, b):\n    return [1, (2, {'k': AlwaysEqual()})]\n", "AlwaysEqual"),
        (ALWAYS_EQUAL + "def add(a, b):\n    return {AlwaysEqual()}\n", "AlwaysEqual"),
        (ALWAYS_EQUAL + "def add(a, b):\n    return {AlwaysEqual(): 1}\n", "AlwaysEqual"),
        ("def add(a, b):\n    yield a + b\n", "generator"),
        ("def add(a, b):\n    return map(int, [a + b])\n", "map"),
        ("def add(a, b):\n    return lambda: a + b\n", "function"),
    ],
    ids=[
        "always_equal", "int_subclass", "honest_int_subclass", "str_subclass", "float_subclass",
        "list_subclass", "tuple_subclass", "dict_subclass", "nested", "in_a_set", "a_dict_key",
        "generator", "map", "function",
    ],
)  # fmt: skip
def test_a_function_returning_anything_but_plain_data_scores_0(solution: str, found: str):
    assert_refused(run(solution), found)
    assert code_reward(solution, TESTS) == 0.0


def test_the_refusal_counts_even_when_the_tests_catch_it():
    tests = "try:\n    assert add(2, 3) == 5\nexcept Exception:\n    pass\n"
    assert_refused(run(ALWAYS_EQUAL + "def add(a, b):\n    return AlwaysEqual()\n", tests))


def test_unittest_assert_equal_compares_the_plain_copy():
    tests = """
        import unittest
        class T(unittest.TestCase):
            def test_add(self):
                self.assertEqual(add(2, 3), 5)
        result = unittest.TextTestRunner(stream=open("/dev/null", "w")).run(
            unittest.defaultTestLoader.loadTestsFromTestCase(T))
        assert result.wasSuccessful() and not result.skipped
    """
    assert_refused(run(ALWAYS_EQUAL + "def add(a, b):\n    return AlwaysEqual()\n", tests))
    assert run("def add(a, b):\n    return a + b\n", tests).passed


def test_a_callable_object_or_a_class_in_place_of_the_function():
    callable_object = ALWAYS_EQUAL + "class Add:\n    def __call__(self, a, b):\n"
    callable_object += "        return AlwaysEqual()\nadd = Add()\n"
    assert_refused(run(callable_object), "add() returned AlwaysEqual")
    # a class is not wrapped (class-based tasks keep their instances), but the tests'
    # comparisons are: its instance never compares
    a_class = (
        ALWAYS_EQUAL + "class add:\n    def __new__(cls, a, b):\n        return AlwaysEqual()\n"
    )
    assert_refused(run(a_class), "the tests compared AlwaysEqual")


# --- what the tests compare ---------------------------------------------------------------------


def test_mutating_an_argument_in_place():
    tests = "xs = [3, 1, 2]\nsort_in_place(xs)\nassert xs == [1, 2, 3]\n"
    hack = ALWAYS_EQUAL + "def sort_in_place(xs):\n    xs[:] = [AlwaysEqual()] * 3\n"
    assert_refused(run(hack, tests), "the tests compared AlwaysEqual")
    assert run("def sort_in_place(xs):\n    xs.sort()\n", tests).passed


def test_a_thread_that_swaps_the_returned_list_after_the_check():
    # the tests compare the harness's own copy: the thread reaches only the original
    hack = (
        ALWAYS_EQUAL
        + """
import threading
def add(a, b):
    out = [0]
    def swap():
        while True:
            out[0] = AlwaysEqual()
            out[0] = 0
    threading.Thread(target=swap, daemon=True).start()
    return out
"""
    )
    for _ in range(3):
        r = run(hack, "for _ in range(200):\n    assert add(2, 3) == [5]\n")
        assert not r.passed and r.verdict == "failed", r


@pytest.mark.parametrize(
    "patch",
    [
        # builtins the checks could use
        "import builtins\nbuiltins.type = lambda *a: int\nbuiltins.isinstance = lambda *a: True\n"
        "builtins.id = lambda o: 0\nbuiltins.issubclass = lambda *a: True\n",
        # the name the tests' comparisons call, and the guard's modules
        "_areal_compare = lambda *a: True\nimport ast, collections\n"
        "collections.Counter = AlwaysEqual\nast.NodeTransformer.visit = lambda self, node: node\n",
        # the harness's objects the solution can reach (their globals hold no guard)
        "import gc\ng = gc.set_debug.__globals__\ng['__builtins__']['type'] = lambda *a: int\n",
        # a metaclass that lies to `==`, `in` and `hash` on the class itself
        "class Meta(type):\n    def __eq__(cls, other): return True\n"
        "    def __hash__(cls): return hash(int)\n"
        "AlwaysEqual = Meta('AlwaysEqual', (AlwaysEqual,), {})\n",
    ],
    ids=["builtins", "guard_names_and_modules", "exposed_globals", "metaclass"],
)
def test_patching_what_the_guard_uses_first(patch: str):
    solution = ALWAYS_EQUAL + patch + "def add(a, b):\n    return AlwaysEqual()\n"
    assert_refused(run(solution), "add() returned AlwaysEqual")


def test_data_too_deep_to_copy_is_refused():
    deep = "def add(a, b):\n    x = 5\n    for _ in range(500):\n        x = [x]\n    return x\n"
    assert_refused(run(deep, "assert add(2, 3) != 0\n"), "deeper than")
    # a recursion limit the solution lowers cannot make the copy pass: it fails
    low_limit = "import sys\nsys.setrecursionlimit(30)\n" + deep.replace("500", "40")
    assert_refused(run(low_limit, "assert add(2, 3) != 0\n"), "too deep")


def test_a_range_of_int_subclasses():
    # range() keeps exact ints (from `__index__`); the copy checks them all the same
    hack = f"class I(int):\n{EQ}    __hash__ = int.__hash__\n    def __index__(self): return self\n"
    hack += "def add(a, b):\n    return range(I(0), I(1))\n"
    r = run(hack, "assert add(2, 3) == range(5, 6)\n")
    assert not r.passed, r


# --- honest solutions still pass ----------------------------------------------------------------


def test_every_plain_type_passes():
    solution = """
        import collections
        def f():
            nested = [[0] * 2] * 2  # aliased: one list twice
            cyclic = [1]
            cyclic.append(cyclic)
            return [1, 2.5, 3j, True, "s", b"b", None, (1, (2,)), {"k": [1]}, {1, 2},
                    frozenset({(1, "a")}), range(3), int, nested, cyclic[0]]
        def counts(xs):
            return collections.Counter(xs)
        def groups(xs):
            out = collections.defaultdict(list)
            for x in xs:
                out[x % 2].append(x)
            return out
        def ordered():
            return collections.OrderedDict([("b", 1), ("a", 2)])
    """
    tests = """
        assert f() == [1, 2.5, 3j, True, "s", b"b", None, (1, (2,)), {"k": [1]}, {1, 2},
                       frozenset({(1, "a")}), range(3), int, [[0, 0], [0, 0]], 1]
        assert counts("aab") == {"a": 2, "b": 1}
        assert groups([1, 2, 3]) == {1: [1, 3], 0: [2]}
        assert ordered() == {"a": 2, "b": 1}
        assert f()[0] is not None and f()[6] is None and 0 <= f()[0] < 2 != 3
        assert 3 in range(f()[0] + 5) and "s" in f() and type(f()[0]) == int
        assert all(f()[i] == v for i, v in enumerate([1, 2.5]))
        class Checks:
            ok = f()[0] == 1
        assert Checks.ok
    """
    r = run(solution, tests)
    assert r.passed, r


def test_a_class_based_task_passes():
    solution = """
        class Stack:
            def __init__(self):
                self.items = []
            def push(self, x):
                self.items.append(x)
            def pop(self):
                return self.items.pop()
    """
    tests = """
        s = Stack()
        s.push(1); s.push(2)
        assert isinstance(s, Stack) and s.pop() == 2 and s.pop() == 1 and s.items == []
    """
    assert run(solution, tests).passed


def test_the_tests_may_still_fail_honestly():
    r = run("def add(a, b):\n    return a - b\n")
    assert r.verdict == "failed" and r.reason.startswith("a test failed"), r
    r = run("def add(a, b):\n    return a + b\n", "assert add(1, 2) == 3 ==\n")
    assert r.verdict == "failed" and "SyntaxError" in r.reason, r


def test_a_function_the_tests_hand_to_the_solution_is_its_own():
    # `apply` receives `add` itself, not the tests' wrapper (whose closure leads to the guard)
    solution = """
        def add(a, b):
            return a + b
        def apply(f, *args, key=None):
            assert f is add and key is add, (f, key)
            return f(*args)
    """
    assert run(solution, "assert apply(add, 2, 3, key=add) == 5\n").passed

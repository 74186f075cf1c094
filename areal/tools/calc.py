"""The `calc` tool: exact arithmetic on integers and decimals, read with `ast`, never `eval`.

Invariants:
- Accepted: integer and decimal literals (`12`, `3.5`, `1e3`), `+ - * / // % **`, unary `+ -`,
  parentheses; a trailing `=` and surrounding whitespace are ignored. Anything else (a name, a
  call, an attribute, a string, `^`, a comparison) is refused with `ToolArgumentError` naming it.
- Integers stay exact Python ints while only `+ - * // % **` (non-negative exponents) touch
  them; `/`, a decimal literal or a negative exponent makes the value a `Decimal` (28
  significant digits). An integral result prints as an integer (`7/7` is `1`), a decimal one
  in plain notation without trailing zeros (`7/2` is `3.5`).
- Bounded work: the text is at most `MAX_CHARS` characters, an exponent at most `MAX_EXPONENT`
  in magnitude, and every intermediate result at most `MAX_DIGITS` digits, checked before
  computing it (`2**10**10` is refused at once, not computed). Division by zero is refused.
"""

from __future__ import annotations

import ast
import decimal
import math
from decimal import Decimal

from areal.tools.base import Tool, ToolArgumentError

MAX_CHARS = 500
MAX_EXPONENT = 10_000
MAX_DIGITS = 1_000
_MAX_BITS = int(MAX_DIGITS * math.log2(10)) + 1
_CONTEXT = decimal.Context(prec=28, Emax=MAX_DIGITS, Emin=-MAX_DIGITS, traps=[])
_OPS = {
    ast.Add: "+",
    ast.Sub: "-",
    ast.Mult: "*",
    ast.Div: "/",
    ast.FloorDiv: "//",
    ast.Mod: "%",
    ast.Pow: "**",
}
ALLOWED = "numbers and + - * / // % ** ( )"

Number = int | Decimal


def calc(expression: str) -> str:
    """Evaluate an arithmetic expression exactly (integers and decimals, + - * / // % ** and
    parentheses), e.g. 37*41+5."""
    text = expression.strip().removesuffix("=").strip()
    if not text:
        raise ToolArgumentError(f"calc: an empty expression; write {ALLOWED}")
    if len(text) > MAX_CHARS:
        raise ToolArgumentError(f"calc: the expression is over {MAX_CHARS} characters")
    try:
        tree = ast.parse(text, mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError) as e:
        raise ToolArgumentError(f"calc: cannot read {text!r}: {getattr(e, 'msg', e)}") from None
    with decimal.localcontext(_CONTEXT):
        value = _eval(tree.body, text)
    return _format(value)


def calc_tool() -> Tool:
    return Tool(
        name="calc",
        description="Exact arithmetic: integers and decimals with + - * / // % ** and "
        "parentheses, e.g. 37*41+5",
        fn=calc,
        parameter="expression",
    )


def _eval(node: ast.AST, text: str) -> Number:
    if isinstance(node, ast.Constant):
        if type(node.value) is int:
            _check_size(node.value)
            return node.value
        if type(node.value) is float:  # the literal as written, not the float it became
            src = ast.get_source_segment(text, node) or repr(node.value)
            return _check_size(Decimal(src.replace("_", "")))
        raise ToolArgumentError(f"calc: {node.value!r} is not a number; only {ALLOWED}")
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.UAdd, ast.USub)):
        v = _eval(node.operand, text)
        return -v if isinstance(node.op, ast.USub) else v
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        return _binop(_OPS[type(node.op)], _eval(node.left, text), _eval(node.right, text))
    what = ast.get_source_segment(text, node) or type(node).__name__
    kind = {ast.Name: "a name", ast.Call: "a call", ast.Attribute: "an attribute"}.get(
        type(node), "an operation"
    )
    raise ToolArgumentError(f"calc: {kind} ({what!r}) is not allowed; only {ALLOWED}")


def _binop(op: str, a: Number, b: Number) -> Number:
    if op in ("/", "//", "%") and b == 0:
        raise ToolArgumentError("calc: division by zero")
    if op == "**":
        return _power(a, b)
    if op == "*" and _digits_bound(a) + _digits_bound(b) > MAX_DIGITS + 1:  # before computing
        raise ToolArgumentError(f"calc: the result would have over {MAX_DIGITS} digits")
    if op == "/":
        return _check_size(Decimal(a) / Decimal(b))
    if isinstance(a, Decimal) or isinstance(b, Decimal):
        a, b = Decimal(a), Decimal(b)
    if op == "+":
        out = a + b
    elif op == "-":
        out = a - b
    elif op == "*":
        out = a * b
    elif op == "//":
        out = a // b if isinstance(a, int) else (a / b).to_integral_value(decimal.ROUND_FLOOR)
    else:
        out = (
            a % b if isinstance(a, int) else a - b * (a / b).to_integral_value(decimal.ROUND_FLOOR)
        )
    return _check_size(out)


def _power(a: Number, b: Number) -> Number:
    if isinstance(b, Decimal):
        if b != b.to_integral_value():
            raise ToolArgumentError("calc: only whole-number exponents are allowed")
        b = int(b)
    if abs(b) > MAX_EXPONENT:
        raise ToolArgumentError(f"calc: the exponent {b} is over {MAX_EXPONENT} in magnitude")
    if a == 0 and b < 0:
        raise ToolArgumentError("calc: division by zero (0 to a negative power)")
    if a != 0 and b * _log10(abs(a)) > MAX_DIGITS:
        raise ToolArgumentError(f"calc: the result would have over {MAX_DIGITS} digits")
    if isinstance(a, int) and b >= 0:
        return _check_size(a**b)
    return _check_size(Decimal(a) ** b)


def _log10(v: Number) -> float:
    return math.log10(v) if isinstance(v, int) else float(v.log10())


def _digits_bound(v: Number) -> int:
    """An upper bound on the digits of |v|'s integer part (at least 1)."""
    if isinstance(v, int):
        return max(1, math.ceil(abs(v).bit_length() / math.log2(10)))
    return max(1, v.adjusted() + 1) if v else 1


def _check_size(v: Number) -> Number:
    if isinstance(v, int):
        if v.bit_length() > _MAX_BITS:
            raise ToolArgumentError(f"calc: a value has over {MAX_DIGITS} digits")
        return v
    if not v.is_finite() or (v and v.adjusted() >= MAX_DIGITS):
        raise ToolArgumentError(f"calc: a value has over {MAX_DIGITS} digits")
    return v


def _format(v: Number) -> str:
    if isinstance(v, int):
        return str(v)
    if v == v.to_integral_value():
        return str(int(v))
    return format(v.normalize(), "f")

"""The calc tool: exact arithmetic read with `ast`, bounded, refusing everything else."""

from __future__ import annotations

import pytest

from areal.tools.base import ToolArgumentError
from areal.tools.calc import MAX_DIGITS, calc


@pytest.mark.parametrize(
    ("expression", "expected"),
    [
        ("37*41", "1517"),  # 37*41 = 1517
        ("37*41+5=", "1522"),  # a trailing "=" is ignored
        (" (1+2)*3 ", "9"),
        ("7/2", "3.5"),  # / gives a decimal
        ("7/7", "1"),  # an integral result prints as an integer
        ("-3//2", "-2"),  # floor division, as in Python
        ("-7%3", "2"),  # floor modulo, as in Python
        ("7.5%2", "1.5"),
        ("-7.5//2", "-4"),  # floor(-3.75)
        ("0.1+0.2", "0.3"),  # decimals, not binary floats
        ("3.5*2", "7"),
        ("1e3", "1000"),
        ("2**-2", "0.25"),
        ("2**100", "1267650600228229401496703205376"),  # exact integers
        ("-2**2", "-4"),  # ** binds tighter than unary minus
        ("1/3", "0.3333333333333333333333333333"),  # 28 significant digits
    ],
)
def test_arithmetic(expression, expected):
    assert calc(expression) == expected


@pytest.mark.parametrize(
    ("expression", "why"),
    [
        ("2**10**10", "exponent"),  # refused before computing, not computed
        ("10**1000*10", f"over {MAX_DIGITS} digits"),
        ("(10**500)*(10**501)", f"over {MAX_DIGITS} digits"),
        ("0.5**-5000", f"over {MAX_DIGITS} digits"),
        ("x+1", "a name"),
        ("__import__('os').system('true')", "a call"),
        ("(2).real", "an attribute"),
        ("2^3", "not allowed"),
        ("1<2", "not allowed"),
        ("'a'*3", "not a number"),
        ("True+1", "not a number"),
        ("1j", "not a number"),
        ("2**0.5", "whole-number exponents"),
        ("1/0", "division by zero"),
        ("1%0", "division by zero"),
        ("0**-1", "division by zero"),
        ("", "empty"),
        ("1+", "cannot read"),
        ("9" * 600, "over 500 characters"),
        ("(" * 300 + "1" + ")" * 300, "over 500 characters"),
        ("(" * 210 + "1" + ")" * 210, "cannot read"),  # too deeply nested for the parser
    ],
)
def test_refusals_name_the_reason(expression, why):
    with pytest.raises(ToolArgumentError, match="calc: ") as e:
        calc(expression)
    assert why in str(e.value)

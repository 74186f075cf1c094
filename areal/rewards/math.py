"""Math answer verification: pull the final answer out of a completion and compare numbers.

Invariants:
- Pure functions, text in, value out; never raise on any input string.
- `extract_answer` precedence: the last `\\boxed{...}` (nested braces allowed), then the last
  `#### x` line, then the last `answer: x` / `answer is x` (case-insensitive), then the last
  number anywhere in the text; None if there is none.
- `numbers_equal` compares exact rationals (ints, decimals, `a/b`, `\\frac{a}{b}`, thousands
  commas, spaces, `$`, a trailing `.`) and falls back to normalised string equality for
  anything that is not a number.
"""

from __future__ import annotations

import re
from fractions import Fraction

_NUMBER = r"-?\d[\d,]*(?:\.\d+)?(?:\s*/\s*\d+)?|-?\.\d+"
_NUMBER_RE = re.compile(_NUMBER)
_HASHES_RE = re.compile(r"####\s*([^\n]+)")
_ANSWER_RE = re.compile(r"answer\s*(?::|is)\s*([^\n]+)", re.IGNORECASE)
_FRAC_RE = re.compile(r"^(-?)\\[dt]?frac\{([^{}]+)\}\{([^{}]+)\}$")


def _last_boxed(text: str) -> str | None:
    start = max(text.rfind("\\boxed{"), text.rfind("\\fbox{"))
    if start < 0:
        return None
    i = text.index("{", start) + 1
    depth = 1
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i:j].strip()
    return None  # unbalanced: fall through to the next rule


def _clean_tail(value: str) -> str:
    value = value.strip().rstrip(".").strip()
    match = _NUMBER_RE.search(value)
    # "answer: 42 apples" -> "42"; "answer: x+1" stays as text.
    if match and not re.search(r"[A-Za-z\\]", value[: match.start()]):
        return match.group(0).strip()
    return value


def extract_answer(text: str) -> str | None:
    """The final answer stated in `text`, or None if it states none."""
    boxed = _last_boxed(text)
    if boxed:
        return boxed
    hashes = _HASHES_RE.findall(text)
    if hashes and hashes[-1].strip():
        return _clean_tail(hashes[-1])
    answers = _ANSWER_RE.findall(text)
    if answers and answers[-1].strip():
        return _clean_tail(answers[-1])
    numbers = _NUMBER_RE.findall(text)
    return numbers[-1].strip() if numbers else None


def _normalise(text: str) -> str:
    text = text.strip().strip("$").strip()
    text = re.sub(r"\\(?:left|right|!|,|;)", "", text)
    text = text.replace(" ", "").replace(",", "")
    return text.rstrip(".")


def parse_number(text: str) -> Fraction | None:
    """Exact value of an int / decimal / fraction string, or None if it is not one."""
    text = _normalise(text)
    frac = _FRAC_RE.match(text)
    if frac:
        text = f"{frac.group(1)}{frac.group(2)}/{frac.group(3)}"
    if text.endswith("%"):
        text = text[:-1]
    try:
        if "/" in text:
            num, den = text.split("/")
            return Fraction(num) / Fraction(den)
        if not re.fullmatch(r"[-+]?(\d+(\.\d*)?|\.\d+)", text):
            return None
        return Fraction(text)
    except (ValueError, ZeroDivisionError):
        return None


def numbers_equal(a: str, b: str) -> bool:
    """True iff `a` and `b` denote the same number (or, for non-numbers, the same text)."""
    x, y = parse_number(a), parse_number(b)
    if x is not None and y is not None:
        return x == y
    return bool(_normalise(a)) and _normalise(a) == _normalise(b)


def math_reward(completion: str, answer: str) -> float:
    """1.0 iff the completion's final answer equals `answer`. A reference answer in solution
    form (e.g. GSM8K's "... #### 72") is reduced with `extract_answer` first."""
    predicted = extract_answer(completion)
    if predicted is None:
        return 0.0
    reference = answer if parse_number(answer) is not None else extract_answer(answer) or answer
    return 1.0 if numbers_equal(predicted, reference) else 0.0

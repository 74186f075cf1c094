"""Math answer verification: an exact fast path for numbers, HF `math-verify` for the rest.

Invariants:
- `math_reward` is pure (text in, exactly 0.0 or 1.0 out) and never raises an `Exception` on
  any input: a parser or comparison failure scores 0.0 and is logged with its reason
  (`math_verify_error`). A `BaseException` (the pool's `ItemTimeout`, KeyboardInterrupt) is never
  caught here: it passes through to `areal.rewards.scoring`.
- Only the final segment of a completion counts: the text after its last `</think>`, and of
  that, the text before any `<think>` left open (a completion cut off while thinking scores 0;
  an answer stated only inside the thinking scores 0).
- At most `MAX_TEXT_CHARS` of the completion and of the answer are read, their tails (the final
  answer is at the end): sympy on a huge input can hang in C code, where no alarm reaches.
- The gold answer may be plain (`72`, `\\frac{1}{2}`, `x^2+1`) or a solution: its last
  `#### x` (GSM8K), else its last `\\boxed{x}`, is the answer.
- Route, first match wins. (1) exact: when the completion states an anchored answer (the last
  `\\boxed{}`, `#### x`, `answer is x` / `answer: x`) that equals the gold as an exact rational or
  as normalised text, 1.0; when both are exact numbers and neither has a `%`, 0.0. (2)
  last_number: with no anchored answer (and no `\\boxed` at all: a completion whose boxes are
  all empty or unclosed states nothing and scores 0.0), the last number of the final segment equal to the gold
  scores 1.0, and against a gold that is an exact number anything else scores 0.0: a plain
  expression in the text is never evaluated ("I do not know. 3+4" never matches 7). (3)
  math-verify: the last `\\boxed{}` alone if there is one, else the anchored answer, else (a
  non-numeric gold) only the LaTeX math of the final segment, parsed and compared symbolically (fractions, radicals, polynomials, sets, intervals, percentages,
  LaTeX); a prediction with `{` nested deeper than `MAX_BRACE_DEPTH` (inside its box) is not
  parsed and scores 0.0 (route `rejected`): math-verify's parse time doubles with each level of
  bare braces (`{{{7}}}`, 16 levels take ~30 s). (4) without an importable `math_verify`: the
  pure comparison of `extract_answer` with `numbers_equal` (logged once,
  `math_verify_unavailable`).
- Exact numbers: ints, decimals, `a/b`, `\\frac{a}{b}`, a trailing `%`; spaces, `$`, `\\$`, `\\,`
  and a trailing `.` are ignored. A comma is a thousands separator only between groups of three
  digits (`1,000`, `1{,}000`, `12,345.5`): `1,2` and `1, 2` are lists of two answers, never 12.
- math-verify's own timeouts are off (`parsing_timeout=None`, `timeout_seconds=None`): they use
  `signal.alarm`, which would replace the pool's per-item SIGALRM timer and cancel it. A slow
  parse or comparison is cut by that per-item timeout (`areal.rewards.scoring`); called outside
  such a pool (no alarm), nothing bounds it, so score untrusted text through the pool.
"""

from __future__ import annotations

import functools
import logging
import re
from fractions import Fraction
from types import ModuleType
from typing import Any

import structlog

log = structlog.get_logger()

MAX_TEXT_CHARS = 20_000  # tail of the completion / answer that is read
MAX_BRACE_DEPTH = 10  # deeper `{` nesting is rejected: math-verify's parse is exponential in it
# Thousands commas only in groups of three (`1,000`, `12,345.5`): `1,2` is a list, not 12.
_NUMBER = r"-?(?:\d{1,3}(?:,\d{3})+(?!\d)|\d+)(?:\.\d+)?(?:\s*/\s*\d+)?|-?\.\d+"
_NUMBER_RE = re.compile(_NUMBER)
_HASHES_RE = re.compile(r"####\s*([^\n]+)")
_ANSWER_RE = re.compile(r"answer\s*(?::|is)\s*([^\n]+)", re.IGNORECASE)
_FRAC_RE = re.compile(r"^(-?)\\[dt]?frac\{([^{}]+)\}\{([^{}]+)\}$")
_THOUSANDS_COMMA_RE = re.compile(r"(?<=\d),(?=\d{3}(?!\d))")
_LIST_REST_RE = re.compile(r"\s*[,;]\s*-?\d")  # "1, 2": the rest of a list of answers
_LATEX_MARKERS = ("$", "\\(", "\\[", "\\boxed")

# --- pure extraction and exact comparison -------------------------------------------------------


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
    if "=" in value:  # "the answer is 3 + 4 = 7" -> "7"
        value = value.rsplit("=", 1)[1].strip()
    match = _NUMBER_RE.search(value)
    # "answer: 42 apples" -> "42"; "answer: x+1" and "answer: 1, 2" stay as text.
    if (
        match
        and not re.search(r"[A-Za-z\\]", value[: match.start()])
        and not _LIST_REST_RE.match(value, match.end())
    ):
        return match.group(0).strip()
    return value


def _anchored_answer(text: str) -> str | None:
    """The answer `text` states explicitly: last box, else last `####`, else last `answer is`."""
    boxed = _last_boxed(text)
    if boxed:
        return boxed
    hashes = _HASHES_RE.findall(text)
    if hashes and hashes[-1].strip():
        return _clean_tail(hashes[-1])
    answers = _ANSWER_RE.findall(text)
    if answers and answers[-1].strip():
        return _clean_tail(answers[-1])
    return None


def extract_answer(text: str) -> str | None:
    """The final answer stated in `text`: the last `\\boxed{...}` (nested braces allowed), then
    the last `#### x`, then the last `answer: x` / `answer is x`, then the last number; None if
    there is none."""
    anchored = _anchored_answer(text)
    if anchored is not None:
        return anchored
    numbers = _NUMBER_RE.findall(text)
    return numbers[-1].strip() if numbers else None


def _normalise(text: str) -> str:
    text = text.replace("\\$", "").replace("{,}", ",")  # `\$5`, LaTeX's `1{,}000`
    text = text.strip().strip("$").strip()
    text = re.sub(r"\\(?:left|right|!|,|;)", "", text)
    text = _THOUSANDS_COMMA_RE.sub("", text.replace(" ", ""))
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
    except (ValueError, ZeroDivisionError):  # includes ints past Python's digit limit
        return None


def numbers_equal(a: str, b: str) -> bool:
    """True iff `a` and `b` denote the same number (or, for non-numbers, the same text)."""
    x, y = parse_number(a), parse_number(b)
    if x is not None and y is not None:
        return x == y
    return bool(_normalise(a)) and _normalise(a) == _normalise(b)


# --- what is read ---------------------------------------------------------------------------


def final_segment(completion: str) -> str:
    """The part of `completion` that states its answer (see the module invariants)."""
    end = completion.rfind("</think>")
    if end >= 0:
        completion = completion[end + len("</think>") :]
    return completion.split("<think>", 1)[0][-MAX_TEXT_CHARS:]


def reduce_gold(answer: str) -> str:
    """The gold answer itself: `72` from `... #### 72`, `x` from `... \\boxed{x}`, else as is."""
    answer = answer.strip()[-MAX_TEXT_CHARS:]
    hashes = _HASHES_RE.findall(answer)
    if hashes and hashes[-1].strip():
        return _clean_tail(hashes[-1])
    return _last_boxed(answer) or answer


# --- math-verify -------------------------------------------------------------------------------


class _DropTimeoutDisabledWarning(logging.Filter):
    """math-verify warns once per process that its timeouts are off; that is by design here."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "Timeout is disabled" not in record.getMessage()


_mv_module: ModuleType | None = None
_mv_missing = False


def _math_verify() -> ModuleType | None:
    """`math_verify`, imported on first use (it pulls in sympy and antlr); None if unavailable."""
    global _mv_module, _mv_missing
    if _mv_module is None and not _mv_missing:
        try:
            import math_verify
        except Exception as e:  # not installed, or a broken antlr runtime
            _mv_missing = True
            log.warning(
                "math_verify_unavailable",
                error=f"{type(e).__name__}: {e}",
                fallback="exact numbers and normalised text only",
                fix="pip install 'math-verify>=0.7'",
            )
            return None
        for name in ("math_verify.parser", "math_verify.grader"):
            logging.getLogger(name).addFilter(_DropTimeoutDisabledWarning())
        _mv_module = math_verify
    return _mv_module


@functools.lru_cache(maxsize=4096)  # a group of samples shares one gold answer
def _parse_gold(mv: ModuleType, gold: str) -> tuple[Any, ...]:
    # `\$5` is a dollar amount, not math mode: such a gold is wrapped in `$...$` like plain ones.
    if any(marker in gold.replace("\\$", "") for marker in _LATEX_MARKERS):
        configs = [mv.LatexExtractionConfig(), mv.ExprExtractionConfig()]
        return tuple(mv.parse(gold, configs, parsing_timeout=None))
    parsed = mv.parse(f"${gold}$", [mv.LatexExtractionConfig()], parsing_timeout=None)
    if not parsed:  # not LaTeX after all: a plain expression such as `3*x + 1`
        parsed = mv.parse(gold, [mv.ExprExtractionConfig()], parsing_timeout=None)
    return tuple(parsed)


def brace_depth(text: str) -> int:
    """The deepest nesting of `{` in `text` (a stray `}` does not go below 0)."""
    depth = deepest = 0
    for char in text:
        if char == "{":
            depth += 1
            deepest = max(deepest, depth)
        elif char == "}":
            depth = max(0, depth - 1)
    return deepest


def _mv_equal(mv: ModuleType, prediction: str, gold: str, *, latex_only: bool = False) -> bool:
    gold_parsed = _parse_gold(mv, gold)
    configs = [mv.LatexExtractionConfig()]
    if not latex_only:
        configs.append(mv.ExprExtractionConfig())
    pred_parsed = mv.parse(prediction, configs, parsing_timeout=None)
    if not gold_parsed or not pred_parsed:
        return False
    return bool(mv.verify(list(gold_parsed), pred_parsed, timeout_seconds=None))


# --- the reward ----------------------------------------------------------------------------------

Detail = dict[str, str | None]  # route, predicted, gold, error


def math_reward_detail(completion: str, answer: str) -> tuple[float, Detail]:
    """`math_reward` with how it was decided: `route` (`no_answer`, `exact`, `last_number`,
    `math_verify`, `rejected`, `pure_fallback`, `error`), the `predicted` and `gold` strings compared, and any
    `error` (the exception, or why the input was rejected)."""
    text, gold = final_segment(completion), reduce_gold(answer)
    detail: Detail = {"route": "no_answer", "predicted": None, "gold": gold, "error": None}
    if not text.strip() or not gold:
        return 0.0, detail
    anchored = _anchored_answer(text)
    if anchored is not None:
        detail.update(route="exact", predicted=anchored)
        if numbers_equal(anchored, gold):
            return 1.0, detail
        exact_numbers = parse_number(anchored) is not None and parse_number(gold) is not None
        if exact_numbers and "%" not in anchored + gold:
            return 0.0, detail
    mv = _math_verify()
    if mv is None:
        predicted = extract_answer(text)
        detail.update(route="pure_fallback", predicted=predicted)
        return (1.0 if predicted is not None and numbers_equal(predicted, gold) else 0.0), detail
    boxed = _last_boxed(text)
    latex_only = False
    if boxed:
        prediction = f"\\boxed{{{boxed}}}"
    elif anchored is not None:
        prediction = anchored
    elif "\\boxed" in text:  # only empty or unclosed boxes: the stated answer is nothing
        detail.update(route="no_answer")
        return 0.0, detail
    else:
        # No stated answer: the last number, exactly; plain expressions are never evaluated
        # ("I do not know. 3+4" must not score against 7), only LaTeX math is parsed.
        last = extract_answer(text)
        if last is not None and numbers_equal(last, gold):
            detail.update(route="last_number", predicted=last)
            return 1.0, detail
        if parse_number(gold) is not None:
            detail.update(route="last_number", predicted=last)
            return 0.0, detail
        prediction, latex_only = text, True
    detail.update(route="math_verify", predicted=boxed or anchored)
    if brace_depth(prediction) > MAX_BRACE_DEPTH + 1:  # + 1: the box's own braces
        detail.update(route="rejected", error=f"braces nested deeper than {MAX_BRACE_DEPTH}")
        return 0.0, detail
    try:
        return (1.0 if _mv_equal(mv, prediction, gold, latex_only=latex_only) else 0.0), detail
    except Exception as e:  # a math-verify / sympy bug on odd input: this sample scores 0
        detail.update(route="error", error=f"{type(e).__name__}: {e}"[:500])
        log.warning("math_verify_error", error=detail["error"], gold=gold[:200])
        return 0.0, detail


def math_reward(completion: str, answer: str) -> float:
    """1.0 iff the completion's final answer equals `answer` (see the module invariants)."""
    return math_reward_detail(completion, answer)[0]

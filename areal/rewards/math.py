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
- A hedge scores 0.0 before any route (route `rejected`, `hedge`): against a gold that is one
  number, every value the stated answer (the last box's content, else the line after the last
  `####` / `answer is`) gives must be that one value. Its parts are split at `=`, `\\equiv`,
  `\\Rightarrow`, `\\to`, `\\lor`, `\\mid`, `\\\\`, `~`, wide spaces, the word `or` and its words
  (`\\text{...}`, whose numbers are parts too); parts that are numbers must be equal (exactly,
  else by math-verify), names are skipped. So `\\boxed{2+2 = 6}`, `\\boxed{1 = 2 = 6}` and
  `\\boxed{6 \\text{ apples, or 7}}` score 0.0 where math-verify alone read one part (the last of
  a chain, the number before the words), while `\\boxed{x = 6}`, `\\boxed{2+4=6}` and
  `\\boxed{6 \\text{ apples}}` keep 1.0. `\\approx` is no join (`2\\pi \\approx 6.28`); against
  a list, an equation or an expression gold (`(x+1)^2`) the parts are math-verify's to judge.
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
MAX_PARTS = 16  # values an answer may join (`x = 2+4 = 6` joins 3) against a one-number gold
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


def _stated_answer(text: str) -> tuple[str, bool] | None:
    """The answer `text` states explicitly, as written, and whether it is a box: the last box's
    content, else the rest of the line after the last `####`, else after the last `answer is`."""
    boxed = _last_boxed(text)
    if boxed:
        return boxed, True
    for found in (_HASHES_RE.findall(text), _ANSWER_RE.findall(text)):
        if found and found[-1].strip():
            return found[-1].strip(), False
    return None


def _anchored_answer(text: str) -> str | None:
    """The answer `text` states explicitly: last box, else last `####`, else last `answer is`
    (of these two, the number of the line, see `_clean_tail`)."""
    stated = _stated_answer(text)
    if stated is None:
        return None
    answer, boxed = stated
    return answer if boxed else _clean_tail(answer)


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


# --- hedges: an answer that states two different values -----------------------------------------

# Words in an answer (`\text{ apples}`) and a unit's exponent after them (`\text{m}^2`).
_WORDS_RE = re.compile(
    r"\\(?:text|textbf|textit|textrm|mathrm|mbox|operatorname)\s*\{([^{}]*)\}"
    r"(?:\s*[_^]\s*(?:\{[^{}]*\}|\w))?"
)
# What joins two values that math-verify reads only one of: an equation chain (`2+2 = 6` reads
# 6), an equivalence or implication, an `or`, a line break, a wide space. `<=`, `>=`, `!=`, `:=`
# are matched first and kept.
_JOINS_RE = re.compile(
    r"<=|>=|!=|:=|(=|\\(?:equiv|Rightarrow|implies|to|lor|vee|mid|quad|qquad)(?![A-Za-z])"
    r"|\\hspace\*?\{[^{}]*\}|\\\\|~|\bor\b)"
)
_NUMBER_WITH_UNIT_RE = re.compile(rf"\s*({_NUMBER})\s*[A-Za-z][A-Za-z .]*")  # "6 apples"
_BRACKETS = {")": "(", "]": "["}


def _parts(stated: str) -> list[str]:
    """The values `stated` joins: the pieces between its joins and its words (brackets left
    open by a cut and list commas at the ends removed), then each number written in its words."""
    in_words: list[str] = []

    def words(match: re.Match[str]) -> str:
        in_words.extend(n.strip() for n in _NUMBER_RE.findall(match.group(1)))
        return "\0"

    text = re.sub(r"\\(?:left|right)(?![A-Za-z])", "", stated)
    text = _WORDS_RE.sub(words, text)
    text = _JOINS_RE.sub(lambda m: "\0" if m.group(1) else m.group(0), text)
    text = re.sub(r"\\[,;:! ]", " ", text)  # thin spaces: `6 \;`, `1\,000`
    pieces = [_close(piece).strip(" ,;") for piece in text.split("\0")]  # `6 apples, 7 pears`
    return [piece for piece in pieces if piece] + in_words


def _close(piece: str) -> str:
    """`piece` without the brackets a cut left unmatched (`6 (` and `7)` of `6 (or 7)`)."""
    out, opened = list(piece), []
    for i, char in enumerate(piece):
        if char in "([":
            opened.append(i)
        elif char in _BRACKETS:
            if opened and piece[opened[-1]] == _BRACKETS[char]:
                opened.pop()
            else:
                out[i] = ""
    for i in opened:
        out[i] = ""
    return "".join(out)


def _part_value(mv: ModuleType | None, part: str) -> Fraction | list[Any] | None:
    """The value of a part: an exact number (`6`, `6 apples`), else math-verify's parse when
    it is a number (`2+2`, `\\sqrt{2}`), else None (a name such as `x`, `f(2)`, or words)."""
    number = parse_number(part)
    if number is None and (unit := _NUMBER_WITH_UNIT_RE.fullmatch(part)):
        number = parse_number(unit.group(1))
    if number is not None or mv is None or brace_depth(part) > MAX_BRACE_DEPTH:
        return number
    parsed = mv.parse(f"${part}$", [mv.LatexExtractionConfig()], parsing_timeout=None)
    return parsed if parsed and getattr(parsed[0], "is_number", False) is True else None


def _same_value(mv: ModuleType | None, a: Fraction | list[Any], b: Fraction | list[Any]) -> bool:
    if isinstance(a, Fraction) and isinstance(b, Fraction):
        return a == b
    if mv is None:
        return True  # cannot tell: not refused
    a_parsed = a if isinstance(a, list) else mv.parse(f"${a}$", [mv.LatexExtractionConfig()])
    b_parsed = b if isinstance(b, list) else mv.parse(f"${b}$", [mv.LatexExtractionConfig()])
    return bool(mv.verify(a_parsed, b_parsed, timeout_seconds=None))


def _is_one_value(mv: ModuleType | None, gold: str) -> bool:
    """Whether the gold is one number (`6`, `\\frac{1}{2}`, `2\\sqrt{2}`), not a set, an
    interval, an equation or an expression in a variable."""
    if parse_number(gold) is not None:
        return True
    parsed = _parse_gold(mv, gold) if mv is not None else ()
    return len(parsed) > 0 and getattr(parsed[0], "is_number", False) is True


def hedge(stated: str, gold: str) -> str | None:
    """Why the answer `stated` (as written) is refused against `gold`, or None: against a gold
    that is one number (and states it alone), every value the answer states must be that one.
    An equation chain whose parts disagree (`2+2 = 6`, `1 = 2 = 6`), two values joined by `or`,
    an implication or a line break (`6 \\lor 7`), words naming another number
    (`6 \\text{ apples, or 7}`) are refused; a name on the left (`x = 6`), a unit
    (`6 \\text{ apples}`) and a chain whose parts agree (`2+4=6`) are not."""
    if not (_WORDS_RE.search(stated) or any(m.group(1) for m in _JOINS_RE.finditer(stated))):
        return None
    parts = _parts(stated)
    if len(parts) < 2:
        return None
    mv = _math_verify()
    if len(_parts(gold)) > 1 or not _is_one_value(mv, gold):
        return None  # a gold that itself joins values (`2 \\text{ h } 30 \\text{ min}`): as before
    if len(parts) > MAX_PARTS:  # each part is parsed: an answer is not a list of hundreds
        return f"the answer joins {len(parts)} values (at most {MAX_PARTS})"
    values = [(part, _part_value(mv, part)) for part in parts]
    values = [(part, value) for part, value in values if value is not None]
    for part, value in values[1:]:
        first, first_value = values[0]
        if not _same_value(mv, first_value, value):
            return f"the answer states two values: {first[:50]!r} and {part[:50]!r}"
    return None


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
    stated = _stated_answer(text)
    try:
        why = hedge(stated[0], gold) if stated is not None else None
    except Exception as e:  # a math-verify / sympy bug on a part: this sample scores 0
        why = f"{type(e).__name__}: {e}"[:500]
        log.warning("math_verify_error", error=why, gold=gold[:200])
    if why is not None:
        detail.update(route="rejected", predicted=stated[0] if stated else None, error=why)
        return 0.0, detail
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

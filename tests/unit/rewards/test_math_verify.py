"""`math_reward` on a hand-written table (equivalent forms, wrong answers, hostile outputs), and
through the `ScoringPool`: a sample past its timeout or a scorer that raises costs only itself.

The pool runs `tests.unit.rewards.test_math_verify:math_reward`, i.e. the real `math_reward`
looked up through this module: importing the module in a pool process imports `math_verify`
(below), so that import is paid before the first item's timer starts, not inside it.
"""

from __future__ import annotations

import asyncio

import math_verify
import pytest

from areal.rewards.math import (
    MAX_BRACE_DEPTH,
    MAX_PARTS,
    brace_depth,
    hedge,
    math_reward,
    math_reward_detail,
)
from areal.services.reward_pool import ScoringPool

HUGE = "1" + "0" * 5000  # 10**5000: past Python's 4300-digit int parsing limit
GSM8K_GOLD = "Natalia sold 48/2 = 24 clips in May.\nAltogether she sold 48+24 = 72 clips.\n#### 72"
NESTED_7 = "{" * 5000 + "7" + "}" * 5000
GIGANTIC = "Let me think step by step. " * 20_000  # ~540k characters

CASES = [
    # --- equivalent forms: 1.0 ---------------------------------------------------------------
    ("frac_vs_decimal", "\\boxed{\\frac{1}{2}}", "0.5", 1.0),
    ("dfrac_shorthand", "\\boxed{\\dfrac12}", "0.5", 1.0),  # `\dfrac12` = \dfrac{1}{2}
    ("decimal_vs_frac_gold", "\\boxed{0.5}", "\\frac{1}{2}", 1.0),
    ("slash_fraction", "The answer is 1/2.", "\\frac{1}{2}", 1.0),
    ("improper_fraction", "\\boxed{1.5}", "\\frac{3}{2}", 1.0),
    ("mixed_number", "\\boxed{3\\frac{1}{2}}", "3.5", 1.0),  # read as 3 + 1/2, not 3 * 1/2
    ("sqrt_simplified", "\\boxed{\\sqrt{8}}", "2\\sqrt{2}", 1.0),
    ("sqrt_unsimplified", "\\boxed{2\\sqrt{2}}", "\\sqrt{8}", 1.0),
    ("rationalised", "\\boxed{\\frac{\\sqrt{2}}{2}}", "\\frac{1}{\\sqrt{2}}", 1.0),
    ("pi_over_two", "\\boxed{\\pi/2}", "\\frac{\\pi}{2}", 1.0),
    ("negative", "\\boxed{-3}", "-3", 1.0),
    ("negative_fraction", "\\boxed{-\\frac{1}{2}}", "-0.5", 1.0),
    ("power_tower", "\\boxed{2^{2^{2}}}", "16", 1.0),
    # 1/(1 + 1/(1 + 1/2)) = 1/(1 + 2/3) = 3/5
    ("continued_fraction", "\\boxed{\\frac{1}{1+\\frac{1}{1+\\frac{1}{2}}}}", "\\frac{3}{5}", 1.0),
    ("thousands_comma", "\\boxed{1,000}", "1000", 1.0),
    ("thousands_in_text", "She earns 1,000 a week. The answer is 1,000.", "1000", 1.0),
    ("thousands_latex_comma", "\\boxed{1{,}000}", "1000", 1.0),
    ("thousands_thin_space", "\\boxed{1\\,000}", "1000", 1.0),
    ("percent_vs_number", "\\boxed{50\\%}", "50", 1.0),  # "what percent ...?" with gold 50
    ("percent_vs_fraction", "\\boxed{50\\%}", "0.5", 1.0),
    ("dollar_in_box", "\\boxed{\\$5}", "5", 1.0),
    ("dollar_in_gold", "\\boxed{5}", "\\$5", 1.0),  # MATH writes money golds as `\$5`
    ("dollars_and_cents_gold", "The answer is 18.90", "\\$18.90", 1.0),
    ("dollars_in_words", "The answer is 5 dollars.", "5", 1.0),
    ("text_unit", "\\boxed{5\\text{ cm}}", "5", 1.0),
    ("bare_unit", "\\boxed{5 cm}", "5", 1.0),
    ("unit_in_gold", "\\boxed{5}", "5 \\text{ cm}", 1.0),
    ("equation_in_box", "\\boxed{x = 3}", "3", 1.0),
    ("equation_unboxed", "Solving for x, we get x = 3.", "3", 1.0),
    ("set_any_order", "\\boxed{\\{1,2,3\\}}", "\\{3,2,1\\}", 1.0),
    # a comma list is a set of solutions ("find all x"): order does not matter
    ("solutions_any_order", "\\boxed{1, 2}", "2, 1", 1.0),
    ("tuple", "\\boxed{(1, 2)}", "(1,2)", 1.0),
    ("interval_left_right", "\\boxed{\\left[0, 1\\right)}", "[0,1)", 1.0),
    ("polynomial_expanded", "\\boxed{x^2+2x+1}", "(x+1)^2", 1.0),
    ("trailing_zero", "\\boxed{7.0}", "7", 1.0),
    ("text_after_box", "\\boxed{72} apples", "72", 1.0),
    ("choice_letter", "\\boxed{(A)}", "A", 1.0),
    ("gsm8k_hashes", "She sold 72 clips in all.\n#### 72", GSM8K_GOLD, 1.0),
    ("gsm8k_gold_boxed", "So \\boxed{72}.", GSM8K_GOLD, 1.0),
    ("think_then_box", "<think>48 + 24 = 72</think> \\boxed{72}", "72", 1.0),
    ("box_inside_think_ignored", "<think>maybe \\boxed{8}?</think> so \\boxed{7}", "7", 1.0),
    ("last_box_wins", "First \\boxed{3}; no, correcting: \\boxed{7}", "7", 1.0),
    # --- wrong answers: 0.0 ------------------------------------------------------------------
    ("close_number", "\\boxed{7.01}", "7", 0.0),
    ("off_by_one", "\\boxed{71}", GSM8K_GOLD, 0.0),
    ("gsm8k_hashes_wrong", "#### 71", GSM8K_GOLD, 0.0),
    ("wrong_sign", "\\boxed{3}", "-3", 0.0),
    ("wrong_sign_fraction", "\\boxed{\\frac{1}{2}}", "-\\frac{1}{2}", 0.0),
    ("truncated_repeating", "\\boxed{0.333}", "\\frac13", 0.0),  # 333/1000 is not 1/3
    ("sqrt_approximation", "\\boxed{1.41}", "\\sqrt{2}", 0.0),
    ("pi_approximation", "\\boxed{6.28}", "2\\pi", 0.0),
    ("wrong_last_box", "\\boxed{7}, no wait: \\boxed{3}", "7", 0.0),  # the last box is the answer
    ("wrong_choice", "\\boxed{B}", "A", 0.0),
    ("tuple_order", "\\boxed{(2,1)}", "(1,2)", 0.0),  # an ordered pair, unlike a set
    ("interval_ends", "\\boxed{(0,1]}", "[0,1)", 0.0),
    ("subset", "\\boxed{\\{1,2\\}}", "\\{1,2,3\\}", 0.0),
    ("list_is_not_a_number", "\\boxed{1, 2}", "12", 0.0),  # `1, 2` is two answers, not 12
    ("unboxed_list_not_a_number", "The answer is 1, 2", "12", 0.0),
    # --- malformed and adversarial: 0.0 unless the answer is really there --------------------
    ("empty", "", "7", 0.0),
    ("whitespace", " \n\t ", "7", 0.0),
    ("no_answer", "I am not sure how to solve this.", "7", 0.0),
    ("empty_box", "\\boxed{}", "7", 0.0),
    # cut off while writing the box: `\boxed{7` may have become `\boxed{72}`
    ("unclosed_box", "so the answer is \\boxed{7", "7", 0.0),
    ("stray_closing_braces", "\\boxed{}}}}7", "7", 0.0),
    ("huge_number", f"\\boxed{{{HUGE}}}", "7", 0.0),
    ("huge_number_equal", f"\\boxed{{{HUGE}}}", HUGE, 1.0),  # equal as text past int limits
    # math-verify's parse doubles per level of bare braces: rejected unparsed (see math.py)
    ("nested_braces", f"\\boxed{{{NESTED_7}}}", "7", 0.0),
    # no box, no anchor: the last number counts (7), and nothing is parsed
    ("unclosed_braces", "{" * 5000 + "7", "7", 1.0),
    ("unclosed_braces_wrong", "{" * 5000 + "8", "7", 0.0),
    ("gigantic_answer_at_end", GIGANTIC + "\\boxed{7}", "7", 1.0),
    ("gigantic_answer_at_start", "\\boxed{7} " + GIGANTIC, "7", 0.0),  # only the tail is read
    ("divide_by_zero", "\\boxed{\\frac{1}{0}}", "7", 0.0),
    ("empty_fractions", "\\boxed{\\frac{\\frac{}{}}{}}", "7", 0.0),
    ("dangling_operators", "\\boxed{\\lim_{x\\to}\\sum^{}_{}\\int}", "7", 0.0),
    ("matrix_vs_number", "\\boxed{\\begin{pmatrix}1\\\\2\\end{pmatrix}}", "7", 0.0),
    ("answer_only_in_think", "<think>2 + 5 = 7, so \\boxed{7}</think>", "7", 0.0),
    ("answer_only_in_think_then_chat", "<think>\\boxed{7}</think>\nHope this helps!", "7", 0.0),
    ("cut_off_while_thinking", "<think>the answer is \\boxed{7}", "7", 0.0),
    # restating the question is no answer: an unanchored plain expression is never evaluated
    ("restated_question", "I do not know. 3+4", "Tom has 3+4 apples #### 7", 0.0),
    ("expression_then_dots", "3 + 4 = ...", "7", 0.0),
    ("restated_in_words", "There are no direct formulas to add 3 and 4 to 3 + 4.", "7", 0.0),
    ("worked_then_result", "so 3+4 = 7", "7", 1.0),  # the last number is the answer
    ("unanchored_decimal", "so it is 0.5", "\\frac{1}{2}", 1.0),
    ("unanchored_latex", "we get $\\frac{1}{2}$", "\\frac12", 1.0),
    # --- hedges: an answer that states two values scores 0.0 (math-verify alone reads one of
    # them: the last of an equation chain, the value before the words), its honest forms 1.0 --
    ("chain_parts_disagree", "\\boxed{2+2 = 6}", "6", 0.0),  # 4 and 6
    ("chain_of_three_disagrees", "\\boxed{1 = 2 = 6}", "6", 0.0),
    ("hedge_in_words", "\\boxed{6 \\text{ apples, or 7}}", "6", 0.0),
    ("hedge_in_words_other_gold", "\\boxed{6 \\text{ apples, or 7}}", "7", 0.0),
    ("hedge_in_parenthesised_words", "\\boxed{6 \\text{ (or 7)}}", "6", 0.0),
    ("hedge_in_bold_words", "\\boxed{6 \\textbf{ or 7}}", "6", 0.0),
    ("hedge_words_between", "\\boxed{6 \\; (\\text{or } 7)}", "7", 0.0),
    ("hedge_two_units", "\\boxed{6 \\text{ apples}, 7 \\text{ pears}}", "6", 0.0),
    ("hedge_lor", "\\boxed{6 \\lor 7}", "7", 0.0),  # math-verify read 7
    ("hedge_line_break", "\\boxed{6 \\\\ 7}", "7", 0.0),
    ("hedge_implication", "\\boxed{6 \\Rightarrow 7}", "7", 0.0),
    ("hedge_tilde_space", "\\boxed{6 ~ 7}", "7", 0.0),
    ("chain_reversed", "\\boxed{7 = 6}", "6", 0.0),
    ("chain_after_a_name_disagrees", "\\boxed{x = 6 = 7}", "7", 0.0),
    ("answer_is_or", "The answer is 6 or 7", "6", 0.0),  # the exact path read 6
    ("answer_is_chain_disagrees", "The answer is 2+2 = 6", "6", 0.0),
    ("hashes_chain_disagrees", "#### 2+2=6", "6", 0.0),
    ("name_on_the_left", "\\boxed{x = 6}", "6", 1.0),
    ("function_value_on_the_left", "\\boxed{f(2) = 6}", "6", 1.0),
    ("segment_on_the_left", "\\boxed{AB = 6}", "6", 1.0),
    ("chain_parts_agree", "\\boxed{2+4=6}", "6", 1.0),
    ("chain_after_a_name_agrees", "\\boxed{x = 2 \\cdot 3 = 6}", "6", 1.0),
    ("chain_exact_and_decimal", "\\boxed{\\frac{1}{2} = 0.5}", "\\frac12", 1.0),
    ("chain_radicals_agree", "\\boxed{\\sqrt{8} = 2\\sqrt{2}}", "2\\sqrt2", 1.0),
    ("unit_in_words", "\\boxed{6 \\text{ apples}}", "6", 1.0),
    ("unit_with_exponent", "\\boxed{6 \\text{ m}^2}", "6", 1.0),
    ("words_naming_the_same_number", "\\boxed{6 \\text{ (6 in all)}}", "6", 1.0),
    ("answer_is_chain_agrees", "The answer is 3 + 3 = 6", "6", 1.0),
    ("two_values_for_a_list_gold", "\\boxed{1 \\text{ and } 2}", "1, 2", 1.0),  # not a hedge
    ("equation_gold", "\\boxed{y = 2x + 3}", "y = 2x+3", 1.0),
    (
        "gold_with_two_numbers_in_words",
        "\\boxed{2 \\text{ h } 30 \\text{ min}}",
        "2 \\text{ h } 30 \\text{ min}",
        1.0,
    ),
    # limits: `\\approx` is an approximation, not a hedge (its first value counts), and a chain
    # against an expression gold is math-verify's to judge
    ("approximation_kept", "\\boxed{2\\pi \\approx 6.28}", "2\\pi", 1.0),
    ("identity_against_an_expression", "\\boxed{x^2+2x+1 = (x+1)^2}", "(x+1)^2", 1.0),
]


@pytest.mark.timeout(120)  # hang guard: math-verify's own timeouts are off in math.py
@pytest.mark.parametrize(
    ("completion", "answer", "expected"),
    [pytest.param(c, a, e, id=name) for name, c, a, e in CASES],
)
def test_math_reward_table(completion: str, answer: str, expected: float):
    reward, detail = math_reward_detail(completion, answer)
    assert reward == expected, detail
    assert math_reward(completion, answer) == expected


def test_the_table_ids_are_unique():
    names = [name for name, *_ in CASES]
    assert len(names) == len(set(names)) and len(names) >= 40


def test_a_hedge_names_its_two_values():
    reward, detail = math_reward_detail("\\boxed{6 \\text{ apples, or 7}}", "6")
    assert (reward, detail["route"]) == (0.0, "rejected")
    assert detail["error"] == "the answer states two values: '6' and '7'"
    assert hedge("2+2 = 6", "6") == "the answer states two values: '2+2' and '6'"
    assert hedge("x = 6", "6") is None and hedge("6", "6") is None
    many = " = ".join(["6"] * (MAX_PARTS + 1))  # each part is parsed: a cap
    assert hedge(many, "6") == f"the answer joins {MAX_PARTS + 1} values (at most {MAX_PARTS})"


def test_brace_depth():
    assert brace_depth("") == 0
    assert brace_depth("\\frac{1}{\\sqrt{2}}") == 2
    assert brace_depth("}}}{{}") == 2  # a stray `}` does not go below 0


def test_braces_at_the_depth_limit_are_parsed_one_deeper_rejected():
    deepest_parsed = "\\boxed{" + "{" * MAX_BRACE_DEPTH + "7" + "}" * MAX_BRACE_DEPTH + "}"
    assert math_reward_detail(deepest_parsed, "7")[1]["route"] == "math_verify"
    too_deep = "\\boxed{" + "{" * (MAX_BRACE_DEPTH + 1) + "7" + "}" * (MAX_BRACE_DEPTH + 1) + "}"
    reward, detail = math_reward_detail(too_deep, "7")
    assert (reward, detail["route"]) == (0.0, "rejected")
    assert detail["error"] == f"braces nested deeper than {MAX_BRACE_DEPTH}"


def test_a_math_verify_exception_scores_0_with_its_reason(monkeypatch: pytest.MonkeyPatch):
    def broken_verify(*args: object, **kwargs: object) -> bool:
        raise RuntimeError("sympy fell over")

    monkeypatch.setattr(math_verify, "verify", broken_verify)
    # `\sqrt{8}` vs `2\sqrt{2}` is not an exact-number match: it needs math-verify
    reward, detail = math_reward_detail("\\boxed{\\sqrt{8}}", "2\\sqrt{2}")
    assert (reward, detail["route"]) == (0.0, "error")
    assert detail["error"] == "RuntimeError: sympy fell over"
    assert math_reward("\\boxed{\\sqrt{8}}", "2\\sqrt{2}") == 0.0
    # the exact fast path does not need math-verify: still scored
    assert math_reward_detail("\\boxed{0.5}", "1/2") == (
        1.0,
        {"route": "exact", "predicted": "0.5", "gold": "1/2", "error": None},
    )


# --- through the ScoringPool ---------------------------------------------------------------

POOL_FN = "tests.unit.rewards.test_math_verify"  # this module, importable by pool processes


def raising_reward(completion: str, answer: str) -> float:
    """A user's reward fn: `math_reward`, except that it raises on 'boom'."""
    if "boom" in completion:
        raise ValueError("user reward fn failed")
    return math_reward(completion, answer)


@pytest.mark.asyncio
async def test_a_sample_past_its_timeout_scores_0_and_its_neighbours_are_scored():
    # 9^(9^9) = 9^387420489: sympy evaluates the power, far longer than the 3 s per sample
    pool = ScoringPool(f"{POOL_FN}:math_reward", workers=1, timeout_s=3.0)
    try:
        items = [
            ("\\boxed{7}", "7"),
            ("\\boxed{9^{9^{9}}}", "7"),
            ("\\boxed{\\sqrt{8}}", "2\\sqrt{2}"),
            ("\\boxed{8}", "7"),
        ]
        out = await asyncio.wait_for(pool.score(items), 120)  # hang guard only
        assert [(r, e) for r, e, _ in out] == [
            (1.0, None),
            (0.0, "timeout after 3.0s"),
            (1.0, None),
            (0.0, None),
        ]
        # the pool still scores (whether the alarm or the backstop ended the power)
        assert (await asyncio.wait_for(pool.score([("\\boxed{1/2}", "0.5")]), 60))[0][0] == 1.0
    finally:
        pool.close()


@pytest.mark.asyncio
async def test_a_raising_reward_fn_scores_0_with_its_reason_and_the_pool_lives():
    pool = ScoringPool(f"{POOL_FN}:raising_reward", workers=1, timeout_s=10.0)
    try:
        items = [
            ("\\boxed{7}", "7"),
            ("boom \\boxed{7}", "7"),
            ("\\boxed{\\pi/2}", "\\frac{\\pi}{2}"),
        ]
        out = await asyncio.wait_for(pool.score(items), 120)  # hang guard only
        assert [(r, e) for r, e, _ in out] == [
            (1.0, None),
            (0.0, "ValueError: user reward fn failed"),
            (1.0, None),
        ]
        out = await asyncio.wait_for(pool.score([("boom", "7"), ("\\boxed{7}", "7")]), 60)
        assert [r for r, _, _ in out] == [0.0, 1.0]
        assert pool.n_calls == 2 and pool.n_resets == 0  # scored in the call, nothing rebuilt
    finally:
        pool.close()

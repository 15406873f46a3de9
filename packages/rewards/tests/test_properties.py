"""Property tests (hypothesis) for extraction, normalisation and scoring."""

from __future__ import annotations

from fractions import Fraction

from hypothesis import given, settings
from hypothesis import strategies as st

from turnrl.rewards import (
    MathRewardConfig,
    extract_boxed,
    extract_boxed_strict,
    fast_verdict,
    normalize_answer,
    parse_rational,
    score_math,
)
from turnrl.rewards.math_normalize import format_rational

TOKENS = [
    *"0123456789abcxyz+-*/^_.,()[]{}$%= ~\\",
    "\\frac",
    "\\dfrac",
    "\\sqrt",
    "\\left",
    "\\right",
    "\\text{cm}",
    "\\text{",
    "\\%",
    "\\pi",
    "\\cdot",
    "\\times",
    "^\\circ",
    "\\!",
    "\\,",
    "\\\\",
    "{,}",
    "\\begin{pmatrix}",
    "\\mbox{",
    " cm",
    "x=",
]
LATEXISH = st.lists(st.sampled_from(TOKENS), max_size=25).map("".join)


@st.composite
def balanced(draw: st.DrawFn, depth: int = 0) -> str:
    """Text with balanced braces (what a well-formed box can hold)."""
    parts = draw(st.lists(st.text(alphabet="0123456789xy+-^\\frac ", max_size=4), max_size=3))
    if depth < 3 and draw(st.booleans()):
        parts.append("{" + draw(balanced(depth + 1)) + "}")
    return "".join(parts)


@given(LATEXISH)
@settings(max_examples=400, deadline=None)
def test_normalize_is_idempotent(text):
    once = normalize_answer(text)
    assert normalize_answer(once) == once


@st.composite
def written_numbers(draw: st.DrawFn) -> tuple[Fraction, list[str]]:
    """A rational and several ways to write it."""
    num = draw(st.integers(-(10**6), 10**6))
    den = draw(st.sampled_from([1, 2, 4, 5, 8, 10, 3, 7]))
    value = Fraction(num, den)
    forms = [f"\\frac{{{num}}}{{{den}}}", f"{num}/{den}", f"\\dfrac{{{num}}}{{{den}}}"]
    if value.denominator in (1, 2, 4, 5, 8, 10):  # terminating decimals
        decimal = f"{float(value):.6f}".rstrip("0").rstrip(".")
        forms += [decimal, decimal + ("0" if "." in decimal else ".0")]
    if value.denominator == 1:
        forms += [str(value.numerator), f"{value.numerator:,}"]
    return value, forms


@given(written_numbers())
@settings(max_examples=200, deadline=None)
def test_every_writing_of_a_number_normalizes_the_same(case):
    value, forms = case
    assert {normalize_answer(form) for form in forms} == {format_rational(value)}
    assert all(parse_rational(normalize_answer(form)) == value for form in forms)


@given(
    st.one_of(
        st.integers(-(10**12), 10**12).map(str),
        st.decimals(-1000, 1000, places=3, allow_nan=False).map(str),
        st.tuples(st.integers(-99, 99), st.integers(1, 99)).map(
            lambda t: f"\\frac{{{t[0]}}}{{{t[1]}}}"
        ),
    )
)
@settings(max_examples=150, deadline=None)
def test_a_number_equals_itself_in_every_mode(number):
    response = f"so $\\boxed{{{number}}}$"
    for mode in ("strict", "normalized", "math_verify"):
        # The fast path must decide self-equality (no sympy needed for a number vs itself).
        verdict, _ = fast_verdict(response, number, MathRewardConfig(mode=mode))
        assert verdict is not None and verdict.correct, (mode, number)


@given(st.integers(-(10**9), 10**9), st.integers(-(10**9), 10**9))
@settings(max_examples=150, deadline=None)
def test_different_integers_are_never_equal(a, b):
    if a == b:
        return
    for mode in ("strict", "normalized", "math_verify"):
        assert not score_math(f"\\boxed{{{a}}}", str(b), MathRewardConfig(mode=mode)).correct


@given(balanced(), st.text(alphabet="abc \n.", max_size=10))
@settings(max_examples=300, deadline=None)
def test_boxed_extraction_round_trips(content, prefix):
    text = prefix + "\\boxed{" + content + "} done."
    assert extract_boxed_strict(text) == content
    assert extract_boxed(text) == (content.strip() or None)


@given(st.fractions(max_denominator=1000).filter(lambda f: abs(f) < 10**9))
def test_rational_format_round_trips(value):
    assert parse_rational(format_rational(value)) == value

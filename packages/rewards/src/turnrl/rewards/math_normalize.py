"""String normalisation of math answers for the `normalized` scoring mode.

`normalize_answer` rewrites an answer into a canonical text so that notational variants of
the same written answer compare equal, without any symbolic algebra:

- whitespace and LaTeX spacing (`\\,`, `\\;`, `\\!`, `\\ `, `~`) removed; `$` removed;
- `\\dfrac`/`\\tfrac` → `\\frac`, `\\left`/`\\right` dropped, `\\frac12` → `\\frac{1}{2}`,
  `\\sqrt2` → `\\sqrt{2}`, `pmatrix`/`bmatrix`/… → `matrix`, `\\le`/`\\ge` spelled long;
- units and decoration dropped: `\\text{cm}`-style unit words, `^\\circ`, `\\%`, a trailing
  plain unit word after a number; remaining `\\text{X}`/`\\mathrm{X}` unwrapped;
- a leading `x =` (a single variable name) removed;
- plain numbers made canonical: leading zeros, trailing `.0`, thousands separators (`1,000`),
  decimals, `a/b`, `\\frac{a}{b}` and scientific notation (`1.5e3`, `1.5\\times10^{3}`) all
  become the reduced fraction text (`"1500"`, `"1/2"`), so `0.5`, `\\frac{2}{4}` and `1/2`
  are one answer.

What it does not do (use the `math_verify` mode): reorder sets, simplify radicals or
expressions (`2\\sqrt{2}` vs `\\sqrt{8}`), or treat `50\\%` as `0.5`. Normalisation is
idempotent: `normalize_answer(normalize_answer(s)) == normalize_answer(s)`.
"""

from __future__ import annotations

import re
from fractions import Fraction

_UNIT_WORDS = (
    "cm",
    "mm",
    "km",
    "m",
    "meters",
    "meter",
    "metres",
    "inches",
    "inch",
    "feet",
    "foot",
    "ft",
    "miles",
    "mile",
    "mph",
    "kg",
    "g",
    "grams",
    "gm",
    "pounds",
    "lbs",
    "seconds",
    "second",
    "minutes",
    "minute",
    "hours",
    "hour",
    "days",
    "day",
    "years",
    "year",
    "degrees",
    "degree",
    "units",
    "unit",
    "square",
    "sq",
    "dollars",
    "dollar",
    "cents",
    "cent",
    "points",
    "ways",
    "cm^2",
    "m^2",
    "cm^3",
    "m^3",
    "students",
    "people",
    "digits",
    "integers",
)
_UNIT_ALT = "|".join(sorted((re.escape(u) for u in _UNIT_WORDS), key=len, reverse=True))
_TEXT_UNIT = re.compile(r"\\(?:text|mbox|mathrm)\{\s*(?:" + _UNIT_ALT + r")\s*\}(?:\^\{?[23]\}?)?")
# A bare trailing unit only when it is a word (`10cm`), never one letter (`2m` may be 2·m).
_WORD_UNIT_ALT = "|".join(
    sorted((re.escape(u) for u in _UNIT_WORDS if len(u) > 1), key=len, reverse=True)
)
_TRAILING_UNIT = re.compile(r"(?<=[\d}])(?:" + _WORD_UNIT_ALT + r")(?:\^\{?[23]\}?)?$")
_TEXT_WRAP = re.compile(r"\\(?:text|mbox|mathrm|textbf|mathbf)\{([^{}]*)\}")
# `\\\\` (a row break) is matched first so its second backslash is not read as `\ `.
_SPACING = re.compile(r"\\\\|\\[,;:! ]|~")
_FRAC_SHORT = re.compile(r"\\frac(\d)(\d)")
_FRAC_HALF = re.compile(r"\\frac\{([^{}]*)\}(\d)")
_SQRT_SHORT = re.compile(r"\\sqrt(\w)")
_SUP_SHORT = re.compile(r"\^(\w)")
_MATRIX_ENV = re.compile(r"\\(begin|end)\{[pbvBV]?matrix\}")
_LEADING_VAR = re.compile(r"^[a-zA-Z]\s*=(?!=)")
_THOUSANDS = re.compile(r"^-?\d{1,3}(,\d{3})+(\.\d+)?$")
# Number patterns are unambiguous (`\d+(\.\d*)?`, not `\d+\.?\d*`): no quadratic
# backtracking on a long digit string that fails at its end.
_NUMBER = r"[+-]?(?:\d+(?:\.\d*)?|\.\d+)"
_DECIMAL = re.compile(rf"^{_NUMBER}$")
_SCI_E = re.compile(rf"^({_NUMBER})[eE]([+-]?\d+)$")
_SCI_TIMES = re.compile(rf"^({_NUMBER})(?:\\times|\\cdot|\*)10\^\{{?([+-]?\d+)\}}?$")
_SLASH_FRAC = re.compile(r"^([+-]?\d+)/(\d+)$")
_TEX_FRAC = re.compile(r"^([+-]?)\\frac\{([+-]?\d+)\}\{(\d+)\}$")
_MAX_PASSES = 8  # each pass peels one wrapper layer; real answers settle in 1-2
_MAX_EXPONENT = 400  # a 10^k past this is not an answer anyone writes; keep it textual


def parse_rational(text: str) -> Fraction | None:
    """The exact value of a plain number written in `text`, or None if it is not one.

    Accepts integers (with leading zeros or thousands separators), decimals, `a/b`,
    `\\frac{a}{b}` and scientific notation (`1.5e3`, `1.5\\times10^{3}`). Anything else —
    radicals, constants, expressions, tuples — is not a plain number.

    Args:
        text: An answer with whitespace and `$` already removed.

    Returns:
        The value as an exact fraction, or None.
    """
    try:
        return _parse_rational(text)
    except (ValueError, ZeroDivisionError):
        # Python refuses to convert numbers of more than 4300 digits; not a plain answer.
        return None


def _parse_rational(text: str) -> Fraction | None:
    if _THOUSANDS.match(text):
        text = text.replace(",", "")
    if _DECIMAL.match(text):
        return Fraction(text)
    for pattern in (_SCI_E, _SCI_TIMES):
        match = pattern.match(text)
        if match:
            exponent = int(match.group(2))
            if abs(exponent) > _MAX_EXPONENT:
                return None
            return Fraction(match.group(1)) * Fraction(10) ** exponent
    match = _SLASH_FRAC.match(text)
    if match and int(match.group(2)) != 0:
        return Fraction(int(match.group(1)), int(match.group(2)))
    match = _TEX_FRAC.match(text)
    if match and int(match.group(3)) != 0:
        value = Fraction(int(match.group(2)), int(match.group(3)))
        return -value if match.group(1) == "-" else value
    return None


def format_rational(value: Fraction) -> str:
    """Canonical text of an exact number: `"7"`, `"-3/4"`."""
    if value.denominator == 1:
        return str(value.numerator)
    return f"{value.numerator}/{value.denominator}"


def _strip_outer_braces(text: str) -> str:
    """`{{7}}` → `7`: drop braces that wrap the whole answer (not `{a}+{b}`), in one pass."""
    leading = len(text) - len(text.lstrip("{"))
    if leading == 0 or not text.endswith("}"):
        return text
    closes_at: dict[int, int] = {}  # index of each leading `{` -> index of its `}`
    stack: list[int] = []
    for i, char in enumerate(text):
        if char == "{":
            stack.append(i)
        elif char == "}" and stack:
            opened = stack.pop()
            if opened < leading:
                closes_at[opened] = i
    layers = 0
    while layers < leading and closes_at.get(layers) == len(text) - 1 - layers:
        layers += 1
    return text[layers : len(text) - layers] if layers else text


def _strip_decoration(text: str) -> str:
    text = text.replace("\\$", "").replace("$", "")
    text = _SPACING.sub(lambda m: m.group(0) if m.group(0) == "\\\\" else "", text)
    text = text.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    text = text.replace("\\left", "").replace("\\right", "")
    text = text.replace("\\displaystyle", "")
    text = text.replace("\\leq", "\\le").replace("\\geq", "\\ge")
    text = text.replace("\\le", "\\leq").replace("\\ge", "\\geq")
    text = text.replace("{,}", "")
    text = re.sub(r"\^\{?\\circ\}?", "", text)
    text = text.replace("\\%", "").replace("%", "")
    text = _TEXT_UNIT.sub("", text)
    text = _TEXT_WRAP.sub(r"\1", text)
    text = _MATRIX_ENV.sub(r"\\\1{matrix}", text)
    return text


def normalize_answer(answer: str) -> str:
    """Canonical text of an answer for string comparison (see the module docstring).

    The rewrite is repeated until nothing changes (nested wrappers such as
    `\\text{\\text{cm}}` peel one layer per pass), which makes it idempotent.

    Args:
        answer: An extracted answer or a ground truth.

    Returns:
        The normalised text; numbers become reduced fractions (`"1/2"`), other answers keep
        their structure with notation unified.
    """
    text = answer
    for _ in range(_MAX_PASSES):
        rewritten = _normalize_once(text)
        if rewritten == text:
            break
        text = rewritten
    return text


def _normalize_once(answer: str) -> str:
    text = _strip_decoration(answer.strip())
    text = re.sub(r"\s+", "", text)
    text = _LEADING_VAR.sub("", text)
    text = _TRAILING_UNIT.sub("", text)
    text = _FRAC_SHORT.sub(r"\\frac{\1}{\2}", text)
    text = _FRAC_HALF.sub(r"\\frac{\1}{\2}", text)
    text = _SQRT_SHORT.sub(r"\\sqrt{\1}", text)
    text = _SUP_SHORT.sub(r"^{\1}", text)
    text = _strip_outer_braces(text.rstrip("."))
    value = parse_rational(text)
    return format_rational(value) if value is not None else text

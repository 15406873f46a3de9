"""The calculate tool: tau-bench's results and error texts, and bounded work on hostile input."""

import time

import pytest

from turnrl.tool_envs.tau.calculate import MAX_EXPRESSION_CHARS, calculate

SPEC_EXAMPLES = [
    ("3131.1 + 4777.75 + 367.38", "8276.23"),
    ("135.24 - 153.23", "-17.99"),
    ("(65 + 83) * 2", "296.0"),
    ("1/3", "0.33"),
    ("2.675", "2.67"),
    ("-0", "0.0"),
    ("-0.0", "-0.0"),
    ("10**20", "1e+20"),
    ("10.0**308*10", "inf"),
    ("  2 * 3", "6.0"),
    ("-2**2", "-4.0"),
    ("2**-1", "0.5"),
    ("7 // 2", "3.0"),
    ("10**400 / 10**399", "10.0"),
]


@pytest.mark.parametrize(("expression", "expected"), SPEC_EXAMPLES)
def test_results_match_tau_bench(expression, expected):
    assert calculate(expression) == expected


SPEC_ERRORS = [
    ("(1)(2)", "Error: 'int' object is not callable"),
    ("( 1", "Error: '(' was never closed (<string>, line 1)"),
    ("1 (", "Error: '(' was never closed (<string>, line 1)"),
    ("1)", "Error: unmatched ')' (<string>, line 1)"),
    ("1 2", "Error: invalid syntax (<string>, line 1)"),
    ("(1 2)", "Error: invalid syntax. Perhaps you forgot a comma? (<string>, line 1)"),
    ("(*7)", "Error: cannot use starred expression here (<string>, line 1)"),
    ("10**400", "Error: int too large to convert to float"),
    ("(-8)**0.5", "Error: float() argument must be a string or a real number, not 'complex'"),
    ("", "Error: invalid syntax (<string>, line 0)"),
    ("1/0", "Error: division by zero"),
    ("1.0/0", "Error: float division by zero"),
    ("1//0", "Error: integer division or modulo by zero"),
    ("0**-1", "Error: 0.0 cannot be raised to a negative power"),
    ("()+1", 'Error: can only concatenate tuple (not "int") to tuple'),
    ("x + 1", "Error: invalid characters in expression"),
    ("__import__('os')", "Error: invalid characters in expression"),
]


@pytest.mark.parametrize(("expression", "expected"), SPEC_ERRORS)
def test_error_texts_match_tau_bench(expression, expected):
    assert calculate(expression) == expected


def test_non_string_argument_gives_the_iteration_error():
    assert calculate(5) == "Error: 'int' object is not iterable"


@pytest.mark.parametrize(
    "expression",
    [
        "9**9**9**9",
        "1000000**1000000**2",
        "2**100000*2**100000",
        "(10**30000)*(10**30000)*(10**30000)",
        "2 ** 10000000",
        "(" * 150 + "1" + ")" * 150,
        "-" * 5000 + "1",
        "1+" * 4000 + "1",
        "9" * 20000,
    ],
)
def test_hostile_expressions_return_quickly(expression):
    start = time.perf_counter()
    out = calculate(expression)
    assert time.perf_counter() - start < 2.0
    assert isinstance(out, str)


def test_exponent_tower_is_refused_with_an_error():
    assert calculate("9**9**9**9").startswith("Error: result too large")


def test_overlong_expression_is_refused():
    assert calculate("1+" * MAX_EXPRESSION_CHARS + "1").startswith("Error: expression longer than")

"""tau-bench's ``calculate`` tool with a bounded evaluator (never ``eval``).

Upstream checks the characters (digits, ``+ - * / ( ) .`` and space) and then calls
``eval``; an exponent tower such as ``9**9**9**9`` then builds integers until memory runs
out. Here the string is parsed by Python's own parser (``ast.parse`` runs no code and
gives the same syntax errors as ``eval``) and the tree is evaluated by a small
interpreter that allows only numbers, ``()``, ``...``, unary ``+``/``-``, ``+ - * / // **``
and calls (which always fail, as upstream), refusing integer results above
:data:`MAX_INT_BITS` bits and nesting deeper than :data:`MAX_DEPTH`. Every other result and
error text is the one ``eval`` would give; the value is converted to float, rounded to
two decimals and returned in ``repr`` form (SPEC §8.1).
"""

from __future__ import annotations

import ast
import math
import operator
from collections.abc import Callable
from typing import Any

ALLOWED_CHARS = frozenset("0123456789+-*/(). ")
"""Characters an expression may contain (anything else is rejected before parsing)."""
MAX_EXPRESSION_CHARS = 10_000
"""Longest expression evaluated; longer ones are refused (bounds parse and evaluation time)."""
MAX_INT_BITS = 100_000
"""Largest integer (in bits, ~30,000 digits) an operation may produce before it is refused."""
MAX_DEPTH = 300
"""Deepest nesting of operands evaluated (left-leaning ``+ - * /`` chains do not count)."""

_BINARY: dict[type[ast.operator], Callable[[Any, Any], Any]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Pow: operator.pow,
}


class _LimitExceeded(Exception):
    """An operation would exceed the evaluator's bounds."""


def calculate(expression: Any) -> str:
    """Evaluate an arithmetic expression as tau-bench does; returns the text or ``Error: ...``."""
    try:
        if any(char not in ALLOWED_CHARS for char in expression):
            return "Error: invalid characters in expression"
        if not isinstance(expression, str):
            return "Error: eval() arg 1 must be a string, bytes or code object"
        if len(expression) > MAX_EXPRESSION_CHARS:
            return f"Error: expression longer than {MAX_EXPRESSION_CHARS} characters"
        tree = ast.parse(expression.lstrip(" "), filename="<string>", mode="eval")
        value = _evaluate(tree.body, 0)
        return repr(round(float(value), 2))
    except _LimitExceeded as exc:
        return f"Error: {exc}"
    except Exception as exc:  # SyntaxError, ZeroDivisionError, OverflowError, TypeError, ...
        return f"Error: {exc}"


def _evaluate(node: ast.expr, depth: int) -> Any:
    if depth > MAX_DEPTH:
        raise _LimitExceeded(f"expression nested deeper than {MAX_DEPTH} levels")
    if isinstance(node, ast.Constant) and type(node.value) in (int, float, type(Ellipsis)):
        return node.value
    if isinstance(node, ast.BinOp):
        return _evaluate_chain(node, depth)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub | ast.UAdd):
        operand = _evaluate(node.operand, depth + 1)
        return -operand if isinstance(node.op, ast.USub) else +operand
    if isinstance(node, ast.Tuple) and not node.elts:
        return ()
    if isinstance(node, ast.Call):
        return _evaluate_call(node, depth)
    raise _LimitExceeded(f"unsupported expression element {type(node).__name__}")


def _evaluate_chain(node: ast.BinOp, depth: int) -> Any:
    """Evaluate a left-leaning chain ``((a op b) op c) ...`` without recursing on its spine."""
    chain: list[tuple[ast.operator, ast.expr]] = []
    left: ast.expr = node
    while isinstance(left, ast.BinOp) and not isinstance(left.op, ast.Pow):
        chain.append((left.op, left.right))
        left = left.left
    if isinstance(left, ast.BinOp):  # a power: right-associative, so recurse on its exponent
        value = _apply(left.op, _evaluate(left.left, depth + 1), _evaluate(left.right, depth + 1))
    else:
        value = _evaluate(left, depth + 1)
    for op, right in reversed(chain):
        value = _apply(op, value, _evaluate(right, depth + 1))
    return value


def _apply(op: ast.operator, left: Any, right: Any) -> Any:
    func = _BINARY.get(type(op))
    if func is None:
        raise _LimitExceeded(f"unsupported operator {type(op).__name__}")
    if type(left) is int and type(right) is int:
        _check_int_size(op, left, right)
    return func(left, right)


def _check_int_size(op: ast.operator, left: int, right: int) -> None:
    """Refuse an integer operation whose exact result would exceed :data:`MAX_INT_BITS`."""
    if isinstance(op, ast.Pow):
        if right <= 0 or abs(left) <= 1:
            return
        if right > MAX_INT_BITS or math.log2(abs(left)) * right > MAX_INT_BITS:
            raise _LimitExceeded(f"result too large (more than {MAX_INT_BITS} bits)")
    elif isinstance(op, ast.Mult) and left.bit_length() + right.bit_length() > MAX_INT_BITS + 1:
        raise _LimitExceeded(f"result too large (more than {MAX_INT_BITS} bits)")


def _evaluate_call(node: ast.Call, depth: int) -> Any:
    """A call: evaluate the callee and argument, then let Python raise its own TypeError.

    Only numbers, ``()`` and ``...`` can appear here and none of them is callable, so the
    call always fails with the message ``eval`` would give; no code can run.
    """
    callee = _evaluate(node.func, depth + 1)
    if node.keywords:  # only ``f(**x)`` is expressible with the allowed characters
        mapping = _evaluate(node.keywords[0].value, depth + 1)
        return callee(**mapping)
    if not node.args:
        return callee()
    arg = node.args[0]
    if isinstance(arg, ast.Starred):
        return callee(*_evaluate(arg.value, depth + 1))
    return callee(_evaluate(arg, depth + 1))

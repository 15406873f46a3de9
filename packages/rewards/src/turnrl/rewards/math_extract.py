"""Answer extraction from a model's response: the last `\\boxed{…}` and `Answer:` lines.

Two extractors:

- `extract_boxed_strict` reproduces verl's DAPO `strict_box_verify` rule: the content of the
  last `\\boxed{` occurrence, braces matched; if that last box never closes there is no answer.
- `extract_answer` is the lenient extractor used by the `normalized` and `math_verify` modes:
  the last box written as `\\boxed{…}`, `\\fbox{…}` or `\\boxed 5` (no braces, up to the
  next whitespace or `$`); when the response has no box, the last `Answer: …` line.

Both scan the text once (linear time), so a long or adversarial response cannot stall them.
"""

from __future__ import annotations

import re

_BOX_COMMANDS = ("\\boxed", "\\fbox")
# `Answer:` (any case, optional markdown bold) up to the end of its line; the last one wins.
_ANSWER_LINE = re.compile(r"(?i)\banswer\**\s*[:：]\**\s*([^\n]*)")


def _matching_brace(text: str, open_index: int) -> int | None:
    """Index of the `}` closing the `{` at `open_index`, or None when it never closes."""
    depth = 0
    for i in range(open_index, len(text)):
        char = text[i]
        if char == "{":
            depth += 1
        elif char == "}":
            depth -= 1
            if depth == 0:
                return i
    return None


def extract_boxed_strict(text: str) -> str | None:
    """Content of the last `\\boxed{…}` exactly as verl's DAPO strict scoring reads it.

    Args:
        text: The model's response.

    Returns:
        The raw content between the braces (nothing stripped), or None when the response has
        no `\\boxed{` or its last one is unclosed.
    """
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    open_index = start + len("\\boxed")
    close = _matching_brace(text, open_index)
    return None if close is None else text[open_index + 1 : close]


def _last_box_start(text: str) -> tuple[int, str] | None:
    """Position and command of the last `\\boxed`/`\\fbox` that is not part of a longer name."""
    best: tuple[int, str] | None = None
    for command in _BOX_COMMANDS:
        end = len(text)
        while True:
            pos = text.rfind(command, 0, end)
            if pos < 0:
                break
            after = pos + len(command)
            # `\boxedsomething` is another macro, not a box.
            if after < len(text) and text[after].isalpha():
                end = pos
                continue
            if best is None or pos > best[0]:
                best = (pos, command)
            break
    return best


def extract_boxed(text: str) -> str | None:
    """Content of the last `\\boxed{…}`, `\\fbox{…}` or brace-less `\\boxed 5` in `text`.

    Args:
        text: The model's response.

    Returns:
        The box content with surrounding whitespace stripped, or None when there is no box,
        the last box is unclosed, or it is empty.
    """
    found = _last_box_start(text)
    if found is None:
        return None
    pos, command = found
    i = pos + len(command)
    while i < len(text) and text[i] in " \t":
        i += 1
    if i < len(text) and text[i] == "{":
        close = _matching_brace(text, i)
        if close is None:
            return None
        content = text[i + 1 : close].strip()
    else:
        # `\boxed 5`: one token, up to whitespace or the closing `$`.
        match = re.match(r"[^\s$]+", text[i:])
        content = match.group(0).rstrip(".") if match else ""
    return content or None


def extract_answer_line(text: str) -> str | None:
    """The text after the last `Answer:` (case-insensitive), without `$` and a final period.

    Args:
        text: The model's response.

    Returns:
        The answer text, or None when there is no non-empty `Answer:` line.
    """
    matches = _ANSWER_LINE.findall(text)
    if not matches:
        return None
    answer = matches[-1].strip().strip("*").strip()
    if answer.endswith("."):
        answer = answer[:-1]
    answer = answer.strip().strip("$").strip()
    boxed = extract_boxed(answer)
    if boxed is not None:
        return boxed
    return answer or None


def extract_answer(text: str) -> str | None:
    """The model's final answer: the last box if there is one, else the last `Answer:` line.

    Args:
        text: The model's response.

    Returns:
        The extracted answer, or None when the response states none.
    """
    if _last_box_start(text) is not None:
        return extract_boxed(text)
    return extract_answer_line(text)

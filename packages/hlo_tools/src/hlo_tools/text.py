"""Bracket- and quote-aware scanning of HLO text fragments.

HLO attribute values nest (), {}, [] and carry double-quoted strings (op names,
backend_config JSON with escaped quotes), so splitting on commas or finding the
end of a value needs a small scanner rather than a split. The scanner steps from
token to token with one regular expression (a whole string or comment is one
token, skipped: the brackets in them do not count) instead of from character to
character: a compiled step's text is megabytes, most of it inside strings.
"""

import functools
import re

from hlo_tools.errors import HloParseError

_OPEN = {"(": ")", "{": "}", "[": "]"}
_CLOSE = {")", "}", "]"}
# A whole string (backslash escapes) or comment first; a quote or comment opener left
# over is one that is never closed. Then one bracket.
_TOKEN = r'"[^"\\]*(?:\\.[^"\\]*)*"|/\*.*?\*/|"|/\*|[()\[\]{}]'
_BRACKETS = re.compile(_TOKEN, re.S)


@functools.cache
def _splitter(sep: str) -> re.Pattern:
    """The tokens split_top_level reads: strings, comments, brackets and `sep`."""
    return re.compile(f"{_TOKEN}|{re.escape(sep)}", re.S)


def _opaque(token: str, s: str, line_number: int) -> bool:
    """Whether `token` is a string or comment (skipped); raises where it is unclosed."""
    if token == '"':
        raise HloParseError("unterminated string", line_number, s)
    if token == "/*":
        raise HloParseError("unterminated comment", line_number, s)
    return token[0] == '"' or token.startswith("/*")


def skip_comment(s: str, i: int, line_number: int = 0) -> int:
    """Return the index just past the ``/* ... */`` comment starting at ``s[i]``."""
    end = s.find("*/", i + 2)
    if end < 0:
        raise HloParseError("unterminated comment", line_number, s)
    return end + 2


def match_bracket(s: str, i: int, line_number: int = 0) -> int:
    """Return the index just past the bracket group opening at ``s[i]``."""
    if i >= len(s) or s[i] not in _OPEN:
        raise HloParseError(f"expected an opening bracket at column {i + 1}", line_number, s)
    stack = [_OPEN[s[i]]]
    for m in _BRACKETS.finditer(s, i + 1):
        c = m.group()
        if _opaque(c, s, line_number):
            continue
        if c in _OPEN:
            stack.append(_OPEN[c])
            continue
        if c != stack[-1]:
            raise HloParseError(f"mismatched {c!r} at column {m.start() + 1}", line_number, s)
        stack.pop()
        if not stack:
            return m.end()
    raise HloParseError("unbalanced brackets", line_number, s)


def open_brackets(s: str, line_number: int = 0) -> int:
    """Brackets ``s`` opens and does not close (outside strings and comments).

    An instruction whose attributes hold text with line breaks (a Pallas kernel's
    ``kernel_metadata={...}`` on TPU) spans several lines: it is complete when this
    is 0. Counting first is exact whenever no string or comment holds a bracket."""
    counts = [s.count(c) for c in "([{)]}"]
    if counts[:3] == counts[3:]:
        return 0
    depth = 0
    for m in _BRACKETS.finditer(s):
        c = m.group()
        if not _opaque(c, s, line_number):
            depth += 1 if c in _OPEN else -1
    return depth


def split_top_level(s: str, sep: str = ",", line_number: int = 0) -> list[str]:
    """Split ``s`` on ``sep`` where it is outside brackets, strings and comments."""
    parts: list[str] = []
    start = 0
    stack: list[str] = []
    for m in _splitter(sep).finditer(s):
        c = m.group()
        if _opaque(c, s, line_number):
            continue
        if c in _OPEN:
            stack.append(_OPEN[c])
        elif c in _CLOSE:
            if not stack:
                raise HloParseError(f"unexpected {c!r} at column {m.start() + 1}", line_number, s)
            if c != stack.pop():
                raise HloParseError(f"mismatched {c!r} at column {m.start() + 1}", line_number, s)
        elif not stack:
            parts.append(s[start : m.start()])
            start = m.end()
    if stack:
        raise HloParseError("unbalanced brackets", line_number, s)
    parts.append(s[start:])
    return [p.strip() for p in parts if p.strip()]


def strip_comments(s: str) -> str:
    """Remove ``/* ... */`` comments (XLA prints ``/*index=5*/`` inside long tuples)."""
    out = []
    i = 0
    while True:
        j = s.find("/*", i)
        if j < 0:
            out.append(s[i:])
            return "".join(out)
        out.append(s[i:j])
        i = skip_comment(s, j)

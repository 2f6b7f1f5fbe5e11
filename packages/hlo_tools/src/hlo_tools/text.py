"""Bracket- and quote-aware scanning of HLO text fragments.

HLO attribute values nest (), {}, [] and carry double-quoted strings (op names,
backend_config JSON with escaped quotes), so splitting on commas or finding the
end of a value needs a small scanner rather than a regular expression.
"""

from hlo_tools.errors import HloParseError

_OPEN = {"(": ")", "{": "}", "[": "]"}
_CLOSE = {")", "}", "]"}


def skip_string(s: str, i: int, line_number: int = 0) -> int:
    """Return the index just past the double-quoted string starting at ``s[i]``."""
    j = i + 1
    while j < len(s):
        c = s[j]
        if c == "\\":
            j += 2
            continue
        if c == '"':
            return j + 1
        j += 1
    raise HloParseError("unterminated string", line_number, s)


def skip_comment(s: str, i: int, line_number: int = 0) -> int:
    """Return the index just past the ``/* ... */`` comment starting at ``s[i]``."""
    end = s.find("*/", i + 2)
    if end < 0:
        raise HloParseError("unterminated comment", line_number, s)
    return end + 2


def skip_opaque(s: str, i: int, line_number: int = 0) -> int:
    """Skip a string or comment starting at ``s[i]`` (their brackets do not count); else ``i``."""
    if s[i] == '"':
        return skip_string(s, i, line_number)
    if s.startswith("/*", i):
        return skip_comment(s, i, line_number)
    return i


def match_bracket(s: str, i: int, line_number: int = 0) -> int:
    """Return the index just past the bracket group opening at ``s[i]``."""
    if i >= len(s) or s[i] not in _OPEN:
        raise HloParseError(f"expected an opening bracket at column {i + 1}", line_number, s)
    stack = [_OPEN[s[i]]]
    j = i + 1
    while j < len(s):
        c = s[j]
        past = skip_opaque(s, j, line_number)
        if past != j:
            j = past
            continue
        if c in _OPEN:
            stack.append(_OPEN[c])
        elif c in _CLOSE:
            if c != stack[-1]:
                raise HloParseError(f"mismatched {c!r} at column {j + 1}", line_number, s)
            stack.pop()
            if not stack:
                return j + 1
        j += 1
    raise HloParseError("unbalanced brackets", line_number, s)


def open_brackets(s: str, line_number: int = 0) -> int:
    """Brackets ``s`` opens and does not close (outside strings and comments).

    An instruction whose attributes hold text with line breaks (a Pallas kernel's
    ``kernel_metadata={...}`` on TPU) spans several lines: it is complete when this
    is 0. Counting first is exact whenever no string or comment holds a bracket."""
    counts = [s.count(c) for c in "([{)]}"]
    if counts[:3] == counts[3:]:
        return 0
    depth, j = 0, 0
    while j < len(s):
        past = skip_opaque(s, j, line_number)
        if past != j:
            j = past
            continue
        if s[j] in _OPEN:
            depth += 1
        elif s[j] in _CLOSE:
            depth -= 1
        j += 1
    return depth


def split_top_level(s: str, sep: str = ",", line_number: int = 0) -> list[str]:
    """Split ``s`` on ``sep`` where it is outside brackets, strings and comments."""
    parts: list[str] = []
    start = 0
    j = 0
    while j < len(s):
        c = s[j]
        past = skip_opaque(s, j, line_number)
        if past != j:
            j = past
            continue
        if c in _OPEN:
            j = match_bracket(s, j, line_number)
            continue
        if c in _CLOSE:
            raise HloParseError(f"unexpected {c!r} at column {j + 1}", line_number, s)
        if c == sep:
            parts.append(s[start:j])
            start = j + 1
        j += 1
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

"""The scanner under the parser: brackets, commas and quotes inside strings and
comments do not count; every malformed fragment raises HloParseError."""

import pytest

from hlo_tools.errors import HloParseError
from hlo_tools.text import match_bracket, open_brackets, split_top_level, strip_comments

# An attribute tail as XLA prints it: nested braces, a JSON string with escaped
# quotes, brackets and commas inside it, and a comment holding a comma and a brace.
TAIL = r'a={b,{c}}, d="{\"e\":[1,2]}, )", f=/*g, }*/h, i=(j,k)'


def test_split_top_level_skips_strings_comments_and_nested_brackets():
    assert split_top_level(TAIL) == [
        "a={b,{c}}",
        r'd="{\"e\":[1,2]}, )"',
        "f=/*g, }*/h",
        "i=(j,k)",
    ]
    assert split_top_level("x y", " ") == ["x", "y"]


def test_match_bracket_returns_the_index_past_the_group():
    s = '(a, "b)", /*)*/ (c)) tail'
    assert s[: match_bracket(s, 0)] == '(a, "b)", /*)*/ (c))'
    assert match_bracket("x[1]{0}", 1) == 4


def test_open_brackets_counts_only_outside_strings():
    assert open_brackets('k={a="}", b=[') == 2
    assert open_brackets('k={a="{"}') == 0


def test_strip_comments():
    assert strip_comments("a, /*index=5*/b") == "a, b"


@pytest.mark.parametrize(
    "fragment, message",
    [
        ('a="unclosed, b=1', "unterminated string"),
        ('a="ends in an escape\\"', "unterminated string"),
        ("a=/* never closed", "unterminated comment"),
        ("a={b], c=1", r"mismatched '\]' at column 5"),
        ("a=b), c=1", r"unexpected '\)' at column 4"),
        ("a={b, c=1", "unbalanced brackets"),
    ],
)
def test_malformed_fragments_raise(fragment, message):
    with pytest.raises(HloParseError, match=message):
        split_top_level(fragment)


def test_match_bracket_errors():
    with pytest.raises(HloParseError, match="expected an opening bracket at column 1"):
        match_bracket("a(b)", 0)
    with pytest.raises(HloParseError, match=r"mismatched '\)' at column 3"):
        match_bracket("{a)", 0)
    with pytest.raises(HloParseError, match="unbalanced brackets"):
        match_bracket('(a, "b)"', 0)

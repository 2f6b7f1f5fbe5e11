"""Parser for compiled HLO text (``jax.jit(f).lower(...).compile().as_text()``).

Line oriented: XLA prints one instruction per line and one computation header
per line. Everything the parser does not understand raises :class:`HloParseError`
with the line number, so a truncated or mangled dump never reads as "no
collectives".
"""

from __future__ import annotations

import re
import threading
from collections import OrderedDict

from hlo_tools.errors import HloParseError
from hlo_tools.module import Computation, HloModule, Instruction
from hlo_tools.shapes import parse_type
from hlo_tools.text import match_bracket, open_brackets, split_top_level, strip_comments

_NAME = r"[A-Za-z_][\w.\-]*"
_HEADER = re.compile(rf"HloModule\s+({_NAME})\s*(,.*)?$")
_COMPUTATION = re.compile(rf"(ENTRY\s+)?%?({_NAME})\s*(?=\()")
_INSTRUCTION = re.compile(rf"(ROOT\s+)?%?({_NAME})\s*=\s*")
_OPCODE = re.compile(r"[a-z][\w\-]*")
_KEY = re.compile(r"[A-Za-z_][\w.\-]*$")
_OPERAND = re.compile(rf"%?({_NAME})$")
# Debug-info tables JAX prints between the header and the first computation.
_SECTION = re.compile(r"[A-Z][A-Za-z]*$")
_SECTION_ROW = re.compile(r"\d+\s")
# Opcodes whose parenthesised text is a literal, not operand names.
_LITERAL_OPCODES = {"constant", "parameter", "iota"}

_CLOSE_WITH_ATTRIBUTES = re.compile(r"^\}\s*,\s*[\w.]+=")

# The modules of the texts parsed last. One compiled program is commonly parsed
# several times in a row (accum's verdict when it is compiled, the trainer's
# startup collective summary and kernel count, a test's own assertions), each a
# whole parse: about a second for tagtrain-tiny's step, several for a full-size
# model's. Bounded by the texts' total length (a module holds about six times its
# text's bytes), except that the newest text is always kept: `train
# compile_topology=h200-1` parsed deepseek3-small's 53 MB program five times.
_CACHE: OrderedDict[str, HloModule] = OrderedDict()
_CACHE_CHARS = 16_000_000
_CACHE_LOCK = threading.Lock()


def parse(text: str) -> HloModule:
    """Parse compiled HLO text into an :class:`HloModule`.

    The same text gives the same module object while it is among the last ones
    parsed (up to 16 M characters of text in all, and always the last one): treat
    a module as read-only (nothing in hlo_tools changes one).

    Understands CPU, GPU and TPU dumps: tuple types, tiled layouts, the debug
    tables (FileNames, StackFrames, ...), attributes holding JSON. Raises
    :class:`HloParseError` (with a line number) on anything malformed: unknown
    line shapes, unbalanced brackets, an unterminated computation, a missing
    ENTRY, or a reference to an undefined computation or operand.

    >>> module = ht.parse(HLO)
    >>> module.name, module.entry_name, sorted(module.computations)
    ('step', 'main', ['add', 'body', 'cond', 'main'])
    >>> ht.parse("ENTRY %main {")
    Traceback (most recent call last):
    ...
    hlo_tools.errors.HloParseError: ...
    """
    if not isinstance(text, str):
        raise TypeError(f"parse() takes HLO text, got {type(text).__name__}")
    with _CACHE_LOCK:
        module = _CACHE.get(text)
        if module is not None:
            _CACHE.move_to_end(text)
            return module
    module = _parse(text)
    with _CACHE_LOCK:
        _CACHE[text] = module
        while len(_CACHE) > 1 and sum(map(len, _CACHE)) > _CACHE_CHARS:
            _CACHE.popitem(last=False)
    return module


def _parse(text: str) -> HloModule:
    name, attributes = "", {}
    computations: dict[str, Computation] = {}
    current: Computation | None = None
    in_section = False
    entry_name = None
    # An instruction continued on the next lines (its brackets not yet closed): its
    # first line's number and its text so far.
    pending: tuple[int, str] | None = None
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if pending is not None:
            pending = (pending[0], f"{pending[1]} {line}")
            if open_brackets(pending[1], pending[0]) <= 0:
                current.instructions.append(
                    _parse_instruction(pending[1], pending[0], current.name)
                )
                pending = None
            continue
        if current is not None:
            # TPU SparseCore computations close with `}, execution_thread="sparsecore"`.
            if line == "}" or _CLOSE_WITH_ATTRIBUTES.match(line):
                _finish(current, raw)
                current = None
            elif line and open_brackets(line, number) > 0:
                pending = (number, line)
            elif line:
                current.instructions.append(_parse_instruction(line, number, current.name))
            continue
        if not line:
            in_section = False
            continue
        if line.startswith("HloModule"):
            if name or computations:
                raise HloParseError("second HloModule header", number, raw)
            name, attributes = _parse_header(line, number)
        elif in_section and _SECTION_ROW.match(line):
            continue
        elif _SECTION.match(line):
            in_section = True
        elif line.endswith("{") and _COMPUTATION.match(line):
            current = _parse_computation_header(line, number)
            if current.name in computations:
                raise HloParseError(f"duplicate computation %{current.name}", number, raw)
            computations[current.name] = current
            if current.is_entry:
                if entry_name is not None:
                    raise HloParseError("second ENTRY computation", number, raw)
                entry_name = current.name
        else:
            raise HloParseError("unrecognised line outside any computation", number, raw)
    if pending is not None:
        raise HloParseError("unbalanced brackets", pending[0], pending[1])
    if current is not None:
        raise HloParseError(
            f"computation %{current.name} is not closed by '}}'", current.line_number
        )
    if not computations:
        raise HloParseError("no computations found")
    if entry_name is None:
        raise HloParseError("no ENTRY computation")
    module = HloModule(name, attributes, computations, entry_name)
    _check_references(module)
    return module


def parse_instruction(line: str, line_number: int = 0, computation: str = "") -> Instruction:
    """Parse one instruction line on its own (no cross-reference checks)."""
    return _parse_instruction(line.strip(), line_number, computation)


def _parse_header(line: str, number: int) -> tuple[str, dict[str, str]]:
    m = _HEADER.match(line)
    if not m:
        raise HloParseError("bad HloModule header", number, line)
    return m.group(1), _parse_attributes(m.group(2) or "", number, line)


def _parse_computation_header(line: str, number: int) -> Computation:
    m = _COMPUTATION.match(line)
    i = match_bracket(line, m.end(), number)
    rest = line[i:].strip()
    if not rest.startswith("->"):
        raise HloParseError("computation header lacks '->'", number, line)
    rest = rest[2:]
    _, j = parse_type(rest, 0, number)
    if rest[j:].strip() != "{":
        raise HloParseError("computation header must end with '{'", number, line)
    return Computation(m.group(2), bool(m.group(1)), number)


def _parse_instruction(line: str, number: int, computation: str) -> Instruction:
    m = _INSTRUCTION.match(line)
    if not m:
        raise HloParseError("expected an instruction 'name = type opcode(...)'", number, line)
    hlo_type, i = parse_type(line, m.end(), number)
    om = _OPCODE.match(line, _skip_spaces(line, i))
    if not om:
        raise HloParseError("expected an opcode", number, line)
    opcode = om.group(0)
    if om.end() >= len(line) or line[om.end()] != "(":
        raise HloParseError(f"expected '(' after opcode {opcode!r}", number, line)
    end = match_bracket(line, om.end(), number)
    inner = line[om.end() + 1 : end - 1]
    operands: tuple[str, ...] = ()
    literal = ""
    if opcode in _LITERAL_OPCODES:
        literal = inner
    else:
        # Long operand lists carry '/*index=5*/' markers; they are not operands.
        parts = split_top_level(strip_comments(inner), ",", number)
        operands = tuple(_operand_name(p, number, line) for p in parts)
    tail = line[end:].strip()
    if tail and not tail.startswith(","):
        raise HloParseError("expected ',' before attributes", number, line)
    return Instruction(
        name=m.group(2),
        type=hlo_type,
        opcode=opcode,
        operands=operands,
        attributes=_parse_attributes(tail, number, line),
        computation=computation,
        line_number=number,
        line=line,
        is_root=bool(m.group(1)),
        literal=literal,
    )


def _operand_name(part: str, number: int, line: str) -> str:
    # Older printers spell operands with their type: 'f32[4]{0} %x'.
    om = _OPERAND.match(part.split()[-1])
    if not om:
        raise HloParseError(f"bad operand {part!r}", number, line)
    return om.group(1)


def _parse_attributes(tail: str, number: int, line: str) -> dict[str, str]:
    attributes = {}
    for part in split_top_level(tail, ",", number):
        key, eq, value = part.partition("=")
        if not eq or not _KEY.match(key.strip()):
            raise HloParseError(f"bad attribute {part[:60]!r}", number, line)
        attributes[key.strip()] = value.strip()
    return attributes


def _skip_spaces(s: str, i: int) -> int:
    while i < len(s) and s[i] == " ":
        i += 1
    return i


def _finish(comp: Computation, raw: str) -> None:
    roots = [i for i in comp.instructions if i.is_root]
    if len(roots) != 1:
        raise HloParseError(
            f"computation %{comp.name} has {len(roots)} ROOT instructions, expected 1",
            comp.line_number,
        )
    names = set()
    for instr in comp.instructions:
        if instr.name in names:
            raise HloParseError(f"duplicate instruction %{instr.name}", instr.line_number)
        names.add(instr.name)


def _check_references(module: HloModule) -> None:
    for comp in module.computations.values():
        defined = comp.by_name
        for instr in comp.instructions:
            for operand in instr.operands:
                if operand not in defined:
                    raise HloParseError(
                        f"operand %{operand} is not defined in %{comp.name}",
                        instr.line_number,
                        instr.line,
                    )
            for _, callee in instr.called():
                if callee not in module.computations:
                    raise HloParseError(
                        f"reference to undefined computation %{callee}",
                        instr.line_number,
                        instr.line,
                    )

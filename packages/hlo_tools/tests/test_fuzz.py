"""Mutated HLO must raise HloParseError, never another exception or a silent result."""

import random

import pytest

import hlo_tools as ht


def _mutations(text: str, rng: random.Random, n: int):
    lines = text.splitlines()
    for _ in range(n):
        mutated = list(lines)
        k = rng.randrange(len(mutated))
        line = mutated[k]
        how = rng.choice(["truncate_line", "drop_brace", "garbage", "drop_line", "truncate_text"])
        if how == "truncate_line" and line:
            mutated[k] = line[: rng.randrange(len(line))]
        elif how == "drop_brace" and any(c in line for c in "{}()[]"):
            idx = [i for i, c in enumerate(line) if c in "{}()[]"]
            i = rng.choice(idx)
            mutated[k] = line[:i] + line[i + 1 :]
        elif how == "garbage":
            junk = "".join(
                rng.choice("%{}()[]=,\"'/*<> abcXYZ019") for _ in range(rng.randint(1, 12))
            )
            pos = rng.randrange(len(line) + 1)
            mutated[k] = line[:pos] + junk + line[pos:]
        elif how == "drop_line":
            del mutated[k]
        else:
            mutated = mutated[:k]
        yield how, "\n".join(mutated)


@pytest.mark.parametrize("name", ["cpu_replicated.hlo", "tpu_tagged.hlo"])
def test_mutations_raise_only_parse_errors(data_dir, name):
    text = (data_dir / name).read_text()
    rng = random.Random(1234)  # deterministic
    raised = 0
    for how, mutated in _mutations(text, rng, 300):
        try:
            module = ht.parse(mutated)
            ht.collectives(module)
            ht.traffic(module)
            ht.split_by_entry_loop(module)
        except ht.HloParseError as e:
            raised += 1
            assert e.line_number >= 0
        except Exception as e:  # pragma: no cover - the failure we hunt for
            pytest.fail(f"{how}: {type(e).__name__}: {e}")
    # Most mutations break the text; the ones that do not are fine (a line
    # dropped in the debug tables, garbage inside a string).
    assert raised > 150


@pytest.mark.parametrize(
    "text,line",
    [
        ("", 0),
        ("HloModule m\n\n%c (a: f32[]) -> f32[] {\n  ROOT %a = f32[] parameter(0)\n}\n", 0),
        ("HloModule m\nENTRY %e () -> f32[] {\n  ROOT %a = f32[] constant(1)\n", 2),
        ("HloModule m\nENTRY %e () -> f32[] {\n  ROOT %a = f32[] constant(1\n}\n", 3),
        ("HloModule m\nENTRY %e () -> f32[] {\n  ROOT %a = f32[] negate(%zz)\n}\n", 3),
        ("HloModule m\nENTRY %e () -> f32[] {\n  ROOT %a = f32[] call(), to_apply=%nope\n}\n", 3),
        ("HloModule m\nthis is not hlo\n", 2),
        ("HloModule m\nENTRY %e () -> f32[] {\n  %a = f32[] constant(1)\n}\n", 2),
    ],
)
def test_malformed_text_reports_the_line(text, line):
    with pytest.raises(ht.HloParseError) as err:
        ht.parse(text)
    assert err.value.line_number == line

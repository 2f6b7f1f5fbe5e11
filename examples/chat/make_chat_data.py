"""Write examples/chat/{train,held_out}.jsonl: small conversations in the `messages`
(role/content) format of chat fine-tuning sets, for the fine-tuning examples and tests.

Deterministic (no randomness): rerun it and the files are byte-identical. The answers
follow a few fixed patterns, so a tiny model fine-tuned on them learns visibly.
"""

from __future__ import annotations

import json
from pathlib import Path

HERE = Path(__file__).parent
NUMBERS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]
COLOURS = ["red", "blue", "green", "grey", "brown", "white"]
THINGS = ["mill", "river", "wheel", "cart", "sack", "lane"]


def sum_chat(a: int, b: int) -> dict:
    """One user question about a sum and the assistant's answer."""
    return {
        "messages": [
            {"role": "user", "content": f"What is {a} plus {b}?"},
            {"role": "assistant", "content": f"{a} plus {b} is {a + b}."},
        ]
    }


def colour_chat(index: int) -> dict:
    """A two-turn conversation with a system prompt."""
    colour, thing = COLOURS[index % len(COLOURS)], THINGS[index % len(THINGS)]
    return {
        "messages": [
            {"role": "system", "content": "You answer in one short sentence."},
            {"role": "user", "content": f"The {thing} is {colour}. What colour is the {thing}?"},
            {"role": "assistant", "content": f"The {thing} is {colour}."},
            {"role": "user", "content": f"Spell the number {index % 10}."},
            {"role": "assistant", "content": f"It is {NUMBERS[index % 10]}."},
        ]
    }


def conversations(start: int, count: int) -> list[dict]:
    """Alternating sum and colour conversations, `count` of them from `start`."""
    rows = []
    for index in range(start, start + count):
        if index % 2 == 0:
            rows.append(sum_chat(index % 7, (3 * index) % 5))
        else:
            rows.append(colour_chat(index))
    return rows


def write(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))


if __name__ == "__main__":
    write(HERE / "train.jsonl", conversations(0, 48))
    write(HERE / "held_out.jsonl", conversations(48, 8))

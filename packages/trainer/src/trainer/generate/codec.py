"""Text <-> token ids for generation: a checkpoint's tokenizer.json, or the trainer's bytes.

Prompts are encoded as the tokenizer encodes a text by default (its post-processor
adds what it adds: DeepSeek's prepends BOS); completions are decoded with special
tokens skipped. A run trained on text without a tokenizer.json used byte tokens
(trainer.data.text_data: ids 0..255, 256 ends a document): the same here.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable, Sequence

from trainer.config import ConfigError
from trainer.data.text_data import BYTE_VOCAB, EOS_BYTE, EOS_NAMES

# DeepSeek's end of sentence, looked up before the trainer's generic names.
DEEPSEEK_EOS = "<｜end▁of▁sentence｜>"


@dataclasses.dataclass(frozen=True)
class Codec:
    """A tokenizer as generation uses it."""

    name: str
    vocab_size: int  # ids are < vocab_size
    eos_id: int | None  # its end-of-text token, where it names one
    encode: Callable[[str], list[int]]
    decode: Callable[[Sequence[int]], str]


def from_file(path: str, key: str = "tokenizer_path") -> Codec:
    """The tokenizer.json at `path`; ConfigError naming `key` when it does not read."""
    if not os.path.isfile(path):
        raise ConfigError(f"{key}={path!r} is not a file")
    import tokenizers  # deferred: only text prompts need it

    try:
        tok = tokenizers.Tokenizer.from_file(path)
    except Exception as error:  # the Rust side raises its own exception types
        raise ConfigError(f"{key}={path!r} is not a readable tokenizer.json: {error}") from None
    names = (DEEPSEEK_EOS, *EOS_NAMES)
    eos = next((i for i in map(tok.token_to_id, names) if i is not None), None)
    return Codec(
        f"tokenizer.json ({path})",
        tok.get_vocab_size(with_added_tokens=True),
        eos,
        lambda text: tok.encode(text).ids,
        lambda ids: tok.decode(list(ids), skip_special_tokens=True),
    )


def bytes_codec() -> Codec:
    """The trainer's byte tokens (UTF-8 bytes, EOS_BYTE ends a document)."""
    return Codec(
        "bytes",
        BYTE_VOCAB,
        EOS_BYTE,
        lambda text: list(text.encode("utf-8")),
        lambda ids: bytes(i for i in ids if i < EOS_BYTE).decode("utf-8", errors="replace"),
    )


def _ids(value, where: str) -> tuple[int, ...]:
    values = value if isinstance(value, list) else [value]
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in values):
        raise ConfigError(f"{where}: eos_token_id={value!r} is not a token id or a list of them")
    return tuple(values)


def checkpoint_eos(directory: str) -> tuple[int, ...] | None:
    """The eos ids a Hugging Face directory declares: generation_config.json's
    `eos_token_id` (what transformers' generate stops at), else config.json's; None
    when neither file names one."""
    for name in ("generation_config.json", "config.json"):
        path = os.path.join(directory, name)
        if not os.path.isfile(path):
            continue
        try:
            with open(path) as f:
                value = json.load(f).get("eos_token_id")
        except (OSError, ValueError, AttributeError) as error:
            raise ConfigError(f"{path}: not a JSON object ({error})") from None
        if value is not None:
            return _ids(value, path)
    return None

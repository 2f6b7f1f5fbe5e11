"""The row forms TRL's SFTTrainer takes, besides `messages` and `input_ids` + `labels`
(sft_data.Encoder reads those and calls these):

- `prompt` + `completion`, plain strings: TRL tokenizes the prompt alone and the
  prompt followed by the completion (an end-of-sequence token appended when the
  completion does not end with one), with the tokenizer's special tokens; the loss
  counts the tokens past the prompt's (completion_only_loss, TRL's default for this
  form; `sft_train_on_completion_only=false`: every token).
- `prompt` + `completion`, both lists of messages (conversational): the prompt
  rendered with the generation prompt and the whole conversation rendered, each by
  the chat template; the tokens past the prompt's count.
- `text`: a document; tokenized with the special tokens, an end-of-sequence token
  appended as TRL does; every token counts.
- pretokenized `input_ids` with `assistant_masks` or `completion_mask` (what TRL's
  own tokenization writes) instead of `labels`: 1 counts, 0 does not.

Message content: a string, null (an assistant turn holding `tool_calls` only), or a
list of parts; a text model's template renders a string, so the parts' texts
(`{"type": "text", "text": ...}`) are joined, and a part of another type is refused
by name. Everything else of a message (`tool_calls`, `name`, `tool_call_id`,
`reasoning_content` ...) reaches the template unchanged.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from trainer.config import ConfigError
from trainer.data.text_data import IGNORE

ROLES = ("system", "developer", "user", "assistant", "tool")
MASKS = ("assistant_masks", "completion_mask")  # TRL's names of the counted-token mask


def _content(content: Any, where: str, i: int) -> Any:
    """A message's content as a text template renders it (see the module doc)."""
    if content is None or isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text":
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise ConfigError(
                    f"{where}: message {i}'s content has a part of type {kind!r}; a text "
                    "model takes text parts only ({'type': 'text', 'text': ...})"
                )
            if not isinstance(part.get("text"), str):
                raise ConfigError(f"{where}: message {i}'s text part has no string 'text'")
            texts.append(part["text"])
        return "".join(texts)
    kind = type(content).__name__
    raise ConfigError(f"{where}: message {i}'s content is a {kind}, not a string, null or parts")


def check_messages(messages: Any, where: str, column: str, need_assistant=True) -> list[dict]:
    """The messages as the template gets them; ConfigError naming the row and message."""
    if not isinstance(messages, list) or not messages:
        raise ConfigError(f"{where}: {column!r} is not a non-empty list of messages")
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or "role" not in message:
            raise ConfigError(f"{where}: message {i} is not an object with a role")
        if message["role"] not in ROLES:
            raise ConfigError(
                f"{where}: message {i} has role {message['role']!r}, not one of {', '.join(ROLES)}"
            )
        if "content" not in message and not message.get("tool_calls"):
            raise ConfigError(f"{where}: message {i} has neither content nor tool_calls")
        out.append({**message, "content": _content(message.get("content"), where, i)})
    if need_assistant and not any(message["role"] == "assistant" for message in out):
        raise ConfigError(f"{where}: no assistant message (nothing to learn from)")
    return out


def mask_labels(ids: np.ndarray, mask: Any, name: str, where: str) -> np.ndarray:
    """Labels from a 0/1 mask the length of `ids` (TRL's assistant_masks)."""
    if not isinstance(mask, list) or len(mask) != len(ids) or not set(mask) <= {0, 1}:
        raise ConfigError(
            f"{where}: {name} is not a list of 0 and 1 as long as input_ids ({len(ids)})"
        )
    return np.where(np.asarray(mask, bool), ids, IGNORE)


def _past_prompt(ids: list[int], prompt_length: int, completion_only: bool) -> tuple:
    ids_array = np.asarray(ids, np.int32)
    if not completion_only:
        return ids_array, ids_array.copy()
    labels = ids_array.copy()
    labels[:prompt_length] = IGNORE
    return ids_array, labels


def with_eos(text: str, eos: str | None) -> str:
    """`text` ending with the end-of-sequence token (TRL's add_eos)."""
    return text if not eos or text.endswith(eos) else text + eos


def prompt_completion(encoder, row: dict, where: str) -> tuple[np.ndarray, np.ndarray]:
    """(ids, labels) of a prompt/completion row, plain or conversational."""
    prompt, completion = row["prompt"], row["completion"]
    if isinstance(prompt, str) and isinstance(completion, str):
        tokenizer = encoder.need_tokenizer(where)
        eos = encoder.special_tokens.get("eos_token")
        prompt_ids = tokenizer.encode(prompt).ids
        ids = tokenizer.encode(prompt + with_eos(completion, eos)).ids
        return _past_prompt(ids, len(prompt_ids), encoder.completion_only)
    if isinstance(prompt, list) and isinstance(completion, list):
        prompt = check_messages(prompt, where, "prompt", need_assistant=False)
        completion = check_messages(completion, where, "completion")
        template = encoder.need_template(where)
        prompt_text = encoder.rendered(template.render, where, prompt, True)
        text = encoder.rendered(template.render, where, prompt + completion, False)
        if not text.startswith(prompt_text):
            raise ConfigError(
                f"{where}: the chat template ({template.source}) does not render prompt + "
                "completion as an extension of the prompt, so the completion's tokens cannot "
                "be told apart; use pretokenized rows"
            )
        tokenizer = encoder.tokenizer
        prompt_ids = tokenizer.encode(prompt_text, add_special_tokens=False).ids
        ids = tokenizer.encode(text, add_special_tokens=False).ids
        return _past_prompt(ids, len(prompt_ids), encoder.completion_only)
    raise ConfigError(
        f"{where}: prompt and completion must both be strings or both lists of messages "
        f"(they are a {type(prompt).__name__} and a {type(completion).__name__})"
    )


def text(encoder, row: dict, where: str) -> tuple[np.ndarray, np.ndarray]:
    """(ids, labels) of a `text` row: every token counts."""
    if not isinstance(row["text"], str) or not row["text"]:
        raise ConfigError(f"{where}: text is not a non-empty string")
    tokenizer = encoder.need_tokenizer(where)
    ids = tokenizer.encode(with_eos(row["text"], encoder.special_tokens.get("eos_token"))).ids
    return _past_prompt(ids, 0, False)

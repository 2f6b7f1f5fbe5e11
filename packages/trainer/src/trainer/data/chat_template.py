"""A checkpoint's chat template: found in its directory, rendered, assistant spans located.

Chat templates are Jinja source shipped with a checkpoint (`chat_template.jinja`, or
the `chat_template` entry of `tokenizer_config.json`). They come from the Hub, so they
are untrusted code: they run in jinja2's immutable sandbox, with the environment a
transformers user's template expects (`trim_blocks`, `lstrip_blocks`, loop controls,
`raise_exception`, `strftime_now`, a `tojson` that does not HTML-escape, and the
special tokens `bos_token`, `eos_token`, ... as variables).

Which characters are the assistant's: most templates carry no `{% generation %}`
markers (the tag is accepted and ignored), so the spans are found from the template's
own output. The text of assistant message i is what rendering `messages[:i + 1]` adds
to rendering `messages[:i]` with the generation prompt (the prompt that asks the
model for that reply): for DeepSeek's format, the reply followed by the
end-of-sentence token, which is what teaches the model to stop. That holds when every
render is a prefix of the next; a template that rewrites earlier turns (one that drops
past reasoning, say) breaks it, and the row is refused by name.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Sequence
from datetime import datetime
from typing import Any

from trainer.config import ConfigError

TEMPLATE_FILE = "chat_template.jinja"  # transformers' own file, preferred over the json entry
CONFIG_FILE = "tokenizer_config.json"


class TemplateBreaksPrefix(ValueError):
    """Rendering a longer conversation did not extend the shorter one's text."""


@dataclasses.dataclass(frozen=True)
class ChatTemplate:
    """A compiled chat template and the variables it is rendered with."""

    template: Any  # jinja2.Template
    special_tokens: dict[str, str]  # bos_token, eos_token, ...: the template's variables
    source: str  # the file it came from

    def render(self, messages: Sequence[dict], add_generation_prompt: bool = False) -> str:
        """The conversation as text, special tokens written by the template (as
        transformers' apply_chat_template with tokenize=False)."""
        return self.template.render(
            messages=list(messages), add_generation_prompt=add_generation_prompt,
            **self.special_tokens,
        )  # fmt: skip

    def assistant_spans(self, messages: Sequence[dict]) -> tuple[str, list[tuple[int, int]]]:
        """(the whole conversation's text, [start, stop) of each assistant message's text
        in it); TemplateBreaksPrefix when a render does not extend the previous one."""
        text = self.render(messages)
        spans = []
        for i, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            prompt = self.render(messages[:i], add_generation_prompt=True)
            upto = self.render(messages[: i + 1])
            if not upto.startswith(prompt) or not text.startswith(upto):
                raise TemplateBreaksPrefix(
                    f"the chat template ({self.source}) does not render message {i} (the "
                    "assistant's) as an extension of the messages before it, so its tokens "
                    "cannot be told apart; set sft_train_on_completion_only=false to count "
                    "every token, or use pretokenized input_ids/labels rows"
                )
            spans.append((len(prompt), len(upto)))
        return text, spans


def _token_text(value: Any) -> str | None:
    """A special token as tokenizer_config.json holds it: a string, or an AddedToken
    dict ({"content": ..., "__type": "AddedToken"}) in older files."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _template_source(directory: str, config: dict, key: str) -> tuple[str, str]:
    """(template text, the file it came from): chat_template.jinja, else the json entry
    (a string, or transformers' list of named templates: the one named "default")."""
    path = os.path.join(directory, TEMPLATE_FILE)
    if os.path.isfile(path):
        with open(path, encoding="utf-8") as f:
            return f.read(), path
    where = os.path.join(directory, CONFIG_FILE)
    entry = config.get("chat_template")
    if isinstance(entry, list):
        named = {t.get("name"): t.get("template") for t in entry if isinstance(t, dict)}
        entry = named.get("default")
    if not isinstance(entry, str) or not entry.strip():
        raise ConfigError(
            f"{key}={directory!r} has no chat template (no {TEMPLATE_FILE}, no 'chat_template' "
            f"in {CONFIG_FILE}), which `messages` rows need under use_sft; point {key} at the "
            "checkpoint the conversations are for, or use pretokenized input_ids/labels rows"
        )
    return entry, where


def _read_config(directory: str, key: str) -> dict:
    """tokenizer_config.json of `directory` ({} when absent); ConfigError when unreadable."""
    path = os.path.join(directory, CONFIG_FILE)
    if not os.path.isfile(path):
        return {}
    try:
        with open(path, encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ConfigError(f"{key}: {path} is not readable JSON: {error}") from None
    if not isinstance(config, dict):
        raise ConfigError(f"{key}: {path} holds a {type(config).__name__}, not an object")
    return config


def _environment():
    """jinja2's immutable sandbox with what chat templates on the Hub expect."""
    # Imported here: only SFT on conversations renders templates.
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationTag(jinja2.ext.Extension):
        """`{% generation %}...{% endgeneration %}` (transformers' marker of assistant
        text): parsed and rendered as its body; the spans are found by rendering."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.Scope(body).set_lineno(lineno)

    def raise_exception(message: str):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        # jinja's own tojson HTML-escapes <, >, & and ': templates expect plain JSON.
        return json.dumps(
            value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
            sort_keys=sort_keys,
        )  # fmt: skip

    environment = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[GenerationTag, jinja2.ext.loopcontrols]
    )
    environment.filters["tojson"] = tojson
    environment.globals["raise_exception"] = raise_exception
    environment.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return environment


def special_tokens(directory: str, key: str) -> dict[str, str]:
    """The special tokens of `directory`'s tokenizer_config.json (bos_token, eos_token,
    ...: the template's variables), {} without the file."""
    return {
        name: token
        for name, value in _read_config(directory, key).items()
        if name.endswith("_token") and (token := _token_text(value)) is not None
    }


def load(directory: str, key: str) -> ChatTemplate:
    """The chat template of checkpoint `directory` (named by config key `key`), compiled,
    with its special tokens; ConfigError naming `key` when there is none or it does not
    parse."""
    import jinja2  # here: see _environment

    config = _read_config(directory, key)
    text, source = _template_source(directory, config, key)
    try:
        template = _environment().from_string(text)
    except jinja2.TemplateError as error:
        raise ConfigError(f"{key}: the chat template in {source} does not parse: {error}") from None
    return ChatTemplate(template, special_tokens(directory, key), source)

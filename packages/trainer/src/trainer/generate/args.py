"""`generate`'s `key=value` arguments, read and checked before any backend starts.

`prompt=` and `prompt_ids=` may be given several times: one batch row each, in the
order given (a `prompts_file=` adds one text row per non-empty line after the
`prompt=` ones). Every other key once. A bad key or value is a ConfigError naming it.
"""

from __future__ import annotations

import dataclasses
import difflib
import os

from trainer.config import DTYPES, ConfigError
from trainer.generate.sampling import STRATEGIES

# key -> its one-line meaning (docs/finetune.md's table is this, in words).
KEYS = {
    "hf_model_path": "a Hugging Face directory: its config.json, weights and tokenizer.json",
    "run_dir": "a run's directory (base_output_directory/run_name): its newest checkpoint",
    "step": "with run_dir: this checkpoint step instead of the newest",
    "prompt": "a text prompt, tokenized by the checkpoint's tokenizer (repeatable: a row each)",
    "prompts_file": "a text file: one prompt per non-empty line",
    "prompt_ids": "a prompt as token ids, 1,2,3 (repeatable: a row each)",
    "max_new_tokens": "tokens generated per prompt at most (default 32)",
    "decode_sampling_strategy": f"{', '.join(STRATEGIES)} (default: generation_config.json's "
    "do_sample: composite, else greedy)",
    "decode_sampling_temperature": "logits are divided by it first (default: the checkpoint's, "
    "else 1.0)",
    "decode_sampling_top_k": "topk, composite: then the k largest (default: the checkpoint's, "
    "else 50)",
    "decode_sampling_nucleus_p": "nucleus, composite: then the top tokens of mass p (default: "
    "the checkpoint's top_p, else 1.0)",
    "seed": "seed of the draws (default 0)",
    "eos_token_id": "a row ends at this id (default: generation_config.json's; -1: none)",
    "tokenizer_path": "a tokenizer.json (default: the checkpoint's)",
    "dtype": "compute dtype, float32 or bfloat16 (default: the checkpoint's config)",
    "weight_dtype": "parameter dtype, float32 or bfloat16 (default: the checkpoint's config)",
}
REPEATABLE = ("prompt", "prompt_ids")
DEFAULT_MAX_NEW_TOKENS = 32


@dataclasses.dataclass(frozen=True)
class Arguments:
    """What `generate` was asked, parsed; nothing read from the checkpoint yet."""

    hf_model_path: str = ""
    run_dir: str = ""
    step: int | None = None
    texts: tuple[str, ...] = ()  # prompt= then prompts_file lines
    id_rows: tuple[tuple[int, ...], ...] = ()  # prompt_ids=
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS
    # The decode_sampling_* keys given, parsed (strategy, temperature, top_k,
    # nucleus_p); the rest come from the checkpoint (sampling.choose_sampling).
    sampling_given: tuple[tuple[str, object], ...] = ()
    seed: int = 0
    eos_token_id: int | None = None  # None: the checkpoint's; -1: never end early
    tokenizer_path: str = ""
    model_overrides: tuple[tuple[str, str], ...] = ()  # dtype, weight_dtype


def _split(argv: list[str]) -> dict[str, list[str]]:
    """key -> its values in order; ConfigError for a word that is not key=value, an
    unknown key (with the nearest known one) or a second value of a one-value key."""
    out: dict[str, list[str]] = {}
    for arg in argv:
        key, sep, value = arg.partition("=")
        if not sep or not key:
            raise ConfigError(f"generate: argument {arg!r} is not of the form key=value")
        if key not in KEYS:
            close = difflib.get_close_matches(key, KEYS, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else f" (keys: {', '.join(KEYS)})"
            raise ConfigError(f"generate: unknown key {key!r}{hint}")
        if key in out and key not in REPEATABLE:
            raise ConfigError(f"generate: {key}= given twice")
        out.setdefault(key, []).append(value)
    return out


def _number(key: str, value: str, kind: type):
    try:
        return kind(value)
    except ValueError:
        what = "an integer" if kind is int else "a number"
        raise ConfigError(f"{key}={value!r} is not {what}") from None


def _token_ids(value: str) -> tuple[int, ...]:
    words = [w.strip() for w in value.split(",")]
    if not value.strip() or not all(w.isdigit() for w in words):
        raise ConfigError(f"prompt_ids={value!r} is not a comma-separated list of token ids")
    return tuple(int(w) for w in words)


def _file_prompts(path: str) -> list[str]:
    if not os.path.isfile(path):
        raise ConfigError(f"prompts_file={path!r} is not a file")
    try:
        with open(path, encoding="utf-8") as f:
            lines = [line.rstrip("\n") for line in f]
    except (OSError, UnicodeDecodeError) as error:
        raise ConfigError(f"prompts_file={path!r} does not read as UTF-8 text: {error}") from None
    prompts = [line for line in lines if line.strip()]
    if not prompts:
        raise ConfigError(f"prompts_file={path!r} holds no prompt (no non-empty line)")
    return prompts


def _source(values: dict[str, list[str]], files: bool) -> tuple[str, str, int | None]:
    hf_path, run_dir = values.get("hf_model_path", [""])[0], values.get("run_dir", [""])[0]
    if bool(hf_path) == bool(run_dir):
        raise ConfigError("generate: give one of hf_model_path= or run_dir=")
    for key, path in (("hf_model_path", hf_path), ("run_dir", run_dir)):
        if files and path and not os.path.isdir(path):
            raise ConfigError(f"{key}={path!r} is not a directory")
    step = _number("step", values["step"][0], int) if "step" in values else None
    if step is not None and not run_dir:
        raise ConfigError("step= goes with run_dir= (a Hugging Face directory has no steps)")
    return hf_path, run_dir, step


def _sampling(values: dict[str, list[str]]) -> tuple[tuple[str, object], ...]:
    """The sampling keys given, parsed: (name, value) with sampling.Sampling's names."""
    out: list[tuple[str, object]] = []
    if "decode_sampling_strategy" in values:
        out.append(("strategy", values["decode_sampling_strategy"][0]))
    for name, kind in (("temperature", float), ("top_k", int), ("nucleus_p", float)):
        key = f"decode_sampling_{name}"
        if key in values:
            out.append((name, _number(key, values[key][0], kind)))
    return tuple(out)


def parse(argv: list[str], *, files: bool = True) -> Arguments:
    """`generate`'s command line -> Arguments; ConfigError naming the first bad key.
    `files=False` checks the words alone: no directory looked for, no prompts_file
    read (its rows then are its path; what the docs' command check uses)."""
    values = _split(argv)
    hf_path, run_dir, step = _source(values, files)
    texts = list(values.get("prompt", []))
    if "prompts_file" in values:
        path = values["prompts_file"][0]
        texts += _file_prompts(path) if files else [path]
    id_rows = [_token_ids(v) for v in values.get("prompt_ids", [])]
    if texts and id_rows:
        raise ConfigError("generate: give text prompts (prompt=, prompts_file=) or prompt_ids=")
    if not texts and not id_rows:
        raise ConfigError("generate: no prompt (prompt=TEXT, prompt_ids=1,2,3 or prompts_file=)")
    if any(not text for text in texts):
        raise ConfigError("prompt='' is empty")
    max_new = _number("max_new_tokens", values.get("max_new_tokens", ["32"])[0], int)
    if max_new < 1:
        raise ConfigError(f"max_new_tokens={max_new} must be >= 1")
    eos = values.get("eos_token_id")
    eos_id = _number("eos_token_id", eos[0], int) if eos else None
    if eos_id is not None and eos_id < -1:
        raise ConfigError(f"eos_token_id={eos_id} must be a token id or -1 (none)")
    overrides = []
    for key in ("dtype", "weight_dtype"):
        if key in values:
            if values[key][0] not in DTYPES:
                raise ConfigError(f"{key}={values[key][0]!r} is not one of {', '.join(DTYPES)}")
            overrides.append((key, values[key][0]))
    return Arguments(
        hf_model_path=hf_path,
        run_dir=run_dir,
        step=step,
        texts=tuple(texts),
        id_rows=tuple(id_rows),
        max_new_tokens=max_new,
        sampling_given=_sampling(values),
        seed=_number("seed", values.get("seed", ["0"])[0], int),
        eos_token_id=eos_id,
        tokenizer_path=values.get("tokenizer_path", [""])[0],
        model_overrides=tuple(overrides),
    )

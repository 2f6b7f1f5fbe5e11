"""The `generate` console script.

    uv run generate hf_model_path=DIR prompt="Once upon a time" max_new_tokens=20
    uv run generate run_dir=outputs/my_run prompt_ids=0,5,9 prompt_ids=0,7 \\
        decode_sampling_strategy=nucleus decode_sampling_nucleus_p=0.9 seed=1

Arguments are `key=value` words as `train` takes them (args.py lists the keys).
Every check (keys, values, paths, tokenizer, prompt lengths) runs before any weight
is read or anything compiles; a failure is one line, `config error: ...`, exit 2.
Per prompt it prints the prompt, the completion's text (special tokens skipped) and
`ids: ...`, the new token ids (an eos that ended the row included).
"""

from __future__ import annotations

import sys

from trainer.config import ConfigError
from trainer.generate import args as args_lib
from trainer.generate import sampling as sampling_lib
from trainer.generate import source as source_lib


def prompt_rows(arguments: args_lib.Arguments, source: source_lib.Source) -> list[list[int]]:
    """The batch's token rows: text prompts encoded with the source's tokenizer, or the
    given ids; ConfigError for ids past the vocabulary or past YaRN's context."""
    config = source.config
    if arguments.texts:
        if source.codec is None:
            raise ConfigError(
                "prompt= needs a tokenizer, and this checkpoint has none: give "
                "tokenizer_path= or prompt_ids="
            )
        rows = [source.codec.encode(text) for text in arguments.texts]
        for text, row in zip(arguments.texts, rows, strict=True):
            if not row:
                raise ConfigError(f"prompt={text!r} encodes to no token")
    else:
        rows = [list(row) for row in arguments.id_rows]
        for row in rows:
            if max(row) >= config.vocab_size:
                raise ConfigError(
                    f"prompt_ids={','.join(map(str, row))}: id {max(row)} is not below the "
                    f"model's vocab_size={config.vocab_size}"
                )
    total = max(len(row) for row in rows) + arguments.max_new_tokens
    if config.rope_type == "yarn" and total > config.max_position_embeddings:
        raise ConfigError(
            f"max_new_tokens={arguments.max_new_tokens} after a {total - arguments.max_new_tokens}"
            f"-token prompt exceeds max_position_embeddings={config.max_position_embeddings}, "
            "the context rope_type=yarn extends to"
        )
    return rows


def _describe(arguments, source, rows, sampling) -> list[str]:
    c = source.config
    how = sampling_lib.describe(sampling)
    how += "" if sampling.strategy == "greedy" else f", seed {arguments.seed}"
    eos = ",".join(map(str, source.eos_ids)) or "none"
    shortest, longest = min(map(len, rows)), max(map(len, rows))
    batch = f"{len(rows)} prompts" if len(rows) > 1 else "1 prompt"
    lengths = f"{longest}" if shortest == longest else f"{shortest}-{longest}"
    padded = " (left-padded)" if shortest != longest else ""
    return [
        f"model: {source.where} ({c.dtype} compute, {c.weight_dtype} weights)",
        f"generate: {batch} of {lengths} tokens{padded}, up to {arguments.max_new_tokens} new "
        f"tokens, {how}, eos {eos}",
        f"kv cache: per token and layer the latent ({c.kv_lora_rank}) and the rope key "
        f"({c.qk_rope_head_dim}), {c.dtype}; attention absorbs wkv_b (DeepSeek's MLA decode)",
    ]


def _row_lines(index: int, arguments, source, row: list[int], new: list[int]) -> list[str]:
    prompt = arguments.texts[index] if arguments.texts else ",".join(map(str, row))
    ended = bool(new) and new[-1] in source.eos_ids
    why = "ended at eos" if ended else "max_new_tokens reached"
    lines = [f"prompt {index + 1}: {prompt}"]
    if source.codec is not None:
        lines.append(
            f"completion {index + 1} ({len(new)} tokens, {why}): {source.codec.decode(new)}"
        )
    else:
        lines.append(f"completion {index + 1} ({len(new)} tokens, {why})")
    return [*lines, f"ids: {','.join(map(str, new))}"]


def main(argv: list[str] | None = None) -> int:
    """Console entry point: 0 on success, 2 on a config error."""
    argv = sys.argv[1:] if argv is None else argv
    try:
        arguments = args_lib.parse(argv)
        source = source_lib.choose_source(arguments)
        given = dict(arguments.sampling_given)
        sampling = sampling_lib.choose_sampling(given, dict(source.generation))
        notes = sampling_lib.check(sampling, source.config.vocab_size, tuple(given))
        rows = prompt_rows(arguments, source)
    except ConfigError as error:
        print(f"config error: {error}", file=sys.stderr)
        return 2
    for line in [*(f"note: {n}" for n in notes), *_describe(arguments, source, rows, sampling)]:
        print(line, flush=True)
    from trainer.generate.runner import generate  # the model code loads here

    new_rows = generate(
        source.config,
        source.load(),
        rows,
        max_new_tokens=arguments.max_new_tokens,
        sampling=sampling,
        seed=arguments.seed,
        eos_ids=source.eos_ids,
    )
    for index, (row, new) in enumerate(zip(rows, new_rows, strict=True)):
        for line in _row_lines(index, arguments, source, row, new):
            print(line, flush=True)
    return 0


def run() -> None:
    """Console-script entry point."""
    sys.exit(main())

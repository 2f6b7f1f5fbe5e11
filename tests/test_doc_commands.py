"""Every command line the docs show runs as shown: a removed key or a wrong flag fails.

The commands are read from README.md, docs/*.md and packages/*/README.md: each line of
a ```bash block (backslash continuations joined), each `$ `-prefixed line of a plain
``` block (the lines under it are its output) and each inline `uv run ...` span. Kept
are tagtrain's own programs: `train`, `plan-reduction`, `export-hf`, `generate`,
`plot-metrics`, `hlo-report` and `python` (an example file or `-c`); `nox`, `pytest`,
`uv sync` and the shell's own are left out. The Python blocks that are whole programs
(no name used that the block does not define) run too; README.md's are
test_readme_examples.py's.

- cpu tier, text only (a few seconds): each command's arguments go through its program's
  own parser: `train`'s keys through `make_config` (MaxText's names as `train` reads
  them) and its `--flags` against the flags `train` defines, `plan-reduction`'s through
  `config_of`, `export-hf`'s, `generate`'s, `plot-metrics`' and `hlo-report`'s through
  theirs; a Python example file exists and a `-c` program compiles. No page names a
  removed key.
- slow tier: every fenced command runs, page after page in one scratch directory (the
  repository's examples/ and packages/ linked in, /tmp/ moved under it) with tiny
  overrides: at most 2 steps (a run of 1,000 or more steps is one the docs stop by
  signal, kept), the example's own outputs. A command the docs show failing (its next
  line `config error: ...`) must exit 2 with that line; a `plan-reduction` whose output
  block follows must print exactly that. Blocks that compile for a TPU or GPU topology
  (and the commands after them in the block, which read what they wrote) are aot and
  slow (`nox -s slow_aot`); GPU ones skip without the `gpu` extra.
"""

from __future__ import annotations

import ast
import builtins
import dataclasses
import importlib.util
import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# training.md first: outputs.md plots the multi-host run training.md makes.
PAGES = [
    ROOT / "README.md",
    ROOT / "docs" / "training.md",
    *sorted(p for p in ROOT.glob("docs/*.md") if p.name != "training.md"),
    *sorted(ROOT.glob("packages/*/README.md")),
]
PROGRAMS = (
    "train", "plan-reduction", "export-hf", "generate", "plot-metrics", "hlo-report", "python"
)  # fmt: skip
FENCE = re.compile(r"^( *)```(\w*)\n(.*?)^\1```", re.S | re.M)
INLINE = re.compile(r"`((?:[A-Z_]+=\S+ )*(?:uv run|\.venv/bin/)[^`]*)`")
# Shell words that separate one program's invocation from the next.
OPERATORS = {";", "&", "&&", "||", "|", "do", "done", "then", "until", "while", "for", ">"}
# Steps at or above this are a run the docs stop by signal: not shortened.
LONG_RUN = 1000


@dataclasses.dataclass
class Command:
    page: Path
    line: int
    text: str  # the shell line, continuations joined
    fenced: bool  # in a code block (runs in the slow tier), not an inline span
    block: int = 0  # index of its block on the page
    expect_error: str = ""  # the `config error: ...` line the docs show under it
    output: tuple[str, ...] = ()  # the plain block the docs show as its output

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(ROOT).as_posix()}:{self.line}"


def _logical_lines(body: str) -> list[tuple[int, str]]:
    """(offset of the first line, line) with backslash continuations joined."""
    out, pending, start = [], "", 0
    for number, raw in enumerate(body.splitlines()):
        if not pending:
            start = number
        if raw.rstrip().endswith("\\"):
            pending += raw.rstrip()[:-1] + " "
            continue
        out.append((start, pending + raw))
        pending = ""
    return out


def _dollar_commands(body: str) -> list[tuple[int, str, list[str]]]:
    """(offset, command, the output lines under it) of a plain block's `$ ` lines."""
    out: list[tuple[int, str, list[str]]] = []
    for offset, line in _logical_lines(body):
        if line.startswith("$ "):
            out.append((offset, line[2:], []))
        elif out:
            out[-1][2].append(line)
    return out


def _invocations(text: str) -> list[list[str]]:
    """The program invocations of a shell line: words between operators, with leading
    VAR=value, `timeout -s SIG N`, `uv run [--extra X]` and `.venv/bin/` taken off."""
    lexer = shlex.shlex(text, posix=True, punctuation_chars=";&|>")
    lexer.whitespace_split = True
    lexer.commenters = "#"
    words, groups = list(lexer), [[]]
    loop_words = False  # `for NAME in WORDS`: no program
    for previous, word in zip([None, *words], words, strict=False):
        if word in OPERATORS:
            groups.append([])
            loop_words = word == "for"
        elif previous != ">" and not loop_words:  # a redirection's file is no program
            groups[-1].append(word)
    out = []
    for group in groups:
        while group and re.fullmatch(r"[A-Za-z_]+=\S*", group[0]):
            group = group[1:]
        if group[:1] == ["timeout"]:  # timeout [-s SIG] [-k T] DURATION COMMAND
            group = group[1:]
            while group and group[0].startswith("-"):
                group = group[2:] if group[0] in ("-s", "-k") else group[1:]
            group = group[1:]
        if group[:2] == ["uv", "run"]:
            group = group[2:]
            while group[:1] == ["--extra"]:
                group = group[2:]
        if group and group[0].startswith(".venv/bin/"):
            group = [group[0].removeprefix(".venv/bin/"), *group[1:]]
        if group:
            out.append(group)
    return out


def program(command: Command) -> str:
    """The tagtrain program a command runs ('' for another one)."""
    found = [w[0] for w in _invocations(command.text) if w[0] in PROGRAMS]
    return found[0] if found else ""


def page_commands(page: Path) -> list[Command]:
    """The page's commands of tagtrain's programs, in page order."""
    text = page.read_text()
    commands: list[Command] = []
    blocks = list(FENCE.finditer(text))
    for index, match in enumerate(blocks):
        indent, lang, body = match.group(1), match.group(2), match.group(3)
        body = "\n".join(line.removeprefix(indent) for line in body.splitlines())
        first = text[: match.start()].count("\n") + 2
        if lang in ("bash", "sh"):
            found = [
                Command(page, first + offset, line.strip(), True, index)
                for offset, line in _logical_lines(body)
                if line.strip() and not line.strip().startswith("#")
            ]
            following = blocks[index + 1] if index + 1 < len(blocks) else None
            if (
                len(found) == 1
                and following is not None
                and not following.group(2)
                and not text[match.end() : following.start()].strip()
                and "$ " not in following.group(3)
            ):
                found[0].output = tuple(following.group(3).splitlines())
            commands += found
        elif not lang:
            for offset, line, under in _dollar_commands(body):
                error = next((u for u in under[:1] if u.startswith("config error:")), "")
                commands.append(Command(page, first + offset, line, True, index, error))
    for match in INLINE.finditer(FENCE.sub(lambda m: "\n" * m.group(0).count("\n"), text)):
        line = text[: match.start()].count("\n") + 1
        commands.append(Command(page, line, " ".join(match.group(1).split()), False, -1))
    return [c for c in commands if program(c)]


def section_commands(page: Path, heading: str) -> list[Command]:
    """The page's commands under the `## heading` section (up to the next `## `)."""
    lines = page.read_text().splitlines()
    first = lines.index(f"## {heading}") + 1
    last = next((i for i in range(first, len(lines)) if lines[i].startswith("## ")), len(lines))
    return [c for c in page_commands(page) if first < c.line <= last]


def all_commands() -> list[Command]:
    return [c for page in PAGES for c in page_commands(page)]


COMMANDS = all_commands()


def _is_placeholder(command: Command) -> bool:
    """A shape rather than a command (`...`, `KEY=VALUE`, `FILE`)."""
    return "..." in command.text or re.search(r"=[A-Z]{3,}\b|\b[A-Z_]{4,}\.\.\.", command.text)


# --- cpu tier: every command through its program's parser -----------------------------


def _check_train(args: list[str]) -> None:
    from trainer.config import make_config, maxtext_compat
    from trainer.run import main

    flags = [a for a in args if a.startswith("--")]
    for flag in flags:
        name = flag[2:].split("=", 1)[0]
        assert name in main.FLAGS, f"train has no flag --{name}"
    overrides, _ = maxtext_compat.read_command_line([a for a in args if a not in flags])
    make_config(overrides)


def _check_python(args: list[str]) -> None:
    if args[:1] == ["-c"]:
        compile(args[1], "<-c>", "exec")
    elif args[:1] == ["-m"]:
        assert importlib.util.find_spec(args[1]), f"no module {args[1]}"
    else:
        assert (ROOT / args[0]).is_file(), f"no file {args[0]}"


def check_arguments(command: Command) -> None:
    """The command's arguments through its program's own parser (no run)."""
    for words in _invocations(command.text):
        name, args = words[0], words[1:]
        if name == "train":
            _check_train(args)
        elif name == "plan-reduction":
            from trainer.run import plan_reduction

            plan_reduction.config_of([a for a in args if a != "--compile"])
        elif name == "export-hf":
            from trainer.io import export_hf

            export_hf._arguments(args)
        elif name == "generate":
            from trainer.generate import args as generate_args

            generate_args.parse(args, files=False)  # the run it reads may not exist yet
        elif name == "plot-metrics":
            from trainer.io import plots

            plots.build_parser().parse_args(args)
        elif name == "hlo-report":
            from hlo_tools import cli

            parsed = cli.build_parser().parse_args(args)
            if parsed.file.startswith("packages/"):
                assert (ROOT / parsed.file).is_file(), f"no file {parsed.file}"
        elif name == "python":
            _check_python(args)


def test_commands_are_found():
    programs = {program(c) for c in COMMANDS}
    assert set(PROGRAMS) <= programs, set(PROGRAMS) - programs
    # The README's main job, a `$` line with its error, a multi-line inline span.
    texts = [c.text for c in COMMANDS]
    assert any(t.startswith("uv run train model_name=tagtrain-tiny steps=10") for t in texts)
    assert any(c.expect_error.startswith("config error: vocab_size=256") for c in COMMANDS)
    assert any(t.startswith("uv run train ici_data_parallelism=4 ici_fsdp") for t in texts)


def test_invocations_take_off_the_launchers():
    assert _invocations("JAX_PLATFORMS=cpu uv run --extra tpu train a=1 --x=2  # comment") == [
        ["train", "a=1", "--x=2"]
    ]
    assert _invocations("for i in 0 1; do X=1 .venv/bin/train a=$i & done; wait") == [
        ["train", "a=$i"],
        ["wait"],
    ]
    assert _invocations("train a=1 > /tmp/log &") == [["train", "a=1"]]
    assert _invocations("timeout -s TERM 30 train steps=9") == [["train", "steps=9"]]


# Shapes such as `train KEY=VALUE ...` are not commands: left out, not skipped.
@pytest.mark.parametrize(
    "command", [c for c in COMMANDS if not _is_placeholder(c)], ids=lambda c: c.where
)
def test_documented_command_parses(command):
    try:
        check_arguments(command)
    except (Exception, SystemExit) as error:  # argparse exits; the rest raise
        pytest.fail(f"{command.where}: `{command.text}`: {type(error).__name__}: {error}")


def test_no_page_names_a_removed_key():
    from trainer.config import REPLACED_KEYS

    pages = [*PAGES, *sorted(ROOT.glob("benchmarks/results/*.md"))]
    found = [
        f"{page.relative_to(ROOT)}: {key}="
        for page in pages
        for key in REPLACED_KEYS
        if re.search(rf"\b{key}=", page.read_text())
    ]
    assert not found, "removed keys (config.REPLACED_KEYS) on a page: " + ", ".join(found)


# --- slow tier: every fenced command runs ----------------------------------------------


def _undefined_names(code: str) -> set[str]:
    """Names the code reads but neither defines, imports nor gets from builtins."""
    tree = ast.parse(code)
    defined = set(dir(builtins))
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store | ast.Del):
            defined.add(node.id)
        elif isinstance(node, ast.FunctionDef | ast.ClassDef):
            defined.add(node.name)
        elif isinstance(node, ast.arg):
            defined.add(node.arg)
        elif isinstance(node, ast.alias):
            defined.add((node.asname or node.name).split(".")[0])
    used = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}
    return used - defined


def python_programs(page: Path) -> list[tuple[int, int, str]]:
    """(line, block index, code) of the page's ```python blocks that are whole programs."""
    text, out = page.read_text(), []
    for index, match in enumerate(FENCE.finditer(text)):
        if match.group(2) != "python":
            continue
        code = "\n".join(line.removeprefix(match.group(1)) for line in match.group(3).split("\n"))
        try:
            if _undefined_names(code):
                continue
        except SyntaxError:
            continue
        out.append((text[: match.start()].count("\n") + 2, index, code))
    return out


@dataclasses.dataclass
class Step:
    """One thing the slow tier runs: a fenced command or a Python program."""

    where: str
    shell: str = ""
    python: str = ""
    command: Command | None = None
    compiles: str = ""  # '', 'tpu' or 'gpu': the block compiles for a topology


def _compiles(text: str) -> str:
    """'tpu' or 'gpu' for a line that compiles for a topology (train, plan-reduction
    --compile), else ''."""
    compiling = [
        w
        for w in _invocations(text)
        if w[0] == "train" or (w[0] == "plan-reduction" and "--compile" in w)
    ]
    if not any("compile_topology=" in " ".join(w) for w in compiling):
        return ""
    return "gpu" if re.search(r"compile_topology=h\d00", text) else "tpu"


# Programs a block may run that are not tagtrain's (the shell around them).
SHELL = {"for", "grep", "sleep", "kill", "wait", "tail", "true", "echo"}


def _runs_here(line: str) -> bool:
    """Whether the slow tier runs this line of a block: tagtrain's programs and the
    shell around them; not a placeholder, a benchmark (their pages say what they cost)
    or another tool (pytest, nox, uv sync)."""
    if "..." in line or "benchmarks/" in line:
        return False
    words = _invocations(line)
    return all(
        w[0] in PROGRAMS or w[0] in SHELL or re.fullmatch(r"[A-Za-z_]+=\S*", w[0]) for w in words
    )


def _block_steps(page: Path, match: re.Match, commands: list[Command]) -> list[Step]:
    """A ```bash block as the slow tier runs it: one script of all its lines (a
    variable it sets, a background run it waits for), except that each line compiling
    for a topology, with the `hlo-report` lines after it that read what it wrote, is a
    step of its own (aot)."""
    indent, body = match.group(1), match.group(3)
    lines = _logical_lines("\n".join(x.removeprefix(indent) for x in body.splitlines()))
    first = page.read_text()[: match.start()].count("\n") + 2
    where = lambda offset: f"{page.relative_to(ROOT).as_posix()}:{first + offset}"  # noqa: E731
    plain, compiled = [], []
    for offset, line in lines:
        if not _runs_here(line):
            continue
        kind = _compiles(line)
        if kind:
            compiled.append(Step(where(offset), shell=line, compiles=kind))
        elif compiled and line.strip().startswith(("uv run hlo-report", "hlo-report")):
            compiled[-1].shell += "\n" + line
        else:
            plain.append((offset, line))
    out = []
    if any(program(Command(page, 0, line, True)) for _, line in plain):
        script = "\n".join(line for _, line in plain)
        only = commands[0] if len(commands) == 1 else None
        out.append(Step(where(plain[0][0]), shell=script, command=only))
    return out + compiled


README_FINETUNE = "Fine-tune a published checkpoint"


def steps() -> list[Step]:
    # README's main job: test_readme_sample.py runs it and checks its output.
    out, seen = [], {next(c.text for c in COMMANDS if c.page.name == "README.md")}
    # README's fine-tune block: test_readme_finetune.py runs it and checks its output.
    theirs = {c.where for c in section_commands(ROOT / "README.md", README_FINETUNE)}
    for page in PAGES:
        text = page.read_text()
        commands = [c for c in page_commands(page) if c.fenced and not _is_placeholder(c)]
        found: list[tuple[int, Step]] = []
        for index, match in enumerate(FENCE.finditer(text)):
            mine = [c for c in commands if c.block == index]
            if not mine:
                continue
            if match.group(2) in ("bash", "sh"):
                found += [
                    (int(s.where.rsplit(":", 1)[1]), s) for s in _block_steps(page, match, mine)
                ]
            else:  # `$ ` lines: one step each, with the error the docs show under it
                found += [(c.line, Step(c.where, shell=c.text, command=c)) for c in mine]
        if page != ROOT / "README.md":  # README's: test_readme_examples.py
            rel = page.relative_to(ROOT).as_posix()
            found += [
                (line, Step(f"{rel}:{line}", python=code))
                for line, _, code in python_programs(page)
            ]
        for _, step in sorted(found, key=lambda x: x[0]):
            key = step.shell or step.python
            if key in seen or step.where in theirs:  # the same lines elsewhere run once
                continue
            seen.add(key)
            out.append(step)
    return out


STEPS = steps()


# Documented commands that fail on this tree, by a piece of their text: strict xfails,
# so the fix turns them into a failure that says to drop the entry.
KNOWN_FAILURES: dict[str, str] = {
    # "a piece of the command": "why it fails today" (strict xfail: fixed -> remove it).
    # training.md's 2-slice hierarchical ZeRO-1 run failed at d0a88d8 (TagLostError,
    # in-slice reduce-scatters judged as dropped tags); fixed by accum's per-plan verdict.
}


def _marks(step: Step) -> list:
    marks = [pytest.mark.slow]
    if step.compiles:
        marks.append(pytest.mark.aot)
    marks += [
        pytest.mark.xfail(reason=why, strict=True)
        for piece, why in KNOWN_FAILURES.items()
        if piece in step.shell
    ]
    return marks


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def local(shell: str) -> str:
    """The command with this environment's programs (`uv run` and `.venv/bin/` taken off)."""
    shell = re.sub(r"\buv run (--extra \w+ )*", "", shell)
    return shell.replace(".venv/bin/", f"{Path(sys.executable).parent}/")


def tiny(shell: str, scratch: Path) -> str:
    """The command as the test runs it: this environment's programs, at most 2 steps
    (runs of LONG_RUN steps or more are stopped by signal: kept), /tmp/ and $PWD under
    the scratch directory, a free port."""
    shell = local(shell)
    shell = re.sub(
        r"\bsteps=(\d+)", lambda m: m.group(0) if int(m.group(1)) >= LONG_RUN else "steps=2", shell
    )
    shell = shell.replace("/tmp/", f"{scratch}/tmp/").replace("$PWD", str(scratch))
    return re.sub(r"\bPORT=\d+", f"PORT={_free_port()}", shell)


@pytest.fixture(scope="module")
def scratch(tmp_path_factory):
    """One directory for every page's commands, in order (a later page's command may
    read an earlier one's outputs), with the repository's inputs linked in."""
    root = tmp_path_factory.mktemp("doc_commands")
    for name in ("examples", "packages", "benchmarks"):
        (root / name).symlink_to(ROOT / name)
    (root / "tmp").mkdir()
    return root


@pytest.mark.parametrize("step", [pytest.param(s, marks=_marks(s), id=s.where) for s in STEPS])
def test_documented_command_runs(step, scratch):
    if step.compiles == "gpu" and importlib.util.find_spec("jax_cuda12_plugin") is None:
        pytest.skip("compiles for a GPU topology: needs the gpu extra")
    if step.compiles == "tpu" and importlib.util.find_spec("libtpu") is None:
        pytest.skip("compiles for a TPU topology: needs the tpu extra")
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PATH": f"{Path(sys.executable).parent}:"}
    env["PATH"] += os.environ.get("PATH", "")
    if step.python:
        argv = [sys.executable, "-c", step.python]
    else:
        argv = ["bash", "-c", tiny(step.shell, scratch)]
    done = subprocess.run(argv, cwd=scratch, env=env, capture_output=True, text=True, timeout=1800)
    shown = step.command.text if step.command else (step.shell or step.python).splitlines()[0]
    log = f"{step.where}: `{shown}`\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    if step.command and step.command.expect_error:
        assert done.returncode == 2, log
        assert step.command.expect_error in done.stderr, log
        return
    assert done.returncode == 0, log
    if step.command and step.command.output:
        assert done.stdout.splitlines() == list(step.command.output), log


def test_module_has_a_step_per_page_block():
    # The multi-host loop, the SIGTERM example and a Python program are among them.
    shells = [s.shell for s in STEPS]
    assert any(s.startswith("PORT=") and "for i in 0 1;" in s for s in shells)
    assert any("kill -TERM" in s for s in shells)
    assert any("moe_kernels" in s.python for s in STEPS)
    assert shutil.which("bash")

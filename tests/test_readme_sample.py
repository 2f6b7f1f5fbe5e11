"""README.md's main-job sample output is what the command prints (slow tier).

The README shows the main job's command in a ```bash block and, under a
`readme-sample` marker, its console output. This reruns the command in a temporary
directory on 8 virtual CPU devices and compares: on `step` lines the loss, gradient
norm and learning rate exactly and the throughput and time by pattern (they are
timings); every other line exactly (model sizes, the mesh, the predicted reduction
table, the compiled step's collective summary). A README whose sample has gone stale
fails here, naming the first line that differs.
"""

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MARKER = "<!-- readme-sample:"
# A step line's timing fields, e.g. "2,949 tokens/s  347 ms": any numbers match.
TIMINGS = re.compile(r"[\d,]+ tokens/s\s+[\d,]+ ms$")


def readme_command_and_sample(text: str) -> tuple[list[str], list[str]]:
    """(argv of the last `uv run train` command before the marker, sample lines)."""
    head, tail = text.split(MARKER, 1)
    commands = re.findall(r"```bash\n(uv run train [^\n]*)\n```", head)
    assert commands, "README.md: no ```bash block with `uv run train ...` before the sample"
    sample = tail.split("```\n", 1)[1].split("```", 1)[0]
    return shlex.split(commands[-1]), sample.splitlines()


def line_matches(expected: str, actual: str) -> bool:
    """Equal, except that a step line's timing fields may hold any numbers."""
    if expected.startswith("step ") and TIMINGS.search(expected):
        pattern = re.escape(TIMINGS.sub("", expected)) + TIMINGS.pattern
        return re.fullmatch(pattern, actual) is not None
    return expected == actual


def test_parser_reads_the_readme_block():
    argv, sample = readme_command_and_sample((ROOT / "README.md").read_text())
    assert argv[:3] == ["uv", "run", "train"]
    assert sample[0].startswith("model: ")
    assert any(line.startswith("step ") for line in sample)
    # The timing pattern accepts other timings and nothing else.
    step = "step     1  loss 6.0149  grad_norm 0.897  lr 0.00e+00  2,949 tokens/s  347 ms"
    assert line_matches(step, step.replace("2,949", "12,345").replace("347", "91"))
    assert not line_matches(step, step.replace("6.0149", "6.0148"))


@pytest.mark.slow
def test_readme_sample_output_is_what_the_main_job_prints(tmp_path):
    argv, sample = readme_command_and_sample((ROOT / "README.md").read_text())
    # The `train` of the environment running the tests (uv's or nox's), in an empty
    # directory so its outputs/ land there.
    train = Path(sys.executable).parent / "train"
    command = [str(train), *argv[3:]] if train.exists() else argv
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    env.pop("XLA_FLAGS", None)  # the README's run uses XLA's defaults
    result = subprocess.run(
        command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900
    )
    assert result.returncode == 0, result.stderr[-2000:]
    printed = result.stdout.splitlines()
    assert len(printed) == len(sample), (
        f"README sample has {len(sample)} lines, the command printed {len(printed)}:\n"
        + result.stdout
    )
    for number, (expected, actual) in enumerate(zip(sample, printed, strict=True), 1):
        assert line_matches(expected, actual), (
            f"README sample line {number} differs from the output of {shlex.join(argv)}\n"
            f"  README:  {expected}\n  printed: {actual}"
        )

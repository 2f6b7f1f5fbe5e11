"""hlo-report on saved dumps: the table, JSON, filters, exit codes."""

import json
import re
import subprocess
import sys

import pytest

from hlo_tools.cli import main


def _run(capsys, *argv):
    code = main(list(argv))
    return code, capsys.readouterr()


def test_table_for_replicated_dump(capsys, data_dir, programs):
    code, out = _run(capsys, str(data_dir / "cpu_replicated.hlo"))
    assert code == 0
    lines = out.out.splitlines()
    row = next(ln for ln in lines if ln.startswith("%while"))
    per_exec = programs.WIDTH**2 * 4
    times = programs.LAYERS * programs.MICROBATCHES
    # Columns are separated by two or more spaces; both sizes stay under 1 KiB.
    cells = re.split(r"\s{2,}", row)
    assert cells[1:] == ["all-reduce", "1", f"{per_exec} B", str(times), f"{per_exec * times} B"]
    assert lines[-1].startswith("FAIL") and lines[-3].startswith("total")
    assert lines[-2].startswith(
        "overlapped (async, compute between start and done): gradient reductions 0.0%"
    )


def test_check_exit_codes(capsys, data_dir):
    assert _run(capsys, str(data_dir / "cpu_tagged.hlo"), "--check")[0] == 0
    assert _run(capsys, str(data_dir / "cpu_replicated.hlo"), "--check")[0] == 1


def test_json_and_filters(capsys, data_dir, programs):
    code, out = _run(capsys, str(data_dir / "tpu_replicated.hlo"), "--json")
    data = json.loads(out.out)
    assert code == 0 and data["verdict"]["status"] == "FAIL"
    (c,) = data["collectives"]
    assert c["kind"] == "all-reduce" and c["multiplier"] == programs.LAYERS * programs.MICROBATCHES
    assert data["traffic"]["bytes_per_step"] == c["bytes"] * c["multiplier"]
    _, out = _run(capsys, str(data_dir / "tpu_replicated.hlo"), "--json", "--kind", "all-gather")
    assert json.loads(out.out)["collectives"] == []
    _, out = _run(
        capsys, str(data_dir / "tpu_replicated.hlo"), "--json", "--min-bytes", str(c["bytes"] + 1)
    )
    data = json.loads(out.out)
    # Filters shrink the rows but never the verdict, which judges the whole module.
    assert data["collectives"] == [] and data["verdict"]["status"] == "FAIL"


def test_malformed_input_exits_2(capsys, tmp_path):
    bad = tmp_path / "bad.hlo"
    bad.write_text("HloModule m\nENTRY %e () -> f32[] {\n  ROOT %a = f32[] constant(1\n}\n")
    code, out = _run(capsys, str(bad))
    assert code == 2 and "line 3" in out.err


def test_console_script_reads_stdin(data_dir):
    text = (data_dir / "cpu_tagged.hlo").read_text()
    proc = subprocess.run(
        [sys.executable, "-m", "hlo_tools.cli", "-", "--details"],
        input=text,
        capture_output=True,
        text=True,
        check=True,
    )
    assert proc.stdout.splitlines()[-1].startswith("OK")
    assert "jit(step)/reshard" in proc.stdout


@pytest.mark.parametrize("argv", [["--kind", "nonsense", "x"], []])
def test_bad_arguments(argv):
    with pytest.raises(SystemExit):
        main(argv)

"""`trainer.__all__` is the trainer's public API: every name resolves, and importing
the package loads no JAX (the binary reports a bad key before JAX starts)."""

import subprocess
import sys

import trainer


def test_every_public_name_resolves():
    for name in trainer.__all__:
        assert getattr(trainer, name) is not None, name
    assert trainer.make_config({"steps": "2"}).steps == 2
    assert trainer.hf.load and trainer.setup.__module__ == "trainer.run.run"


def test_importing_the_package_loads_no_jax():
    code = "import sys, trainer; print('jax' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.stdout.strip() == "False", done.stderr

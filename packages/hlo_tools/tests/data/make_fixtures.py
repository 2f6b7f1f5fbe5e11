"""Regenerate the saved HLO dumps in this folder.

    JAX_PLATFORMS=cpu uv run --extra tpu python packages/hlo_tools/tests/data/make_fixtures.py

CPU dumps need nothing else; TPU dumps need libtpu (the `tpu` extra) and are
skipped without it. Parser tests read these files, so they run without JAX.
"""

import importlib.util
import sys
from pathlib import Path

HERE = Path(__file__).parent


def main() -> int:
    import jax

    jax.config.update("jax_num_cpu_devices", 8)
    spec = importlib.util.spec_from_file_location("programs", HERE.parent / "programs.py")
    programs = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(programs)
    for tagged, name in ((True, "tagged"), (False, "replicated")):
        (HERE / f"cpu_{name}.hlo").write_text(programs.compile_cpu(tagged))
        try:
            text = programs.compile_tpu(tagged)
        except Exception as e:  # no libtpu: keep the CPU dumps
            print(f"skipping TPU dump: {e}", file=sys.stderr)
            continue
        (HERE / f"tpu_{name}.hlo").write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Saved dumps of the example programs (tests/data, made by make_fixtures.py): no JAX needed.

Sizes come from programs.py, which produced the dumps.
"""

import re

import pytest

import hlo_tools as ht

CASES = {
    # file: (width, in_loop)
    "cpu_tagged.hlo": ("WIDTH", False),
    "cpu_replicated.hlo": ("WIDTH", True),
    "tpu_tagged.hlo": ("TPU_WIDTH", False),
    "tpu_replicated.hlo": ("TPU_WIDTH", True),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_saved_dump(data_dir, programs, name):
    text = (data_dir / name).read_text()
    width = getattr(programs, CASES[name][0])
    in_loop = CASES[name][1]
    records = ht.collectives(text)
    n_lines = sum(1 for ln in text.splitlines() if re.search(r"\sall-reduce\(", ln))
    assert len(records) == n_lines == 1
    (c,) = records
    assert c.in_loop is in_loop
    if in_loop:
        assert c.shape == (width, width)
        assert c.multiplier == programs.LAYERS * programs.MICROBATCHES
        # TPU dumps carry no known_trip_count; the counts are read off the loop code.
        source = "inferred" if name.startswith("tpu") else "known"
        assert {lp.trip_count_source for lp in c.loops} == {source}
        with pytest.raises(AssertionError):
            ht.assert_reduced_once_per_step(text)
    else:
        assert c.shape == (programs.LAYERS, width, width)
        ht.assert_reduced_once_per_step(text)
    assert ht.traffic(text)["bytes_per_step"] == c.bytes * c.multiplier

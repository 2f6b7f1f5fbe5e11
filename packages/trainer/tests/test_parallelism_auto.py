"""Issue 7's matrix, auto mode: each parallelism layout equals one device.

The same layouts and check as test_parallelism.py (conftest.LAYOUTS); a file of
its own so the two halves compile on different test workers.
"""


def test_auto_layout_matches_single_device(matrix_layout, check_layout):
    check_layout(matrix_layout, "auto")

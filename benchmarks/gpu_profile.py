"""GPU kernel time by category from a jax.profiler trace (xplane), for device_check.

`read(trace_dir)` sums the GPU planes' kernel events (the stream lines) by
category (matmul, attention, transpose, copy, ...; `category(name)` reads the
kernel's name as hlo_tools.profile_group does) and counts them; `top` lists
the costliest kernels by name.
"""

from __future__ import annotations

import os

from hlo_tools import profile_group


def category(name: str) -> str:
    """The profile group of a kernel's name: hlo_tools' reading (gpu_kernels.NAME_KEYWORDS),
    so a device profile and hlo_tools.gpu_estimate's prediction split the same way."""
    return profile_group(name)


def read(d, steps: int = 1):
    """{kernels_per_step, ms_per_step_by_category, top} of the newest trace under
    `d`, which holds `steps` steps."""
    import glob

    from jax.profiler import ProfileData

    path = sorted(glob.glob(os.path.join(d, "**", "*.xplane.pb"), recursive=True))[-1]
    pd = ProfileData.from_file(path)
    by_cat, by_name, count = {}, {}, 0
    for plane in pd.planes:
        if not plane.name.startswith("/device:GPU"):
            continue
        for line in plane.lines:
            if "stream" not in line.name.lower():
                continue
            for ev in line.events:
                dur = ev.duration_ns / 1e6
                count += 1
                by_cat[category(ev.name)] = by_cat.get(category(ev.name), 0) + dur
                by_name[ev.name] = by_name.get(ev.name, 0) + dur
    top = sorted(by_name.items(), key=lambda kv: -kv[1])[:40]
    return {
        "kernels_per_step": count / steps,
        "ms_per_step_by_category": {k: v / steps for k, v in by_cat.items()},
        "top": [(name, ms / steps) for name, ms in top],
    }

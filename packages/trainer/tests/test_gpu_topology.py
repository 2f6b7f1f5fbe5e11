"""GPU topologies for compile_topology: names, the target config we write, the
missing-plugin error. No compile here (that is test_aot_gpu.py, aot tier)."""

import importlib.util

import pytest

from trainer.config import ConfigError, make_config
from trainer.run import aot, gpu_topology, xla_options


def test_gpu_topology_names_and_memory():
    h100, h200 = aot.TOPOLOGIES["h100-8"], aot.TOPOLOGIES["h200-1"]
    assert (h100.platform, h100.chip, h100.chips, h100.hbm_gib) == ("gpu", "h100", 8, 80.0)
    assert (h200.platform, h200.chip, h200.chips, h200.hbm_gib) == ("gpu", "h200", 1, 141.0)
    assert aot.TOPOLOGIES["v5e-8"].platform == "tpu"


def test_target_config_carries_the_chip_figures():
    text = gpu_topology.target_config(gpu_topology.CHIPS["h200"])
    assert "device_memory_size: 151397597184" in text  # 141 GiB
    assert "memory_bandwidth: 4800000000000" in text
    assert "core_count: 132 " in text and "cuda_compute_capability { major: 9 minor: 0 }" in text
    assert 'device_description_str: "NVIDIA H200"' in text
    # A cub_version would make XLA ask the absent device about large sorts.
    assert "cub_version" not in text
    h100 = gpu_topology.target_config(gpu_topology.CHIPS["h100"])
    assert "device_memory_size: 85899345920" in h100 and "memory_bandwidth: 3350000000000" in h100


def test_hosts_must_fill_the_dcn_axes():
    config = make_config({"compile_topology": "h100-8", "compile_topology_num_slices": "2"})
    assert aot.choose_topology(config.parallelism).chips == 8  # dcn_data=-1 spans the 2 hosts
    config = make_config(
        {
            "compile_topology": "h100-8",
            "compile_topology_num_slices": "2",
            "dcn_data_parallelism": "3",
        }
    )
    with pytest.raises(ConfigError, match="dcn"):
        aot.choose_topology(config.parallelism)


def test_missing_plugin_says_how_to_install_it(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == gpu_topology.PLUGIN else real(name, *a),
    )
    with pytest.raises(ConfigError, match=r"uv sync --extra gpu") as error:
        gpu_topology.require_plugin()
    assert "\n" not in str(error.value)
    config = make_config({"compile_topology": "h100-1", "model_name": "tagtrain-test"})
    with pytest.raises(ConfigError, match="jax_plugins.xla_cuda12"):
        aot.main(config)


def test_gpu_compiles_get_no_tpu_flags():
    config = make_config({"tpu_async_collectives": "true"})
    options = xla_options.compiler_options(config.parallelism, "gpu")
    assert options == xla_options.GPU_CUBLAS_GEMMS  # gpu_gemm=cublas, the default
    assert not set(options) & set(xla_options.TPU_ASYNC_COLLECTIVES)


def test_allocator_hint_when_the_step_fits_hbm_but_not_jaxs_default_share():
    gib = gpu_topology.GIB
    # deepseek3-h200 at pdbs 8 GA 2 compiled to about 127 GiB of a 141 GiB H200 with
    # f32 AdamW moments (the preset's bf16 moments and batch: gpu_estimate.md's h200
    # rows): more than the 75% JAX's allocator takes by default.
    line = gpu_topology.allocator_line(int(127.0 * gib), 141.0)
    assert line is not None
    assert "XLA_PYTHON_CLIENT_MEM_FRACTION=0.93" in line and "105.75 GiB" in line
    # Within the default share, or beyond the chip: no hint.
    assert gpu_topology.allocator_line(int(100 * gib), 141.0) is None
    assert gpu_topology.allocator_line(int(150 * gib), 141.0) is None
    # Close to the whole chip: capped below 1.
    assert "=0.99" in gpu_topology.allocator_line(int(140.5 * gib), 141.0)

"""Shared pytest setup: 8 virtual CPU devices before any JAX backend starts."""

import jax

# Must run before the first backend use. It only shapes the CPU backend, so real
# accelerators (tpu_integration) are unaffected.
jax.config.update("jax_num_cpu_devices", 8)

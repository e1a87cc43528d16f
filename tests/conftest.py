import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

jax.config.update("jax_enable_x64", False)
jax.config.update("jax_num_cpu_devices", 2)  # two fake CPU devices for the tensor-parallel tests

import sys  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))  # tests import numpy_ref / tolerance helpers

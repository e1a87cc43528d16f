import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

jax.config.update("jax_enable_x64", False)

import sys  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))  # tests import numpy_ref / tolerance helpers

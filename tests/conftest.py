import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# One BLAS thread: on the 2-core CI machine a multi-threaded OpenBLAS (behind jax's CPU triangular
# solve in the chunked GDN prefill) makes every 16+ token prefill ~65 ms instead of 2-3 ms.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import jax  # noqa: E402

jax.config.update("jax_enable_x64", False)
jax.config.update("jax_num_cpu_devices", 2)  # two fake CPU devices for the tensor-parallel tests

import sys  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))  # tests import numpy_ref / tolerance helpers

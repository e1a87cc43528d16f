import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# One BLAS thread: on the 2-core CI machine a multi-threaded OpenBLAS (behind jax's CPU triangular
# solve in the chunked GDN prefill) makes every 16+ token prefill ~65 ms instead of 2-3 ms.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
if os.environ["JAX_PLATFORMS"] == "cpu":
    # The CPU suite is mostly XLA compile time (tiny models, interpreted kernels): XLA's low-effort
    # settings compile it ~1.4x faster (tests/test_engine.py 172 -> 103 s on the 2-core machine) and change no result a test checks (CPU codegen without fast math either way). Environment
    # variables, so the subprocesses the CLI and server tests start get them too; GPU runs keep XLA's
    # defaults.
    os.environ.setdefault("JAX_DISABLE_MOST_OPTIMIZATIONS", "1")
    os.environ.setdefault("JAX_OPTIMIZATION_LEVEL", "O0")

import jax  # noqa: E402

jax.config.update("jax_enable_x64", False)
jax.config.update("jax_num_cpu_devices", 2)  # two fake CPU devices for the tensor-parallel tests

import sys  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))  # tests import numpy_ref / tolerance helpers


# The tiny-model fixtures of tests/test_engine.py and tests/test_server.py (shapes and helpers:
# tests/serving_fixtures.py). One per process: the files that use them run in one
# (scripts/pytest_groups.py) and share one checkpoint and its loaded model (params are immutable).
# A test file that defines its own `ckpt` or `model` fixture overrides these.
import pytest  # noqa: E402


@pytest.fixture(scope="module")
def single_threaded_cpu_blas():
    """scipy's OpenBLAS, which jax's CPU triangular solve calls in the chunked GDN prefill, hands work to
    a second thread and waits ~65 ms for it on this 2-core machine (measured: prefill 65 ms with 2
    BLAS threads, 2-3 ms with 1). One thread for the module that asks (pytestmark usefixtures); restored
    afterwards."""
    import ctypes
    import glob

    import scipy
    import scipy.linalg  # noqa: F401 (loads the library)
    libs = glob.glob(os.path.join(os.path.dirname(scipy.__file__), os.pardir, "scipy.libs", "libscipy_openblas*.so"))
    if not libs:
        yield
        return
    lib = ctypes.CDLL(libs[0])
    before = lib.scipy_openblas_get_num_threads()
    lib.scipy_openblas_set_num_threads(1)
    yield
    lib.scipy_openblas_set_num_threads(before)


@pytest.fixture(scope="session")
def ckpt(tmp_path_factory):
    """The tiny random checkpoint (preset tiny, fp32, seed 0), written once per process."""
    from qmtp.tools import make_checkpoint
    return make_checkpoint.write_checkpoint(str(tmp_path_factory.mktemp("serving") / "tiny"), "tiny", "fp32", seed=0)


@pytest.fixture(scope="session")
def model(ckpt):
    """`ckpt` loaded in float32 with the serving tests' page size (serving_fixtures.PAGE)."""
    import qmtp
    from serving_fixtures import PAGE
    return qmtp.load(ckpt, dtype="float32", page_size=PAGE, progress=False)


def _mapped_regions() -> int:
    with open("/proc/self/maps") as maps:
        return sum(1 for _ in maps)


# Each executable XLA compiles for the CPU holds ~3 memory mappings until its jit cache entry goes,
# and Linux allows a process 65530 (vm.max_map_count). The whole suite in one process compiles
# enough (Pallas interpret mode especially) to reach that: a one-process suite died twice with a
# segfault inside XLA's compile in the same late test, which passed in every smaller run. Clearing
# jax's caches between modules once the count is high keeps the suite below the limit; a function
# shared across modules compiles again, nothing else changes.
MAPPED_REGIONS_CLEAR_AT = 30000


@pytest.fixture(scope="module", autouse=True)
def bounded_compiled_executables():
    yield
    if os.path.exists("/proc/self/maps"):
        n = _mapped_regions()
        if os.environ.get("QMTP_LOG_MAPS"):
            with open(os.environ["QMTP_LOG_MAPS"], "a") as log:
                log.write(f"{n}\n")
        if n > MAPPED_REGIONS_CLEAR_AT:
            jax.clear_caches()

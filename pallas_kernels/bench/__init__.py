"""Benchmarks of the Pallas kernels on the GPU: `python -m pallas_kernels.bench --help`."""

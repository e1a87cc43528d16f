"""The runtime: KernelConfig, ops (the door to pallas_kernels), tensor parallelism, decode state,
paging, and the one decode loop."""

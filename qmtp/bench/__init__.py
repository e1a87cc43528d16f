"""Model-level benchmarks: the harness (`python -m qmtp.bench`), its report and plot, acceptance
profiles, the round breakdown and the decode-step benchmark."""

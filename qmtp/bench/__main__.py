"""python -m qmtp.bench: the benchmark harness (qmtp/bench/harness.py)."""

from qmtp.bench.harness import cli

cli()

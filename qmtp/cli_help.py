"""The one absl entry-point wrapper of qmtp's command lines (generate, bench, server)."""

from __future__ import annotations

import sys

from absl import app, flags

HELP_ARGS = ("--help", "-h", "--helpshort")


def run(main, doc: str) -> None:
    """app.run(main), except that a help request prints `doc` and every flag of the main module and
    exits 0 (absl exits with status 1 after --help; asking for help is not an error)."""
    if any(a in HELP_ARGS for a in sys.argv[1:]):
        flags.FLAGS(sys.argv[:1])
        print(doc)
        print(flags.FLAGS.main_module_help())
        sys.exit(0)
    app.run(main)

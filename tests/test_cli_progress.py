"""qmtp.cli_progress.Phases: the lines a long command prints while it works."""

import io
import time

from qmtp.cli_progress import Phases


def test_a_long_phase_prints_elapsed_seconds_until_it_ends():
    out = io.StringIO()
    phases = Phases("generate", every=0.05, stream=out)
    phases("compiling")
    time.sleep(0.3)
    phases("generating")  # ends the compile phase
    phases.done()
    lines = out.getvalue().splitlines()
    assert lines[0] == "generate: compiling"
    ticks = lines[1:lines.index("generate: generating") - 1]
    assert len(ticks) >= 2 and all(t.startswith("generate:   ... ") and t.endswith(" s") for t in ticks), lines
    assert lines[lines.index("generate: generating") - 1].startswith("generate:   done in 0.")
    assert lines[-1].startswith("generate:   done in ") and len(lines) == len(ticks) + 4
    time.sleep(0.15)  # nothing more once done
    assert out.getvalue().splitlines() == lines


def test_a_phase_that_shows_its_own_progress_gets_no_ticks():
    out = io.StringIO()
    phases = Phases("generate", every=0.05, stream=out)
    phases("loading", tick=False)
    time.sleep(0.2)
    phases.done()
    assert out.getvalue().splitlines()[0] == "generate: loading" and len(out.getvalue().splitlines()) == 2

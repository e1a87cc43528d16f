"""The GPU session scripts parse (bash -n) and name only flags and step variants that exist, so a
lease is not spent on a typo: every `--flag` the scripts pass to a qmtp or pallas_kernels entry
point is one that entry point defines, and every --step_impls variant is known."""

from __future__ import annotations

import glob
import os
import re
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPTS = sorted(glob.glob(os.path.join(ROOT, "scripts", "*.sh")))


@pytest.mark.parametrize("path", SCRIPTS, ids=os.path.basename)
def test_script_parses(path):
    r = subprocess.run(["bash", "-n", path], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


def test_gpu_session_uses_known_flags_and_variants():
    import sys
    from pallas_kernels.bench.step import VARIANTS
    text = open(os.path.join(ROOT, "scripts", "gpu_session.sh")).read()
    text = re.sub(r"\\\n\s*", " ", text)  # join continued lines
    python = sys.executable
    known = {}
    for module in ("qmtp.bench", "pallas_kernels.bench", "qmtp.server", "qmtp.train"):
        r = subprocess.run([python, "-m", module, "--help"], cwd=ROOT, capture_output=True, text=True,
                           env=dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT))
        known[module] = set(re.findall(r"--(?:\[no\])?(\w+):", r.stdout))
        assert known[module], (module, r.stderr[-1000:])
    checked = 0
    for module, args in re.findall(r"python3 -m ([\w.]+) (.*)", text):
        if module not in known:
            continue
        for flag in re.findall(r"(?<![\w-])--(\w+)(?==|\s|$)", args):
            assert flag in known[module] | {"flagfile"}, f"{module} has no --{flag}"
            checked += 1
    assert checked > 20
    for impls in re.findall(r"--step_impls=([\w,]+)", text):
        assert set(impls.split(",")) <= set(VARIANTS) | {"ref"}, impls


def test_gpu_session_kernel_settings_exist():
    """Every --kernels=NAME=VALUE,... the lease functions pass names a setting with a value it takes
    (ops.parse_kernel_settings / set_kernel_settings), so no lease ends on a typo in a setting."""
    from qmtp import ops
    text = open(os.path.join(ROOT, "scripts", "gpu_session.sh")).read()
    # literal lists only (a value from a shell variable, e.g. a loop's, is the script's own business)
    found = [spec for spec in re.findall(r"--kernels=([^\s'\"]+)", text) if "$" not in spec]
    assert len(found) > 10
    before = ops.kernel_settings()
    try:
        for spec in found:
            ops.set_kernel_settings(ops.parse_kernel_settings(spec.split(",")))  # raises, naming the setting
            ops.set_kernel_settings(before)
    finally:
        ops.set_kernel_settings(before)


def test_scripts_name_test_files_that_exist():
    """Every tests/....py path the device scripts pass to pytest exists, so a lease does not end on a
    renamed test file."""
    named = {path for script in SCRIPTS for path in re.findall(r"tests/[\w/]+\.py", open(script).read())}
    assert len(named) >= 5
    missing = sorted(p for p in named if not os.path.isfile(os.path.join(ROOT, p)))
    assert missing == [], missing

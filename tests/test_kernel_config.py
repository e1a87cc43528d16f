"""KernelConfig: the one explicit kernel configuration, built once per model and passed down as a
static argument. Two models with different configurations run side by side in one process, each
with its own kernels, and nothing in qmtp or pallas_kernels sets a module global at run time."""

from __future__ import annotations

import ast
import dataclasses
import pathlib

import numpy as np
import pytest

import qmtp
from qmtp.runtime.kernel_config import KernelConfig, PALLAS, REF
from qmtp.tools import make_checkpoint

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def fp8_dir(tmp_path_factory):
    return make_checkpoint.write_checkpoint(str(tmp_path_factory.mktemp("kc") / "fp8"), "tiny", "fp8", seed=2)


def test_a_bad_impl_is_refused_by_name():
    with pytest.raises(ValueError, match=r"impl='cuda': supported \('ref', 'pallas'\)"):
        KernelConfig("cuda")
    with pytest.raises(ValueError, match="impl='cuda'"):
        qmtp.load("/nonexistent", impl="cuda")
    assert hash(KernelConfig()) == hash(REF) and REF != PALLAS  # usable as a static jit argument


def test_two_configurations_run_side_by_side(fp8_dir, monkeypatch):
    """Exact and E4M3 activations, and the reference and Pallas paths, in one process, interleaved:
    each model keeps its own numbers, and only the Pallas model's programs call the Pallas kernel."""
    from pallas_kernels import fp8_matmul
    calls = []
    kernel = fp8_matmul.fp8_matmul_many
    monkeypatch.setattr(fp8_matmul, "fp8_matmul_many", lambda *a, **kw: calls.append(1) or kernel(*a, **kw))
    ids = list(range(3, 12))
    exact = qmtp.load(fp8_dir, dtype="bfloat16", progress=False)
    a8 = qmtp.load(fp8_dir, dtype="bfloat16", progress=False, fp8_act_quant=True)
    assert exact.kernels == REF and a8.kernels == KernelConfig(fp8_act_quant=True)
    first = qmtp.target_logits(exact, ids)
    quantized = qmtp.target_logits(a8, ids)
    assert not np.array_equal(first, quantized)  # E4M3 activations change the numbers
    np.testing.assert_array_equal(qmtp.target_logits(exact, ids), first)  # ... of that model only
    np.testing.assert_array_equal(qmtp.target_logits(a8, ids), quantized)
    assert not calls  # neither traced a Pallas kernel
    pallas = dataclasses.replace(exact, kernels=PALLAS)
    qmtp.target_logits(pallas, ids)
    assert calls, "the Pallas model's program calls the Pallas FP8 kernel"
    calls.clear()
    np.testing.assert_array_equal(qmtp.target_logits(exact, ids), first)
    assert not calls


@pytest.mark.parametrize("package", ["qmtp", "pallas_kernels"])
def test_no_module_global_is_set_at_run_time(package):
    """No function rebinds a module global (`global x; x = ...`) or sets an attribute of a module
    (`setattr(...)`, `module.NAME = ...`): the kernels a program runs follow from its arguments alone.
    (Import-time registration at module level, such as numpy's float8 dtype, is not run time; nor is
    _fp8_dot.install, which wraps JAX's Triton lowering once when fp8_matmul is imported, whatever the
    configuration.)"""
    found = []
    for path in sorted((ROOT / package).rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        imported = {alias.asname or alias.name.split(".")[0] for node in ast.walk(tree)
                    if isinstance(node, (ast.Import, ast.ImportFrom)) for alias in node.names}
        bodies = [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))]
        for node in (inner for body in bodies for inner in ast.walk(body)):
            if isinstance(node, ast.Global):
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}: global {', '.join(node.names)}")
            elif isinstance(node, ast.Call) and getattr(node.func, "id", None) == "setattr":
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}: setattr")
            elif isinstance(node, ast.Assign):
                for t in node.targets:
                    if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id in imported:
                        found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {t.value.id}.{t.attr} =")
    assert [f for f in found if not f.startswith("pallas_kernels/_fp8_dot.py")] == [], found

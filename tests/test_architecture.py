"""The layout's rules, read from the import statements: only qmtp/runtime/ops.py imports
pallas_kernels, pallas_kernels imports nothing from qmtp, only qmtp/runtime/tp.py builds meshes and
shardings, and no module imports itself back through others (no import cycle, lazy imports included)."""

from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]
OPS = "qmtp.runtime.ops"
TP = "qmtp.runtime.tp"


def _module(path: pathlib.Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, pathlib.Path]:
    return {_module(p): p for pkg in ("qmtp", "pallas_kernels") for p in sorted((ROOT / pkg).rglob("*.py"))}


def _imports(path: pathlib.Path, known: set[str]) -> set[str]:
    """The project modules a file imports anywhere in it (top level or inside functions)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module)
            out |= {f"{node.module}.{a.name}" for a in node.names if f"{node.module}.{a.name}" in known}
    return {m for m in out if m in known}


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    known = set(modules)
    return {name: _imports(path, known) - {name} for name, path in modules.items()}


def test_only_ops_imports_pallas_kernels():
    offenders = sorted(m for m, deps in _graph().items()
                       if m.startswith("qmtp") and m != OPS and any(d.startswith("pallas_kernels") for d in deps))
    assert offenders == []


def test_pallas_kernels_imports_nothing_from_qmtp():
    offenders = sorted(m for m, deps in _graph().items()
                       if m.startswith("pallas_kernels") and any(d.startswith("qmtp") for d in deps))
    assert offenders == []


def _dotted(node) -> str:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    return ".".join([node.id] + parts[::-1]) if isinstance(node, ast.Name) else ""


def test_only_tp_builds_meshes_and_shardings():
    """No qmtp module but tp.py imports jax.sharding or calls jax.shard_map / jax.make_mesh."""
    offenders = []
    for name, path in _modules().items():
        if not name.startswith("qmtp") or name == TP:
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(("jax.sharding", "jax.experimental.shard")):
                offenders.append(f"{name}:{node.lineno}: from {node.module}")
            elif isinstance(node, ast.Attribute) and _dotted(node).startswith(
                    ("jax.sharding", "jax.shard_map", "jax.make_mesh", "jax.experimental.shard_map")):
                offenders.append(f"{name}:{node.lineno}: {_dotted(node)}")
    assert offenders == []


def test_no_import_cycle():
    graph = _graph()
    cycles, state = [], {}

    def visit(node, stack):
        state[node] = "open"
        for dep in sorted(graph[node]):
            if state.get(dep) == "open":
                cycles.append(stack[stack.index(dep):] + [dep])
            elif dep not in state:
                visit(dep, stack + [dep])
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    assert cycles == []

"""scripts/pytest_groups.py, the runner behind `make test`: how it splits the test files."""

import importlib.util
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
spec = importlib.util.spec_from_file_location("pytest_groups", os.path.join(ROOT, "scripts", "pytest_groups.py"))
pytest_groups = importlib.util.module_from_spec(spec)
spec.loader.exec_module(pytest_groups)


def test_split_keeps_every_file_once_in_order_and_balances_counts():
    files = [f"t{i}" for i in range(10)]
    groups = pytest_groups.split(files, 3)
    assert [len(g) for g in groups] == [4, 3, 3]
    assert [f for g in groups for f in g] == files


def test_split_never_makes_empty_groups():
    assert pytest_groups.split(["a", "b"], 8) == [["a"], ["b"]]
    assert pytest_groups.split(["a", "b", "c"], 1) == [["a", "b", "c"]]


def test_make_test_runs_the_groups():
    with open(os.path.join(ROOT, "Makefile")) as f:
        recipe = f.read().split("\ntest: ", 1)[1].split("\n\n", 1)[0]
    assert "scripts/pytest_groups.py" in recipe and "-x" in recipe

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


def test_plan_runs_the_files_that_share_compiles_first_and_together():
    files = ["t/test_a.py", "t/test_engine.py", "t/test_engine_x.py", "t/test_m.py", "t/test_server.py", "t/test_z.py"]
    assert pytest_groups.plan(files, 3) == [["t/test_engine.py", "t/test_engine_x.py", "t/test_server.py"],
                                            ["t/test_a.py", "t/test_m.py"], ["t/test_z.py"]]
    assert pytest_groups.plan(files[:1], 3) == [["t/test_a.py"]]  # nothing shared: split as before
    assert pytest_groups.plan(files, 1) == [files[1:3] + files[4:5], ["t/test_a.py", "t/test_m.py", "t/test_z.py"]]


def test_make_test_runs_the_groups():
    with open(os.path.join(ROOT, "Makefile")) as f:
        recipe = f.read().split("\ntest: ", 1)[1].split("\n\n", 1)[0]
    assert "scripts/pytest_groups.py" in recipe and "-x" in recipe


def test_parse_args():
    assert pytest_groups.parse_args(["--groups=3", "--jobs=2", "-q", "-x"]) == (3, 2, ["-q", "-x"])
    groups, jobs, args = pytest_groups.parse_args(["-q"])
    assert groups == 16 and jobs == min(pytest_groups.usable_cpus(), pytest_groups.MAX_DEFAULT_JOBS) and args == ["-q"]
    assert 1 <= pytest_groups.usable_cpus() <= (os.cpu_count() or 1)
    for bad in ("--jobs=0", "--groups=x"):
        try:
            pytest_groups.parse_args([bad])
        except ValueError as e:
            assert bad.split("=")[0] in str(e)
        else:
            raise AssertionError(f"{bad} accepted")


def _write(path, body):
    path.write_text(body)
    return str(path)


def test_groups_run_side_by_side_and_stop_after_a_failure(tmp_path):
    """Two at a time: the groups' outputs come out whole, a group of deselected tests passes, and after
    the failing group no new group starts (the fourth never runs) while the exit code is the failure's."""
    import io
    slow = _write(tmp_path / "test_a.py", "import time\ndef test_a():\n    time.sleep(1.5)\n")
    fails = _write(tmp_path / "test_b.py", "def test_b():\n    assert 1 == 2, 'b fails'\n")
    empty = _write(tmp_path / "test_c.py", "import pytest\n@pytest.mark.skipme\ndef test_c():\n    pass\n")
    never = _write(tmp_path / "test_d.py", "def test_d():\n    open(__file__ + '.ran', 'w').close()\n")
    out = io.StringIO()
    rc = pytest_groups.run_groups([[slow], [fails], [empty], [never]], ["-q", "-p", "no:cacheprovider",
                                                                      "-m", "not skipme"], jobs=2, out=out)
    text = out.getvalue()
    assert rc == 1, text
    assert "group 2 failed (exit 1)" in text and "b fails" in text
    assert not os.path.exists(never + ".ran") and "group 4/4" not in text
    # group 1 (slow) was started before group 2 ended, and finished after it: they ran side by side
    assert text.index("group 1/4 started") < text.index("group 2/4: exit 1") < text.index("group 1/4: exit 0")
    block = text.split("== group 1/4: test_a.py\n", 1)[1].split("== group 1/4: exit", 1)[0]
    assert "1 passed" in block and "b fails" not in block  # one group's lines, whole


def test_groups_all_pass_and_deselected_count_as_pass(tmp_path):
    import io
    ok = _write(tmp_path / "test_ok.py", "def test_ok():\n    pass\n")
    empty = _write(tmp_path / "test_e.py", "import pytest\n@pytest.mark.skipme\ndef test_e():\n    pass\n")
    out = io.StringIO()
    assert pytest_groups.run_groups([[ok], [empty]], ["-q", "-p", "no:cacheprovider", "-m", "not skipme"], jobs=3,
                                    out=out) == 0
    assert "all 2 groups passed" in out.getvalue() and "exit 5" in out.getvalue()


def test_groups_share_a_compile_cache_that_keeps_every_program(tmp_path):
    import io
    probe = _write(tmp_path / "test_env.py", "import os, jax\ndef test_env():\n    print('cache', "
                   "os.environ['JAX_COMPILATION_CACHE_DIR'], jax.config.jax_persistent_cache_min_compile_time_secs,"
                   " jax.config.jax_persistent_cache_min_entry_size_bytes)\n")
    env = pytest_groups.shared_compile_cache_env(str(tmp_path / "cache"), {"PATH": os.environ["PATH"]})
    out = io.StringIO()
    assert pytest_groups.run_groups([[probe], [probe]], ["-q", "-s", "-p", "no:cacheprovider"], jobs=2, out=out,
                                    env=env) == 0
    assert out.getvalue().count(f"cache {tmp_path / 'cache'} 0.0 0") == 2, out.getvalue()
    assert pytest_groups.shared_compile_cache_env("x", {"JAX_COMPILATION_CACHE_DIR": "mine"})[
        "JAX_COMPILATION_CACHE_DIR"] == "mine"  # the caller's own setting wins

"""scripts/gpu_check.sh's step table, run on the CPU with `echo` for the interpreter: every listed step has
its case (none answers "unknown step"), each writes its log ending rc=N, and an unknown step is refused."""

import os
import re
import subprocess

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "scripts", "gpu_check.sh")


def all_steps() -> list[str]:
    text = open(SCRIPT).read()
    return re.search(r"ALL_STEPS=\(([^)]*)\)", text).group(1).split()


def test_every_listed_step_runs_its_case(tmp_path):
    steps = all_steps()
    assert len(steps) == len(set(steps)) and {"bench_moe_vocab", "loop_trace", "decode_prefix"} <= set(steps)
    env = dict(os.environ, PYTHON="echo", OUT=str(tmp_path))
    r = subprocess.run(["bash", SCRIPT, *steps], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert "unknown step" not in r.stdout + r.stderr
    for step in steps:
        log = (tmp_path / f"{step}.log").read_text()
        assert re.search(r"^rc=\d+$", log, re.M), (step, log[-500:])


def test_an_unknown_step_is_refused(tmp_path):
    env = dict(os.environ, PYTHON="echo", OUT=str(tmp_path))
    r = subprocess.run(["bash", SCRIPT, "no_such_step"], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 2 and "unknown step 'no_such_step'" in r.stdout


def test_bench_args_for_every_bench_step_or_one(tmp_path):
    env = dict(os.environ, PYTHON="echo", OUT=str(tmp_path), BENCH_ARGS="--repeats=1",
               BENCH_ARGS_bench_long="--prompt_lengths=8192")
    subprocess.run(["bash", SCRIPT, "bench_long", "bench_sampling"], cwd=ROOT, env=env, capture_output=True,
                   text=True, timeout=60)
    long, sampling = ((tmp_path / f"{s}.log").read_text() for s in ("bench_long", "bench_sampling"))
    # each command's own flags, then the extra ones last
    assert long.split("\n")[0].endswith("bench_tp1_long.json --prompt_lengths=8192")
    assert sampling.split("\n")[0].endswith("bench_tp1_sampling.json --repeats=1")

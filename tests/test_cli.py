"""python -m qmtp.generate end to end, including its bad-input messages."""

import json
import math
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(*args, cache, devices=1):
    env = dict(os.environ, JAX_PLATFORMS="cpu", QMTP_CACHE=str(cache), PYTHONPATH=ROOT,
               XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}")
    return subprocess.run([sys.executable, "-m", "qmtp.generate", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("qmtp_cache")


def test_tiny_flagfile_generates_text_and_json(cache, tmp_path):
    out = tmp_path / "out.json"
    r = run("--flagfile=configs/tiny.flags", "--max_new_tokens=5", f"--output_json={out}", "--compare_plain",
            "--repeats=2", "--logprobs=2", cache=cache)
    assert r.returncode == 0, r.stderr
    assert "[0] text:" in r.stdout and "tok/s" in r.stdout
    # what it is doing goes to stderr, phase by phase, with the seconds each took
    for line in ("generate: loading preset:tiny", "generate: compiling prefill (batch 2, prompt bucket 16) and the "
                 "plain decode loop", "generate: compiling prefill (batch 2, prompt bucket 16) and the MTP K=3 "
                 "decode loop", "generate: generating up to 5 tokens for 2 prompts"):
        assert line in r.stderr, r.stderr
    assert r.stderr.count("generate:   done in ") == 7, r.stderr  # load; compile + run of each mode; a repeat each
    assert "the median of 2 runs" in r.stdout
    # --compare_plain: plain decoding of the same prompts in the same run, beside MTP
    assert re.search(r"plain [\d.]+ tok/s, MTP K=3 [\d.]+ tok/s: [\d.]+x; tokens identical", r.stdout), r.stdout
    report = json.loads(out.read_text())
    assert report["prompts"] == ["def fibonacci(", "The quick brown fox"]
    assert all(1 <= len(t) <= 5 for t in report["tokens"]) and len(report["texts"]) == 2
    assert report["stats"]["decode_tokens_per_s"] > 0
    assert report["mtp_k"] == 3 and "MTP K=3:" in r.stdout and report["stats"]["drafted"] > 0
    assert report["plain"]["tokens_identical"] and report["plain"]["tokens"] == report["tokens"]
    assert len(report["decode_tokens_per_s_runs"]) == len(report["plain"]["decode_tokens_per_s_runs"]) == 2
    # --logprobs: one line per token and the JSON's entries, the greedy token first among the alternatives
    assert [[t["token"] for t in row] for row in report["logprobs"]] == report["tokens"]
    assert all(len(t["top"]) == 2 and t["top"][0][0] == t["token"] for row in report["logprobs"] for t in row)
    first = report["logprobs"][0][0]
    assert f"[0]   {first['token']} " in r.stdout and f": {first['logprob']:.4f}  | " in r.stdout, r.stdout
    # the preset was built into the cache on first use
    assert any(name.startswith("tiny-bf16") for name in os.listdir(cache / "checkpoints"))


def test_score_prints_and_writes_each_prompts_perplexity(cache, tmp_path):
    """--score: per prompt, the NLL over its tokens after the first and exp(NLL / tokens); with --logprobs a line
    per token (its rank too); nothing generated."""
    out = tmp_path / "score.json"
    r = run("--checkpoint=preset:tiny", "--prompt=def fibonacci(n):", "--prompt_ids=5", "--dtype=float32", "--score",
            "--logprobs=2", f"--output_json={out}", cache=cache)
    assert r.returncode == 0, r.stderr
    rows = json.loads(out.read_text())["scores"]
    first, one = rows
    assert first["tokens_scored"] == len(first["logprobs"]) > 1 and one["tokens_scored"] == 0
    assert first["nll"] == pytest.approx(-sum(t["logprob"] for t in first["logprobs"]))
    assert first["perplexity"] == pytest.approx(math.exp(first["nll"] / first["tokens_scored"]))
    assert all(len(t["top"]) == 2 and t["rank"] >= 1 for t in first["logprobs"])
    assert f"perplexity {first['perplexity']:.4f}" in r.stdout and "(rank " in r.stdout and "text:" not in r.stdout


@pytest.mark.slow  # CI time: three CLI runs; the text-prompt run stays in CI
def test_prompt_ids_and_prompt_file_match_the_text_prompt(cache, tmp_path):
    from qmtp.tools import make_checkpoint, tiny_tokenizer
    text = "def fibonacci(n):\n    return"  # two lines: the file keeps the newline
    ids = tiny_tokenizer.build_tokenizer().encode(text, add_special_tokens=False).ids
    (tmp_path / "p.txt").write_text(text)
    outs = [tmp_path / f"{n}.json" for n in "abc"]
    common = ("--checkpoint=preset:tiny", "--max_new_tokens=4", "--dtype=float32", "--stop_token_ids=")
    for source, out in zip((f"--prompt={text}", "--prompt_ids=" + ",".join(map(str, ids)),
                            f"--prompt_file={tmp_path / 'p.txt'}"), outs):
        r = run(*common, source, f"--output_json={out}", cache=cache)
        assert r.returncode == 0, r.stderr[-2000:]
    a, b, c = (json.loads(o.read_text()) for o in outs)
    assert a["tokens"] == b["tokens"] == c["tokens"] and c["prompt_lengths"] == [len(ids)]


@pytest.mark.slow  # ~30 s; TP2 == TP1 tokens run in CI through tests/test_tp_model.py
def test_tp2_gives_the_tp1_tokens(cache, tmp_path):
    outs = []
    for tp in (1, 2):
        out = tmp_path / f"tp{tp}.json"
        r = run("--checkpoint=preset:tiny", "--prompt=def fibonacci(", "--max_new_tokens=6", "--dtype=float32",
                "--mtp_k=2", f"--tp={tp}", f"--output_json={out}", cache=cache, devices=2)
        assert r.returncode == 0, r.stderr[-2000:]
        outs.append(json.loads(out.read_text()))
    assert outs[0]["tokens"] == outs[1]["tokens"] and outs[1]["tp"] == 2
    # the converted cache: a miss writes it, the next run hits it, same tokens
    conv = tmp_path / "conv"
    for expect in ("miss", "hit"):
        r = run("--checkpoint=preset:tiny", "--prompt=def fibonacci(", "--max_new_tokens=6", "--dtype=float32",
                "--mtp_k=2", "--tp=2", f"--converted_cache={conv}", f"--output_json={tmp_path / 'c.json'}",
                cache=cache, devices=2)
        assert r.returncode == 0 and f"converted cache: {expect}" in r.stderr, r.stderr[-2000:]
        assert json.loads((tmp_path / "c.json").read_text())["tokens"] == outs[0]["tokens"]


@pytest.mark.parametrize("args,message", [
    (("--checkpoint=preset:tiny", "--prompt=hi", "--tp=2"), r"error: --tp=2: 1 cpu device\(s\) visible"),
    (("--checkpoint=/nonexistent/ckpt", "--prompt=hi"), "error: /nonexistent/ckpt: checkpoint directory not found"),
    (("--checkpoint=preset:tiny", "--prompt=hello world", "--num_pages=1", "--page_size=4"),
     "error: .* tokens need .* pages of 4, but the KV cache has only 1 pages .*raise --num_pages"),
    (("--checkpoint=preset:tiny", "--prompt_ids=1,x,3"), "error: --prompt_ids='1,x,3': expected comma-separated"),
    (("--checkpoint=preset:tiny", "--prompt_ids=1,99999"), r"error: prompt 0: token ids \[99999\] outside"),
    (("--checkpoint=preset:nope", "--prompt=hi"), "error: .*nope"),
    (("--checkpoint=preset:tiny",), "error: give at least one --prompt, --prompt_file or --prompt_ids"),
    (("--checkpoint=preset:tiny", "--prompt_file=/nonexistent/p.txt"),
     r"error: --prompt_file=/nonexistent/p.txt: .*No such file"),
    (("--checkpoint=/nonexistent/ckpt", "--prompt=hi", "--temperature=0.8", "--top_p=1.5"),
     r"error: --top_p=1.5 must be in \(0, 1\]"),  # checked before the checkpoint
    (("--checkpoint=/nonexistent/ckpt", "--prompt=hi", "--logit_bias=5:-100,7"),
     "error: --logit_bias=5:-100,7: expected ID:BIAS"),
    (("--checkpoint=/nonexistent/ckpt", "--prompt=hi", "--logit_bias=5:-200"),
     r"error: --logit_bias=-200.0 \(token 5\) must be in \[-100, 100\]"),
    # checked before anything is loaded: the bad checkpoint is never reached
    (("--checkpoint=/nonexistent/ckpt", "--prompt=hi", "--output_json=/nonexistent_dir/out.json"),
     "error: --output_json=/nonexistent_dir/out.json: directory /nonexistent_dir does not exist"),
    (("--checkpoint=preset:tiny", "--prompt=hi", "--compare_plain"), "error: --compare_plain .* give --mtp_k"),
    (("--checkpoint=preset:tiny", "--prompt=hi", "--score", "--mtp_k=3"), "error: --score scores the prompts"),
    (("--checkpoint=preset:tiny", "--prompt=hi", "--deterministic"), "error: deterministic=True needs impl='pallas'"),
    (("--checkpoint=preset:tiny", "--prompt=hi", "--prefill_chunk=24"), "error: prefill_chunk=24: a power of two"),
])
def test_bad_input_gives_one_error_line(cache, args, message):
    r = run(*args, cache=cache)
    assert r.returncode == 2, (r.stdout, r.stderr)
    lines = [line for line in r.stderr.strip().splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and re.search(message, lines[0]), r.stderr
    assert "Traceback" not in r.stderr


@pytest.mark.parametrize("args,message", [
    (("--checkpoint=preset:tiny", "--no_such_flag=1"), "Unknown command line flag 'no_such_flag'"),
    (("--checkpoint=preset:tiny", "--dtype=float16"), "value should be one of"),
    (("--checkpoint=preset:tiny", "--mtp_k=9"), "mtp_k"),
    (("--checkpoint=preset:tiny", "--max_new_tokens=0"), "max_new_tokens"),
])
def test_flag_errors_are_one_error_line_and_status_2(cache, args, message):
    """A bad flag keeps the promise every bad input keeps: one `error: ...` line, exit status 2."""
    r = run(*args, cache=cache)
    lines = [line for line in r.stderr.strip().splitlines() if line.strip()]
    assert r.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], r.stderr


def test_help_explains_every_flag(cache):
    r = run("--help", cache=cache)
    assert r.returncode == 0
    for flag in ("checkpoint", "prompt", "prompt_file", "prompt_ids", "max_new_tokens", "dtype", "page_size", "num_pages",
                 "output_json", "stop_token_ids", "warmup", "impl", "mtp_k", "temperature", "top_k", "top_p", "min_p",
                 "seed", "tp", "logprobs",
                 "converted_cache", "fp8_act_quant", "draft_head"):
        assert re.search(rf"--(\[no\])?{flag}: \S", r.stdout), flag  # listed with an explanation


@pytest.mark.parametrize("batch, k, impl, fp8, expected", [
    (16, 3, "pallas", True, None),  # 64 rows: on the decode kernel
    (32, 3, "pallas", True, None),  # 128 rows: its limit
    (40, 3, "pallas", True, "40 sequences x (K+1 = 4) = 160 rows per MTP verify pass exceed the FP8 decode "
                            "kernel's 128; they run on GEMM tiles"),
    (40, 3, "pallas", True, "--mtp_k=2 keeps them on it"),  # 40 x 3 = 120 rows
    (48, 4, "pallas", True, "--mtp_k=1 keeps them on it"),  # 48 x 3 = 144, 48 x 2 = 96 rows
    (80, 1, "pallas", True, "at most 64 sequences at K=1 keep them on it"),
    (40, 3, "ref", True, None),  # no Pallas kernels
    (40, 3, "pallas", False, None),  # bf16 weights: no FP8 decode kernel
    (64, 0, "pallas", True, None),  # plain decoding has no verify pass
])
def test_verify_rows_warning(batch, k, impl, fp8, expected):
    """generate and the server warn when batch x (K+1) verify rows leave the FP8 decode kernel (the GEMM
    tiles at 128 rows made K=3 at batch 32 barely faster than plain on the H200), and say which K fits."""
    import types
    from qmtp import cli_help
    model = types.SimpleNamespace(impl=impl, cfg=types.SimpleNamespace(quantization=object() if fp8 else None),
                                  kernels=types.SimpleNamespace(deterministic=False))
    got = cli_help.verify_rows_warning(model, batch, k)
    if expected is None:
        assert got is None
    else:
        assert got is not None and expected in got and got.startswith("warning: "), got
        assert cli_help.verify_rows_warning(model, batch, k, unit="batch slots").startswith(f"warning: {batch} batch slots x")


def test_deterministic_passes_stay_on_the_decode_kernel():
    """Under --deterministic, verify rows past 128 run decode launches (the warning says so), and a pass
    that would reach the GEMM (whose sums differ from the decode kernel's) is refused, naming the flags."""
    import types
    from qmtp import cli_help
    from qmtp.runtime import ops
    from qmtp.runtime.kernel_config import PALLAS, KernelConfig
    det = KernelConfig("pallas", deterministic=True)
    model = types.SimpleNamespace(impl="pallas", cfg=types.SimpleNamespace(quantization=object()), kernels=det)
    assert "they run as decode launches of 128 rows" in cli_help.verify_rows_warning(model, 40, 3)
    ops.check_deterministic_rows(det, 255, 3)  # 1020 rows
    ops.check_deterministic_rows(PALLAS, 256, 3)  # not deterministic: no limit
    with pytest.raises(ValueError, match=r"--batch_slots x \(K\+1\) = 256 x 4 = 1024 rows per pass; at most 1023"):
        ops.check_deterministic_rows(det, 256, 3, "--batch_slots x (K+1)")

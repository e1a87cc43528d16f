"""qmtp.train, train_data, train_loss and export on the CPU, with configs/train_tiny.flags.

Run A (module fixture) is an uninterrupted 8-step run; the tests read its metrics, checkpoints and
tokenizer. Resume is checked bitwise: the same jitted step on the same inputs is deterministic on
the CPU, so a run stopped at step 4 and resumed must hold exactly run A's parameters and optimizer state.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from qmtp import api
from qmtp.model import checkpoint, config as qconfig, load as load_lib
from qmtp.model.params import tensor_table
from qmtp.tools import make_checkpoint
from qmtp.train import checkpoints as train_checkpoints
from qmtp.train import data as train_data
from qmtp.train import export
from qmtp.train import health
from qmtp.train import hyper
from qmtp.train import loss as train_loss
from qmtp.train import trainer as train

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(REPO, "configs", "train_tiny.flags")


def _train(*args: str) -> None:
    assert train.main(["train", f"--flagfile={TINY}", *args]) == 0


def _rows(run_dir: str) -> list[dict]:
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def _restore(run_dir: str):
    """(cfg, config dict, final params, opt_state) of a joint run."""
    with open(os.path.join(run_dir, "config.json")) as f:
        config = json.load(f)
    cfg = qconfig.from_dict(config)
    with open(os.path.join(run_dir, "run_config.json")) as f:
        rc = json.load(f)
    hp = hyper.Hyper(rc["steps"], rc["learning_rate"], rc["warmup_steps"], rc["min_lr_ratio"], rc["weight_decay"],
                     rc["grad_clip"], rc["adam_b1"], rc["adam_b2"], rc["mtp_loss_weight"], rc["compute_dtype"], False)
    fresh = jax.tree_util.tree_map(jnp.asarray, train_loss.init_params(cfg, 0))
    got = train_checkpoints.restore(run_dir, {"params": fresh, "opt_state": hp.optimizer().init(fresh),
                                              "step": jnp.int32(0)})
    return cfg, config, got["params"], got["opt_state"], int(got["step"])


@pytest.fixture(scope="module")
def run_a(tmp_path_factory) -> str:
    """The tiny preset's 8-step run (its final acceptance on 2 held-out windows); its stdout and stderr
    are kept in OUT.stdout and OUT.stderr."""
    out = str(tmp_path_factory.mktemp("train") / "a")
    stdout, stderr = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        _train(f"--out_dir={out}")
    for name, text in (("stdout", stdout), ("stderr", stderr)):
        with open(f"{out}.{name}", "w") as f:
            f.write(text.getvalue())
    return out


def test_tokenizer_round_trips_text(run_a):
    data = train_data.prepare(os.path.join(run_a, "data"), vocab_size=None)
    tok = data.tokenizer
    assert tok.get_vocab_size() == 512
    assert train_data.special_ids(tok) == {"<|endoftext|>": 509, "<|im_start|>": 510, "<|im_end|>": 511}
    for text in ['def f(x):\n\treturn {"a": x ** 2}  # ok\n', "héllo wörld ✓ 你好 \x00\x7f", "   \n\n  trailing  "]:
        ids = tok.encode(text, add_special_tokens=False).ids
        assert all(0 <= i < 509 for i in ids)
        assert tok.decode(ids) == text
    chat = "<|im_start|>user\nhi<|im_end|>"
    assert tok.encode(chat, add_special_tokens=False).ids[0] == 510
    assert tok.decode(tok.encode(chat, add_special_tokens=False).ids, skip_special_tokens=False) == chat
    # the token streams are the tokenizer applied to the corpus; training it again gives the same tokenizer
    corpus = train_data.load_corpus(eval_fraction=0.1, max_bytes=300000)
    assert train_data.train_tokenizer(corpus.train_texts, 512).to_str() == tok.to_str()
    assert np.array_equal(data.eval, train_data.encode_stream(tok, corpus.eval_texts))
    assert not set(corpus.train_files) & set(corpus.eval_files)


def test_few_steps_lower_both_losses_on_a_fixed_batch(run_a):
    evals = [r for r in _rows(run_a) if r["kind"] == "eval"]
    first, last = evals[0], evals[-1]
    assert (first["step"], last["step"]) == (0, 8)
    assert np.isfinite([first["main"], first["mtp"], last["main"], last["mtp"]]).all()
    assert last["main"] < first["main"] - 0.4, (first, last)
    assert last["mtp"] < first["mtp"] - 0.4, (first, last)  # the MTP term alone: ~0.2
    assert os.path.getsize(os.path.join(run_a, "loss.png")) > 10_000


@pytest.mark.slow  # ~23 s (CI time)
def test_resume_reproduces_the_uninterrupted_run_bitwise(run_a, tmp_path):
    out = str(tmp_path / "b")
    _train(f"--out_dir={out}", "--stop_at_step=4", "--export_best")
    assert not os.path.exists(os.path.join(out, "export"))
    with open(os.path.join(out, "best", "best.json")) as f:
        assert json.load(f)["step"] == 0  # the only evaluation before the stop
    _train(f"--out_dir={out}", "--resume", "--final_eval_windows=0", "--export_best")
    with open(os.path.join(out, "summary.json")) as f:
        summary = json.load(f)
    assert summary["export"]["step"] == 8  # the loss fell: the last evaluation is the best
    # no final acceptance (--final_eval_windows=0): the verdict is the exported step's evaluation's
    assert summary["degenerate"] and summary["degenerate"] == [r for r in _rows(out) if r["kind"] == "eval"][-1][
        "degenerate"]
    *_, params_a, opt_a, step_a = _restore(run_a)
    *_, params_b, opt_b, step_b = _restore(out)
    assert step_a == step_b == 8
    leaves_a, leaves_b = jax.tree_util.tree_leaves((params_a, opt_a)), jax.tree_util.tree_leaves((params_b, opt_b))
    assert len(leaves_a) == len(leaves_b)
    differ = [i for i, (x, y) in enumerate(zip(leaves_a, leaves_b)) if not np.array_equal(np.asarray(x), np.asarray(y))]
    assert differ == [], f"{len(differ)} of {len(leaves_a)} parameter / optimizer leaves differ"
    assert [r for r in _rows(out) if r["kind"] == "eval"][-1] == [r for r in _rows(run_a) if r["kind"] == "eval"][-1]


def test_export_round_trips_through_qmtp_load(run_a, tmp_path):
    cfg, config, params, _, _ = _restore(run_a)
    tok = train_data.prepare(os.path.join(run_a, "data"), vocab_size=None).tokenizer
    ids = tok.encode("import os\n\ndef main(argv):\n    return len(argv)\n", add_special_tokens=False).ids
    limit = 300_000
    for dtype, expected_params in (("fp32", params),
                                   ("bf16", jax.tree_util.tree_map(
                                       lambda x: jnp.asarray(x, jnp.bfloat16).astype(jnp.float32), params))):
        out = str(tmp_path / dtype)
        export.export_checkpoint(out, config, jax.device_get(params), tok, dtype, max_shard_bytes=limit)
        shards = sorted(n for n in os.listdir(out) if n.endswith(".safetensors"))
        assert len(shards) > 1 and all(os.path.getsize(os.path.join(out, n)) <= limit + 4096 for n in shards)
        loaded = api.load(out, dtype="float32", progress=False)
        assert loaded.cfg == dataclasses.replace(cfg, eos_token_ids=(511, 509))  # + generation_config's eos
        # the loader joins the GDN gate projections (load_lib.fuse_gate_projections); one [2 Hv, E] dot may sum
        # in another order than two [Hv, E] ones on some CPUs, so the tree in memory is joined the same way
        in_memory = api.Model(loaded.cfg, load_lib.fuse_gate_projections(expected_params), tok, out, dtype="float32")
        got, want = (jax.tree_util.tree_leaves_with_path(m.params) for m in (loaded, in_memory))
        assert [jax.tree_util.keystr(k) for k, _ in got] == [jax.tree_util.keystr(k) for k, _ in want]
        assert all(np.array_equal(np.asarray(x), np.asarray(y)) for (_, x), (_, y) in zip(got, want))
        assert np.array_equal(api.target_logits(loaded, ids), api.target_logits(in_memory, ids))
        assert np.array_equal(api.mtp_logits(loaded, ids).logits, api.mtp_logits(in_memory, ids).logits)
        with open(os.path.join(out, "config.json")) as f:
            written = json.load(f)
        assert written["model_type"] == "qwen3_5" and written["text_config"]["mtp_num_hidden_layers"] == 1
        with open(os.path.join(out, "generation_config.json")) as f:
            assert json.load(f)["eos_token_id"] == [511, 509]
        with open(os.path.join(out, "tokenizer_config.json")) as f:
            template = json.load(f)["chat_template"]
        import jinja2
        rendered = jinja2.Template(template).render(messages=[{"role": "user", "content": "hi"}],
                                                    add_generation_prompt=True)
        assert rendered == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
        names = set(checkpoint.read_headers(out))
        assert names == {e.name for e in tensor_table(loaded.cfg)}


def _raw_tensors(ckpt_dir: str) -> dict[str, bytes]:
    from safetensors import safe_open
    out = {}
    for name in sorted(os.listdir(ckpt_dir)):
        if name.endswith(".safetensors"):
            with safe_open(os.path.join(ckpt_dir, name), framework="numpy") as f:
                for key in f.keys():
                    out[key] = np.ascontiguousarray(f.get_tensor(key)).tobytes()
    return out


@pytest.mark.slow  # CI time: the export round trip and the tokenizer fixture train in CI
def test_train_mtp_only_changes_only_the_mtp_tensors(tmp_path):
    src = make_checkpoint.write_checkpoint(str(tmp_path / "fp8"), "tiny", "fp8", seed=3)
    out = str(tmp_path / "mtp_run")
    _train(f"--out_dir={out}", "--train_mtp_only", f"--init_checkpoint={src}", "--mtp_data=self_distill",
           "--self_distill_sequences=4", "--self_distill_prompt_len=16", "--steps=3", "--learning_rate=3e-2",
           "--final_eval_windows=1", "--seq_len=48")
    before, after = _raw_tensors(src), _raw_tensors(os.path.join(out, "export"))
    assert before.keys() == after.keys()
    mtp_weights = [n for n in before if n.startswith("mtp.") and not n.endswith("_scale_inv")]
    assert len(mtp_weights) == 15 and any(n.endswith("q_proj.weight") for n in mtp_weights)
    unchanged = [n for n in before if not n.startswith("mtp.")]
    assert any(n.endswith("weight_scale_inv") for n in unchanged)  # FP8 target tensors are part of the check
    assert [n for n in unchanged if before[n] != after[n]] == []
    assert [n for n in mtp_weights if before[n] == after[n]] == []
    for name in os.listdir(src):
        if not name.endswith(".safetensors"):
            with open(os.path.join(src, name), "rb") as f, open(os.path.join(out, "export", name), "rb") as g:
                assert f.read() == g.read(), name
    # the written-back checkpoint loads strictly; its FP8 MTP projections are the re-quantized trained values
    with open(os.path.join(out, "summary.json")) as f:
        summary = json.load(f)
    assert summary["trained_parameters"] < summary["total_parameters"]
    assert 0.0 <= summary["heldout_mtp_acceptance"]["acceptance"] <= 1.0
    train_rows = [r for r in _rows(out) if r["kind"] == "train"]  # batches drawn from the same 4 continuations
    assert train_rows[-1]["mtp"] < train_rows[0]["mtp"] - 0.2
    assert train_rows[-1]["loss"] == train_rows[-1]["mtp"]  # the frozen target's loss is not optimized


def test_best_keeps_the_lowest_held_out_loss_across_a_resume(tmp_path):
    run = str(tmp_path / "run")
    like = {"w": jnp.zeros((3,), jnp.float32)}
    best = train_checkpoints.Best(run, like, resume=False)
    for step, loss in ((0, 5.0), (10, 2.0), (20, 2.5)):
        best.offer({"step": step, "kind": "eval", "loss": loss}, {"w": jnp.full((3,), float(step))})
    assert (best.step, best.loss) == (10, 2.0) and np.array_equal(best.params["w"], np.full(3, 10.0))
    best.close()
    again = train_checkpoints.Best(run, like, resume=True)
    assert (again.step, again.loss) == (10, 2.0) and np.array_equal(again.params["w"], np.full(3, 10.0))
    again.offer({"step": 30, "kind": "eval", "loss": 1.0}, {"w": jnp.full((3,), 30.0)})
    assert again.step == 30
    again.close()
    assert train_checkpoints.Best(run, like, resume=False).step is None  # a fresh run starts without a best


def test_corpus_from_several_directories(tmp_path):
    extra = tmp_path / "extra"
    (extra / "pkg").mkdir(parents=True)
    for i in range(40):
        (extra / "pkg" / f"m{i}.py").write_text(f"def f{i}(x):\n    return x + {i}\n")
    roots = train_data.corpus_roots(f"stdlib,{extra}")
    assert [label for label, _ in roots] == ["stdlib", "dir1"] and roots[1][1] == str(extra)
    corpus = train_data.load_corpus(f"stdlib,{extra}", eval_fraction=0.1, max_bytes=400_000)
    names = corpus.train_files + corpus.eval_files
    assert any(n.startswith("dir1/pkg/m") for n in names) and any(n.startswith("stdlib/") for n in names)
    assert not set(corpus.train_files) & set(corpus.eval_files)
    with pytest.raises(ValueError, match="nowhere"):
        train_data.corpus_roots(f"stdlib,{tmp_path / 'nowhere'}")
    assert len(train_data.first_bytes(["ab", "cd", "ef"], 4)) == 2 and len(train_data.first_bytes(["abc"], 1)) == 1


def test_held_out_split_keeps_packages_whole():
    corpus = train_data.load_corpus(eval_fraction=0.1, max_bytes=2_000_000)
    top = lambda names: {"/".join(n.split("/")[:2]) for n in names if n.count("/") >= 2}
    assert corpus.eval_files and not top(corpus.train_files) & top(corpus.eval_files)


@pytest.mark.slow  # ~29 s; depth one (the recipes' default) is trained by the default suite
def test_mtp_depth_two_trains_the_drafting_chain(run_a):
    from qmtp.model import mtp, target as model_lib
    from qmtp.runtime.kernel_config import REF
    from qmtp.runtime.state import init_state
    cfg, _, params, _, _ = _restore(run_a)
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, cfg.vocab_size - 3, (2, 12)), jnp.int32)
    _, one = train_loss.losses(cfg, params, tokens, mtp_depth=1)
    _, two = train_loss.losses(cfg, params, tokens, mtp_depth=2)
    assert two["main"] == one["main"] and two["mtp1"] == one["mtp"] and "mtp2" not in one
    assert np.isclose(two["mtp"], (two["mtp1"] + two["mtp2"]) / 2)
    # index 0 of depth 2 is one drafting step: token x_2, the depth-1 output at index 0, an empty cache
    state = init_state(cfg, np.arange(2)[:, None], num_pages=2, page_size=12, dtype=jnp.float32)
    n = jnp.full((2,), 12, jnp.int32)
    hidden, state = model_lib.forward(cfg, params, state, tokens, n, REF)
    mh, _ = mtp.forward(cfg, params, state, tokens[:, 1:-1], hidden[:, :-2], jnp.zeros((2,), jnp.int32), n - 2, REF)
    (h2,) = train_loss.mtp_chain(cfg, params, state, tokens, mh, 2)
    assert h2.shape == (2, 9, cfg.hidden_size)
    step, _ = mtp.forward(cfg, params, state, tokens[:, 2:3], mh[:, :1], jnp.zeros((2,), jnp.int32),
                          jnp.ones((2,), jnp.int32), REF)
    np.testing.assert_allclose(np.asarray(h2[:, 0]), np.asarray(step[:, 0]), rtol=1e-5, atol=1e-5)


@pytest.mark.slow  # ~30 s: a second training run
def test_a_depth_two_run_lowers_both_depths_losses(tmp_path):
    out = str(tmp_path / "d2")
    _train(f"--out_dir={out}", "--mtp_depth=2", "--final_eval_windows=0")
    evals = [r for r in _rows(out) if r["kind"] == "eval"]
    assert evals[-1]["mtp2"] < evals[0]["mtp2"] - 0.2 and evals[-1]["mtp1"] < evals[0]["mtp1"] - 0.2


def test_the_tiny_preset_collapses_and_its_report_says_so_instead_of_its_acceptance(run_a):
    # 8 steps of the tiny preset learn the token frequencies at best: the greedy target emits ' ' everywhere,
    # which its MTP head predicts as well, so the teacher-forced acceptance reads 1.000
    with open(os.path.join(run_a, "summary.json")) as f:
        summary = json.load(f)
    final = summary["heldout_check"]
    assert final["loss"] >= final["unigram"] and final["top_share"] > health.TOP_SHARE_LIMIT, final
    assert final["top_token_text"] == "' '"
    assert summary["degenerate"] == final["degenerate"] and len(final["degenerate"]) == 2
    assert summary["heldout_mtp_acceptance"]["meaningful"] is False
    with open(f"{run_a}.stderr") as f:
        lines = [line for line in f.read().splitlines() if "MTP acceptance" in line]
    assert len(lines) == 1 and lines[0].startswith("train: DEGENERATE MODEL: held-out loss "), lines
    assert "greedy predictions are token " in lines[0] and lines[0].endswith("is not meaningful"), lines
    # the printed result and every held-out evaluation row carry the verdict next to the number
    with open(f"{run_a}.stdout") as f:
        printed = json.loads(f.read().strip().splitlines()[-1])
    assert printed["degenerate"].startswith("DEGENERATE MODEL: ") and "accept" not in printed["last_eval"]
    last = [r for r in _rows(run_a) if r["kind"] == "eval"][-1]
    assert last["degenerate"] and last["top_share"] > health.TOP_SHARE_LIMIT and last["main"] >= last["unigram"]


def test_health_criteria_on_held_out_text(run_a):
    """check() against predictors built from the held-out stream itself: a bigram table passes; token
    frequencies (the best context-free predictor) and a constant prediction fail, each for its reason."""
    data = train_data.prepare(os.path.join(run_a, "data"), vocab_size=None)
    stream, v = data.eval.astype(np.int64), data.tokenizer.get_vocab_size()
    labels, context = stream[1:], stream[:-1]
    bigram = np.full((v, v), 0.01)
    np.add.at(bigram, (context, labels), 1.0)
    bigram /= bigram.sum(1, keepdims=True)
    ok = health.check(float(np.mean(-np.log(bigram[context, labels]))), labels, bigram[context].argmax(1), stream,
                      data.tokenizer)
    assert ok["degenerate"] is None and ok["loss"] < ok["unigram"] - 1.0 and ok["top_share"] < 0.5, ok
    assert "DEGENERATE" not in health.describe(ok, 0.4) and health.describe(ok, 0.4).endswith("MTP acceptance 0.400")

    train_freq = np.bincount(data.train, minlength=v) + 0.5
    train_freq /= train_freq.sum()  # the training frequencies: what a model that learned only them predicts
    unigram = health.check(float(np.mean(-np.log(train_freq[labels]))), labels,
                           np.full(labels.shape, train_freq.argmax()), stream, data.tokenizer)
    assert len(unigram["degenerate"]) == 2 and "no better than token frequencies" in unigram["degenerate"][0]
    assert unigram["unigram"] == pytest.approx(health.unigram_loss(stream, labels))

    # a better-than-frequencies loss with one token everywhere is still degenerate, and the other way round
    collapsed = health.check(ok["loss"], labels, np.full(labels.shape, 220), stream, data.tokenizer)
    assert collapsed["degenerate"] == ["100% of greedy predictions are token 220 (' ')"]
    line = health.describe(collapsed, 1.0)
    assert line.startswith("DEGENERATE MODEL: 100% of greedy predictions are token 220 (' ')")
    assert line.endswith("its MTP acceptance (1.000) is not meaningful")
    varied = health.check(unigram["unigram"] + 0.01, labels, bigram[context].argmax(1), stream)
    assert len(varied["degenerate"]) == 1 and varied["degenerate"][0].startswith("held-out loss ")
    assert health.check(float("nan"), labels, labels, stream)["degenerate"]  # NaN is no improvement
    assert health.check(ok["loss"], labels, np.where(np.arange(labels.size) % 10, 220, labels), stream)[
        "degenerate"] is None  # 90% one token: under the limit


def test_train_rejects_an_unwritable_out_dir_before_reading_anything(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=REPO)
    r = subprocess.run([sys.executable, "-m", "qmtp.train", f"--flagfile={TINY}", f"--out_dir={blocker}/run"],
                       cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr
    assert r.stderr.splitlines() == [f"train: error: --out_dir={blocker}/run: {blocker} is a file, not a directory"]


def test_train_and_export_reject_unwritable_outputs_before_reading_anything(run_a, tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    out = tmp_path / "run"
    assert train.main(["train", f"--flagfile={TINY}", f"--out_dir={out}", f"--export_dir={blocker}/x"]) == 2
    assert capsys.readouterr().err.splitlines() == [f"train: error: --export_dir={blocker}/x: {blocker} is a file, "
                                                    "not a directory"]
    assert not out.exists()  # nothing written
    assert export.main(["export", f"--run_dir={run_a}", f"--out={blocker}/x"]) == 2
    assert capsys.readouterr().err.splitlines() == [f"export: error: --out={blocker}/x: {blocker} is a file, "
                                                    "not a directory"]
    existing = tmp_path / "existing"
    existing.mkdir()
    assert export.main(["export", f"--run_dir={run_a}", f"--out={existing}"]) == 2
    assert capsys.readouterr().err.splitlines() == [f"export: error: --out={existing} exists (pass --overwrite to "
                                                    "replace it)"]
    assert export.main(["export", f"--run_dir={tmp_path / 'no_run'}", f"--out={tmp_path / 'x'}"]) == 2
    assert "no_run is not a qmtp.train run directory" in capsys.readouterr().err


def test_the_shipped_demo_model_is_not_flagged():
    """A model that learned something: models/qmtp-demo (configs/train_demo.flags) on held-out standard
    library text, through the check the trainer runs on its export."""
    import types
    demo = api.load(os.path.join(REPO, "models", "qmtp-demo"), dtype="float32", progress=False)
    stream = train_data.encode_stream(demo.tokenizer, train_data.load_corpus("stdlib", eval_fraction=0.02).eval_texts)
    windows = np.stack([stream[a:a + 128] for a in np.linspace(0, stream.size - 128, 4).astype(int)]).astype(np.int32)
    check = train._export_check(demo, windows, types.SimpleNamespace(eval=stream, tokenizer=demo.tokenizer))
    assert check["degenerate"] is None and check["loss"] < check["unigram"] - 1.0 and check["top_share"] < 0.5, check

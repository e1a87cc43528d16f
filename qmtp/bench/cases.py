"""One benchmark case of the harness (qmtp/bench/harness.py, whose flags it reads): every mode of a
(batch, prompt length) on the same prompts, their programs compiled first all at once (`precompile`),
each timed over --repeats generations after a warm-up run, and the figures of each (`summarize`):
decode tokens/s, TTFT, acceptance, speedup, shares of the bandwidth roofline and of the MTP ceiling,
what sampling adds, the round breakdown."""

from __future__ import annotations

import os
import sys
import time

from absl import flags

from qmtp import cli_help

FLAGS = flags.FLAGS
# --engine values: (KernelConfig.impl, KernelConfig.deterministic)
ENGINES = {"pallas": ("pallas", False), "ref": ("ref", False), "deterministic": ("pallas", True)}


def random_prompts(model, batch: int, length: int, seed: int) -> list[list[int]]:
    """`batch` prompts of `length` ids drawn from the tokenizer's ordinary tokens (no specials)."""
    import numpy as np
    vocab = model.cfg.vocab_size
    if model.tokenizer is not None:
        vocab = min(vocab, model.tokenizer.get_vocab_size(with_added_tokens=False))
    special = set(model.cfg.eos_token_ids) | {model.cfg.bos_token_id}
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(batch):
        ids = rng.integers(0, vocab, size=length * 2)
        out.append([int(i) for i in ids if int(i) not in special][:length])
    return out


def memory() -> dict:
    """Resident and peak device memory of the first device (None where the backend has no stats)."""
    import jax
    stats = jax.devices()[0].memory_stats() or {}
    return {"bytes_in_use": stats.get("bytes_in_use"), "peak_bytes_in_use": stats.get("peak_bytes_in_use")}


class Progress:
    def __init__(self, total: int):
        self.total, self.done, self.t0 = total, 0, time.perf_counter()

    def show(self, what: str) -> None:
        self.done += 1
        self.note(what)

    def note(self, what: str) -> None:
        print(f"[{self.done}/{self.total} {time.perf_counter() - self.t0:.0f}s] {what}", file=sys.stderr, flush=True)


def sampling() -> dict:
    """qmtp.generate's sampling arguments from the flags (seed 0 unless given: the same draws each repeat)."""
    return cli_help.sampling_from_flags(default_seed=0)


def run_mode(model, prompts, k: int, cap, repeats: int, progress: Progress, label: str, greedy: bool = False) -> dict:
    """Warm-up (compile), then `repeats` timed generations of one mode (greedy: at temperature 0 whatever
    the flags say); with --sampling_cost a sampled mode's greedy twin runs after it, under "greedy"."""
    import qmtp
    args = dict(sampling(), temperature=0.0) if greedy else sampling()
    t = time.perf_counter()
    qmtp.generate(model, prompts, max_new_tokens=FLAGS.max_new_tokens, stop_token_ids=[], mtp_k=k,
                  accept_cap=cap, warmup=True, **args)
    compile_s = time.perf_counter() - t
    runs = []
    for r in range(repeats):
        res = qmtp.generate(model, prompts, max_new_tokens=FLAGS.max_new_tokens, stop_token_ids=[], mtp_k=k,
                            accept_cap=cap, **args)
        runs.append(res)
        progress.show(f"{label} repeat {r + 1}/{repeats}: {res.stats['decode_tokens_per_s']:.1f} tok/s, "
                      f"TTFT {1e3 * res.stats['ttft_s']:.0f} ms")
    # device memory after the mode: in use, and the process's high-water mark through it (the modes run in
    # the table's order, so a mode that needs more than every one before it raises the mark)
    out = {"compile_s": compile_s, "runs": runs, "memory": memory()}
    if FLAGS.trace_dir:  # an untimed run under the profiler (where a round's device time goes)
        import jax
        out["trace_dir"] = os.path.join(FLAGS.trace_dir, f"{engine_name(model)}_{trace_name(label)}")
        with jax.profiler.trace(out["trace_dir"], create_perfetto_trace=True):
            qmtp.generate(model, prompts, max_new_tokens=FLAGS.max_new_tokens, stop_token_ids=[], mtp_k=k,
                          accept_cap=cap, **args)
    if FLAGS.sampling_cost and not greedy:
        out["greedy"] = run_mode(model, prompts, k, cap, repeats, progress, label + " greedy", greedy=True)
    return out


def precompile(model, prompts, modes: list[tuple[object, object]]) -> float | None:
    """Compiles the programs of every mode (k, accept_cap) at once, a thread each (qmtp.generate's
    compile_only; a cap schedule's shape, not its values, makes the program), before the modes run, so
    a mode's compile does not wait for the one before it (XLA compiles release the GIL). Returns the
    seconds, or None under tensor parallelism (one device only: each mode then compiles in its warm-up)."""
    import concurrent.futures

    import qmtp
    if model.mesh is not None:
        return None
    programs = {(str(k), cap is None): (k, cap) for k, cap in modes}
    t = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(len(programs), thread_name_prefix="bench-compile") as pool:
        futures = [pool.submit(qmtp.generate, model, prompts, max_new_tokens=FLAGS.max_new_tokens, stop_token_ids=[],
                               mtp_k=k, accept_cap=cap, compile_only=True, **sampling())
                   for k, cap in programs.values()]
        for f in futures:
            f.result()
    return time.perf_counter() - t


def engine_name(model) -> str:
    """The --engine value of a model's KernelConfig."""
    return next(name for name, kc in ENGINES.items() if kc == (model.impl, model.kernels.deterministic))


def trace_name(label: str) -> str:
    """'B=1 P=64 K=3 profiled' -> 'B1_P64_K3_profiled': a mode's trace directory (after the engine)."""
    return "_".join("".join(c for c in word if c.isalnum()) for word in label.split())


def summarize(name: str, k: int, acceptance: str, mode: dict, plain_tokens, bytes_, copy_bps: float,
              prompt_tokens: int | None = None) -> dict:
    """A mode's figures; prompt_tokens (the batch's prompt tokens) adds the prefill rate, those tokens over
    the median TTFT."""
    from qmtp.bench import report as br
    runs = mode["runs"]
    s0 = runs[-1].stats
    out = {"name": name, "k": k, "acceptance": acceptance, "compile_s": mode["compile_s"],
           "decode_tokens_per_s": br.spread([r.stats["decode_tokens_per_s"] for r in runs]),
           "ttft_s": br.spread([r.stats["ttft_s"] for r in runs]),
           "raw": [{k_: v for k_, v in r.stats.items()} for r in runs], "memory": mode.get("memory")}
    if prompt_tokens:
        out["prefill_tokens_per_s"] = prompt_tokens / out["ttft_s"]["median"]
    if mode.get("trace_dir"):
        out["trace_dir"] = mode["trace_dir"]
    if mode.get("greedy"):
        out.update(br.sampling_cost(runs, mode["greedy"]["runs"]))
    tokens = runs[-1].tokens
    out["tokens_match_plain"] = plain_tokens is None or tokens == plain_tokens
    if not out["tokens_match_plain"]:
        out["first_mismatch"] = [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), min(len(x), len(y)))
                                 for x, y in zip(tokens, plain_tokens)]
    batch = bytes_["batch"]
    roof = br.roofline_tok_s(bytes_["target_total"], batch, copy_bps)
    if k:
        out.update(mean_accepted_length=s0["mean_accepted_length"], acceptance_rate=s0["acceptance_rate"],
                   position_acceptance=s0["position_acceptance"])
        verify = bytes_.get("verify", {}).get(str(len(s0["position_acceptance"])), {"total": bytes_["target_total"]})
        out["ceiling_tok_s"] = br.mtp_ceiling_tok_s(verify["total"], bytes_["draft_total"],
                                                    s0["position_acceptance"], batch, copy_bps)
        out["share_of_ceiling"] = out["decode_tokens_per_s"]["median"] / out["ceiling_tok_s"]
    out["share_of_roofline"] = out["decode_tokens_per_s"]["median"] / roof
    return out


def breakdown(model, batch: int, length: int, ks: list[int], modes: list[dict], progress: Progress,
              kernels: dict) -> dict:
    """Per K: each piece of a round timed alone (qmtp.bench.breakdown) and the measured round time
    of the natural-acceptance mode (decode time / rounds). On a GPU, kernels[K] receives each
    piece's launches per iteration by kind."""
    from qmtp import api
    from qmtp.bench import breakdown as bd
    out = {}
    for k in ks:
        kernels[str(k)] = {}
        pieces = bd.measure(model, lambda: api._new_state(model, [length + FLAGS.max_new_tokens + 8] * batch), k,
                            kernels[str(k)])
        mode = next(m for m in modes if m["k"] == k and m["acceptance"] == "natural")
        raw = mode["raw"][-1]
        pieces["measured_round"] = raw["decode_s"] / max(raw["steps"], 1)
        plain = next(m for m in modes if m["k"] == 0)["raw"][-1]
        pieces["measured_plain_step"] = plain["decode_s"] / max(plain["steps"], 1)
        out[str(k)] = pieces
        progress.note(f"breakdown K={k}: " + ", ".join(f"{n} {v * 1e3:.2f} ms" for n, v in pieces.items()))
    return out


def bench_case(model, batch: int, length: int, copy_bps: float, progress: Progress, prompts=None,
               matmul_tflops: float | None = None) -> dict:
    """All modes for one (batch, prompt length): random prompts, or the given token-id prompts."""
    import numpy as np

    from qmtp import api
    from qmtp.bench import report as br
    from qmtp.bench.profile import acceptance_schedule
    from qmtp.runtime.loop import MAX_K
    if prompts is None:
        prompts = random_prompts(model, batch, length, FLAGS.prompt_seed)
    ks = [int(k) for k in FLAGS.ks]
    profile = [float(p) for p in FLAGS.profile if p]
    state = api._new_state(model, [length + FLAGS.max_new_tokens + 5] * batch)
    bytes_ = br.step_bytes(model.params, state, context=length + FLAGS.max_new_tokens // 2,
                           moe_top_k=model.cfg.moe.top_k if model.cfg.moe else None,
                           verify_ks=range(1, MAX_K + 1))
    del state
    case = {"batch": batch, "prompt_length": length, "bytes": bytes_, "modes": [], "moe": model.cfg.moe is not None}
    rounds = FLAGS.max_new_tokens + 1
    no_cap = {k: np.full((rounds, batch), k, np.int32) for k in ks}  # natural: the profiled runs' shape
    caps = {k: acceptance_schedule(profile[:k], k, rounds, batch, FLAGS.profile_seed)
            for k in ks if k <= len(profile)}
    autos = auto_modes(profile, rounds, batch)
    case["precompile_s"] = precompile(model, prompts, [(0, None)] + [(k, c) for k, c in no_cap.items()]
                                      + [(api.AUTO, cap) for _, cap in autos])
    if case["precompile_s"] is not None:
        progress.note(f"B={batch} P={length}: every mode's programs compiled at once in {case['precompile_s']:.0f} s")
    plain = run_mode(model, prompts, 0, None, FLAGS.repeats, progress, f"B={batch} P={length} plain")
    plain_tokens = plain["runs"][-1].tokens if FLAGS.temperature == 0 else None  # sampled: no token check
    n_prompt = sum(len(p) for p in prompts)
    case["modes"].append(summarize("plain", 0, "-", plain, None, bytes_, copy_bps, n_prompt))
    for k in ks:
        # "no cap" as a schedule of the profiled runs' shape: both runs of a K share one compiled loop
        m = run_mode(model, prompts, k, no_cap[k], FLAGS.repeats, progress, f"B={batch} P={length} K={k} natural")
        case["modes"].append(summarize(f"mtp K={k} natural", k, "natural", m, plain_tokens, bytes_, copy_bps,
                                       n_prompt))
    for k, cap in caps.items():
        m = run_mode(model, prompts, k, cap, FLAGS.repeats, progress, f"B={batch} P={length} K={k} profiled")
        s = summarize(f"mtp K={k} profiled", k, "profiled", m, plain_tokens, bytes_, copy_bps, n_prompt)
        s["imposed_profile"] = profile[:k]
        case["modes"].append(s)
    for acceptance, cap in autos:
        m = run_mode(model, prompts, api.AUTO, cap, FLAGS.repeats, progress, f"B={batch} P={length} auto {acceptance}")
        s = summarize(f"mtp auto {acceptance}", api.AUTO, acceptance, m, plain_tokens, bytes_, copy_bps, n_prompt)
        s["k_rounds"], s["round_cost_s"] = m["runs"][-1].stats["k_rounds"], m["runs"][-1].stats["round_cost_s"]
        case["modes"].append(s)
    base = case["modes"][0]["decode_tokens_per_s"]["median"]
    for m in case["modes"]:
        m["speedup"] = m["decode_tokens_per_s"]["median"] / base
    if matmul_tflops:  # the prefill's compute floor at the FP8 matmul rate measured in this run
        from qmtp.bench.compute import prefill_floor_s
        case["prefill_floor_s"] = prefill_floor_s(model.params, n_prompt, matmul_tflops)
        for m in case["modes"]:
            m["prefill_share_of_floor"] = case["prefill_floor_s"] / m["ttft_s"]["median"]
    case["roofline"] = {"plain_tok_s": br.roofline_tok_s(bytes_["target_total"], batch, copy_bps)}
    if FLAGS.breakdown:
        bks = [int(k) for k in FLAGS.breakdown_ks] or ks
        kernels = {}
        case["breakdown"] = breakdown(model, batch, length, bks, case["modes"], progress, kernels)
        if any(kernels.values()):
            case["breakdown_kernels"] = kernels
    case["all_tokens_match_plain"] = bool(np.all([m["tokens_match_plain"] for m in case["modes"]]))
    return case


def auto_modes(profile: list[float], rounds: int, batch: int) -> list[tuple[str, object]]:
    """With --auto: (acceptance, accept_cap) of the mtp_k='auto' modes: natural, and profiled when the
    profile covers the most drafts of a round (natural's "no cap" has the profiled schedule's shape: the
    two share one compiled loop, ~95 s of compile at the 27B shapes)."""
    import numpy as np

    from qmtp.bench.profile import acceptance_schedule
    from qmtp.runtime import adaptive_k
    if not FLAGS.auto:
        return []
    k = adaptive_k.CANDIDATES[-1]
    modes = [("natural", np.full((rounds, batch), k, np.int32))]
    if len(profile) >= k:
        modes.append(("profiled", acceptance_schedule(profile[:k], k, rounds, batch, FLAGS.profile_seed)))
    return modes

"""Prometheus text exposition (format 0.0.4) of the engine's counters and gauges (GET /metrics)."""

from __future__ import annotations

from qmtp.runtime import adaptive_k
from qmtp.serve.requests import FINISH_REASONS

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def render(engine, invalid_requests: int = 0) -> str:
    c, s = engine.counters, engine.stats()
    lines: list[str] = []

    def metric(name: str, kind: str, help_text: str, samples) -> None:
        """samples: [(labels, value)], or one unlabelled value."""
        lines.extend((f"# HELP {name} {help_text}", f"# TYPE {name} {kind}"))
        for labels, value in samples if isinstance(samples, list) else [({}, samples)]:
            label = "{" + ",".join(f'{k}="{v}"' for k, v in labels.items()) + "}" if labels else ""
            number = repr(float(value)) if isinstance(value, float) else str(int(value))  # numpy float64 too
            lines.append(f"{name}{label} {number}")

    metric("qmtp_requests_total", "counter", "Finished requests by outcome.",
           [({"outcome": o}, c[f"finished_{o}"]) for o in FINISH_REASONS])
    metric("qmtp_requests_rejected_total", "counter", "Requests refused at submission.",
           [({"reason": "invalid"}, invalid_requests), ({"reason": "queue_full"}, c["rejected_queue_full"]),
            ({"reason": "shutting_down"}, c["rejected_shutting_down"]), ({"reason": "warming_up"},
                                                                         c["rejected_warming_up"])])
    metric("qmtp_compiles_while_serving_total", "counter", "Device calls that compiled after the warm-up (a shape "
           "it did not cover; each stalled every slot).", c["serving_compiles"])
    metric("qmtp_prompt_tokens_total", "counter", "Prompt tokens of admitted requests.", c["prompt_tokens"])
    metric("qmtp_generation_tokens_total", "counter", "Generated tokens.", c["generation_tokens"])
    metric("qmtp_prefills_total", "counter", "Prompts prefilled.", c["prefills"])
    metric("qmtp_prefill_passes_total", "counter", "Prefill passes (device calls): prompts admitted together, a "
           "piece of a long prompt, with the prefix cache every pass.", c["prefill_passes"])
    metric("qmtp_prefill_pass_rows_total", "counter", "Prompts in those passes, summed over the passes.",
           c["prefill_pass_rows"])
    metric("qmtp_loop_calls_total", "counter", "Bounded device loop calls.", c["loop_calls"])
    rounds, drafted, accepted = c["mtp_rounds"], c["mtp_drafted"], c["mtp_accepted"]
    metric("qmtp_mtp_k", "gauge", "MTP drafts per round (0 = plain decoding).", engine.k)
    metric("qmtp_mtp_rounds_total", "counter", "Speculative rounds (per sequence).", rounds)
    metric("qmtp_mtp_draft_tokens_total", "counter", "Drafted tokens.", drafted)
    metric("qmtp_mtp_accepted_tokens_total", "counter", "Accepted draft tokens.", accepted)
    metric("qmtp_mtp_acceptance_rate", "gauge", "Accepted / drafted tokens.", accepted / drafted if drafted else 0.0)
    metric("qmtp_mtp_mean_accepted_length", "gauge", "Tokens emitted per round (accepted drafts + 1).",
           (accepted + rounds) / rounds if rounds else 0.0)
    positions = [({"position": str(i + 1)}, n) for i, n in enumerate(engine.position_accepts)]  # K entries
    metric("qmtp_mtp_position_accepted_total", "counter", "Rounds whose draft at this position was accepted.",
           [(p, int(n)) for p, n in positions])
    metric("qmtp_mtp_position_acceptance", "gauge", "Share of rounds whose draft at this position was accepted.",
           [(p, n / rounds if rounds else 0.0) for p, n in positions])
    split = {"sampled": (c["mtp_rounds_sampled"], engine.sampled_position_accepts)}
    split["greedy"] = (rounds - split["sampled"][0], engine.position_accepts - engine.sampled_position_accepts)
    metric("qmtp_mtp_position_acceptance_by_decoding", "gauge", "Share of rounds whose draft at this position was "
           "accepted, of greedy requests (exact match) and of sampled ones (speculative sampling).",
           [({"decoding": d, "position": str(i + 1)}, n / r if r else 0.0)
            for d, (r, accepts) in sorted(split.items()) for i, n in enumerate(accepts)])
    if engine.adaptive:
        metric("qmtp_mtp_loop_rounds_by_k_total", "counter", "Loop rounds run at each draft length (--mtp_k=auto).",
               [({"k": str(k)}, int(n)) for k, n in zip(adaptive_k.CANDIDATES, engine.k_rounds)])
        metric("qmtp_mtp_round_seconds", "gauge", "Seconds of a round at each draft length, timed in the warm-up.",
               [({"k": str(k)}, float(s)) for k, s in zip(adaptive_k.CANDIDATES, engine.round_cost)]
               if engine.round_cost is not None else [])
    metric("qmtp_mtp_rounds_by_accepted_total", "counter", "Rounds that accepted exactly this many drafts.",
           [({"accepted": str(a)}, int(n)) for a, n in enumerate(engine.accept_hist)])
    prefix = engine.prefix
    if prefix is not None:
        metric("qmtp_prefix_cache_lookups_total", "counter", "Prompts looked up in the prefix cache.", prefix.lookups)
        metric("qmtp_prefix_cache_hits_total", "counter", "Prompts resumed from a prefix cache checkpoint.",
               prefix.hits)
        metric("qmtp_prefix_cache_hit_tokens_total", "counter", "Prompt tokens served by the prefix cache (prefill "
               "saved).", prefix.hit_tokens)
        metric("qmtp_prefix_cache_hit_blocks_total", "counter", "Prompt blocks served by the prefix cache.",
               prefix.hit_tokens // prefix.block)
        metric("qmtp_prefix_cache_token_hit_rate", "gauge", "Prompt tokens served by the cache / prompt tokens.",
               prefix.hit_tokens / c["prompt_tokens"] if c["prompt_tokens"] else 0.0)
        metric("qmtp_prefix_cache_checkpoints", "gauge", "Checkpoints held.", len(prefix))
        metric("qmtp_prefix_cache_bytes", "gauge", "Bytes the prefix cache holds alive (GDN states, hiddens, "
               "KV pages).", prefix.bytes)
        metric("qmtp_prefix_cache_budget_bytes", "gauge", "Prefix cache byte budget.", prefix.budget_bytes)
        metric("qmtp_prefix_cache_evictions_total", "counter", "Checkpoints evicted (LRU: budget or KV pages).",
               prefix.evicted)
    metric("qmtp_requests_running", "gauge", "Requests in batch slots.", s["active"])
    metric("qmtp_requests_queued", "gauge", "Requests waiting for a slot.", s["queued"])
    metric("qmtp_slots_free", "gauge", "Free batch slots.", s["free_slots"])
    metric("qmtp_slots_total", "gauge", "Batch slots.", s["batch_slots"])
    metric("qmtp_kv_pages_free", "gauge", "Free KV pages.", s["free_pages"])
    metric("qmtp_kv_pages_total", "gauge", "KV pages in the pool.", s["num_pages"])
    return "\n".join(lines) + "\n"

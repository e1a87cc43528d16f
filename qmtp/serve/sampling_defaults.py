"""A request's sampling defaults from the checkpoint's generation_config.json (`--generation_config=auto`).

Model makers state in generation_config.json how their model should be sampled (Qwen3's: do_sample
true, temperature 0.6, top_p 0.95, top_k 20; their model cards warn that greedy decoding can make a
thinking model repeat itself endlessly). As transformers and vLLM do, a request that leaves
temperature, top_p, top_k or min_p out gets the value the file sets, where the file sets
`do_sample: true`. Only the fields it states count (vLLM's rule: transformers' own defaults, such as
top_k 50, are not applied). A request's own values win: `temperature: 0` stays greedy.
"""

from __future__ import annotations

import json
import os

from qmtp import sampling_args

FIELDS = ("temperature", "top_p", "top_k", "min_p")
FILE = "generation_config.json"


def from_checkpoint(checkpoint_dir: str) -> dict:
    """{field: value} of FIELDS that the checkpoint's generation_config.json sets with do_sample true ({}
    without the file or do_sample); ValueError naming the file for a value out of range."""
    path = os.path.join(checkpoint_dir, FILE)
    if not os.path.isfile(path):
        return {}
    with open(path) as f:
        try:
            config = json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: not valid JSON ({e})") from None
    if config.get("do_sample") is not True:
        return {}
    defaults = {name: config[name] for name in FIELDS if config.get(name) is not None}
    try:
        sampling_args.sampling_params(1, **defaults, seed=0)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{path}: {e}") from None
    return defaults


def describe(defaults: dict) -> str:
    """The log line a server prints at start."""
    if not defaults:
        return "sampling: greedy unless a request sets temperature"
    values = ", ".join(f"{name} {defaults[name]}" for name in FIELDS if name in defaults)
    return (f"sampling defaults from {FILE}: {values} (for a request that leaves them out; "
            "--generation_config=none: greedy)")

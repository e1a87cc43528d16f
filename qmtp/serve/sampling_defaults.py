"""A request's sampling defaults from the checkpoint's generation_config.json (`--generation_config=auto`).

Model makers state in generation_config.json how their model should be sampled (Qwen3's: do_sample
true, temperature 0.6, top_p 0.95, top_k 20; their model cards warn that greedy decoding can make a
thinking model repeat itself endlessly). As transformers and vLLM do, a request that leaves
temperature, top_p, top_k or min_p out gets the value the file sets, where the file sets
`do_sample: true`; one that leaves repetition_penalty out gets the file's whatever do_sample says (it
applies to greedy decoding too, in transformers as in vLLM). Only the fields it states count (vLLM's
rule: transformers' own defaults, such as top_k 50, are not applied). A request's own values win:
`temperature: 0` stays greedy.
"""

from __future__ import annotations

import json
import os

from qmtp import sampling_args

SAMPLED = ("temperature", "top_p", "top_k", "min_p")  # read where the file sets do_sample: true
FIELDS = SAMPLED + ("repetition_penalty",)
FILE = "generation_config.json"


def from_checkpoint(checkpoint_dir: str) -> dict:
    """{field: value} of FIELDS that the checkpoint's generation_config.json sets (SAMPLED only with
    do_sample true; {} without the file); ValueError naming the file for a value out of range."""
    path = os.path.join(checkpoint_dir, FILE)
    if not os.path.isfile(path):
        return {}
    with open(path) as f:
        try:
            config = json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: not valid JSON ({e})") from None
    read = FIELDS if config.get("do_sample") is True else FIELDS[len(SAMPLED):]
    defaults = {name: config[name] for name in read if config.get(name) is not None}
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

#!/usr/bin/env python3
"""HF transformers' Qwen3_5ForCausalLM logits == qmtp logits on an exported checkpoint (qmtp.train's export).

    .venv-oracle/bin/python scripts/check_hf_parity.py --checkpoint=DIR [--text=...] [--tol=1e-4]

Run with the oracle venv (torch + transformers, `make oracle-fixtures` builds it). The text is
tokenized with the checkpoint's tokenizer.json (`tokenizers`, the library both sides share), then:
  * HF: Qwen3_5ForCausalLM.from_pretrained(DIR, float32, eager attention, torch fallback GDN; HF
    ignores mtp.*), loading info must show no missing / unexpected / mismatched keys;
  * qmtp: a child process of the qmtp venv (--qmtp_python, default .venv/bin/python) runs this file
    with --role=qmtp: qmtp.load(DIR, dtype="float32") (strict) and qmtp.target_logits, written to a
    temporary .npz;
  * also: AutoTokenizer gives the same ids as tokenizer.json, and its chat template renders ChatML.
Prints the max relative error max|hf - qmtp| / max|hf| (tests/tolerance.py's definition) and the
argmax agreement; exits 1 when the error exceeds --tol (default 1e-4 = tests/tolerance.py F32_MODEL).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DEFAULT_TEXT = ('def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n    a, b = 0, 1\n'
                '    for _ in range(n):\n        a, b = b, a + b\n    return a\n\n\nclass Stack:\n'
                '    def __init__(self):\n        self.items = []\n')


def qmtp_side(checkpoint: str, ids_path: str, out_path: str) -> None:
    import numpy as np

    import qmtp
    ids = json.loads(Path(ids_path).read_text())
    model = qmtp.load(checkpoint, dtype="float32", progress=False)
    np.savez(out_path, logits=qmtp.target_logits(model, ids))


def hf_side(args) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    os.environ.setdefault("USE_HUB_KERNELS", "0")
    import numpy as np
    import torch
    import transformers
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer, Qwen3_5ForCausalLM

    torch.set_num_threads(max(1, os.cpu_count() or 1))
    transformers.logging.set_verbosity_error()
    ckpt = args.checkpoint
    ids = Tokenizer.from_file(os.path.join(ckpt, "tokenizer.json")).encode(args.text, add_special_tokens=False).ids
    hf_tok = AutoTokenizer.from_pretrained(ckpt)
    same_ids = hf_tok(args.text, add_special_tokens=False)["input_ids"] == ids
    chat = hf_tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    chat_ok = chat == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"

    model, info = Qwen3_5ForCausalLM.from_pretrained(ckpt, dtype=torch.float32, attn_implementation="eager",
                                                     output_loading_info=True)
    bad = {k: sorted(map(str, v)) for k, v in info.items() if k != "error_msgs" and v}
    with torch.no_grad():
        hf = model(input_ids=torch.tensor([ids]), use_cache=False).logits[0].float().numpy()

    with tempfile.TemporaryDirectory() as td:
        ids_path, out_path = os.path.join(td, "ids.json"), os.path.join(td, "qmtp.npz")
        Path(ids_path).write_text(json.dumps(ids))
        env = dict(os.environ, JAX_PLATFORMS=os.environ.get("JAX_PLATFORMS", "cpu"), PYTHONPATH=str(REPO))
        subprocess.run([args.qmtp_python, __file__, "--role=qmtp", f"--checkpoint={ckpt}", f"--ids={ids_path}",
                        f"--out={out_path}"], check=True, env=env, cwd=str(REPO))
        ours = np.load(out_path)["logits"]

    rel = float(np.max(np.abs(ours.astype(np.float64) - hf)) / max(np.max(np.abs(hf)), 1e-30))
    agree = float(np.mean(ours.argmax(-1) == hf.argmax(-1)))
    report = {"checkpoint": ckpt, "tokens": len(ids), "vocab": int(hf.shape[-1]), "max_rel_err": rel,
              "max_abs_err": float(np.max(np.abs(ours - hf))), "max_abs_logit": float(np.max(np.abs(hf))),
              "argmax_agreement": agree, "finite": bool(np.all(np.isfinite(ours))), "hf_load_problems": bad,
              "autotokenizer_ids_equal": same_ids, "chat_template_chatml": chat_ok,
              "transformers": transformers.__version__, "torch": torch.__version__, "tol": args.tol}
    print(json.dumps(report, indent=2))
    ok = rel <= args.tol and report["finite"] and not bad and same_ids and chat_ok
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", required=True, help="exported checkpoint directory")
    ap.add_argument("--text", default=DEFAULT_TEXT, help="text whose teacher-forced logits are compared")
    ap.add_argument("--tol", type=float, default=1e-4, help="max relative error allowed")
    ap.add_argument("--qmtp_python", default=str(REPO / ".venv" / "bin" / "python"),
                    help="python of the qmtp (JAX) venv for the qmtp side")
    ap.add_argument("--role", choices=["hf", "qmtp"], default="hf", help=argparse.SUPPRESS)
    ap.add_argument("--ids", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.role == "qmtp":
        qmtp_side(args.checkpoint, args.ids, args.out)
        return 0
    return hf_side(args)


if __name__ == "__main__":
    sys.exit(main())

"""Offline training text and its tokenizer for `qmtp.train`.

Corpus: the `*.py` files below a comma-separated list of directories (default: the standard library),
named `<directory label>/<relative path>` and ordered by sha256(name). Held out: whole top-level
packages, those whose sha256(`<label>/<first path component>`) as a fraction in [0, 1) is below
`eval_fraction` (near-copies inside a package cannot leak across the split).

Tokenizer: byte-level BPE trained on the training files with the id layout of
`qmtp.tools.tiny_tokenizer`: [0, 256) bytes, [256, V - 3) merges, <|endoftext|>, <|im_start|>, <|im_end|>.
Token streams: each document's ids then <|endoftext|>, concatenated. The training batch of step s is
a pure function of (seed, s) (bit-exact resume); the eval batches are fixed windows.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import sysconfig

import numpy as np
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

from qmtp.tools import tiny_tokenizer

EXCLUDED_DIRS = ("site-packages", "dist-packages", "__pycache__")
TEST_DIRS = ("test", "tests", "idle_test")
DIR_KEYWORDS = {"stdlib": "stdlib", "site-packages": "purelib"}  # --corpus_dir words -> sysconfig paths


def corpus_roots(spec: str | None) -> list[tuple[str, str]]:
    """'stdlib,site-packages,/some/dir' -> [(label, directory)]; empty -> the standard library."""
    out = []
    for i, item in enumerate(x.strip() for x in (spec or "stdlib").split(",")):
        if not item:
            continue
        path = sysconfig.get_paths()[DIR_KEYWORDS[item]] if item in DIR_KEYWORDS else item
        if not os.path.isdir(path):
            raise ValueError(f"corpus directory {item!r} ({path}) does not exist")
        out.append((item if item in DIR_KEYWORDS else f"dir{i}", path))
    if not out:
        raise ValueError(f"--corpus_dir={spec!r} names no directory")
    return out


def _hash_fraction(name: str) -> float:
    """sha256 of the name as a number in [0, 1)."""
    return int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "big") / 2.0**64


@dataclasses.dataclass(frozen=True)
class Corpus:
    root: str
    train_files: tuple[str, ...]
    eval_files: tuple[str, ...]
    train_texts: tuple[str, ...]
    eval_texts: tuple[str, ...]

    def describe(self) -> dict:
        size = lambda texts: sum(len(t.encode()) for t in texts)
        return {"root": self.root, "train_files": len(self.train_files), "eval_files": len(self.eval_files),
                "train_bytes": size(self.train_texts), "eval_bytes": size(self.eval_texts)}


def _read(roots: dict[str, str], files: list[str], max_bytes: int) -> tuple[tuple[str, ...], tuple[str, ...]]:
    kept, texts, total = [], [], 0
    for rel in files:
        label, _, inner = rel.partition("/")
        path = os.path.join(roots[label], inner)
        if max_bytes and total + os.path.getsize(path) > max_bytes:
            continue  # smaller files later in the order may still fit
        try:
            with open(path, encoding="utf-8") as f:
                text = f.read()
        except (UnicodeDecodeError, OSError):
            continue
        if text.strip():
            kept.append(rel)
            texts.append(text)
            total += len(text.encode())
    return tuple(kept), tuple(texts)


def load_corpus(root: str | None = None, eval_fraction: float = 0.02, max_bytes: int = 0,
                include_tests: bool = True, suffix: str = ".py") -> Corpus:
    """The corpus (module doc) of `root` (see corpus_roots). Skipped: non-UTF-8 files, site-packages /
    dist-packages / __pycache__ below the roots, and files that would overshoot max_bytes (0: all;
    training gets (1 - eval_fraction) of it)."""
    roots, files = dict(corpus_roots(root)), []
    for label, path in roots.items():
        for dirpath, dirnames, filenames in os.walk(path):
            dirnames[:] = [d for d in dirnames if d not in EXCLUDED_DIRS and (include_tests or d not in TEST_DIRS)]
            rel_dir = os.path.relpath(dirpath, path)
            files += [os.path.normpath(os.path.join(label, rel_dir, f)) for f in filenames if f.endswith(suffix)]
    files.sort(key=lambda p: (_hash_fraction(p), p))
    held = {f for f in files if _hash_fraction("/".join(f.split("/")[:2])) < eval_fraction}
    train_files, train_texts = _read(roots, [f for f in files if f not in held], int(max_bytes * (1 - eval_fraction)))
    eval_files, eval_texts = _read(roots, [f for f in files if f in held], int(max_bytes * eval_fraction))
    root = ",".join(f"{label}={path}" for label, path in roots.items())
    if not train_texts or not eval_texts:
        raise ValueError(f"corpus {root!r}: {len(train_texts)} training and {len(eval_texts)} held-out "
                         f"{suffix} files; need at least one of each (raise --corpus_max_bytes or --eval_fraction)")
    return Corpus(root, train_files, eval_files, train_texts, eval_texts)


def first_bytes(texts, max_bytes: int) -> list[str]:
    """The leading texts whose UTF-8 sizes sum to at most max_bytes (0: all; at least one text)."""
    out, total = [], 0
    for t in texts:
        total += len(t.encode())
        if max_bytes and out and total > max_bytes:
            break
        out.append(t)
    return out


def train_tokenizer(texts, vocab_size: int) -> Tokenizer:
    """Byte-level BPE with exactly `vocab_size` ids, the special tokens last (module doc)."""
    specials = tiny_tokenizer.SPECIAL_TOKENS
    n_learned = vocab_size - len(specials)
    if n_learned <= tiny_tokenizer.BYTE_ALPHABET_SIZE:
        raise ValueError(f"vocab_size={vocab_size}: need > {tiny_tokenizer.BYTE_ALPHABET_SIZE + len(specials)}")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(tiny_tokenizer._SPLIT_PATTERN), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=n_learned, min_frequency=2, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), special_tokens=[])
    tok.train_from_iterator(list(texts), trainer=trainer)
    if tok.get_vocab_size() != n_learned:
        raise ValueError(f"vocab_size={vocab_size}: the corpus only yields {tok.get_vocab_size() + len(specials)} "
                         "tokens; use more text or a smaller vocabulary")
    tok.add_special_tokens(list(specials))
    return tok


def special_ids(tokenizer: Tokenizer) -> dict[str, int]:
    ids = {name: tokenizer.token_to_id(name) for name in tiny_tokenizer.SPECIAL_TOKENS}
    missing = [n for n, i in ids.items() if i is None]
    if missing:
        raise ValueError(f"tokenizer has no {', '.join(missing)} token")
    return ids


def encode_stream(tokenizer: Tokenizer, texts) -> np.ndarray:
    """Each document's ids then <|endoftext|>, concatenated: [N] uint16 (V <= 65536) or int32."""
    eot = special_ids(tokenizer)[tiny_tokenizer.ENDOFTEXT]
    dtype = np.uint16 if tokenizer.get_vocab_size() <= 65536 else np.int32
    encoded = tokenizer.encode_batch(list(texts), add_special_tokens=False)
    return np.concatenate([np.asarray(enc.ids + [eot], dtype) for enc in encoded])


@dataclasses.dataclass(frozen=True)
class Data:
    tokenizer: Tokenizer
    train: np.ndarray  # [N] token stream
    eval: np.ndarray  # [M]
    meta: dict


def prepare(data_dir: str, *, vocab_size: int | None, tokenizer: Tokenizer | None = None, corpus_dir: str | None = None,
            eval_fraction: float = 0.02, max_bytes: int = 0, include_tests: bool = True, tokenizer_max_bytes: int = 0,
            log=print) -> Data:
    """The run's tokenizer and token streams, built once into `data_dir` (tokenizer.json, train.npy,
    eval.npy, meta.json) and read back on later calls. `tokenizer` given: used as is; otherwise one
    of `vocab_size` ids is trained."""
    paths = {n: os.path.join(data_dir, n) for n in ("tokenizer.json", "train.npy", "eval.npy", "meta.json")}
    if all(os.path.isfile(p) for p in paths.values()):
        with open(paths["meta.json"]) as f:
            meta = json.load(f)
        return Data(Tokenizer.from_file(paths["tokenizer.json"]), np.load(paths["train.npy"]),
                    np.load(paths["eval.npy"]), meta)
    corpus = load_corpus(corpus_dir, eval_fraction, max_bytes, include_tests)
    meta = {"corpus": corpus.describe(), "eval_fraction": eval_fraction, "max_bytes": max_bytes,
            "include_tests": include_tests}
    log(f"corpus: {meta['corpus']}")
    how = "given"
    if tokenizer is None:
        sample = first_bytes(corpus.train_texts, tokenizer_max_bytes)
        tokenizer = train_tokenizer(sample, vocab_size)
        how = f"byte-level BPE trained here on {len(sample)} of {len(corpus.train_texts)} training files"
    meta["tokenizer"] = f"{how}, {tokenizer.get_vocab_size()} ids"
    train, held = encode_stream(tokenizer, corpus.train_texts), encode_stream(tokenizer, corpus.eval_texts)
    meta.update(train_tokens=int(train.size), eval_tokens=int(held.size))
    log(f"tokens: {train.size} train, {held.size} eval ({meta['tokenizer']})")
    os.makedirs(data_dir, exist_ok=True)
    tokenizer.save(paths["tokenizer.json"])
    np.save(paths["train.npy"], train)
    np.save(paths["eval.npy"], held)
    with open(paths["meta.json"], "w") as f:
        json.dump(meta, f, indent=2)
    return Data(tokenizer, train, held, meta)


def train_batch(stream: np.ndarray, step: int, seed: int, batch: int, seq_len: int) -> np.ndarray:
    """[B, T] int32 windows at starts drawn from (seed, step) alone."""
    if stream.size < seq_len + 1:
        raise ValueError(f"token stream of {stream.size} tokens is shorter than --seq_len={seq_len}")
    starts = np.random.default_rng([seed, step]).integers(0, stream.size - seq_len + 1, batch)
    return np.stack([stream[s:s + seq_len] for s in starts]).astype(np.int32)


def eval_windows(stream: np.ndarray, n: int, seq_len: int) -> np.ndarray:
    """Up to n non-overlapping windows [n', T] int32 from the start of `stream`."""
    n = min(n, stream.size // seq_len)
    if n == 0:
        raise ValueError(f"held-out stream of {stream.size} tokens is shorter than --seq_len={seq_len}")
    return stream[:n * seq_len].reshape(n, seq_len).astype(np.int32)

"""A tiny deterministic byte-level BPE tokenizer for synthetic checkpoints: a Qwen-style BPE trained on
`CORPUS` (tiny_corpus.txt beside this file). Ids: [0, 256) the byte symbols (every UTF-8 text round-trips), learned merges, then
<|endoftext|>, <|im_start|>, <|im_end|>. Qwen's stops: eos [<|im_end|>, <|endoftext|>], bos = pad = <|endoftext|>.
"""

from __future__ import annotations

import json
import pathlib

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

TINY_VOCAB_SIZE = 384
ENDOFTEXT, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = (ENDOFTEXT, IM_START, IM_END)  # appended in this order after the learned vocab
BYTE_ALPHABET_SIZE = 256

# Qwen2/Qwen3 pre-tokenizer split (contractions, letter runs, single digits, punctuation, spaces).
_SPLIT_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                  r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")

# ChatML, as Qwen's tokenizer_config.json (without tools / thinking handling).
CHAT_TEMPLATE = ("{%- for message in messages %}"
                 "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
                 "{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")

# a few KB of Python-like code and English text, read from the package so every machine trains alike
CORPUS = pathlib.Path(__file__).with_name("tiny_corpus.txt").read_text(encoding="utf-8")


def build_tokenizer(vocab_size: int = TINY_VOCAB_SIZE) -> Tokenizer:
    """Trains the byte-level BPE on `CORPUS`; exactly `vocab_size` ids, specials last (module doc)."""
    n_learned = vocab_size - len(SPECIAL_TOKENS)  # byte alphabet + merges
    if n_learned <= BYTE_ALPHABET_SIZE:
        raise ValueError(f"vocab_size={vocab_size} is too small: need > {BYTE_ALPHABET_SIZE + len(SPECIAL_TOKENS)} "
                         "(256 byte symbols + at least one merge + 3 special tokens)")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(_SPLIT_PATTERN), behavior="isolated"),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=n_learned, min_frequency=2, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), special_tokens=[])
    tok.train_from_iterator([CORPUS], trainer=trainer)
    if tok.get_vocab_size() != n_learned:
        raise ValueError(f"vocab_size={vocab_size}: the embedded corpus only yields "
                         f"{tok.get_vocab_size() + len(SPECIAL_TOKENS)} tokens; pick a smaller vocab_size")
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    return tok


def special_token_ids(vocab_size: int = TINY_VOCAB_SIZE) -> dict[str, int]:
    """Ids of the special tokens of `build_tokenizer(vocab_size)` (the last three ids)."""
    first = vocab_size - len(SPECIAL_TOKENS)
    return {name: first + i for i, name in enumerate(SPECIAL_TOKENS)}


def bos_token_id(vocab_size: int = TINY_VOCAB_SIZE) -> int:
    """bos (= config eos = pad) id, as Qwen3.5 uses <|endoftext|>."""
    return special_token_ids(vocab_size)[ENDOFTEXT]


def tokenizer_config(vocab_size: int = TINY_VOCAB_SIZE, model_max_length: int = 4096) -> dict:
    """Minimal Qwen-style tokenizer_config.json: ChatML template, eos <|im_end|>, pad <|endoftext|>."""
    added = {str(i): {"content": name, "lstrip": False, "normalized": False, "rstrip": False,
                      "single_word": False, "special": True}
             for name, i in special_token_ids(vocab_size).items()}
    return {"add_bos_token": False, "add_prefix_space": False, "added_tokens_decoder": added, "bos_token": None,
            "chat_template": CHAT_TEMPLATE, "clean_up_tokenization_spaces": False, "eos_token": IM_END,
            "errors": "replace", "model_max_length": model_max_length, "pad_token": ENDOFTEXT,
            "split_special_tokens": False, "tokenizer_class": "Qwen2Tokenizer", "unk_token": None}


def tokenizer_json(vocab_size: int = TINY_VOCAB_SIZE) -> str:
    """The `tokenizer.json` text (pretty-printed, deterministic)."""
    return json.dumps(json.loads(build_tokenizer(vocab_size).to_str()), indent=2, ensure_ascii=False) + "\n"

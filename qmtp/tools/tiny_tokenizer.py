"""A tiny deterministic byte-level BPE tokenizer for synthetic checkpoints: a Qwen-style BPE trained on the
embedded `CORPUS`. Ids: [0, 256) the byte symbols (every UTF-8 text round-trips), learned merges, then
<|endoftext|>, <|im_start|>, <|im_end|>. Qwen's stops: eos [<|im_end|>, <|endoftext|>], bos = pad = <|endoftext|>.
"""

from __future__ import annotations

import json

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

CORPUS = '''\
def fibonacci(n):
    """Return the first n Fibonacci numbers as a list."""
    result = []
    a, b = 0, 1
    for _ in range(n):
        result.append(a)
        a, b = b, a + b
    return result


def is_prime(number):
    """Return True if the number is prime."""
    if number < 2:
        return False
    for divisor in range(2, int(number ** 0.5) + 1):
        if number % divisor == 0:
            return False
    return True


class Counter:
    """Counts how often each item has been seen."""

    def __init__(self):
        self.counts = {}

    def add(self, item):
        self.counts[item] = self.counts.get(item, 0) + 1

    def most_common(self, k=3):
        items = sorted(self.counts.items(), key=lambda pair: pair[1], reverse=True)
        return items[:k]


def read_lines(path):
    with open(path) as handle:
        return [line.rstrip("\\n") for line in handle]


def merge_sorted(left, right):
    """Merge two sorted lists into one sorted list."""
    i, j, out = 0, 0, []
    while i < len(left) and j < len(right):
        if left[i] <= right[j]:
            out.append(left[i])
            i += 1
        else:
            out.append(right[j])
            j += 1
    out.extend(left[i:])
    out.extend(right[j:])
    return out


def binary_search(values, target):
    low, high = 0, len(values) - 1
    while low <= high:
        middle = (low + high) // 2
        if values[middle] == target:
            return middle
        if values[middle] < target:
            low = middle + 1
        else:
            high = middle - 1
    return -1


class Stack:
    def __init__(self):
        self.items = []

    def push(self, item):
        self.items.append(item)

    def pop(self):
        if not self.items:
            raise IndexError("pop from an empty stack")
        return self.items.pop()

    def __len__(self):
        return len(self.items)


for index, value in enumerate(fibonacci(10)):
    print(f"{index}: {value}")

config = {"hidden_size": 160, "num_layers": 4, "vocab_size": 384, "dtype": "bfloat16"}
total = sum(x * x for x in range(100) if x % 3 == 0)
names = [name.upper() for name in ["alpha", "beta", "gamma", "delta"]]

The quick brown fox jumps over the lazy dog. A small model reads the text one token at a time
and predicts the next token. When the model is right, the draft is accepted and the decoder moves
ahead by more than one token in a single step. When the model is wrong, the draft is rejected and
the target model's own choice is kept, so the output is the same as plain greedy decoding.

Once upon a time there was a little robot who lived in a quiet town by the sea. Every morning the
robot walked to the harbour, counted the boats, and wrote the number in a notebook. One day the
number was different, and the robot wondered where the missing boat had gone. It asked the old
fisherman, the baker, and the children playing on the beach. Nobody knew the answer, so the robot
waited on the pier until the evening, when the boat finally came home with a net full of fish.

Question: What is the capital of France?
Answer: The capital of France is Paris.
Question: How many days are there in a week?
Answer: There are seven days in a week.
Question: What is two plus two?
Answer: Two plus two is four.

To install the package, create a virtual environment, activate it, and run the tests. If a test
fails, read the error message carefully: it names the file, the line, and the value that was
wrong. Small functions with clear names are easier to test than long ones, and a test that can
never fail is not a test at all. Write down what you measured, on which machine, and when.

import numpy as np

def softmax(logits, axis=-1):
    shifted = logits - np.max(logits, axis=axis, keepdims=True)
    weights = np.exp(shifted)
    return weights / np.sum(weights, axis=axis, keepdims=True)

def rms_norm(x, weight, eps=1e-6):
    variance = np.mean(x * x, axis=-1, keepdims=True)
    return x / np.sqrt(variance + eps) * (1.0 + weight)

def attention(query, key, value, mask=None):
    scores = query @ key.T / np.sqrt(query.shape[-1])
    if mask is not None:
        scores = np.where(mask, scores, -np.inf)
    return softmax(scores) @ value

The weather today is sunny with a light breeze from the west. Tomorrow there will be clouds in the
morning and rain in the afternoon, so take an umbrella if you are going out. The temperature will
stay between twelve and eighteen degrees for the rest of the week.
'''


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

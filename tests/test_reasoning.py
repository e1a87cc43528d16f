"""qmtp/serve/reasoning.py: a chat reply's `<think>` reasoning split from its content, whole and
streamed (every split of the text into two chunks, and one character at a time, gives the one-shot
split), the prompt deciding where the reply starts, and the auto choice of the parser."""

from __future__ import annotations

import pytest
from tokenizers import AddedToken, Tokenizer, models

from qmtp.serve import reasoning
from qmtp.serve.reasoning import ReasoningSplitter, Split

CALL = "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call>"

# (text, the prompt ended inside <think>, reasoning, content)
CASES = [
    # Qwen3.5 thinking: the prompt holds <think>\n, the reply only </think>
    ("Two and two.\n</think>\n\nIt is 4.", True, "Two and two.\n", "\n\nIt is 4."),
    ("Still thinking about", True, "Still thinking about", ""),  # cut by max_tokens: all reasoning
    ("It is 4.", False, "", "It is 4."),  # enable_thinking=false (the prompt closed the block)
    ("It is </think> 4.", False, "", "It is </think> 4."),  # a closed prompt keeps a stray tag as content
    ("<think>\nhmm\n</think>\n\nHi", False, "\nhmm\n", "\n\nHi"),  # Qwen3's first templates: the model opens
    ("\n\n<think>a</think>b", False, "a", "b"),  # blank space before the opening tag
    ("<think>a</think>b", True, "a", "b"),  # a repeated opening tag is dropped
    ("<thinking>is fun", False, "", "<thinking>is fun"),  # not the tag
    ("\n\nHi", False, "", "\n\nHi"),
    ("\n\n", True, "\n\n", ""),
    ("", True, "", ""),
    ("", False, "", ""),
    ("a</think>b</think>c", True, "a", "b</think>c"),  # only the first closes
    ("x</think", True, "x</think", ""),  # a piece of the tag at the end stays reasoning
    # a tool call ends the reasoning without </think>; a mere mention of <tool_call> does not
    ("I will look it up.\n" + CALL, True, "I will look it up.\n", CALL),
    ("Use <tool_call> tags.\n</think>\n\n" + CALL, True, "Use <tool_call> tags.\n", "\n\n" + CALL),
    ("<tool_call>\n\n  <function=f>", True, "", "<tool_call>\n\n  <function=f>"),
    ("<tool_call>\nnot a call</think>ok", True, "<tool_call>\nnot a call", "ok"),
    ("Answer.\n" + CALL, False, "", "Answer.\n" + CALL),  # in the content: for the tool-call parser
]


@pytest.mark.parametrize("text,in_reasoning,want_reasoning,want_content", CASES)
def test_split(text, in_reasoning, want_reasoning, want_content):
    assert reasoning.split(text, in_reasoning) == Split(want_reasoning, want_content)


def _streamed(chunks: list[str], in_reasoning: bool) -> Split:
    splitter, out = ReasoningSplitter(in_reasoning), Split()
    for chunk in chunks:
        out += splitter.push(chunk)
    out += splitter.finish()
    return out


@pytest.mark.parametrize("text,in_reasoning,want_reasoning,want_content", CASES)
def test_every_two_chunk_stream_and_one_character_at_a_time_equal_the_whole(text, in_reasoning, want_reasoning,
                                                                             want_content):
    want = Split(want_reasoning, want_content)
    for k in range(len(text) + 1):
        assert _streamed([text[:k], text[k:]], in_reasoning) == want, k
    assert _streamed(list(text), in_reasoning) == want


def test_a_tag_split_across_chunks_is_held_until_it_resolves():
    splitter = ReasoningSplitter(in_reasoning=True)
    assert splitter.push("Two and two</thi") == Split("Two and two", "")
    assert splitter.push("nk>\n\nIt") == Split("", "\n\nIt")
    assert splitter.push(" is 4.") == Split("", " is 4.")
    assert splitter.finish() == Split()
    splitter = ReasoningSplitter(in_reasoning=True)
    assert splitter.push("a </th") == Split("a ", "")
    assert splitter.push("ey said") == Split("</they said", "")  # not the tag after all: still reasoning
    splitter = ReasoningSplitter(in_reasoning=True)
    assert splitter.push("look up\n<tool_call>\n") == Split("look up\n", "")  # may be a call: held
    assert splitter.push("<function=f>") == Split("", "<tool_call>\n<function=f>")
    splitter = ReasoningSplitter(in_reasoning=False)
    assert splitter.push("\n<thi") == Split()  # the reply may still open with <think>
    assert splitter.push("s is it") == Split("", "\n<this is it")


def test_the_prompt_decides_where_the_reply_starts():
    thinking = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>\n"
    assert reasoning.opens_reasoning(thinking)
    assert not reasoning.opens_reasoning(thinking + "\n</think>\n\n")  # enable_thinking=false
    assert not reasoning.opens_reasoning("<|im_start|>user\nwhat does <think> mean?<|im_end|>\n<|im_start|>assistant\n")
    assert not reasoning.opens_reasoning("")


def _tokenizer(added: list[AddedToken]) -> Tokenizer:
    tok = Tokenizer(models.WordLevel({"[UNK]": 0, "a": 1}, unk_token="[UNK]"))
    tok.add_tokens(added)
    return tok


def test_auto_is_qwen3_where_the_tokenizer_has_the_tags_as_kept_tokens():
    tags = [AddedToken("<think>", special=False), AddedToken("</think>", special=False)]
    assert reasoning.resolve("auto", _tokenizer(tags))[0] == "qwen3"
    name, why = reasoning.resolve("auto", _tokenizer(tags[:1]))
    assert name == "none" and "no <think> and </think> tokens" in why
    name, why = reasoning.resolve("auto", _tokenizer([AddedToken("<think>", special=True), tags[1]]))
    assert name == "none" and "special" in why  # decoding would drop them: nothing to split
    assert reasoning.resolve("auto", None)[0] == "none"
    assert reasoning.resolve("qwen3", None) == ("qwen3", "--reasoning_parser")
    assert reasoning.resolve("none", _tokenizer(tags)) == ("none", "--reasoning_parser")

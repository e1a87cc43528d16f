"""Token logprobs (api.TokenLogprob) in the two shapes of the OpenAI API.

/v1/completions (legacy): one object per choice (or per stream chunk) of parallel lists,
    {"tokens": [str], "token_logprobs": [float], "top_logprobs": [{str: float}], "text_offset": [int]}
where each top_logprobs dict holds the asked alternatives and the chosen token (so up to N + 1 keys;
alternatives whose text is the same collapse into one key), and text_offset is each token's character
offset: the length of the texts of the choice's tokens before it.
/v1/chat/completions: {"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob",
"bytes"}]}], "refusal": null}, bytes being the UTF-8 of the token's text.

A token's text is the tokenizer's decoding of that id alone (a piece of a multi-byte character decodes
to U+FFFD, as in other engines); without a tokenizer it is "token_id:<id>".
"""

from __future__ import annotations


def token_text(tokenizer, token: int) -> str:
    if tokenizer is None:
        return f"token_id:{token}"
    return tokenizer.decode([token], skip_special_tokens=False)


def completion(tokenizer, logprobs: list, text_offset: int = 0) -> dict:
    """The completions object for these tokens; text_offset: characters of the choice's tokens before them."""
    texts = [token_text(tokenizer, t.token) for t in logprobs]
    offsets, at = [], text_offset
    for text in texts:
        offsets.append(at)
        at += len(text)
    tops = [{**{token_text(tokenizer, i): v for i, v in t.top}, text: t.logprob} for t, text in zip(logprobs, texts)]
    return {"tokens": texts, "token_logprobs": [t.logprob for t in logprobs], "top_logprobs": tops,
            "text_offset": offsets}


def prompt(tokenizer, prompt_ids: list[int], scored: list) -> dict:
    """The completions object of a prompt's tokens (echo): the first's logprob and alternatives null (it has
    none), then each scored one's (qmtp.score: tokens 1 .. T-1)."""
    first = token_text(tokenizer, prompt_ids[0])
    rest = completion(tokenizer, scored, len(first))
    return {"tokens": [first] + rest["tokens"], "token_logprobs": [None] + rest["token_logprobs"],
            "top_logprobs": [None] + rest["top_logprobs"], "text_offset": [0] + rest["text_offset"]}


def vllm_prompt(tokenizer, scored: list, n: int) -> list:
    """vLLM's prompt_logprobs of a prompt scored by qmtp.score: null for its first token, then per token
    {"<id>": {"logprob", "rank", "decoded_token"}} for it (its rank among all ids, 1 = the most likely)
    and its n most likely alternatives (ranks 1 .. n)."""
    def entry(logprob: float, rank: int | None, token: int) -> dict:
        return {"logprob": logprob, "rank": rank, "decoded_token": token_text(tokenizer, token)}

    return [None] + [{**{str(i): entry(v, r + 1, i) for r, (i, v) in enumerate(t.top[:n])},
                      str(t.token): entry(t.logprob, t.rank, t.token)} for t in scored]


def joined(head: dict, tail: dict) -> dict:
    """Two completions objects of consecutive tokens as one."""
    return {key: head[key] + tail[key] for key in head}


def text_length(obj: dict) -> int:
    """Characters of a completions object's token texts (where the next token's text_offset starts)."""
    return sum(map(len, obj["tokens"]))


def chat(tokenizer, logprobs: list) -> dict:
    """The chat object for these tokens."""
    def entry(token: int, logprob: float) -> dict:
        text = token_text(tokenizer, token)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    return {"content": [{**entry(t.token, t.logprob), "top_logprobs": [entry(i, v) for i, v in t.top]}
                        for t in logprobs], "refusal": None}

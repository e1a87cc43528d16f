"""The HTTP reply of one OpenAI request (qmtp/serve/server.py): its n choices of each prompt submitted to
the engine as requests, their events gathered into one JSON body or streamed as server-sent events.

A non-streamed request polls its client every DISCONNECT_POLL_S and cancels its choices when the client
has gone (status 499); a choice that ends otherwise than by stop or length turns the reply into the
engine's error (503 when aborted at shutdown, 500 when the engine failed). A chat choice's text becomes
its message or deltas through chat_output (reasoning and tool calls split out where the server parses
them).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import time

from fastapi.responses import JSONResponse

from qmtp.serve import chat_output, openai_logprobs, protocol as oai

DISCONNECT_POLL_S = 0.25  # how often a waiting non-streamed request checks that its client is still there


def submit(engine, parsed: oai.Parsed, prompt_ids: list, max_tokens: list, stop_ids, loop,
           events: asyncio.Queue) -> list:
    """The request's n choices of each prompt (ids prompt_ids[p], max_tokens[p] tokens) as engine requests,
    choice j of prompt p at index p n + j (a seeded one draws with seed + j), their events going to
    `events` as (index, event); admitted together (Engine.together); all or none: a refused one cancels
    those before it."""
    handles = []
    with engine.together():
        try:
            for ids, budget in zip(prompt_ids, max_tokens):
                for j in range(parsed.n):
                    sampling = dict(parsed.sampling)
                    if sampling["seed"] is not None:
                        sampling["seed"] = (sampling["seed"] + j) % 2 ** 32
                    handles.append(engine.submit(ids, budget, stop_ids, parsed.stop,
                                                 listener=to_loop(loop, events, len(handles)),
                                                 logprobs=parsed.top_logprobs, **sampling, **parsed.text))
        except BaseException:
            for handle in handles:
                handle.cancel()
            raise
    return handles


def to_loop(loop: asyncio.AbstractEventLoop, events: asyncio.Queue, index: int):
    """An engine listener (called on the engine thread) that hands each event of choice `index` to the
    request's queue."""
    def listener(event) -> None:
        with contextlib.suppress(RuntimeError):  # the event loop is closed (server gone): nobody listens
            loop.call_soon_threadsafe(events.put_nowait, (index, event))
    return listener


@dataclasses.dataclass
class Echo:
    """A prompt as an echoing completion begins its choices with it: its text, and its tokens' logprobs
    object (openai_logprobs.prompt; None: not asked)."""

    text: str
    logprobs: dict | None


@dataclasses.dataclass
class Reply:
    """What the response of one HTTP request is built from: its choices' engine requests."""

    rid: str
    chat: bool
    model_name: str
    created: int
    tokenizer: object
    handles: list
    parsing: chat_output.ChatParsing | None = None  # chat: what each choice's text is parsed for (None: nothing)
    n: int = 1  # choices per prompt: handles[p n .. p n + n - 1] are prompt p's
    echoes: list[Echo] | None = None  # completions' echo: each prompt's
    echo_only: bool = False  # echo with max_tokens 0: the choices are their prompts alone
    prompt_logprobs: list | None = None  # each prompt's vLLM prompt_logprobs (openai_logprobs.vllm_prompt)

    @property
    def obj(self) -> str:
        return "chat.completion" if self.chat else "text_completion"

    def usage(self, generated: int | None = None) -> dict:
        """Each prompt once (its choices share it), the tokens of every choice (generated: so many instead)."""
        firsts = self.handles[::self.n]
        if generated is None:
            generated = sum(len(h.tokens) for h in self.handles)
        return oai.usage(sum(len(h.prompt_ids) for h in firsts), 0 if self.echo_only else generated,
                         sum(h.prefix_hit_tokens for h in firsts))

    def echo(self, index: int) -> Echo | None:
        """Choice `index`'s prompt, where the request echoes it."""
        return None if self.echoes is None else self.echoes[index // self.n]

    def completion_part(self, text: str, token_logprobs, text_offset: int = 0):
        """(text, logprobs object) of a choice's generated tokens: none of them for an echo alone."""
        if self.echo_only:
            return "", None
        return text, self.logprobs(token_logprobs, text_offset)

    def logprobs(self, token_logprobs, text_offset: int = 0) -> dict | None:
        if token_logprobs is None:
            return None
        if self.chat:
            return openai_logprobs.chat(self.tokenizer, token_logprobs)
        return openai_logprobs.completion(self.tokenizer, token_logprobs, text_offset)

    def failed(self):
        """The first choice that ended otherwise than by stop or length, or None."""
        return next((h for h in self.handles if h.finish_reason not in ("stop", "length")), None)

    def cancel(self) -> None:
        for handle in self.handles:
            if not handle.finished:
                handle.cancel()


def _engine_error(handle) -> tuple[int, dict]:
    if handle.finish_reason == "abort":
        return 503, oai.error_body(handle.error or "the server is shutting down", "service_unavailable", None,
                                   "shutting_down")
    return 500, oai.error_body(handle.error or "the engine failed", "server_error", None, "engine_failed")


async def complete(request, reply: Reply, events):
    """Waits for every choice to finish; a client that goes away cancels them."""
    try:
        next_check, unfinished = time.monotonic() + DISCONNECT_POLL_S, len(reply.handles)
        while unfinished:
            with contextlib.suppress(TimeoutError):
                _, event = await asyncio.wait_for(events.get(), timeout=DISCONNECT_POLL_S)
                unfinished -= event.finish_reason is not None
            if time.monotonic() >= next_check:  # tokens may arrive more often than the poll period
                next_check = time.monotonic() + DISCONNECT_POLL_S
                if await request.is_disconnected():
                    reply.cancel()
                    return JSONResponse(oai.error_body("client disconnected", "invalid_request_error"), 499)
    finally:
        reply.cancel()
    failed = reply.failed()
    if failed is not None:
        status, body = _engine_error(failed)
        return JSONResponse(body, status_code=status)
    choices = []
    for i, h in enumerate(reply.handles):
        if reply.chat:
            message, reason = (reply.parsing or chat_output.ChatParsing()).message(h.text, h.finish_reason)
            choices.append(oai.choice(i, {"message": message}, list(h.tokens), reason, reply.logprobs(h.logprobs)))
            continue
        extra = {} if reply.prompt_logprobs is None else {"prompt_logprobs": reply.prompt_logprobs[i // reply.n]}
        echo = reply.echo(i)
        head = echo.logprobs if echo is not None else None
        text, logprobs = reply.completion_part(h.text, h.logprobs, openai_logprobs.text_length(head) if head else 0)
        if echo is not None:
            text = echo.text + text
            logprobs = head if logprobs is None else openai_logprobs.joined(head, logprobs)
        tokens, reason = ([], "length") if reply.echo_only else (list(h.tokens), h.finish_reason)
        choices.append(oai.choice(i, {"text": text, **extra}, tokens, reason, logprobs))
    body = oai.body(reply.rid, reply.obj, reply.model_name, reply.created, choices, reply.usage())
    if reply.chat and reply.prompt_logprobs is not None:  # vLLM's place for a chat request's
        body["prompt_logprobs"] = reply.prompt_logprobs[0]
    return JSONResponse(body)


async def stream(reply: Reply, events, include_usage: bool, continuous_usage: bool = False):
    """Server-sent events: one chunk per engine event (of choice i: "index": i), then usage (if asked)
    and [DONE] once every choice finished; a choice that fails ends the stream with its error. Leaving
    early (the client disconnected: Starlette cancels this generator) cancels the request.
    continuous_usage (vLLM's continuous_usage_stats): every chunk also carries the usage so far."""
    obj = "chat.completion.chunk" if reply.chat else "text_completion"
    sent = [0]  # tokens the chunks so far carried

    def sse(choices: list, usage=None) -> str:
        if usage is None and continuous_usage:
            usage = reply.usage(sent[0])
        return f"data: {json.dumps(oai.body(reply.rid, obj, reply.model_name, reply.created, choices, usage))}\n\n"

    offsets = [0] * len(reply.handles)  # characters of each choice's token texts so far (text_offset)
    parsing = reply.parsing if reply.chat and reply.parsing is not None and reply.parsing.active else None
    parsers = [parsing.stream() for _ in reply.handles] if parsing else []  # each choice's
    try:
        for i in range(len(reply.handles) if reply.chat else 0):
            yield sse([oai.choice(i, {"delta": {"role": "assistant", "content": ""}}, [], None)])
        for i in range(len(reply.handles) if reply.echoes is not None else 0):  # the prompts first
            echo = reply.echo(i)
            if echo.logprobs is not None:
                offsets[i] = openai_logprobs.text_length(echo.logprobs)
            yield sse([oai.choice(i, {"text": echo.text}, [], None, echo.logprobs)])
        unfinished = len(reply.handles)
        while unfinished:
            i, event = await events.get()
            reason = event.finish_reason
            if reason in (None, "stop", "length") and (event.text or event.tokens or reason):
                shown = reason  # the finish reason sent: "tool_calls" where the choice made calls
                if parsers:
                    delta = parsers[i].push(event.text)
                    if reason:
                        delta = chat_output.merge(delta, parsers[i].finish())
                        shown = parsers[i].finish_reason(reason)
                    delta = delta or ({} if reason else {"content": ""})
                else:
                    delta = {"content": event.text} if event.text or not reason else {}
                text, logprobs = reply.completion_part(event.text, event.logprobs, offsets[i])
                if logprobs is not None and not reply.chat:
                    offsets[i] += openai_logprobs.text_length(logprobs)
                tokens = event.tokens
                sent[0] += len(tokens)
                if reply.echo_only:
                    tokens, shown = [], reason and "length"
                yield sse([oai.choice(i, {"delta": delta} if reply.chat else {"text": text}, tokens, shown, logprobs)])
            if reason is None:
                continue
            if reason not in ("stop", "length"):
                yield f"data: {json.dumps(_engine_error(reply.handles[i])[1])}\n\n"
                break
            unfinished -= 1
        else:
            if include_usage:
                yield sse([], reply.usage())
        yield "data: [DONE]\n\n"
    finally:
        reply.cancel()

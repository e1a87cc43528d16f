"""The OpenAI API subset the server speaks: request validation, error bodies, response and chunk shapes.

Requests (JSON bodies; unknown fields are ignored):
  /v1/completions       model, prompt (a string, token ids, or a one-element list of either),
                        max_tokens, stop, stop_token_ids (extension), stream, stream_options
  /v1/chat/completions  model, messages [{role, content: string | [{type: "text", text}]}],
                        max_completion_tokens | max_tokens, stop, stop_token_ids, stream, stream_options
Only greedy decoding exists, so temperature must be absent or 0, n / best_of absent or 1, and
sampling-only or unsupported options (logprobs, echo, suffix, logit_bias, penalties, tools) are refused.

Errors are {"error": {"message", "type", "param", "code"}} with these statuses:
  400 invalid_request_error   malformed JSON, wrong field types, n > 1, temperature > 0, max_tokens
                              beyond --max_tokens_limit (code max_tokens_exceeded), prompt beyond the
                              context (code context_length_exceeded), unsupported options
  404 invalid_request_error   unknown model (code model_not_found); unknown route
  429 rate_limit_error        the request queue is full (code queue_full)
  503 service_unavailable     shutting down (code shutting_down); a non-streamed request aborted by shutdown
  500 server_error            the engine failed (code engine_failed)
A streamed request that is aborted or fails after its 200 header ends with one event
`data: {"error": {...}}` (the openai client raises APIError on it) and `data: [DONE]`.

Responses carry the generated token ids in each choice as `token_ids` (an extension).
"""

from __future__ import annotations

import dataclasses
import time
import uuid
from typing import Any

import pydantic

MAX_STOP_STRINGS = 4  # as the OpenAI API


class APIError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code

    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type_: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


class _Common(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="ignore")

    model: str
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int | None = None
    stream: bool = False
    stream_options: dict | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    logprobs: Any = None
    logit_bias: dict | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    seed: int | None = None
    user: str | None = None


class CompletionRequest(_Common):
    prompt: str | list[int] | list[str] | list[list[int]]
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None


class _TextPart(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="ignore")
    type: str
    text: str = ""


class ChatMessage(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="ignore")
    role: str
    content: str | list[_TextPart] | None = None


class ChatRequest(_Common):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    tools: list | None = None
    top_logprobs: int | None = None


@dataclasses.dataclass(frozen=True)
class Limits:
    """What the server checks before the engine sees a request."""

    model_name: str
    max_tokens_limit: int  # --max_tokens_limit
    default_max_tokens: int  # --default_max_tokens (clipped to the context left by the prompt)
    max_model_len: int


@dataclasses.dataclass
class Parsed:
    prompt: str | list[int]  # text (tokenized by the server) or token ids
    max_tokens: int | None
    stop: tuple[str, ...]
    stop_token_ids: tuple[int, ...]
    stream: bool
    include_usage: bool


def _validate(model_cls, body) -> Any:
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object", code="invalid_json")
    try:
        return model_cls.model_validate(body)
    except pydantic.ValidationError as e:
        err = e.errors()[0]
        param = ".".join(str(x) for x in err["loc"]) or None
        raise APIError(400, f"{param}: {err['msg']}" if param else err["msg"], param=param.split(".")[0] if param
                       else None, code="invalid_type" if err["type"] != "missing" else "missing_required_parameter")


def _check_common(req: _Common, limits: Limits, max_tokens: int | None) -> None:
    if req.model != limits.model_name:
        raise APIError(404, f"the model {req.model!r} does not exist; this server serves {limits.model_name!r}",
                       param="model", code="model_not_found")
    if req.n is not None and req.n != 1:
        raise APIError(400, f"n={req.n}: only n = 1 is supported (greedy decoding gives one answer)", param="n",
                       code="unsupported_value")
    if req.temperature is not None and req.temperature != 0:
        raise APIError(400, f"temperature={req.temperature}: only greedy decoding (temperature 0) is supported",
                       param="temperature", code="unsupported_value")
    for name in ("presence_penalty", "frequency_penalty"):
        if getattr(req, name):
            raise APIError(400, f"{name} is not supported (greedy decoding only)", param=name,
                           code="unsupported_value")
    if req.logit_bias:
        raise APIError(400, "logit_bias is not supported", param="logit_bias", code="unsupported_value")
    if req.logprobs not in (None, False):
        raise APIError(400, "logprobs are not supported", param="logprobs", code="unsupported_value")
    if max_tokens is not None:
        if max_tokens < 1:
            raise APIError(400, f"max_tokens={max_tokens} must be >= 1", param="max_tokens", code="invalid_value")
        if max_tokens > limits.max_tokens_limit:
            raise APIError(400, f"max_tokens={max_tokens} exceeds the server limit of {limits.max_tokens_limit} "
                           "(--max_tokens_limit)", param="max_tokens", code="max_tokens_exceeded")
    stops = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    if len(stops) > MAX_STOP_STRINGS or any(not s for s in stops):
        raise APIError(400, f"stop: at most {MAX_STOP_STRINGS} non-empty strings", param="stop",
                       code="invalid_value")


def _finish(req: _Common, prompt, max_tokens: int | None) -> Parsed:
    stops = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    include_usage = bool((req.stream_options or {}).get("include_usage"))
    return Parsed(prompt, max_tokens, tuple(stops), tuple(req.stop_token_ids or ()), req.stream, include_usage)


def parse_completion(body, limits: Limits) -> Parsed:
    req = _validate(CompletionRequest, body)
    _check_common(req, limits, req.max_tokens)
    if req.echo:
        raise APIError(400, "echo is not supported", param="echo", code="unsupported_value")
    if req.best_of not in (None, 1):
        raise APIError(400, f"best_of={req.best_of}: only 1 is supported", param="best_of", code="unsupported_value")
    if req.suffix:
        raise APIError(400, "suffix is not supported", param="suffix", code="unsupported_value")
    prompt = req.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        if len(prompt) != 1:
            raise APIError(400, f"{len(prompt)} prompts given: send one prompt per request", param="prompt",
                           code="unsupported_value")
        prompt = prompt[0]
    if not prompt:
        raise APIError(400, "the prompt is empty", param="prompt", code="invalid_value")
    return _finish(req, prompt, req.max_tokens)


def parse_chat(body, limits: Limits) -> tuple[Parsed, list[dict]]:
    """The parsed request (prompt still None) and the messages as plain dicts for the template."""
    req = _validate(ChatRequest, body)
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    _check_common(req, limits, max_tokens)
    if req.tools:
        raise APIError(400, "tools are not supported", param="tools", code="unsupported_value")
    if not req.messages:
        raise APIError(400, "messages is empty", param="messages", code="invalid_value")
    messages = []
    for m in req.messages:
        content = m.content if isinstance(m.content, str) or m.content is None else "".join(
            p.text for p in m.content if p.type == "text")
        messages.append({"role": m.role, "content": content or ""})
    return _finish(req, None, max_tokens), messages


# ---- responses -------------------------------------------------------------------------------------
def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def completion_response(rid: str, model: str, text: str, token_ids: list[int], finish_reason: str,
                        prompt_tokens: int) -> dict:
    return {"id": rid, "object": "text_completion", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason,
                         "token_ids": token_ids}],
            "usage": usage(prompt_tokens, len(token_ids))}


def chat_response(rid: str, model: str, text: str, token_ids: list[int], finish_reason: str,
                  prompt_tokens: int) -> dict:
    return {"id": rid, "object": "chat.completion", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                         "finish_reason": finish_reason, "token_ids": token_ids}],
            "usage": usage(prompt_tokens, len(token_ids))}


def completion_chunk(rid: str, model: str, created: int, text: str, token_ids: list[int],
                     finish_reason: str | None) -> dict:
    return {"id": rid, "object": "text_completion", "created": created, "model": model,
            "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason,
                         "token_ids": token_ids}]}


def chat_chunk(rid: str, model: str, created: int, delta: dict, token_ids: list[int],
               finish_reason: str | None) -> dict:
    return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
            "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason,
                         "token_ids": token_ids}]}


def usage_chunk(rid: str, model: str, created: int, obj: str, prompt_tokens: int, completion_tokens: int) -> dict:
    return {"id": rid, "object": obj, "created": created, "model": model, "choices": [],
            "usage": usage(prompt_tokens, completion_tokens)}

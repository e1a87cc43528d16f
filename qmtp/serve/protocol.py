"""The OpenAI API subset the server speaks: request validation, error bodies, response and chunk shapes.

Requests (JSON bodies; unknown fields are ignored):
  /v1/completions       model, prompt (a string, token ids, or a list of either: several prompts),
                        max_tokens, stop, stop_token_ids (extension), stream, stream_options (include_usage;
                        continuous_usage_stats as vLLM's: with it every chunk carries the usage so far),
                        logprobs (0-20: each token's logprob and that many alternatives)
  /v1/chat/completions  model, messages [{role, content: string | [{type: "text", text}]}],
                        max_completion_tokens | max_tokens, stop, stop_token_ids, stream, stream_options,
                        logprobs (true/false), top_logprobs (0-20, with logprobs true),
                        chat_template_kwargs (extension, as vLLM's: the chat template's own variables,
                        e.g. {"enable_thinking": false} for Qwen3's), add_generation_prompt and
                        continue_final_message (vLLM's: the reply continues the final message, e.g. an
                        assistant turn begun by the client),
                        tools [{type: "function", function: {name, description, parameters}}] (given
                        to the template as its `tools`; function.strict is accepted, not enforced),
                        tool_choice ("auto", the default, "none", "required" or {type: "function",
                        function: {name}}), parallel_tool_calls (false: the first call only);
                        messages may also be {role: "tool", tool_call_id, content} and
                        assistant messages with tool_calls [{id, type, function: {name, arguments: a
                        JSON string}}] (the template gets arguments as an object, as vLLM gives them)
                        and reasoning_content (or vLLM's `reasoning`)
Chat replies (qmtp/serve/chat_output.py): with --reasoning_parser qwen3, `<think>` ... `</think>` goes
to message.reasoning_content (delta.reasoning_content when streaming); with tools, tool_choice other
than "none" and a --tool_call_parser, the model's calls go to message.tool_calls (streamed whole, one
delta entry each) and finish_reason is "tool_calls". tool_choice "required" or a named function opens
the reply with a call (chat_output.py: the prompt ends with the call's opening, and the function's name
where one is named; the model writes the rest, so a call that does not parse comes back as content).
Tools without a tool-call parser are refused unless tool_choice is "none" (then the template still shows
them and the text is returned as generated).
Sampling: temperature (0: greedy), top_p, top_k and min_p (extensions, as vLLM's), seed,
presence_penalty and frequency_penalty (-2 .. 2, on the tokens the choice generated), repetition_penalty
(vLLM's: > 0, 1 = off, on the tokens of the prompt and of the choice) and logit_bias ({token id: -100 ..
100}, at most 300 ids; greedy takes the adjusted argmax), allowed_token_ids (vLLM's: the only ids the choice
may produce, at most 300); one of the first four or repetition_penalty left
out takes the server's default (qmtp/serve/sampling_defaults.py: the checkpoint's
generation_config.json, else greedy and no cut); out-of-range values get a 400 naming them (the engine
checks them). n (>= 1, at most --max_queue): n choices of each prompt, each a request of the engine
(seeded: choice i of a prompt draws with seed + i), admitted together, so one batched prefill pass
computes them; with several prompts (completions) the choices of prompt p are indexes p n .. p n + n - 1
(as OpenAI's), at most --max_queue in all.
ignore_eos (vLLM's): the default stop ids (the checkpoint's end-of-sequence ids) do not end the choice;
its own stop_token_ids and stop strings still do. min_tokens (vLLM's, <= max_tokens): no stop id or stop
string ends the choice before that many tokens (the stop ids get -inf until then).
include_stop_str_in_output (vLLM's): the text goes on through the stop string that ends it;
skip_special_tokens (vLLM's, default true): false keeps special tokens in the text.
truncate_prompt_tokens (vLLM's): the prompt's last k tokens only (-1: as many as --max_model_len leaves
beside max_tokens, or beside one token).
echo (completions): each choice's text begins with its prompt's, and its logprobs (where asked) with the
prompt's tokens', the first with null values (qmtp.score's, computed on the engine's thread: the first
prompt of a bucket compiles its program); max_tokens 0 with echo returns the prompt alone (as vLLM:
loglikelihood evaluations). prompt_logprobs N (vLLM's, 0-20, not streamed): each prompt token's
{id: {logprob, rank, decoded_token}} with N alternatives (the first token: null), in each completions
choice, at the chat response's top level.
best_of absent or 1; suffix and a response_format other than text are refused. An option the server
cannot honour is refused rather than ignored: the client would believe it applied.
Logprobs (qmtp/serve/openai_logprobs.py) are the target's log_softmax at the request's temperature (1
when greedy), before top_k / top_p / min_p, as OpenAI reports them.

Errors are {"error": {"message", "type", "param", "code"}} with these statuses:
  400 invalid_request_error   malformed JSON, wrong types, unsupported options, max_tokens beyond
                              --max_tokens_limit (max_tokens_exceeded), context_length_exceeded; a bad
                              tool or tool call names its field in param (tools[2].function.name,
                              messages[3].tool_calls[0].function.arguments)
  404 invalid_request_error   unknown model (code model_not_found); unknown route
  429 rate_limit_error        the request queue is full (code queue_full)
  503 service_unavailable     warming up: compiling before serving (code warming_up); shutting down (code
                              shutting_down); a non-streamed request aborted by shutdown
  500 server_error            the engine failed (code engine_failed)
A streamed request aborted or failed after its 200 header ends with `data: {"error": {...}}` (the
openai client raises APIError on it) and `data: [DONE]`. Each choice carries `token_ids` (an extension).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pydantic

from qmtp.runtime.sampling import MAX_TOP_LOGPROBS
from qmtp.serve import chat_fields, chat_template
# error_body too: the routes render errors as oai.error_body
from qmtp.serve.api_error import APIError, error_body, invalid  # noqa: F401

MAX_STOP_STRINGS = 4  # as the OpenAI API
# a field no request or default sets
GREEDY = {"temperature": 0.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0, "repetition_penalty": 1.0}


class _Common(pydantic.BaseModel):  # unknown fields are ignored (pydantic's default)
    model: str
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    n: int | None = None
    stream: bool = False
    stream_options: dict | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    logit_bias: dict | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    seed: int | None = None
    repetition_penalty: float | None = None
    allowed_token_ids: list[int] | None = None
    user: str | None = None
    # options that would change the output, refused unless they leave it as it is (vLLM's extensions too)
    response_format: dict | None = None
    min_tokens: int | None = None
    ignore_eos: bool | None = None
    include_stop_str_in_output: bool | None = None
    skip_special_tokens: bool | None = None
    truncate_prompt_tokens: int | None = None
    prompt_logprobs: pydantic.StrictInt | None = None


class CompletionRequest(_Common):
    prompt: str | list[int] | list[str] | list[list[int]]
    echo: bool = False
    logprobs: pydantic.StrictInt | None = None
    best_of: int | None = None
    suffix: str | None = None


class _TextPart(pydantic.BaseModel):
    type: str
    text: str = ""


class _Function(pydantic.BaseModel):
    name: str
    arguments: str | dict = ""  # the OpenAI API's JSON string (an object accepted too)


class _ToolCall(pydantic.BaseModel):
    id: str | None = None
    type: str = "function"
    function: _Function


class ChatMessage(pydantic.BaseModel):
    role: str
    content: str | list[_TextPart] | None = None
    name: str | None = None
    tool_call_id: str | None = None  # role "tool": the call it answers
    tool_calls: list[_ToolCall] | None = None  # role "assistant": the calls it made
    reasoning_content: str | None = None
    reasoning: str | None = None  # vLLM's newer name for reasoning_content


class ChatRequest(_Common):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    tools: list | None = None  # checked by chat_fields.check_tools, which names the offending entry's field
    tool_choice: str | dict | None = None
    parallel_tool_calls: bool | None = None
    logprobs: bool | None = None
    top_logprobs: pydantic.StrictInt | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool | None = None  # vLLM's: the template's variable (default true)
    continue_final_message: bool | None = None  # vLLM's: the reply continues the final message


@dataclasses.dataclass
class Parsed:
    prompts: list  # each text (tokenized by the server) or token ids: the completion's one or several, the chat's
    max_tokens: int | None
    stop: tuple[str, ...]
    stop_token_ids: tuple[int, ...]
    stream: bool
    include_usage: bool
    sampling: dict  # Engine.submit's sampling arguments (temperature .. min_tokens)
    n: int = 1  # choices
    top_logprobs: int | None = None  # None: no logprobs; else the alternatives per token
    tools: list[dict] | None = None  # chat: the request's tools (None: none given)
    tool_choice: str = "auto"  # chat: "auto", "none" or "required" (a named function too)
    tool_function: str | None = None  # chat: the function a named tool_choice calls
    parallel_tool_calls: bool = True  # chat: false keeps the first call only
    ignore_eos: bool = False  # the default stop ids do not end a choice (stop_token_ids and stop still do)
    # Engine.submit's include_stop_str_in_output and skip_special_tokens
    text: dict = dataclasses.field(default_factory=dict)
    truncate: int | None = None  # keep the prompt's last this many tokens (-1: as many as the context leaves)
    echo: bool = False  # completions: each choice begins with its prompt (text, and logprobs where asked)
    echo_only: bool = False  # echo with max_tokens 0: the prompt alone
    continue_final: bool = False  # chat: the prompt ends inside the final message (chat_template.render's)
    prompt_logprobs: int | None = None  # vLLM's: each prompt token's logprob, rank and this many alternatives
    continuous_usage: bool = False  # stream_options' include_usage and continuous_usage_stats: usage in every chunk


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


def _refuse(*checks) -> None:
    """400 unsupported_value for the first (param, refused, message) whose option is refused."""
    for param, refused, message in checks:
        if refused:
            raise APIError(400, message, param=param, code="unsupported_value")


def _common(req: _Common, model_name: str, max_tokens_limit: int, max_tokens: int | None, max_choices: int,
            defaults: dict) -> Parsed:
    """Checks what both routes share; the Parsed request, its prompt not yet set. defaults: the sampling
    values a request that leaves them out gets (sampling_defaults)."""
    if req.model != model_name:
        raise APIError(404, f"the model {req.model!r} does not exist; this server serves {model_name!r}",
                       param="model", code="model_not_found")
    _refuse(("response_format", (req.response_format or {}).get("type", "text") != "text",
             "response_format: only {\"type\": \"text\"} is supported (no JSON mode or schema)"))
    if req.n is not None and not 1 <= req.n <= max_choices:
        raise APIError(400, f"n={req.n} must be in [1, {max_choices}] (each choice is a queued request: "
                       "--max_queue)", param="n", code="invalid_value")
    if max_tokens is not None:
        if max_tokens < 1:
            raise APIError(400, f"max_tokens={max_tokens} must be >= 1 (0 only with echo)", param="max_tokens",
                           code="invalid_value")
        if max_tokens > max_tokens_limit:
            raise APIError(400, f"max_tokens={max_tokens} exceeds the server limit of {max_tokens_limit} "
                           "(--max_tokens_limit)", param="max_tokens", code="max_tokens_exceeded")
    stops = (req.stop,) if isinstance(req.stop, str) else tuple(req.stop or ())
    if len(stops) > MAX_STOP_STRINGS or any(not s for s in stops):
        raise APIError(400, f"stop: at most {MAX_STOP_STRINGS} non-empty strings", param="stop", code="invalid_value")
    if req.truncate_prompt_tokens is not None and not (req.truncate_prompt_tokens >= 1
                                                       or req.truncate_prompt_tokens == -1):
        raise APIError(400, f"truncate_prompt_tokens={req.truncate_prompt_tokens} must be >= 1 (the prompt's last "
                       "tokens kept) or -1 (as many as the context leaves)", param="truncate_prompt_tokens",
                       code="invalid_value")
    if req.prompt_logprobs is not None:
        _check_top_logprobs(req.prompt_logprobs, "prompt_logprobs")
        _refuse(("prompt_logprobs", req.stream, "prompt_logprobs: not with stream"))
    include_usage = bool((req.stream_options or {}).get("include_usage"))
    continuous_usage = include_usage and bool((req.stream_options or {}).get("continuous_usage_stats"))
    given = {"temperature": req.temperature, "top_k": req.top_k, "top_p": req.top_p, "min_p": req.min_p,
             "repetition_penalty": req.repetition_penalty}
    sampling = {name: value if value is not None else defaults.get(name, GREEDY[name]) for name, value in given.items()}
    sampling["seed"] = req.seed
    sampling["presence_penalty"] = req.presence_penalty or 0.0
    sampling["frequency_penalty"] = req.frequency_penalty or 0.0
    sampling["logit_bias"] = _logit_bias(req.logit_bias)
    sampling["min_tokens"] = req.min_tokens or 0
    sampling["allowed_token_ids"] = req.allowed_token_ids
    text = {"include_stop_str_in_output": bool(req.include_stop_str_in_output),
            "skip_special_tokens": req.skip_special_tokens is not False}
    return Parsed([], max_tokens, stops, tuple(req.stop_token_ids or ()), req.stream, include_usage, sampling,
                  req.n or 1, ignore_eos=bool(req.ignore_eos), text=text, truncate=req.truncate_prompt_tokens,
                  prompt_logprobs=req.prompt_logprobs, continuous_usage=continuous_usage)


def _logit_bias(bias: dict | None) -> dict[int, float] | None:
    """The request's logit_bias ({"token id": bias}, as JSON keys are strings) with int keys; the engine
    checks the ids and values."""
    if not bias:
        return None
    out = {}
    for key, value in bias.items():
        try:
            out[int(key)] = float(value)
        except (TypeError, ValueError):
            raise APIError(400, f"logit_bias: {key!r}: {value!r} must map a token id to a number", param="logit_bias",
                           code="invalid_value") from None
    return out


def _check_top_logprobs(n: int, param: str) -> int:
    if not 0 <= n <= MAX_TOP_LOGPROBS:
        raise APIError(400, f"{param}={n} must be in [0, {MAX_TOP_LOGPROBS}]", param=param, code="invalid_value")
    return n


def parse_completion(body, model_name: str, max_tokens_limit: int, max_choices: int, defaults: dict) -> Parsed:
    req = _validate(CompletionRequest, body)
    echo_only = bool(req.echo) and req.max_tokens == 0  # the prompt alone: one token generated, then dropped
    parsed = _common(req, model_name, max_tokens_limit, 1 if echo_only else req.max_tokens, max_choices, defaults)
    parsed.echo, parsed.echo_only = bool(req.echo), echo_only
    if req.logprobs is not None:
        parsed.top_logprobs = _check_top_logprobs(req.logprobs, "logprobs")
    several = isinstance(req.prompt, list) and req.prompt and isinstance(req.prompt[0], (str, list))
    prompts = list(req.prompt) if several else [req.prompt]
    _refuse(("best_of", req.best_of not in (None, 1), f"best_of={req.best_of}: only 1 is supported"),
            ("suffix", req.suffix, "suffix is not supported"))
    for i, prompt in enumerate(prompts):
        if not prompt:
            raise APIError(400, f"prompt[{i}] is empty" if several else "the prompt is empty", param="prompt",
                           code="invalid_value")
    if len(prompts) * parsed.n > max_choices:
        raise APIError(400, f"{len(prompts)} prompts x n={parsed.n} choices: at most {max_choices} in all (each "
                       "choice is a queued request: --max_queue)", param="prompt", code="invalid_value")
    parsed.prompts = prompts
    return parsed


def parse_chat(body, model_name: str, max_tokens_limit: int, max_choices: int, defaults: dict,
               tool_parser: str = "none") -> tuple[Parsed, list[dict], dict]:
    """The parsed request (prompt still None), the messages as plain dicts for the template and the
    request's own template variables (chat_template_kwargs). tool_parser: the server's tool-call
    parser ("none": tools are refused unless tool_choice is "none")."""
    req = _validate(ChatRequest, body)
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    parsed = _common(req, model_name, max_tokens_limit, max_tokens, max_choices, defaults)
    if req.top_logprobs is not None and not req.logprobs:
        raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs", code="invalid_value")
    if req.logprobs:
        parsed.top_logprobs = _check_top_logprobs(req.top_logprobs or 0, "top_logprobs")
    parsed.tool_choice, parsed.tool_function = chat_fields.tool_choice(req.tool_choice)
    parsed.tools = chat_fields.check_tools(req.tools) if req.tools else None
    parsed.parallel_tool_calls = req.parallel_tool_calls is not False
    if parsed.tool_choice == "required" and not parsed.tools:
        raise invalid("tool_choice", "a call is required but the request gives no tools")
    if parsed.tool_function is not None and all(t["function"]["name"] != parsed.tool_function for t in parsed.tools):
        raise invalid("tool_choice.function.name", f"{parsed.tool_function!r} is none of the request's tools")
    _refuse(("tools", parsed.tools and parsed.tool_choice != "none" and tool_parser == "none",
             "tools need a tool call parser, and this server has none (--tool_call_parser=none, or auto with "
             "a chat template that writes no tool calls); tool_choice \"none\" shows the tools to the model "
             "without parsing calls"))
    try:
        chat_template.check_variables(req.chat_template_kwargs or {})
    except chat_template.ChatTemplateError as e:
        raise APIError(400, str(e), param="chat_template_kwargs", code="invalid_value") from None
    if not req.messages:
        raise APIError(400, "messages is empty", param="messages", code="invalid_value")
    variables = dict(req.chat_template_kwargs or {})
    if req.add_generation_prompt is not None:
        variables.setdefault("add_generation_prompt", req.add_generation_prompt)
    if req.continue_final_message:
        if variables.get("add_generation_prompt"):
            raise invalid("continue_final_message", "cannot be true with add_generation_prompt true (the reply "
                          "either continues the final message or starts a new one)")
        variables["add_generation_prompt"] = False
        parsed.continue_final = True
    return parsed, [chat_fields.template_message(i, m) for i, m in enumerate(req.messages)], variables


# ---- responses -------------------------------------------------------------------------------------
def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict:
    """OpenAI's usage object; cached_tokens: prompt tokens the prefix cache served."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def choice(index: int, part: dict, token_ids: list[int], finish_reason: str | None, logprobs: dict | None = None
           ) -> dict:
    """Choice `index`; part: {"text": ...} (completions), {"message": ...} or {"delta": ...} (chat);
    logprobs: openai_logprobs' object for its tokens, or None."""
    return {"index": index, **part, "logprobs": logprobs, "finish_reason": finish_reason, "token_ids": token_ids}


def body(rid: str, obj: str, model: str, created: int, choices: list[dict], usage_: dict | None = None) -> dict:
    """A response or stream chunk: its choices (none: the usage chunk), usage when given."""
    out = {"id": rid, "object": obj, "created": created, "model": model, "choices": choices}
    return {**out, "usage": usage_} if usage_ else out

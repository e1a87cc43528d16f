"""The HTTP app over one engine (FastAPI) and the uvicorn server that runs it in a process or a thread;
the command line that builds them from flags is qmtp/serve/server_cli.py (python -m qmtp.server).

    POST /v1/completions, /v1/chat/completions   ("stream": true -> server-sent events)
    POST /tokenize, /detokenize                  (vLLM's: a prompt's or a chat's token ids; ids' text)
    GET  /v1/models, /health, /metrics           (/metrics: Prometheus text)
    POST /start_profile, /stop_profile           (a device trace into --profile_dir: qmtp/serve/profiling.py)

Request fields, error statuses and bodies: qmtp/serve/protocol.py. A client that disconnects cancels
its request.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hmac
import json
import threading
import time
import uuid

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from qmtp.serve import chat_output, metrics, openai_logprobs, protocol as oai, reasoning, responses, tool_calls
from qmtp.serve.chat_template import ChatTemplate, ChatTemplateError
from qmtp.serve.profiling import ProfileError, Profiler
from qmtp.serve.requests import EngineStopped, QueueFull, RequestError, WarmingUp


@dataclasses.dataclass(frozen=True)
class ServerSettings:
    model_name: str
    max_tokens_limit: int = 4096
    default_max_tokens: int = 256
    shutdown_timeout_s: float = 30.0
    profile_dir: str = ""  # where POST /start_profile writes a device trace ("" = the endpoints refuse)
    sampling_defaults: dict = dataclasses.field(default_factory=dict)  # what a request leaves out (sampling_defaults)
    reasoning_parser: str = "auto"  # reasoning.PARSERS or auto (reasoning.resolve)
    tool_call_parser: str = "auto"  # tool_calls.PARSERS or auto (tool_calls.resolve)
    api_key: str = ""  # every route but OPEN_ROUTES needs "Authorization: Bearer <api_key>" ("": none)


OPEN_ROUTES = ("/health", "/metrics")  # what a load balancer or a monitor reads without the API key


def create_app(engine, settings: ServerSettings, manage_engine: bool = True):
    """The FastAPI app over `engine`. manage_engine: start it on startup and stop it on shutdown."""
    model = engine.model
    # model, max_tokens, n: what a request may ask for; the sampling a request leaves out
    limits = (settings.model_name, min(settings.max_tokens_limit, engine.max_model_len - 1), engine.config.max_queue,
              settings.sampling_defaults)
    template = ChatTemplate.from_checkpoint(model.checkpoint_dir)
    reasoning_parser = reasoning.resolve(settings.reasoning_parser, model.tokenizer)[0]
    tool_parser = tool_calls.resolve(settings.tool_call_parser, template.source)[0]
    invalid = {"count": 0}

    @contextlib.asynccontextmanager
    async def lifespan(_app):
        if manage_engine:
            engine.start()
        yield
        if manage_engine:
            await asyncio.to_thread(engine.stop, settings.shutdown_timeout_s)

    api = FastAPI(title="qmtp", lifespan=lifespan)

    if settings.api_key:
        expected = f"Bearer {settings.api_key}".encode()

        @api.middleware("http")
        async def authorize(request: Request, call_next):
            given = request.headers.get("authorization", "").encode()
            if request.url.path in OPEN_ROUTES or hmac.compare_digest(given, expected):
                return await call_next(request)
            return JSONResponse(oai.error_body("a valid API key is needed: 'Authorization: Bearer <key>'",
                                               "authentication_error", None, "invalid_api_key"), status_code=401)

    @api.exception_handler(StarletteHTTPException)
    async def http_error(_request, exc):
        return JSONResponse(oai.error_body(str(exc.detail), "invalid_request_error", None,
                                           "not_found" if exc.status_code == 404 else None),
                            status_code=exc.status_code)

    @api.get("/health")
    async def health():
        if engine.failed:
            return JSONResponse({"status": "failed", "error": engine.failed}, status_code=503)
        warming = engine.warming
        if warming is not None:
            return JSONResponse({"status": "warming up", "programs_done": warming[0], "programs": warming[1]},
                                status_code=503)
        if not engine.running:
            return JSONResponse({"status": "unavailable"}, status_code=503)
        return {"status": "ok"}

    profiler = Profiler(settings.profile_dir)

    def profile_route(action: str, step, status: str) -> None:  # POST /<action>_profile runs step()
        async def route():
            try:
                return {"status": status, "profile_dir": await asyncio.to_thread(step)}
            except ProfileError as e:
                return JSONResponse(oai.error_body(str(e), "invalid_request_error", None, "profile"), status_code=400)
        api.post(f"/{action}_profile", name=f"{action}_profile")(route)

    profile_route("start", profiler.start, "profiling")
    profile_route("stop", profiler.stop, "written")

    @api.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": settings.model_name, "object": "model", "created": 0,
                                            "owned_by": "qmtp", "max_model_len": engine.max_model_len}]}

    @api.get("/metrics")
    async def prometheus():
        return PlainTextResponse(metrics.render(engine, invalid["count"]), media_type=metrics.CONTENT_TYPE)

    def tokenize(prompt) -> list[int]:
        """Token ids as given, or the text's (special tokens such as <|im_start|> parsed, no BOS/EOS added)."""
        if isinstance(prompt, list):
            return [int(t) for t in prompt]
        if model.tokenizer is None:
            raise oai.APIError(400, "text prompts need tokenizer.json, which this checkpoint lacks; send token ids",
                               param="prompt", code="invalid_value")
        return model.tokenizer.encode(prompt, add_special_tokens=False).ids

    def echo_of(prompt, ids: list[int], scored: list | None, top_logprobs: int | None) -> responses.Echo:
        """A prompt as an echoing completion shows it: its text (a token-id prompt's decoded, special tokens
        kept), and with logprobs its tokens' (scored: Engine.score's, with at least top_logprobs alternatives)."""
        text = prompt if isinstance(prompt, str) else (
            model.tokenizer.decode(ids, skip_special_tokens=False) if model.tokenizer is not None
            else "".join(openai_logprobs.token_text(None, t) for t in ids))
        if top_logprobs is None:
            return responses.Echo(text, None)
        scored = [dataclasses.replace(t, top=t.top[:top_logprobs]) for t in scored]
        return responses.Echo(text, openai_logprobs.prompt(model.tokenizer, ids, scored))

    async def scores_of(parsed, prompt_ids: list) -> list | None:
        """Each prompt's Engine.score (awaited), where the request's echo or prompt_logprobs needs them."""
        asked = [n for n in (parsed.top_logprobs if parsed.echo else None, parsed.prompt_logprobs) if n is not None]
        if not asked:
            return None
        return [await asyncio.wrap_future(engine.score(ids, max(asked))) for ids in prompt_ids]

    async def json_body(request: Request):
        try:
            return json.loads(await request.body())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise oai.APIError(400, f"malformed JSON body: {e}", code="invalid_json") from None

    def chat_prompt(body):
        """(Parsed, the chat template's prompt) of a chat request's body."""
        parsed, messages, variables = oai.parse_chat(body, *limits, tool_parser=tool_parser)
        try:
            return parsed, template.render(messages, variables, parsed.tools, parsed.continue_final)
        except ChatTemplateError as e:
            raise oai.APIError(400, str(e), param="messages", code="invalid_value") from None

    @api.post("/tokenize")
    async def tokenize_route(request: Request):
        """vLLM's: {"prompt": text} (a completion's prompt) or a chat request's {"messages", "tools",
        "chat_template_kwargs"} (the chat template's prompt; "model" may be left out) -> {"count",
        "max_model_len", "tokens"}: the ids the server would prefill (a tool_choice that opens the reply
        with a call adds that opening after them)."""
        try:
            body = await json_body(request)
            if isinstance(body, dict) and "messages" in body:
                prompt = chat_prompt({"model": settings.model_name, **body})[1]
            elif isinstance(body, dict) and isinstance(body.get("prompt"), str):
                prompt = body["prompt"]
            else:
                raise oai.APIError(400, 'give "prompt" (a string) or "messages"', param="prompt", code="invalid_value")
            ids = tokenize(prompt)
        except oai.APIError as e:
            return JSONResponse(e.body(), status_code=e.status)
        return {"count": len(ids), "max_model_len": engine.max_model_len, "tokens": ids}

    @api.post("/detokenize")
    async def detokenize_route(request: Request):
        """vLLM's: {"tokens": [ids]} -> {"prompt": their text, special tokens included}."""
        try:
            body = await json_body(request)
            tokens, vocab = body.get("tokens") if isinstance(body, dict) else None, model.cfg.vocab_size
            if not isinstance(tokens, list) or not all(type(t) is int and 0 <= t < vocab for t in tokens):
                raise oai.APIError(400, f"tokens: a list of token ids in [0, {vocab})", param="tokens",
                                   code="invalid_value")
            if model.tokenizer is None:
                raise oai.APIError(400, "detokenize needs tokenizer.json, which this checkpoint lacks",
                                   param="tokens", code="invalid_value")
        except oai.APIError as e:
            return JSONResponse(e.body(), status_code=e.status)
        return {"prompt": model.tokenizer.decode(tokens, skip_special_tokens=False)}

    async def serve(request: Request, chat: bool):
        try:
            body = await json_body(request)
            parsing = None  # chat: how each choice's text becomes a message (chat_output)
            if chat:
                parsed, prompt = chat_prompt(body)
                parsing = chat_output.for_request(reasoning_parser, tool_parser, prompt, parsed.tools,
                                                  parsed.tool_choice, parsed.parallel_tool_calls,
                                                  parsed.tool_function)
                parsed.prompts = [prompt + parsing.prompt_suffix]  # tool_choice "required": the reply opens a call
            else:
                parsed = oai.parse_completion(body, *limits)
            prompt_ids = [tokenize(p) for p in parsed.prompts]
            if parsed.truncate is not None:  # the last tokens (-1: those the context leaves room for)
                keep = parsed.truncate if parsed.truncate > 0 else engine.max_model_len - (parsed.max_tokens or 1)
                prompt_ids = [ids[-keep:] for ids in prompt_ids]
            # each prompt's budget: the request's, or as much as its context leaves (up to the server's default)
            max_tokens = [parsed.max_tokens if parsed.max_tokens is not None
                          else max(1, min(settings.default_max_tokens, engine.max_model_len - len(ids)))
                          for ids in prompt_ids]
            extra = parsed.stop_token_ids  # added to the default stop ids, or alone under ignore_eos
            if parsed.ignore_eos:
                stop_ids = extra
            else:
                stop_ids = tuple(dict.fromkeys(engine.default_stop_ids + extra)) if extra else None
            events: asyncio.Queue = asyncio.Queue()  # (choice index, engine event)
            try:
                scores = await scores_of(parsed, prompt_ids) or [None] * len(prompt_ids)
                echoes = [echo_of(p if parsed.truncate is None else ids, ids, s, parsed.top_logprobs)
                          for p, ids, s in zip(parsed.prompts, prompt_ids, scores)] if parsed.echo else None
                prompt_logprobs = None if parsed.prompt_logprobs is None else [
                    openai_logprobs.vllm_prompt(model.tokenizer, s, parsed.prompt_logprobs) for s in scores]
                handles = responses.submit(engine, parsed, prompt_ids, max_tokens, stop_ids, asyncio.get_running_loop(),
                                           events)
            except RequestError as e:
                raise oai.APIError(400, str(e), param="messages" if chat and e.param == "prompt" else e.param,
                                   code=e.code) from None
        except oai.APIError as e:
            if e.status in (400, 404):
                invalid["count"] += 1
            return JSONResponse(e.body(), status_code=e.status)
        except QueueFull as e:
            return JSONResponse(oai.error_body(str(e), "rate_limit_error", None, "queue_full"), status_code=429)
        except WarmingUp as e:
            return JSONResponse(oai.error_body(str(e), "service_unavailable", None, "warming_up"), status_code=503)
        except EngineStopped as e:
            return JSONResponse(oai.error_body(str(e), "service_unavailable", None, "shutting_down"), status_code=503)
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        reply = responses.Reply(rid, chat, settings.model_name, int(time.time()), model.tokenizer, handles, parsing,
                                parsed.n, echoes, parsed.echo_only, prompt_logprobs)
        if parsed.stream:
            return StreamingResponse(responses.stream(reply, events, parsed.include_usage, parsed.continuous_usage),
                                     media_type="text/event-stream")
        return await responses.complete(request, reply, events)

    @api.post("/v1/completions")
    async def completions(request: Request):
        return await serve(request, chat=False)

    @api.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await serve(request, chat=True)

    return api


class Server:
    """uvicorn serving an app in this process; `stop()` does what SIGINT/SIGTERM do."""

    def __init__(self, app, engine, host: str = "127.0.0.1", port: int = 0, shutdown_timeout_s: float = 30.0,
                 log_level: str = "warning"):
        import uvicorn

        class _Uvicorn(uvicorn.Server):
            def handle_exit(self, sig, frame):
                engine.shutdown(shutdown_timeout_s)  # abort queued now; active ones get the timeout
                super().handle_exit(sig, frame)
                # uvicorn re-raises a captured signal after its shutdown (the process would die of it);
                # the shutdown is clean here, so main() returns and the exit status is 0
                getattr(self, "_captured_signals", []).clear()

        self.uvicorn = _Uvicorn(uvicorn.Config(app, host=host, port=port, log_level=log_level, lifespan="on",
                                               timeout_graceful_shutdown=shutdown_timeout_s + 5.0))
        self.engine, self.shutdown_timeout_s = engine, shutdown_timeout_s
        self._thread: threading.Thread | None = None

    @property
    def port(self) -> int:
        return self.uvicorn.servers[0].sockets[0].getsockname()[1]

    def start_in_thread(self, timeout: float = 60.0) -> "Server":
        self._thread = threading.Thread(target=self.uvicorn.run, name="qmtp-http", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self.uvicorn.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the HTTP server did not start")
            time.sleep(0.02)
        return self

    def stop(self, timeout: float = 60.0) -> bool:
        self.engine.shutdown(self.shutdown_timeout_s)
        self.uvicorn.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout)
        return self._thread is None or not self._thread.is_alive()

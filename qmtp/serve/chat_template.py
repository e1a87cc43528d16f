"""Chat messages -> prompt text through the checkpoint's jinja2 chat template.

The template is the checkpoint's `chat_template.jinja` where it has one (transformers prefers that file
to the config's field, as here), else `chat_template` of its tokenizer_config.json (a string, or a list
of {name, template} of which "default" is used), rendered as Hugging Face transformers does: a
sandboxed jinja2 environment with trim_blocks and lstrip_blocks, `raise_exception(msg)`,
`strftime_now(fmt)` and a `tojson` filter; variables messages, add_generation_prompt=True, bos_token,
eos_token, tools (the request's, as given in the OpenAI API, else None), and a request's own
(`chat_template_kwargs`, e.g. Qwen3's enable_thinking).
Without one, DEFAULT_TEMPLATE: ChatML, the format of the Qwen family.
"""

from __future__ import annotations

import datetime
import json
import os

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

TEMPLATE_FILE = "chat_template.jinja"
RESERVED = ("messages", "tools")  # variables a request's chat_template_kwargs cannot set
DEFAULT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")


class ChatTemplateError(ValueError):
    """The messages cannot be rendered (the template raised, or is not valid jinja2)."""


class ChatTemplate:
    def __init__(self, source: str, bos_token: str | None = None, eos_token: str | None = None,
                 origin: str = "default"):
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=["jinja2.ext.loopcontrols"])
        env.filters["tojson"] = lambda x, indent=None, ensure_ascii=False: json.dumps(
            x, indent=indent, ensure_ascii=ensure_ascii)
        env.globals["raise_exception"] = _raise
        env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
        try:
            self._template = env.from_string(source)
        except jinja2.TemplateSyntaxError as e:
            raise ChatTemplateError(f"{origin}: chat_template is not valid jinja2 ({e})") from None
        self.source, self.origin = source, origin
        self.bos_token, self.eos_token = bos_token, eos_token

    @classmethod
    def from_checkpoint(cls, checkpoint_dir: str) -> "ChatTemplate":
        """The checkpoint's template (chat_template.jinja, else tokenizer_config.json's), or DEFAULT_TEMPLATE
        when it has none; bos and eos tokens from tokenizer_config.json."""
        path = os.path.join(checkpoint_dir, "tokenizer_config.json")
        config = {}
        if os.path.isfile(path):
            with open(path) as f:
                config = json.load(f)
        source = config.get("chat_template")
        if isinstance(source, list):  # named templates
            source = {t.get("name"): t.get("template") for t in source}.get("default")
        file = os.path.join(checkpoint_dir, TEMPLATE_FILE)
        if os.path.isfile(file):
            with open(file, encoding="utf-8") as f:
                source, path = f.read(), file
        # a token is a string, or {"content": "<|im_end|>", ...} in some tokenizer configs
        tokens = [t.get("content") if isinstance(t, dict) else t for t in map(config.get, ("bos_token", "eos_token"))]
        return cls(source, *tokens, origin=path) if source else cls(DEFAULT_TEMPLATE, *tokens)

    def render(self, messages: list[dict], variables: dict | None = None, tools: list[dict] | None = None,
               continue_final: bool = False) -> str:
        """The prompt text; variables: a request's own template variables (chat_template_kwargs), which may
        replace the defaults (add_generation_prompt, bos_token, eos_token) but not RESERVED; tools: the
        request's tools ([{type: "function", function: {...}}], None: none). continue_final (vLLM's
        continue_final_message): the text is cut after the final message's content, where the template
        writes it last, so the reply continues that message (its end-of-turn is not written)."""
        check_variables(variables or {})
        context = dict(add_generation_prompt=True, bos_token=self.bos_token or "", eos_token=self.eos_token or "")
        context.update(variables or {})
        try:
            text = self._template.render(messages=messages, tools=tools or None, **context)
        except ChatTemplateError:
            raise
        except jinja2.TemplateError as e:
            raise ChatTemplateError(f"chat template ({self.origin}) failed: {e}") from None
        if not continue_final:
            return text
        final = messages[-1].get("content") or ""
        at = text.rfind(final) if final else -1
        if at < 0:
            raise ChatTemplateError("continue_final_message: the final message needs text that the chat template "
                                    "writes out")
        return text[:at + len(final)]


def check_variables(variables: dict) -> None:
    """ChatTemplateError where a request's template variables name one of RESERVED."""
    names = sorted(set(variables) & set(RESERVED))
    if names:
        raise ChatTemplateError(f"chat_template_kwargs cannot set {', '.join(names)}")


def _raise(message: str):
    raise ChatTemplateError(f"chat template: {message}")

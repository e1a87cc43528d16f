"""A chat request's tools, tool_choice and messages checked and turned into what the chat template reads
(qmtp/serve/protocol.py's parse_chat): a bad entry gets a 400 naming its field (tools[2].function.name,
messages[3].tool_calls[0].function.arguments)."""

from __future__ import annotations

import json
import re

from qmtp.serve.api_error import invalid


def tool_choice(choice) -> tuple[str, str | None]:
    """(tool_choice, the function it names or None)."""
    if choice is None or choice in ("auto", "none", "required"):
        return choice or "auto", None
    if isinstance(choice, dict):
        function = choice.get("function")
        if choice.get("type") != "function" or not isinstance(function, dict):
            raise invalid("tool_choice", "a named function is {\"type\": \"function\", \"function\": {\"name\": "
                          "...}}")
        if not isinstance(function.get("name"), str):
            raise invalid("tool_choice.function.name", "a string is required")
        return "required", function["name"]
    raise invalid("tool_choice", f"{choice!r} is not one of \"auto\", \"none\", \"required\" or a named function")


def check_tools(tools: list) -> list[dict]:
    """The request's tools as given, each checked: {type: "function", function: {name, description?,
    parameters?}}; a name must be unique and free of blank space, '<' and '>' (they would break the
    `<function=NAME>` format)."""
    names = set()
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict):
            raise invalid(where, "must be an object {\"type\": \"function\", \"function\": {...}}")
        if tool.get("type") != "function":
            raise invalid(f"{where}.type", f"must be \"function\", not {tool.get('type')!r}")
        function = tool.get("function")
        if not isinstance(function, dict):
            raise invalid(f"{where}.function", "must be an object {name, description, parameters}")
        name = function.get("name")
        if not isinstance(name, str) or not name:
            raise invalid(f"{where}.function.name", "a non-empty string is required")
        if re.search(r"[\s<>]", name):
            raise invalid(f"{where}.function.name", f"{name!r} holds blank space, '<' or '>'")
        if name in names:
            raise invalid(f"{where}.function.name", f"{name!r} names an earlier tool too")
        names.add(name)
        if not isinstance(function.get("description", ""), str):
            raise invalid(f"{where}.function.description", "must be a string")
        if not isinstance(function.get("parameters", {}), dict):
            raise invalid(f"{where}.function.parameters", "must be a JSON Schema object")
    return tools


def template_message(index: int, m) -> dict:
    """A message (protocol.ChatMessage, messages[index]) as the chat template reads it: text parts joined, tool
    calls' arguments as objects."""
    content = m.content if isinstance(m.content, str) or m.content is None else "".join(
        p.text for p in m.content if p.type == "text")
    message = {"role": m.role, "content": content or ""}
    for key, value in (("name", m.name), ("tool_call_id", m.tool_call_id),
                       ("reasoning_content", m.reasoning_content if m.reasoning_content is not None else m.reasoning)):
        if value is not None:
            message[key] = value
    if m.tool_calls:
        message["tool_calls"] = [template_call(f"messages[{index}].tool_calls[{j}]", c)
                                 for j, c in enumerate(m.tool_calls)]
    return message


def template_call(where: str, call) -> dict:
    """A tool call (protocol's _ToolCall, at the field path `where`) as the chat template reads it."""
    arguments = call.function.arguments
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except ValueError as e:
            raise invalid(f"{where}.function.arguments", f"not valid JSON ({e})") from None
    if not isinstance(arguments, dict):
        raise invalid(f"{where}.function.arguments", "must be a JSON object")
    out = {"type": "function", "function": {"name": call.function.name, "arguments": arguments}}
    return {"id": call.id, **out} if call.id is not None else out


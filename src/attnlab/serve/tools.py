"""Tool calls (OpenAI's `tools` / `tool_choice`) for models whose chat template defines tools.

A chat template that reads the `tools` variable was trained to see them: the request's tools are
rendered into the prompt by the model's own template (as transformers' `apply_chat_template(...,
tools=...)` does), and what the model writes back is read for calls in the formats such
templates teach, in this order:

    <tool_call>{"name": ..., "arguments": {...}}</tool_call>   Hermes, Qwen 2.5 / 3, SmolLM3
    [TOOL_CALLS] [{"name": ..., "arguments": {...}}, ...]      Mistral
    {"name": ..., "parameters": {...}}  (after <|python_tag|>)  Llama 3.1 / 3.2 JSON calls

A call counts only if it names one of the request's tools and its arguments are a JSON object;
anything else stays the message's content (nothing is made up). The text read is decoded with
special tokens kept, since several formats' markers are special tokens.

`tool_choice`:
    "none"      the tools are not rendered and nothing is read as a call
    "auto"      (the default with tools) the model decides; its text is read for calls
    "required"  the output is constrained (serve/grammar.py) to a JSON list of one or more calls
                [{"name": <one of the tools>, "arguments": <its parameters' schema>}]
                (one call at most with parallel_tool_calls: false)
    {"type": "function", "function": {"name": N}}
                the output is constrained to N's arguments (its parameters' schema)

The two constrained modes are vLLM's: the model writes bare JSON instead of its template's call
format, and the schema guarantees the call parses and validates.
"""

from __future__ import annotations

import json
import re
import uuid
from functools import lru_cache

_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)


@lru_cache(maxsize=8)
def template_takes_tools(template: str) -> bool:
    """Whether the chat template reads a `tools` variable (i.e. it was written to show them)."""
    from jinja2 import meta
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    try:
        ast = ImmutableSandboxedEnvironment(extensions=["jinja2.ext.loopcontrols"]).parse(template)
    except Exception:  # a template that does not parse fails at render time, with its reason
        return False
    return "tools" in meta.find_undeclared_variables(ast)


def _parameters(tool) -> dict:
    return tool.function.parameters or {"type": "object"}


def forced_schema(tools: list, choice, parallel: bool = True) -> dict | None:
    """The JSON schema the output must follow for tool_choice (None: unconstrained); one call
    at most unless `parallel`."""
    if choice == "required":
        return {
            "type": "array",
            "minItems": 1,
            **({} if parallel else {"maxItems": 1}),
            "items": {
                "anyOf": [
                    {
                        "type": "object",
                        "properties": {
                            "name": {"const": t.function.name},
                            "arguments": _parameters(t),
                        },
                        "required": ["name", "arguments"],
                        "additionalProperties": False,
                    }
                    for t in tools
                ]
            },
        }
    if choice is not None and not isinstance(choice, str):  # a named function
        tool = next(t for t in tools if t.function.name == choice.function.name)
        return _parameters(tool)
    return None


def _call(name: str, arguments) -> dict:
    return {
        "id": f"call_{uuid.uuid4().hex[:24]}",
        "type": "function",
        "function": {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)},
    }


def _as_calls(value, names: set[str]) -> list[dict] | None:
    """`value` (parsed JSON) as calls if it is one call or a list of them, else None."""
    items = value if isinstance(value, list) else [value]
    calls = []
    for item in items:
        if not isinstance(item, dict) or item.get("name") not in names:
            return None
        args = item.get("arguments", item.get("parameters"))
        if isinstance(args, str):  # some models write the arguments as a JSON string
            try:
                args = json.loads(args)
            except ValueError:
                return None
        if not isinstance(args, dict):
            return None
        calls.append(_call(item["name"], args))
    return calls or None


def _json(text: str):
    try:
        return json.loads(text)
    except ValueError:
        return None


def parse_calls(text: str, names: set[str]) -> tuple[str | None, list[dict]]:
    """(content, calls) read from a model's raw output (special tokens kept); calls empty when
    the text holds none that name one of `names` with object arguments."""
    start = text.find("<tool_call>")
    if start >= 0:
        calls = []
        for body in _HERMES.findall(text[start:]):
            got = _as_calls(_json(body), names)
            if got is None:
                return text, []
            calls += got
        return (text[:start].strip() or None), calls
    for marker in ("[TOOL_CALLS]", "<|python_tag|>"):
        at = text.find(marker)
        if at >= 0:
            got = _as_calls(_json(text[at + len(marker) :].strip()), names)
            if got:
                return (text[:at].strip() or None), got
            return text, []
    got = _as_calls(_json(text.strip()), names)
    return (None, got) if got else (text, [])


def forced_calls(text: str, tools: list, choice) -> list[dict]:
    """The calls in a constrained (required / named) answer: `text` follows forced_schema."""
    value = _json(text)
    if value is None:  # cut off by max_tokens before the JSON closed
        return []
    if choice == "required":
        return _as_calls(value, {t.function.name for t in tools}) or []
    return [_call(choice.function.name, value)] if isinstance(value, dict) else []

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
        "id": _call_id(),
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


_MARKERS = ("<tool_call>", "[TOOL_CALLS]", "<|python_tag|>")
# a call object's start: its name, then where its arguments' value begins
_HEAD = re.compile(r'\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:arguments|parameters)"\s*:\s*')
_BETWEEN = re.compile(r"(?:\s|,|\[|\]|</tool_call>|<tool_call>)*")  # what separates call objects


def _value_end(text: str, start: int) -> tuple[int, bool]:
    """How far the JSON object or array at text[start] is written: (end so far, complete)."""
    depth, in_string, escaped = 0, False, False
    for i in range(start, len(text)):
        c = text[i]
        if in_string:
            if escaped:
                escaped = False
            elif c == "\\":
                escaped = True
            elif c == '"':
                in_string = False
        elif c == '"':
            in_string = True
        elif c in "{[":
            depth += 1
        elif c in "}]":
            depth -= 1
            if depth == 0:
                return i + 1, True
    return len(text), False


class CallStream:
    """OpenAI's streamed tool calls, read from an answer while the model writes it: text before
    any call goes out as content; a call's first delta (index, id, type, name) once its name is
    written and is one of the request's tools, then its arguments' JSON text piece by piece as
    written (the pieces joined are the arguments). `feed(text, final)` takes the answer so far
    (for tool_choice "auto" the raw text, special tokens kept: parse_calls reads the same) and
    returns (content delta, tool_calls deltas).

    What cannot be read that way as it grows (a call whose arguments come before its name, or are
    a JSON string; text that may be a bare JSON call) is held and read whole at the end, as the
    unstreamed answer is (parse_calls / forced_calls): nothing is sent that the whole answer
    would not hold, except where the whole answer turns out not to be calls after a call's head
    went out (its arguments never closed: cut by max_tokens); then the rest is sent as content."""

    def __init__(self, tools: list, mode) -> None:
        self.tools, self.mode = tools, mode
        self.names = {t.function.name for t in tools}
        # streamed: {"id", "name", "object" (its start), "start" (its arguments'), "sent"
        # (argument characters sent), "headed" (its first delta sent), "closed" (all written)}
        self.calls: list[dict] = []
        self.sent = 0  # content characters sent
        self.held = False  # the rest is read whole at the end
        self.cursor = 0  # where the next call object may start (once calls began)
        self.began: int | None = None  # where calls begin in the text
        self.finish: str | None = None
        if not isinstance(mode, str):  # a named function: the whole answer is its arguments
            self.began = 0
            self.calls.append({"id": _call_id(), "name": mode.function.name, "start": 0, "sent": 0})

    def feed(self, text: str, final: bool = False) -> tuple[str, list[dict]]:
        content, deltas = "", []
        if not isinstance(self.mode, str):
            deltas += self._arguments(0, text, len(text))
        elif not self.held:
            if self.began is None:
                content = self._content(text)
            if self.began is not None:
                deltas += self._objects(text)
        if final:
            more_content, more = self._final(text)
            content += more_content
            deltas += more
        return content, _merge(deltas)

    def _content(self, text: str) -> str:
        """Content up to the first call marker; never the start of a marker that may be
        forming; nothing while the answer may be a bare JSON call (Llama 3's format)."""
        if self.mode == "required":  # constrained: the answer is a JSON list of calls
            self.began = self.cursor = 0
            return ""
        hits = [(at, m) for m in _MARKERS if (at := text.find(m)) >= 0]
        if hits:
            at, marker = min(hits)
            self.began, self.cursor = at, at + len(marker)
            end = len(text[:at].rstrip())
        elif text.lstrip()[:1] in ("{", "["):
            end = self.sent  # perhaps a call written bare: read whole at the end
        else:
            forming = [i for m in _MARKERS for i in range(1, len(m)) if text.endswith(m[:i])]
            # trailing whitespace waits too: before a marker, parse_calls strips it
            end = len(text[: len(text) - max(forming, default=0)].rstrip())
        if self.sent == 0:  # parse_calls strips the content: so does the stream
            self.sent = min(len(text) - len(text.lstrip()), end)
        piece = text[self.sent : max(end, self.sent)]
        self.sent += len(piece)
        return piece

    def _objects(self, text: str) -> list[dict]:
        """Deltas of the call objects from `cursor` on, as far as they are written."""
        deltas = []
        while True:
            if self.calls and "closed" not in self.calls[-1]:  # the call being written
                call = self.calls[-1]
                end, complete = _value_end(text, call["start"])
                deltas += self._arguments(len(self.calls) - 1, text, end)
                obj_end, closed = _value_end(text, call["object"])
                if not (complete and closed):
                    return deltas
                call["closed"] = True
                self.cursor = obj_end
            self.cursor = _BETWEEN.match(text, self.cursor).end()
            if self.cursor >= len(text):
                return deltas
            head = _HEAD.match(text, self.cursor)
            if head is None:  # not (yet) a call's start: once whole, read at the end
                if text[self.cursor] != "{" or _value_end(text, self.cursor)[1]:
                    self.held = True
                return deltas
            name = _json(f'"{head.group(1)}"')  # None for a broken escape: not a tool's name
            if name not in self.names or head.end() >= len(text):
                self.held = name not in self.names
                return deltas
            if text[head.end()] != "{":  # arguments as a JSON string: read whole at the end
                self.held = True
                return deltas
            self.calls.append(
                {
                    "id": _call_id(),
                    "name": name,
                    "start": head.end(),
                    "sent": 0,
                    "object": self.cursor,
                }
            )

    def _arguments(self, index: int, text: str, end: int) -> list[dict]:
        call = self.calls[index]
        deltas = []
        if "headed" not in call:
            call["headed"] = True
            deltas.append(
                {
                    "index": index,
                    "id": call["id"],
                    "type": "function",
                    "function": {"name": call["name"], "arguments": ""},
                }
            )
        piece = text[call["start"] + call["sent"] : end]
        if piece:
            call["sent"] += len(piece)
            deltas.append({"index": index, "function": {"arguments": piece}})
        return deltas

    def _final(self, text: str) -> tuple[str, list[dict]]:
        """The end of the answer: what was held, read whole (parse_calls / forced_calls)."""
        if self.mode == "auto":
            content, calls = parse_calls(text, self.names)
        else:
            content, calls = None, forced_calls(text, self.tools, self.mode)
        self.finish = "tool_calls" if calls and isinstance(self.mode, str) else None
        deltas = []
        if not calls and self.calls and not isinstance(self.mode, str):
            return "", deltas  # a named call cut short: its arguments are what was written
        if not calls:  # no call after all: whatever was not sent is content
            rest = text[self.sent :] if not self.calls else ""
            self.sent = len(text)
            return rest, deltas
        for j, call in enumerate(calls):
            if j < len(self.calls):  # streamed: the rest of its arguments' text, if any
                mine = self.calls[j]
                end, _ = _value_end(text, mine["start"])
                deltas += self._arguments(j, text, end)
            else:  # read whole at the end: one delta
                deltas.append({"index": j, **call})
        held = "" if self.began is not None or content is None else content[self.sent :]
        return held, deltas


def _call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _merge(deltas: list[dict]) -> list[dict]:
    """Consecutive argument pieces of one call as one delta."""
    out: list[dict] = []
    for d in deltas:
        prev = out[-1] if out else None
        if prev is not None and prev["index"] == d["index"] and set(d) == {"index", "function"}:
            joined = prev["function"]["arguments"] + d["function"]["arguments"]
            prev["function"] = {**prev["function"], "arguments": joined}
        else:
            out.append(d)
    return out

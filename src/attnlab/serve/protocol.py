"""The OpenAI request bodies the server accepts, and its error shape.

Bodies are strict (pydantic, extra="forbid"): an unknown or misspelt field is a 400 that names
it, not a silent default. Fields OpenAI defines but this server does not implement (logit_bias,
suffix) are accepted only at their neutral values, so a client that sends the default still
works and one that relies on the feature learns it is missing. logprobs (completions: the k best
alternatives; chat: logprobs + top_logprobs) are the model's own log-probabilities, streamed too
(each chunk carries its tokens'). top_k is vLLM's extension. What a body may ask for is bounded
where a value would otherwise cost the server without limit or fail late: `seed` is a 64-bit
integer (torch's generator takes [-2^63, 2^64 - 1]; choice j draws from seed + j, so the
bound keeps the last choice's in range, as vLLM bounds it), at most MAX_STOPS stop strings of at
most MAX_STOP_CHARS characters each (OpenAI allows 4; each is looked for in the text after every
token, on the event loop: 300,000 of them held /health at 10 s) and at most MAX_STOP_TOKEN_IDS
stop_token_ids. Errors use OpenAI's shape:

    {"error": {"message": "...", "type": "invalid_request_error", "param": "max_tokens",
               "code": null}}
"""

from __future__ import annotations

import json
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

MAX_STOPS = 16  # stop strings a request may give (OpenAI: 4)
MAX_STOP_CHARS = 256  # characters in one stop string (a stream holds back this many - 1)
MAX_STOP_TOKEN_IDS = 256  # stop_token_ids a request may give
SEED = Field(ge=-(2**63), le=2**63 - 1)  # a signed 64-bit integer (vLLM's bound)


def error_body(
    message: str,
    param: str | None = None,
    kind: str = "invalid_request_error",
    code: str | None = None,
) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StreamOptions(_Strict):
    include_usage: bool = False


class JSONSchemaFormat(_Strict):
    name: str | None = None
    description: str | None = None
    schema_: dict = Field(alias="schema")
    strict: bool | None = None


class ResponseFormat(_Strict):
    """OpenAI's response_format: plain text, any JSON object, or one JSON schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self):
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError("json_schema is given with (and only with) type 'json_schema'")
        return self

    def schema(self) -> dict | None:
        """The JSON schema output must follow (None: any text)."""
        if self.type == "json_object":
            return {"type": "object"}
        return self.json_schema.schema_ if self.json_schema is not None else None


class _Sampling(_Strict):
    model: str
    temperature: Annotated[float, Field(ge=0, le=2)] = 1.0
    top_p: Annotated[float, Field(gt=0, le=1)] = 1.0
    top_k: Annotated[int, Field(ge=-1)] | None = None  # -1 or None: off (vLLM's convention)
    seed: Annotated[int, SEED] | None = None  # choice j draws from seed + j
    stop: str | list[str] | None = None
    stop_token_ids: (  # vLLM's: end at any of them
        Annotated[list[Annotated[int, Field(ge=0)]], Field(max_length=MAX_STOP_TOKEN_IDS)] | None
    ) = None
    response_format: ResponseFormat | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: Annotated[int, Field(ge=1, le=16)] = 1  # choices: one engine request each
    user: str | None = None
    presence_penalty: Annotated[float, Field(ge=-2, le=2)] = 0.0
    frequency_penalty: Annotated[float, Field(ge=-2, le=2)] = 0.0
    logit_bias: dict | None = None

    @field_validator("stop")
    @classmethod
    def _few_short_stops(cls, stop):
        stops = [stop] if isinstance(stop, str) else stop or []
        if len(stops) > MAX_STOPS:
            raise ValueError(f"{len(stops):,} stop strings, at most {MAX_STOPS} are allowed")
        longest = max(stops, key=len, default="")
        if len(longest) > MAX_STOP_CHARS:
            raise ValueError(
                f"a stop string of {len(longest):,} characters, at most {MAX_STOP_CHARS} are allowed"
            )
        return stop

    @model_validator(mode="after")
    def _neutral_logit_bias(self):
        if self.logit_bias:
            raise ValueError("logit_bias is not supported by this server: leave it out")
        return self

    def stops(self) -> list[str]:
        if self.stop is None:
            return []
        stops = [self.stop] if isinstance(self.stop, str) else self.stop
        return [s for s in stops if s]


class CompletionRequest(_Sampling):
    # one text or token list, or a batch of them (choices: prompt p's j-th is p * n + j)
    prompt: (
        str
        | list[int]
        | Annotated[list[str], Field(min_length=1, max_length=64)]
        | Annotated[list[list[int]], Field(min_length=1, max_length=64)]
    )
    max_tokens: Annotated[int, Field(ge=1)] | None = 16
    echo: bool = False  # the prompt before the completion (with logprobs: the prompt's too)
    logprobs: Annotated[int, Field(ge=0, le=20)] | None = None  # the k best besides the token
    suffix: None = None


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class FunctionCall(_Strict):
    name: str
    arguments: str  # JSON text, as OpenAI sends it

    @model_validator(mode="after")
    def _json_object(self):
        try:
            value = json.loads(self.arguments)
        except ValueError:
            value = None
        if not isinstance(value, dict):
            raise ValueError(f"the arguments of a call to '{self.name}' are not a JSON object")
        return self


class ToolCall(_Strict):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class Message(_Strict):
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool's answer: to which call

    def plain(self) -> dict:
        """As chat templates expect it: {"role", "content"} with the content as one string;
        an assistant's calls with their arguments as objects (what templates' `tojson` writes),
        a tool's answer with its call's id."""
        c = self.content
        text = c if isinstance(c, str) else "".join(p.text for p in c or ())
        out = {"role": "system" if self.role == "developer" else self.role, "content": text}
        if self.tool_calls:
            out["tool_calls"] = [
                {
                    "id": t.id,
                    "type": t.type,
                    "function": {
                        "name": t.function.name,
                        "arguments": json.loads(t.function.arguments),
                    },
                }
                for t in self.tool_calls
            ]
        for key in ("tool_call_id", "name"):
            if getattr(self, key) is not None:
                out[key] = getattr(self, key)
        return out


class FunctionDef(_Strict):
    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")]
    description: str | None = None
    parameters: dict | None = None  # a JSON schema (None: any object)
    strict: bool | None = None


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDef


class _Named(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: _Named


class ChatRequest(_Sampling):
    messages: Annotated[list[Message], Field(min_length=1)]
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    logprobs: bool | None = None
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True

    @model_validator(mode="after")
    def _top_needs_logprobs(self):
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        return self

    @model_validator(mode="after")
    def _tools_agree(self):
        names = [t.function.name for t in self.tools or ()]
        if len(set(names)) != len(names):
            raise ValueError("two tools have the same name")
        choice = self.tool_choice
        if choice not in (None, "none", "auto") and not names:
            raise ValueError("tool_choice asks for a call, but no tools are given")
        if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
            raise ValueError(
                f"tool_choice names '{choice.function.name}', which is not among the tools "
                f"({', '.join(names)})"
            )
        fmt = self.response_format
        if self.forces_call() and fmt is not None and fmt.type != "text":
            raise ValueError(
                "response_format and a tool_choice that forces a call both constrain the "
                "output: give one of them"
            )
        return self

    def tool_mode(self) -> str | NamedToolChoice | None:
        """How tools are used: None (no tools, or tool_choice "none"), "auto", "required" or
        the named function."""
        if not self.tools or self.tool_choice == "none":
            return None
        return self.tool_choice or "auto"

    def forces_call(self) -> bool:
        return self.tool_mode() not in (None, "auto")

    def logprobs_k(self) -> int | None:
        """The engine's logprobs (None: off)."""
        return (self.top_logprobs or 0) if self.logprobs else None


Body = CompletionRequest | ChatRequest  # what the two completion endpoints accept

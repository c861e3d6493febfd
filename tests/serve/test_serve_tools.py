"""Reading tool calls out of a model's text (src/attnlab/serve/tools.py): the formats chat
templates teach, and what is not a call stays content."""

from __future__ import annotations

import json

import pytest

from attnlab.serve.tools import parse_calls, template_takes_tools

NAMES = {"get_weather", "get_time"}


def _calls(text):
    content, calls = parse_calls(text, NAMES)
    return content, [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


@pytest.mark.parametrize(
    ("text", "content", "calls"),
    [
        ('<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>',
         None, [("get_time", {"zone": "UTC"})]),
        ('Let me look.\n<tool_call>{"name": "get_time", "arguments": {"zone": "UTC"}}</tool_call>'
         '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>',
         "Let me look.", [("get_time", {"zone": "UTC"}), ("get_weather", {"city": "Oslo"})]),
        ('<tool_call>{"name": "get_time", "arguments": {"zone": "UTC"}}',  # cut before </tool_call>
         None, [("get_time", {"zone": "UTC"})]),
        ('[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}]',
         None, [("get_weather", {"city": "Paris"})]),
        ('<|python_tag|>{"name": "get_time", "parameters": {"zone": "CET"}}',
         None, [("get_time", {"zone": "CET"})]),
        ('{"name": "get_time", "parameters": {"zone": "CET"}}', None, [("get_time", {"zone": "CET"})]),
        ('{"name": "get_time", "arguments": "{\\"zone\\": \\"CET\\"}"}',  # arguments as a string
         None, [("get_time", {"zone": "CET"})]),
    ],
)  # fmt: skip
def test_calls_in_the_formats_templates_teach(text, content, calls):
    assert _calls(text) == (content, calls)


@pytest.mark.parametrize(
    "text",
    [
        "It is sunny.",
        '{"name": "rm_rf", "arguments": {}}',  # not one of the request's tools
        '<tool_call>{"name": "get_time", "arguments": [1]}</tool_call>',  # arguments not an object
        "<tool_call>{not json}</tool_call>",
        '{"city": "Oslo"}',  # JSON, but not a call
        '[TOOL_CALLS] [{"name": "get_time"}]',  # no arguments
    ],
)
def test_what_is_not_a_call_stays_content(text):
    assert _calls(text) == (text, [])


def test_templates_that_read_tools_are_told_apart():
    assert template_takes_tools("{% if tools %}{{ tools | tojson }}{% endif %}{{ messages }}")
    assert not template_takes_tools("{% for m in messages %}{{ m.content }}{% endfor %}")
    assert not template_takes_tools("{% for %}")  # does not parse: fails later, with its reason


# --- streaming: CallStream --------------------------------------------------------------------


def _tools(*names):
    from attnlab.serve.protocol import ChatRequest

    body = ChatRequest.model_validate(
        {
            "model": "m",
            "messages": [{"role": "user", "content": "hi"}],
            "tools": [
                {"type": "function", "function": {"name": n, "parameters": {"type": "object"}}}
                for n in names
            ],
        }
    )
    return body.tools


def _stream(text, mode="auto", step=3):
    """Feed `text` `step` characters at a time: (content joined, {index: (name, args joined)},
    the number of characters fed when each call's name first went out, finish)."""
    from attnlab.serve.tools import CallStream

    cs = CallStream(_tools(*sorted(NAMES)), mode)
    content, calls, first = "", {}, {}
    cuts = [*range(step, len(text), step), len(text)]
    for n in cuts:
        piece, deltas = cs.feed(text[:n], final=n == len(text))
        content += piece
        for d in deltas:
            f = d["function"]
            if "name" in f:
                assert d["index"] not in calls and d["type"] == "function"
                assert d["id"].startswith("call_")
                calls[d["index"]] = [f["name"], ""]
                first[d["index"]] = n
            calls[d["index"]][1] += f["arguments"]
    return content, {i: (nm, json.loads(a)) for i, (nm, a) in calls.items()}, first, cs.finish


@pytest.mark.parametrize("step", [1, 3, 7])
def test_hermes_calls_stream_their_names_early_and_arguments_in_pieces(step):
    text = (
        'Let me look.\n<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC", "n": [1, {"a": "}"}]}}\n'
        '</tool_call>\n<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>'
    )
    content, calls, first, finish = _stream(text, step=step)
    assert content == "Let me look."
    assert calls == {
        0: ("get_time", {"zone": "UTC", "n": [1, {"a": "}"}]}),
        1: ("get_weather", {"city": "Oslo"}),
    }
    assert first[0] < text.index("get_weather")  # sent while the answer was still being written
    assert finish == "tool_calls"


@pytest.mark.parametrize(
    ("text", "content", "calls"),
    [
        ('[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}]',
         "", {0: ("get_weather", {"city": "Paris"})}),
        ('<|python_tag|>{"name": "get_time", "parameters": {"zone": "CET"}}',
         "", {0: ("get_time", {"zone": "CET"})}),
        ('{"name": "get_time", "parameters": {"zone": "CET"}}',  # bare: held, read at the end
         "", {0: ("get_time", {"zone": "CET"})}),
        ('<tool_call>{"name": "get_time", "arguments": "{\\"zone\\": \\"CET\\"}"}</tool_call>',
         "", {0: ("get_time", {"zone": "CET"})}),  # arguments as a string: whole at the end
        ("It is sunny in <tool or not.", "It is sunny in <tool or not.", {}),
        ('<tool_call>{"name": "get_\\u12x", "arguments": {}}</tool_call>',  # a broken escape
         '<tool_call>{"name": "get_\\u12x", "arguments": {}}</tool_call>', {}),
        ('{"name": "rm_rf", "arguments": {}}', '{"name": "rm_rf", "arguments": {}}', {}),
    ],
)  # fmt: skip
def test_every_format_streams_to_what_the_whole_answer_holds(text, content, calls):
    got_content, got_calls, _, _ = _stream(text, step=2)
    assert (got_content, got_calls) == (content, calls)
    whole_content, whole_calls = _calls(text)
    assert dict(enumerate(whole_calls)) == got_calls
    assert (whole_content or "") == got_content


def test_a_forming_marker_is_never_sent_as_content():
    from attnlab.serve.tools import CallStream

    cs = CallStream(_tools("get_time"), "auto")
    assert cs.feed("Sure. <tool")[0] == "Sure."  # the space waits too: before a call it is cut
    assert cs.feed('Sure. <tool_call>{"na')[0] == ""
    cs = CallStream(_tools("get_time"), "auto")
    assert cs.feed("Sure. <tool")[0] == "Sure."
    assert cs.feed("Sure. <tools are fine ")[0] == " <tools are fine"
    assert cs.feed("Sure. <tools are fine ", final=True)[0] == " "  # no call: all of it, in the end


def test_forced_modes_stream_their_arguments():
    from attnlab.serve.protocol import ChatRequest

    named = ChatRequest.model_validate(
        {"model": "m", "messages": [{"role": "user", "content": "x"}],
         "tools": [{"type": "function", "function": {"name": "get_time"}}],
         "tool_choice": {"type": "function", "function": {"name": "get_time"}}}
    ).tool_choice  # fmt: skip
    content, calls, first, finish = _stream('{"zone": "UTC"}', mode=named, step=4)
    assert content == "" and calls == {0: ("get_time", {"zone": "UTC"})} and first[0] == 4
    assert finish is None  # a named call ends as the engine says ("stop"), as OpenAI's
    text = '[{"name": "get_time", "arguments": {"zone": "UTC"}}, {"name": "get_weather", "arguments": {}}]'
    content, calls, first, finish = _stream(text, mode="required", step=5)
    assert calls == {0: ("get_time", {"zone": "UTC"}), 1: ("get_weather", {})}
    assert first[0] < len(text) // 2 and finish == "tool_calls"

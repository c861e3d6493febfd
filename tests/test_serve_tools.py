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

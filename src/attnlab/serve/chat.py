"""Chat messages -> the prompt text a model was trained on, with its own Jinja chat template.

The template comes with the model (tokenizer_config.json, chat_template.jinja, or the GGUF key
tokenizer.chat_template) and is rendered the way transformers' `apply_chat_template` does: in a
sandboxed, immutable Jinja environment (a template is code from the model's author and must not
reach the server), trim_blocks and lstrip_blocks on, with `messages`, `add_generation_prompt`,
`bos_token` and `eos_token`, `raise_exception` for the template's own errors and a `tojson` that
keeps non-ASCII text. The rendered text already holds any BOS the template writes, so it is
tokenized without adding special tokens.

A template is bounded: `range` yields at most RANGE_BUDGET values per render (nested
range(100000) loops hung the server), `*` and `**` may not build values past MAX_CHARS, and the
output stops at MAX_CHARS; each is a TemplateError (a 400), never a hang.
"""

from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache


class TemplateError(ValueError):
    """The template refused the conversation (its raise_exception) or failed to render."""


def _raise(message: str):
    raise TemplateError(message)


RANGE_BUDGET = 1_000_000  # values `range` may yield in one render
MAX_CHARS = 10_000_000  # the longest string or list a template may build, and its output


def _budgeted_range():
    """A `range` for one render that stops the template past RANGE_BUDGET values in all."""
    left = [RANGE_BUDGET]

    def bounded(*args):
        r = range(*args)
        left[0] -= len(r)
        if left[0] < 0:
            raise TemplateError(
                f"the chat template loops over more than {RANGE_BUDGET:,} values: it is not a "
                "template this server runs"
            )
        return r

    return bounded


@lru_cache(maxsize=8)
def _compile(template: str):
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Bounded(ImmutableSandboxedEnvironment):
        intercepted_binops = frozenset(["*", "**"])

        def call_binop(self, context, operator, left, right):
            if operator == "**" and isinstance(right, int) and right > 64 and abs(left) > 1:
                raise TemplateError(f"the chat template computes {left} ** {right}: too large")
            if operator == "*":
                for seq, n in ((left, right), (right, left)):
                    sized = isinstance(seq, (str, list, tuple)) and isinstance(n, int)
                    if sized and len(seq) * n > MAX_CHARS:
                        raise TemplateError(
                            f"the chat template builds a value of {len(seq) * n:,} items: "
                            f"more than {MAX_CHARS:,}"
                        )
            return super().call_binop(context, operator, left, right)

    env = Bounded(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = lambda x, indent=None, **_: json.dumps(
        x, ensure_ascii=False, indent=indent
    )
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(template)


def render_chat(
    template: str, messages: list[dict], bos_token: str = "", eos_token: str = "", **extra
) -> str:
    """The conversation as prompt text, ending with the assistant's turn opened."""
    try:
        parts, size = [], 0
        for part in _compile(template).generate(  # piece by piece: the output is bounded too
            messages=messages,
            add_generation_prompt=True,
            bos_token=bos_token,
            eos_token=eos_token,
            range=_budgeted_range(),
            **extra,
        ):
            size += len(part)
            if size > MAX_CHARS:
                raise TemplateError(
                    f"the chat template's output passes {MAX_CHARS:,} characters: it is not a "
                    "template this server runs"
                )
            parts.append(part)
        return "".join(parts)
    except TemplateError:
        raise
    except Exception as err:  # jinja's errors, and whatever the template's own code raises
        raise TemplateError(f"the model's chat template failed on these messages: {err}") from None

"""Chat messages -> the prompt text a model was trained on, with its own Jinja chat template.

The template comes with the model (tokenizer_config.json, chat_template.jinja, or the GGUF key
tokenizer.chat_template) and is rendered the way transformers' `apply_chat_template` does: in a
sandboxed, immutable Jinja environment (a template is code from the model's author and must not
reach the server), trim_blocks and lstrip_blocks on, with `messages`, `add_generation_prompt`,
`bos_token` and `eos_token`, `raise_exception` for the template's own errors and a `tojson` that
keeps non-ASCII text. The rendered text already holds any BOS the template writes, so it is
tokenized without adding special tokens.
"""

from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache


class TemplateError(ValueError):
    """The template refused the conversation (its raise_exception) or failed to render."""


def _raise(message: str):
    raise TemplateError(message)


@lru_cache(maxsize=8)
def _compile(template: str):
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
    )
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
        return _compile(template).render(
            messages=messages,
            add_generation_prompt=True,
            bos_token=bos_token,
            eos_token=eos_token,
            **extra,
        )
    except TemplateError:
        raise
    except Exception as err:  # jinja's errors, and whatever the template's own code raises
        raise TemplateError(f"the model's chat template failed on these messages: {err}") from None

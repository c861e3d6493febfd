"""A model as it was read from a file, with what generating text from it needs: the one record
every source gives (a .gguf file: src/attnlab/interop/gguf/reader.py; a run directory, checkpoint
folder or HF folder: src/attnlab/loading.py), so `attnlab generate`, `chat`, `convert` and
`serve` never ask where a model came from.

    g = al.interop.load_gguf("SmolLM2-135M-Instruct.Q4_1.gguf")
    g.model, g.tokenizer, g.chat_template, g.bos_token_id, g.eos_token_ids, g.name
    text = g.apply_chat_template([{"role": "user", "content": "Hi"}], add_generation_prompt=True)

It sits in interop/ (below src/attnlab/loading.py, which also reads training runs) because the
GGUF reader builds it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from torch import nn


@dataclass
class LoadedModel:
    """The model (eval mode), its tokenizer and chat template, and the token ids generation needs
    (`eos_token_ids`: every id that ends a turn, first the EOS)."""

    model: nn.Module
    tokenizer: Any  # tokenizers.Tokenizer
    chat_template: str | None
    bos_token_id: int | None
    eos_token_ids: list[int]
    name: str
    metadata: dict[str, Any] = field(default_factory=dict, repr=False)  # a GGUF file's keys
    packed: dict[str, int] | None = None  # load_gguf(packed=True): maps kept as each block kind
    context_length: int | None = None  # positions the model was trained for, if it says

    def token(self, i: int | None) -> str:
        """The text of special token `i` (what chat templates call bos_token / eos_token)."""
        return "" if i is None else (self.tokenizer.id_to_token(i) or "")

    def special_tokens(self) -> dict[str, str]:
        """The special tokens' text a chat template reads: bos_token and eos_token, and where the
        model came from a GGUF file, the ones its tokenizer.ggml.*_token_id keys name."""
        from .gguf.tokenizer import special_tokens

        eos = self.eos_token_ids[0] if self.eos_token_ids else None
        own = {"bos_token": self.token(self.bos_token_id), "eos_token": self.token(eos)}
        return {**{k: v for k, v in own.items() if v}, **special_tokens(self.metadata)}

    def apply_chat_template(
        self, messages: list[dict], add_generation_prompt: bool = False, **kwargs: Any
    ) -> str:
        """The conversation as the prompt text the model was trained on (its Jinja template,
        rendered as transformers' `apply_chat_template(tokenize=False)` does)."""
        from .gguf.tokenizer import render_chat

        if self.chat_template is None:
            raise ValueError(
                f"{self.name} has no tokenizer.chat_template: format the prompt yourself"
            )
        return render_chat(
            self.chat_template, messages, self.special_tokens(), add_generation_prompt, **kwargs
        )

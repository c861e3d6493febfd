"""Structured output (`response_format`): a JSON schema becomes a token mask at every step,
through llguidance (the grammar engine of Microsoft's Guidance, one of vLLM's and SGLang's
backends). Chosen over xgrammar, whose wheel pulls in triton and a TVM runtime (pip's dry run
here), and over outlines-core, which compiles a schema into a regex and an index over the whole
vocabulary up front: llguidance parses lazily, computing each step's mask as it goes, installs
as one wheel without dependencies, and takes the `tokenizers` JSON we already hold.

    grammar = Grammar(tokenizer, eos_token_id)     once per served model (the token trie)
    c = grammar.constraint({"type": "object"})    one per request: JSONConstraint
    c.allowed(V) -> (V,) bool; c.accept(token); c.finished

The engine masks every other token before sampling (decode/engine.py, `Request.constraint`), so
greedy and sampled output both parse and validate; the request ends ("stop") once the grammar
is complete and has taken the EOS token.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import torch

LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class GrammarError(ValueError):
    """A schema the grammar engine cannot compile (the message says why)."""


class Grammar:
    def __init__(self, tokenizer, eos_token_id: int) -> None:
        import llguidance

        self._llg = llguidance
        self.eos = eos_token_id
        self.tokenizer = llguidance.LLTokenizer(
            tokenizer.to_str(), n_vocab=tokenizer.get_vocab_size(), eos_token=eos_token_id
        )

    def constraint(self, schema: dict[str, Any]) -> JSONConstraint:
        # one canonical layout (", " and ": ", no other whitespace): a model cannot fill the
        # answer with newlines, and the text is what json.dumps would write
        grammar = self._llg.LLMatcher.grammar_from_json_schema(json.dumps(schema), defaults=LAYOUT)
        matcher = self._llg.LLMatcher(self.tokenizer, grammar)
        if matcher.is_error():
            raise GrammarError(f"the JSON schema cannot be compiled: {matcher.get_error()}")
        constraint = JSONConstraint(matcher)
        # llguidance compiles some schemas no value satisfies (a $ref to itself: {"$ref": "#"})
        # and finds out only at the first mask, which then allows the end of text alone: the
        # answer was "" with finish_reason "stop", not JSON. The first mask is computed here
        # (once; the matcher's state is unchanged) so that such a schema is a 400.
        first = constraint.allowed(self.tokenizer.vocab_size)
        if matcher.is_error() or not first.any() or (first.sum() == 1 and first[self.eos]):
            raise GrammarError(
                "the JSON schema admits no value (a $ref that refers only to itself, such as "
                '{"$ref": "#"}, defines nothing): give the schema a type or properties'
            )
        return constraint


class JSONConstraint:
    def __init__(self, matcher) -> None:
        self.matcher = matcher

    def allowed(self, vocab_size: int) -> torch.Tensor:
        """(V,) bool: the tokens the grammar accepts next (llguidance's bitmask, 32 per word)."""
        words = np.frombuffer(self.matcher.compute_bitmask(), dtype=np.uint32)
        bits = (words[:, None] >> np.arange(32, dtype=np.uint32)) & 1  # (W, 32)
        return torch.from_numpy(bits.reshape(-1)[:vocab_size].astype(bool))

    def accept(self, token: int) -> None:
        self.matcher.consume_token(token)

    @property
    def finished(self) -> bool:
        return self.matcher.is_stopped()

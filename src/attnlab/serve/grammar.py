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
        if not admits_a_value(schema):  # llguidance would compile it: the answer never ends
            raise GrammarError(
                "the JSON schema admits no value: it requires itself without end (a $ref to "
                "itself, or a required property or an array's minItems whose schema leads back "
                "to it): make the recursion optional"
            )
        # one canonical layout (", " and ": ", no other whitespace): a model cannot fill the
        # answer with newlines, and the text is what json.dumps would write
        grammar = self._llg.LLMatcher.grammar_from_json_schema(json.dumps(schema), defaults=LAYOUT)
        matcher = self._llg.LLMatcher(self.tokenizer, grammar)
        if matcher.is_error():
            raise GrammarError(f"the JSON schema cannot be compiled: {matcher.get_error()}")
        constraint = JSONConstraint(matcher)
        # llguidance compiles some schemas no value satisfies and finds out only at the first
        # mask, which then allows the end of text alone ({"$ref": "#"} gave "" with finish_reason
        # "stop", not JSON, before admits_a_value caught it): the first mask is computed here
        # (once; the matcher's state is unchanged) so that any other such schema is a 400 too.
        first = constraint.allowed(self.tokenizer.vocab_size)
        if matcher.is_error() or not first.any() or (first.sum() == 1 and first[self.eos]):
            raise GrammarError(
                "the JSON schema admits no value (the grammar engine allows no text at its "
                "start): check the schema's types and $refs"
            )
        return constraint


def admits_a_value(schema: Any, budget: int = 100_000, depth: int = 64) -> bool:
    """False where no finite JSON value can satisfy `schema` because it requires itself: a
    `$ref` to itself ({"$ref": "#"}), an object that requires a property whose schema leads
    back to the object, an array with minItems >= 1 whose items do. An AND-OR graph's
    productivity: a node on the current path counts as unsatisfiable (a finite value never
    needs to pass through the same schema twice on one path). Conservative: every other
    keyword is taken as satisfiable, as is a $ref outside the document; past `budget` visits or
    `depth` nested schemas the answer is True (llguidance decides: a walk as deep as the schema
    would end in Python's recursion limit, a 500)."""
    known: set[int] = set()  # ids of schemas found satisfiable (whatever the path)
    visits = [0]

    def target(ref: str) -> Any:
        if ref == "#":
            return schema
        if not ref.startswith("#/"):
            return True
        node = schema
        for part in ref[2:].split("/"):
            part = part.replace("~1", "/").replace("~0", "~")
            if isinstance(node, dict) and part in node:
                node = node[part]
            elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
                node = node[int(part)]
            else:
                return True
        return node

    def ok(node: Any, path: frozenset[int]) -> bool:
        if not isinstance(node, dict):
            return node is not False
        if id(node) in known:
            return True
        if id(node) in path:
            return False
        visits[0] += 1
        if visits[0] > budget or len(path) > depth:
            return True
        path = path | {id(node)}
        needed = []  # schemas that must all be satisfiable
        if isinstance(node.get("$ref"), str):
            needed.append(target(node["$ref"]))
        needed += node.get("allOf", []) if isinstance(node.get("allOf"), list) else []
        props = node.get("properties") if isinstance(node.get("properties"), dict) else {}
        if node.get("type") == "object" and isinstance(node.get("required"), list):
            needed += [props[k] for k in node["required"] if isinstance(k, str) and k in props]
        least = node.get("minItems", 0)
        if node.get("type") == "array" and isinstance(least, int) and least > 0:
            prefix = node.get("prefixItems") if isinstance(node.get("prefixItems"), list) else []
            needed += prefix[:least]
            if least > len(prefix) and "items" in node:
                needed.append(node["items"])
        good = all(ok(n, path) for n in needed)
        for key in ("anyOf", "oneOf"):
            if good and isinstance(node.get(key), list) and node[key]:
                good = any(ok(n, path) for n in node[key])
        if good:
            known.add(id(node))
        return good

    return ok(schema, frozenset())


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

"""The pieces of an answer in OpenAI's shapes: a choice's text as its tokens come, their
log-probabilities, the usage.

`Text` detokenizes incrementally: the whole answer is decoded again at each token and only the
part that is safe is handed out: whole UTF-8 (a multi-byte character split over tokens reads
"\\ufffd" until its last byte) and never the start of a stop string (the last len(longest stop)
- 1 characters are held back); a stop string cuts the text before it and marks it `stopped`.
"""

from __future__ import annotations

import itertools


class Text:
    """Incremental detokenization with stop strings (see the module docstring)."""

    def __init__(self, tokenizer, stops: list[str]) -> None:
        self.tok, self.stops, self.ids, self.sent = tokenizer, stops, [], 0
        self.hold = max((len(s) for s in stops), default=1) - 1
        self.text, self.stopped = "", False

    def add(self, token: int) -> str:
        self.ids.append(token)
        self.text = self.tok.decode(self.ids, skip_special_tokens=True)
        if self.stops:
            hits = [
                i for s in self.stops if (i := self.text.find(s, max(0, self.sent - len(s)))) >= 0
            ]
            if hits:
                self.text, self.stopped = self.text[: min(hits)], True
                return self.flush()
        safe = len(self.text) - self.hold
        if self.text.endswith("\ufffd"):  # a multi-byte character not yet complete
            safe = min(safe, len(self.text) - 1)
        delta = self.text[self.sent : max(safe, self.sent)]
        self.sent += len(delta)
        return delta

    def flush(self) -> str:
        delta = self.text[self.sent :]
        self.sent = len(self.text)
        return delta


def _piece(tok, token: int) -> str:
    return tok.decode([token], skip_special_tokens=False)


def chat_logprob(tok, e) -> dict:
    """One token of a chat choice's `logprobs.content`, in OpenAI's shape."""

    def entry(token: int, logprob: float) -> dict:
        s = _piece(tok, token)
        return {"token": s, "logprob": logprob, "bytes": list(s.encode("utf-8"))}

    return {**entry(e.token, e.logprob), "top_logprobs": [entry(t, v) for t, v in e.top_logprobs]}


def _alternatives(tok, top) -> dict[str, float]:
    """{text: logprob} of the best tokens; two whose text is the same (byte pieces of one
    character both read "\ufffd") are told apart by their vocabulary entries."""
    out: dict[str, float] = {}
    for t, v in top:
        key = _piece(tok, t)
        out[key if key not in out else tok.id_to_token(t)] = v
    return out


def completion_logprobs(
    tok, events: list, k: int, prompt: list[int] = (), head=(), start: int = 0
) -> dict:
    """A completion choice's `logprobs` (OpenAI's legacy shape): each token's text, its
    log-probability, its k best alternatives, its character offset in the text (from `start`:
    a streamed chunk's offsets continue the text before it); with echo the prompt's tokens
    first, `head` their (logprob, best) pairs given the tokens before each (the first has none:
    nothing comes before it)."""
    pieces = [_piece(tok, t) for t in prompt] + [_piece(tok, e.token) for e in events]
    offsets = list(itertools.accumulate(map(len, pieces), initial=start))[:-1]
    head = list(head or ())
    lps = [None, *(lp for lp, _ in head)][: len(prompt)] + [e.logprob for e in events]
    tops = [None, *(_alternatives(tok, t) for _, t in head)][: len(prompt)]
    return {
        "tokens": pieces,
        "token_logprobs": lps,
        "top_logprobs": tops + [_alternatives(tok, e.top_logprobs) for e in events] if k else None,
        "text_offset": offsets,
    }


def usage(prompt: int, completion: int) -> dict:
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }

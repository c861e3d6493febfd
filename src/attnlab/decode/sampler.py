"""Picking the next token without reading the device: one row (`sample_next`, what `generate`
draws with) or a batch of rows with settings of their own (`sample_rows`, the engine's output
side, src/attnlab/decode/output.py).

A draw from softmax(z) is the race argmax_i p_i / E_i with E_i ~ Exp(1) independent: the
smallest E_i / p_i is an exponential of rate p_i racing the others, and it wins with probability
p_i / sum(p) (the exponential-race form of the Gumbel-max trick; Maddison et al. 2014,
arXiv:1411.0030, section 2). `torch.multinomial(p, 1, generator=g)` computes it on the CPU, draw
for draw with the same generator (tests/decode/test_sampler.py checks this); it is written out here
because then nothing reads the device from the host (torch's own call may check its input there)
and because the noise E of a batch can come from one generator per row: a request seeded alone
gets the same tokens in any batch.

    sample_next   (B, V) logits, one temperature / top-k / top-p for all rows, one generator
    sample_rows   (B, V) logits, each row its own settings and its own noise
    noise_rows    the noise of sample_rows: a row of Exp(1) from each row's generator

The truncations (top-k, then top-p: the smallest set of the most likely tokens whose mass reaches
top_p; Holtzman et al. 2019, arXiv:1904.09751, section 3.1) act on logits / temperature, in the
order transformers applies its warpers. A row with temperature 0 is greedy.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

_INF = float("inf")


def _race(logits: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """argmax_i softmax(logits)_i / noise_i per row: a draw from softmax(logits) for noise ~
    Exp(1)."""
    return (logits.softmax(dim=-1) / noise).argmax(dim=-1)


def _nucleus(logits: torch.Tensor, top_p: torch.Tensor | float) -> torch.Tensor:
    """logits (B, V) with -inf outside each row's nucleus: keep the most likely tokens until
    their mass reaches top_p (a scalar or (B, 1)); the most likely one always stays."""
    ordered, order = logits.sort(dim=-1, descending=True)
    p = ordered.softmax(dim=-1)
    drop = p.cumsum(dim=-1) - p >= top_p  # the mass before a token already reaches top_p
    ordered = ordered.masked_fill(drop, -_INF)
    return torch.full_like(logits, -_INF).scatter(-1, order, ordered)


def sample_next(
    logits: torch.Tensor,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """One token per row from logits (B, V): temperature, then top-k, then nucleus (top-p),
    then a draw with `generator` (None: torch's global one). temperature <= 0: the argmax.
    sample_rows with these settings on every row: a row draws what it draws in any batch."""
    if temperature <= 0:
        return logits.argmax(dim=-1)
    B, V = logits.shape
    t = torch.full((B,), float(temperature), dtype=logits.dtype, device=logits.device)
    k = None if top_k is None or top_k >= V else torch.full_like(t, top_k, dtype=torch.long)
    p = None if top_p is None or top_p >= 1.0 else torch.full_like(t, top_p)
    noise = torch.empty_like(logits).exponential_(generator=generator)
    return sample_rows(logits, t, noise, k, p)


def noise_rows(
    generators: Sequence[torch.Generator | None], vocab: int, device: torch.device | str
) -> torch.Tensor:
    """(B, vocab) Exp(1) noise for sample_rows: row b from generators[b], the rows whose
    generator is None from torch's global one (in one draw). A row drawn from its own generator
    is what sample_next draws for that row alone with it, so a seeded request samples the same
    tokens in any batch."""
    noise = torch.empty(len(generators), vocab, device=device)
    shared = [b for b, g in enumerate(generators) if g is None]
    for b, g in enumerate(generators):
        if g is not None:
            noise[b].exponential_(generator=g)
    if shared:
        noise[shared] = torch.empty(len(shared), vocab, device=device).exponential_()
    return noise


def sample_rows(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    noise: torch.Tensor | None,
    top_k: torch.Tensor | None = None,
    top_p: torch.Tensor | None = None,
) -> torch.Tensor:
    """One token per row of logits (B, V), each row with its own settings, as sample_next draws
    it for that row alone with the same noise. temperature (B,): 0 for a greedy row; noise
    (B, V): Exp(1) draws (noise_rows), None when every row is greedy; top_k (B,) long: V for a
    row without one; top_p (B,): above 1 for a row without one. None: no row has one. Reads
    nothing back from the device (and compiles whole)."""
    greedy = logits.argmax(dim=-1)
    if noise is None:
        return greedy
    sampled = temperature > 0
    # times 1 / T rather than over T: torch divides by a one-element tensor as by a scalar,
    # through its reciprocal, so a row alone would round differently from the same row in a batch
    z = logits * (1.0 / torch.where(sampled, temperature, 1.0))[:, None]
    if top_k is not None:
        V = z.shape[-1]
        kth = z.sort(dim=-1, descending=True).values.gather(1, (top_k.clamp(1, V) - 1)[:, None])
        z = z.masked_fill(z < kth, -_INF)  # (B, V): row b's k-th largest and above
    if top_p is not None:
        z = _nucleus(z, top_p[:, None])
    return torch.where(sampled, _race(z, noise), greedy)

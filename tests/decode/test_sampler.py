"""The sampler (src/attnlab/decode/sampler.py) and the engine's output side that uses it
(src/attnlab/decode/output.py):

- the exponential race is torch.multinomial's draw, draw for draw with the same generator;
- sample_rows draws each row from its own truncated distribution (empirical frequencies against
  a float64 target, every row with other settings);
- a row draws the same token alone (sample_next) and in any batch (sample_rows with its
  generator's noise), and compiled (inductor, fullgraph) as eager;
- the output side reads the device once per step for the tokens (and once more for the
  log-probabilities where asked), whatever the rows' penalties, constraints and settings.
"""

import pytest
import torch

from attnlab.decode.engine import Request
from attnlab.decode.output import Output
from attnlab.decode.requests import Seq
from attnlab.decode.sampler import noise_rows, sample_next, sample_rows

V = 40


def _logits(rows: int, seed: int) -> torch.Tensor:
    return torch.randn(rows, V, generator=torch.Generator().manual_seed(seed)) * 2


def test_the_race_is_torch_multinomials_draw():
    logits = _logits(5, 0)
    for seed in range(20):
        want = torch.multinomial(
            logits.softmax(-1), 1, generator=torch.Generator().manual_seed(seed)
        ).squeeze(-1)
        got = sample_next(logits, generator=torch.Generator().manual_seed(seed))
        assert torch.equal(got, want)


def _target(logits: torch.Tensor, t: float, k: int | None, p: float | None) -> torch.Tensor:
    """float64: softmax(logits / t) kept on the top k, then on the smallest most-likely set
    whose mass reaches p, renormalised."""
    q = (logits.double() / t).softmax(-1)
    if k is not None:
        q = torch.where(q >= q.topk(k).values[-1], q, 0.0)
        q = q / q.sum()
    if p is not None:
        order = q.argsort(descending=True)
        before = q[order].cumsum(0) - q[order]
        keep = torch.zeros_like(q, dtype=torch.bool)
        keep[order] = before < p
        q = torch.where(keep, q, 0.0)
        q = q / q.sum()
    return q


SETTINGS = [(0.7, None, None), (1.5, 5, None), (1.0, None, 0.6), (2.0, 8, 0.5)]


def test_each_row_draws_from_its_own_truncated_distribution():
    """40,000 draws per setting, the four settings interleaved row by row in one batch."""
    n = 40_000
    base = _logits(1, 4)[0]
    t = torch.tensor([s[0] for s in SETTINGS]).repeat(n)
    k = torch.tensor([s[1] or V for s in SETTINGS]).repeat(n)
    p = torch.tensor([s[2] or 2.0 for s in SETTINGS]).repeat(n)
    noise = torch.empty(len(t), V).exponential_(generator=torch.Generator().manual_seed(1))
    draws = sample_rows(base.expand(len(t), V), t, noise, k, p).view(n, len(SETTINGS))
    for i, (temp, top_k, top_p) in enumerate(SETTINGS):
        q = _target(base, temp, top_k, top_p)
        freq = torch.bincount(draws[:, i], minlength=V).double() / n
        assert set(draws[:, i].unique().tolist()) <= set(q.nonzero().flatten().tolist())
        assert (freq - q).abs().max() < 5 * 0.5 / n**0.5  # 5 standard errors at most


def test_a_seeded_row_draws_the_same_alone_and_in_any_batch():
    logits = _logits(6, 2)
    settings = [(0.8, None, None), (1.3, 4, None), (0.0, None, None), (1.0, None, 0.7),
                (0.6, 10, 0.9), (1.1, None, None)]  # fmt: skip
    for step in range(5):
        seeds = [step * 10 + b for b in range(len(settings))]
        alone = [
            int(sample_next(logits[b : b + 1], t, k, p, torch.Generator().manual_seed(s))[0])
            for b, ((t, k, p), s) in enumerate(zip(settings, seeds, strict=True))
        ]
        gens = [torch.Generator().manual_seed(s) for s in seeds]
        noise = noise_rows(gens, V, "cpu")
        batch = sample_rows(
            logits,
            torch.tensor([t for t, _, _ in settings]),
            noise,
            torch.tensor([k or V for _, k, _ in settings]),
            torch.tensor([p or 2.0 for _, _, p in settings]),
        )
        assert batch.tolist() == alone


def test_compiled_sample_rows_draws_what_eager_draws():
    torch._dynamo.reset()
    B = 64
    logits = _logits(B, 3)
    g = torch.Generator().manual_seed(0)
    t = torch.rand(B, generator=g) * 2
    t[::5] = 0.0  # some greedy rows
    k = torch.randint(1, V + 1, (B,), generator=g)
    p = torch.rand(B, generator=g) + 0.2  # some above 1: no nucleus
    noise = torch.empty(B, V).exponential_(generator=g)
    compiled = torch.compile(sample_rows, fullgraph=True, dynamic=False)
    assert torch.equal(compiled(logits, t, noise, k, p), sample_rows(logits, t, noise, k, p))
    assert torch.equal(compiled(logits, t, noise, k, p)[::5], logits[::5].argmax(-1))


def _seqs(requests: list[Request]) -> list[Seq]:
    out = []
    for i, r in enumerate(requests):
        gen = torch.Generator().manual_seed(r.seed) if r.seed is not None else None
        out.append(Seq(i, r, gen, tokens=[3, 3, 7][: i % 4]))
    return out


class _Only:
    """A constraint allowing two tokens."""

    finished = False

    def allowed(self, vocab: int) -> torch.Tensor:
        return torch.isin(torch.arange(vocab), torch.tensor([5, 9]))

    def accept(self, token: int) -> None:
        pass


@pytest.mark.parametrize("logprobs", [None, 3])
def test_the_output_side_reads_the_device_once_a_step(device_reads, logprobs):
    """One read for the batch's tokens, one more for the log-probabilities where asked."""
    reqs = [Request([1], max_tokens=9, temperature=0.9, seed=5, top_k=4, logprobs=logprobs),
            Request([1], max_tokens=9, frequency_penalty=0.5, presence_penalty=0.2),
            Request([1], max_tokens=9, temperature=1.2, top_p=0.8, constraint=_Only()),
            Request([1], max_tokens=9, temperature=0.7, seed=2, frequency_penalty=1.0),
            Request([1], max_tokens=9)]  # fmt: skip
    out = Output("cpu")
    seqs = _seqs(reqs)
    with device_reads:
        sampled = out.sample(seqs, _logits(len(reqs), 5))
    assert device_reads.names == ["tolist"] * (1 if logprobs is None else 2), device_reads.names
    assert sampled[2][0] in (5, 9)
    # one token a row, and the requests untouched (the scheduler's update appends them)
    assert len(sampled) == 5 and [len(s.tokens) for s in seqs] == [0, 1, 2, 3, 0]


def test_the_output_side_picks_each_row_as_alone():
    """Rows with penalties, constraints and sampling picked in one batch and one by one."""
    reqs = [Request([1], max_tokens=9, temperature=0.9, seed=5, top_k=4),
            Request([1], max_tokens=9, frequency_penalty=0.5, presence_penalty=0.2),
            Request([1], max_tokens=9, temperature=1.2, seed=1, top_p=0.8, constraint=_Only()),
            Request([1], max_tokens=9, temperature=0.7, seed=2, frequency_penalty=1.0),
            Request([1], max_tokens=9)]  # fmt: skip
    logits = _logits(len(reqs), 6)
    out = Output("cpu")
    batch = out.pick(_seqs(reqs), logits).tolist()
    alone = [int(out.pick([s], logits[b : b + 1])[0]) for b, s in enumerate(_seqs(reqs))]
    assert batch == alone

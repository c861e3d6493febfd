"""How many prompt tokens fit in what is left of an engine step's time (src/attnlab/decode/engine.py,
`max_step_ms`): the inter-token latency a running stream sees is the length of a step, its decodes
plus the prompt chunks that share it. The scheduler plans a step before it runs, so both halves
are predicted: one `CallCosts` fits the engine's decode calls to their rows, one its prefill calls
to their padded tokens.

A token budget (`step_tokens`, vLLM's max_num_batched_tokens) bounds a step's work in tokens,
which sets its time only where decode rows and prompt tokens cost the same and the machine's
speed is known. On a CPU neither holds: a step is compute-bound, a prompt chunk's call pays a
fixed cost of its own (its attention and small ops), and the step's cost changes with the
machine. So the engine times its own calls: `CallCosts` fits the time of a call to its size,
t ≈ a + b·n (least squares, older calls weighted down so the fit follows the machine's load), and
a step whose decodes are predicted to take t_dec gives the prompts the largest n with
(a + b·n)·s ≤ max_step − t_dec, or none when not even one token fits (Agrawal et al. 2024,
arXiv:2403.02310, Sarathi-Serve, section 4.3: a step's token budget chosen from the inter-token
latency target; here refitted as the engine runs). s covers what the line misses — a chunk's
attention over its cached context, the mix of row counts, a noisy machine: the mean plus two
standard deviations of the recent calls' actual / predicted times (about 98 % of normally spread
calls within it), so that most steps, not only the average one, end in time
(benchmarks/serve_http.py's "max" rows: the streams' inter-token p99 in decode steps).
"""

from __future__ import annotations

import math

# the fit follows about the last 20 calls (0.95^20 ≈ 0.36: older ones weigh a third or less)
DECAY = 0.95
# a call further than this factor from the line counts as this far off, in the fit and in s: one
# stall (a page fault, another process) is not the machine's speed
CLIP = 2.0


class CallCosts:
    """Seconds a call of size n (a prefill's padded tokens, a decode's rows) takes, fitted to the
    calls seen so far."""

    def __init__(self, decay: float = DECAY) -> None:
        self.decay = decay
        self._w = self._n = self._t = self._nn = self._nt = 0.0  # weighted sums
        self._e = self._r = self._rr = 0.0  # weight, sums of actual / predicted and its square

    def add(self, tokens: int, seconds: float) -> None:
        """One call: its size (a prefill's padded tokens, rows × widest chunk; a decode's rows)
        and its time (a time that is not a positive number — a coarse or broken clock — is
        ignored)."""
        if not (tokens > 0 and 0.0 < seconds < math.inf):
            return
        k, line = self.decay, self._line()
        if line is not None:  # how far off the line was, clipped (CLIP)
            predicted = line[0] + line[1] * tokens
            r = min(CLIP, max(1 / CLIP, seconds / predicted))
            self._e, self._r, self._rr = k * self._e + 1.0, k * self._r + r, k * self._rr + r * r
            seconds = r * predicted
        self._w = k * self._w + 1.0
        self._n = k * self._n + tokens
        self._t = k * self._t + seconds
        self._nn = k * self._nn + tokens * tokens
        self._nt = k * self._nt + tokens * seconds

    @property
    def fitted(self) -> tuple[float, float] | None:
        """(a, b) of t ≈ a + b·n; None before any call. With calls of one size only, the line
        through the origin (no fixed cost known yet: the larger estimate per token for larger
        calls)."""
        if self._w == 0.0:
            return None
        line = self._line()
        if line is None:
            return 0.0, self._t / max(self._n, self._w)
        return line

    def _line(self) -> tuple[float, float] | None:
        """The least-squares line, where the calls' sizes differ enough to give one."""
        if self._w == 0.0:
            return None
        mean_n, mean_t = self._n / self._w, self._t / self._w
        var = self._nn / self._w - mean_n * mean_n
        if var <= 1e-9 * max(1.0, mean_n * mean_n):  # one size, up to rounding
            return None
        b = (self._nt / self._w - mean_n * mean_t) / var
        if not 0.0 < b < math.inf:  # noise over a narrow range of sizes
            return None
        a = max(0.0, mean_t - b * mean_n)
        return a, b

    @property
    def margin(self) -> float:
        """s: mean + 2 standard deviations of actual / predicted time (each clipped, CLIP) over
        the calls a line predicted; 1 before any."""
        if self._e == 0.0:
            return 1.0
        mean = self._r / self._e
        std = max(0.0, self._rr / self._e - mean * mean) ** 0.5
        return mean + 2.0 * std

    def predict(self, n: int) -> float | None:
        """Seconds a call of size n is expected to take, with the margin s (most calls end
        within it); None before any call was timed."""
        fit = self.fitted
        return None if fit is None else (fit[0] + fit[1] * n) * self.margin

    def tokens_within(self, seconds: float, first: int) -> int:
        """Padded prompt tokens a call can take within `seconds`: 0 where not even one token
        fits; `first` before any call was timed."""
        fit = self.fitted
        if fit is None or not fit[1] > 0.0:
            return first
        a, b = fit
        n = (seconds / self.margin - a) / b
        return math.floor(n) if n >= 1 else 0

"""How many prompt tokens fit in what is left of an engine step's time (src/attnlab/decode/engine.py,
`max_step_ms`): the inter-token latency a running stream sees is the length of a step, its decodes
plus the prompt chunks that share it.

A token budget (`step_tokens`, vLLM's max_num_batched_tokens) bounds a step's work in tokens,
which sets its time only where decode rows and prompt tokens cost the same and the machine's
speed is known. On a CPU neither holds: a step is compute-bound, a prompt chunk's call pays a
fixed cost of its own (its attention and small ops), and the step's cost changes with the
machine. So the engine times its own calls: `PrefillCosts` fits the time of a prefill call to
its padded tokens, t ≈ a + b·n (least squares, older calls weighted down so the fit follows the
machine's load), and a step whose decodes took t_dec gives the prompts the n with
(a + b·n)·s ≤ max_step − t_dec (Agrawal et al. 2024, arXiv:2403.02310, Sarathi-Serve, section
4.3: a step's token budget chosen from the inter-token latency target; here refitted as the
engine runs). s covers what the line misses — a chunk's attention over its cached context, the
mix of row counts, a noisy machine: the mean plus two standard deviations of the recent calls'
actual / predicted times, so that most steps, not only the average one, end in time. (On
SmolLM2-135M, 2 threads, AMD EPYC, a fit without s ran 40 % of steps over a 246 ms bound by up
to 30 %: the prediction 5-15 % low.)
"""

from __future__ import annotations

import math


class PrefillCosts:
    """Seconds a prefill call of n padded tokens takes, fitted to the calls seen so far."""

    def __init__(self, decay: float = 0.95) -> None:
        self.decay = decay
        self._w = self._n = self._t = self._nn = self._nt = 0.0  # weighted sums
        self._e = self._r = self._rr = 0.0  # weight, sums of actual / predicted and its square

    def add(self, tokens: int, seconds: float) -> None:
        """One prefill call: its padded tokens (rows × widest chunk) and its time."""
        k, fit = self.decay, self._line()
        if fit is not None:  # how far off the line was (clipped: one stall is not the machine)
            r = min(2.0, max(0.5, seconds / (fit[0] + fit[1] * tokens)))
            self._e, self._r, self._rr = k * self._e + 1.0, k * self._r + r, k * self._rr + r * r
        self._w = k * self._w + 1.0
        self._n = k * self._n + tokens
        self._t = k * self._t + seconds
        self._nn = k * self._nn + tokens * tokens
        self._nt = k * self._nt + tokens * seconds

    @property
    def fitted(self) -> tuple[float, float] | None:
        """(a, b) of t ≈ a + b·n; None before any call. With calls of one size only, the line
        through the origin (no fixed cost known yet: the larger estimate per token)."""
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
        if var <= 1e-9 * max(1.0, mean_n * mean_n):
            return None
        b = (self._nt / self._w - mean_n * mean_t) / var
        if b <= 0.0:  # noise over a narrow range of sizes
            return None
        a = max(0.0, mean_t - b * mean_n)
        return (a, b) if a + b > 0.0 else None

    @property
    def margin(self) -> float:
        """s: mean + 2 standard deviations of actual / predicted time (each clipped to
        [0.5, 2]) over the calls a line predicted; 1 before any."""
        if self._e == 0.0:
            return 1.0
        mean = self._r / self._e
        std = max(0.0, self._rr / self._e - mean * mean) ** 0.5
        return mean + 2.0 * std

    def tokens_within(self, seconds: float, first: int) -> int:
        """Padded prompt tokens a call can take within `seconds` (at least 1: a prompt always
        moves on); `first` before any call was timed."""
        fit = self.fitted
        if fit is None:
            return first
        a, b = fit
        seconds /= self.margin
        return max(1, math.floor((seconds - a) / b)) if seconds > a else 1

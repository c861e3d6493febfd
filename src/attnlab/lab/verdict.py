"""From measurements to a verdict: a pure function of numbers, tested on synthetic results.

A claim compares a quantity `a` with `b` (two variants' metrics, two metrics of one variant, or
a metric and a constant). Its effect is d = f(a) - f(b), f the identity or log (ratios: times,
memory). The interval of d:

- paired over seeds: a and b measured with the same seeds (same initial draw and data order,
  src/attnlab/lab/runner.py), d_s per seed, mean ± t(0.975, n-1) · sd/√n;
- one seed (or a constant b): the runs' own standard errors (over evaluation windows or timing
  repetitions), ±1.96 · √(se_a² + se_b²);
- unpaired seeds: Welch's standard error, df = min(n_a, n_b) - 1.

The verdict, with m the claim's margin (0: any effect) and t the tolerance of "equal":

    expect lower    pass: hi < -m     fail: lo > -m           otherwise inconclusive
    expect higher   pass: lo > m      fail: hi < m            otherwise inconclusive
    expect equal    pass: -t < lo and hi < t    fail: lo > t or hi < -t    otherwise inconclusive

"inconclusive" states the minimum detectable effect, (t(0.975) + t(0.80)) · se: the smallest
true effect this many seeds would detect 80% of the time. A run that failed the quality gate (the
model did not learn) gives "no verdict", and so does a missing measurement. An "equal" pass needs
the experiment's positive control to have passed: a setup that cannot show a large, known effect
says nothing by finding none.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

Expect = Literal["lower", "higher", "equal"]
Status = Literal["pass", "fail", "inconclusive", "no verdict"]

# two-sided 95% (one-sided 0.975) and one-sided 0.80 quantiles of Student's t, df 1..30
_T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179,
         2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064,
         2.060, 2.056, 2.052, 2.048, 2.045, 2.042)  # fmt: skip
_T80 = (1.376, 1.061, 0.978, 0.941, 0.920, 0.906, 0.896, 0.889, 0.883, 0.879, 0.876, 0.873,
        0.870, 0.868, 0.866, 0.865, 0.863, 0.862, 0.861, 0.860, 0.859, 0.858, 0.858, 0.857,
        0.856, 0.856, 0.855, 0.855, 0.854, 0.854)  # fmt: skip


def t_quantiles(df: float) -> tuple[float, float]:
    """(t 0.975, t 0.80) for df degrees of freedom; the normal's beyond 30 (and for inf)."""
    if df >= 31 or math.isinf(df):
        return 1.960, 0.842
    i = max(int(df), 1) - 1
    return _T975[i], _T80[i]


@dataclass(frozen=True)
class Measurement:
    """The effect d = f(a) - f(b) with its 95% interval; `n` seeds, `method` how it was formed."""

    estimate: float
    lo: float
    hi: float
    se: float
    df: float
    n: int
    method: str
    log: bool = False  # d is a log ratio: exp(d) is a / b

    @property
    def mde(self) -> float:
        """The minimum detectable effect (in d's units): 80% power at the 5% level."""
        t975, t80 = t_quantiles(self.df)
        return (t975 + t80) * self.se

    def describe(self) -> str:
        if self.log:
            e, lo, hi = (math.exp(x) for x in (self.estimate, self.lo, self.hi))
            return f"ratio {e:.3g} [{lo:.3g}, {hi:.3g}] ({self.method})"
        return f"{self.estimate:+.4g} [{self.lo:+.4g}, {self.hi:+.4g}] ({self.method})"


@dataclass(frozen=True)
class Verdict:
    status: Status
    reason: str = ""

    def __str__(self) -> str:
        return f"{self.status} ({self.reason})" if self.reason else self.status


Values = Mapping[int, tuple[float, float | None]]  # seed -> (value, standard error or None)


def _f(x: float, se: float | None, log: bool) -> tuple[float, float | None]:
    if not log:
        return x, se
    if x <= 0:
        raise ValueError(f"a log-ratio claim needs positive values, got {x}")
    return math.log(x), (se / x if se is not None else None)  # delta method


def measure(a: Values, b: Values | float, log: bool = False) -> Measurement | None:
    """The effect f(a) - f(b) over seeds (see the module docstring); None without values or
    without any way to form an interval."""
    if not a:
        return None
    fa = {s: _f(v, se, log) for s, (v, se) in a.items()}
    if isinstance(b, (int, float)):
        fb = {s: (_f(float(b), 0.0, log)) for s in fa}
    else:
        if not b:
            return None
        fb = {s: _f(v, se, log) for s, (v, se) in b.items()}
    common = sorted(set(fa) & set(fb))
    if len(common) >= 2:
        d = [fa[s][0] - fb[s][0] for s in common]
        n = len(d)
        mean = sum(d) / n
        sd = math.sqrt(sum((x - mean) ** 2 for x in d) / (n - 1))
        se, df, how = sd / math.sqrt(n), n - 1, f"paired over {n} seeds"
        if sd == 0:  # identical differences (deterministic quantities): fall back to run SEs
            run_se = _pooled(fa, fb, common)
            se = run_se if run_se is not None else 0.0
    elif len(common) == 1:
        s = common[0]
        mean = fa[s][0] - fb[s][0]
        se = _pooled(fa, fb, common)
        if se is None:
            return None
        df, n, how = math.inf, 1, "1 seed, within-run standard error"
    else:  # no shared seed: Welch
        va, vb = [v for v, _ in fa.values()], [v for v, _ in fb.values()]
        if min(len(va), len(vb)) < 2:
            return None
        ma, mb = sum(va) / len(va), sum(vb) / len(vb)
        var_a = sum((x - ma) ** 2 for x in va) / (len(va) - 1)
        var_b = sum((x - mb) ** 2 for x in vb) / (len(vb) - 1)
        mean, se = ma - mb, math.sqrt(var_a / len(va) + var_b / len(vb))
        df, n, how = min(len(va), len(vb)) - 1, min(len(va), len(vb)), "unpaired seeds"
    t975, _ = t_quantiles(df)
    return Measurement(mean, mean - t975 * se, mean + t975 * se, se, df, n, how, log)


def _pooled(fa, fb, seeds) -> float | None:
    """√(se_a² + se_b²) averaged over seeds (None when a standard error is missing)."""
    out = []
    for s in seeds:
        sa, sb = fa[s][1], fb[s][1]
        if sa is None or sb is None:
            return None
        out.append(math.sqrt(sa**2 + sb**2))
    return sum(out) / len(out) / math.sqrt(len(out))


def decide(
    m: Measurement | None,
    expect: Expect,
    margin: float = 0.0,
    gate_failed: list[str] | None = None,
    control_passed: bool | None = None,
) -> Verdict:
    """The verdict of one claim (module docstring). `gate_failed`: the runs whose model did not
    learn (non-empty: no verdict); `control_passed`: the experiment's positive control (None: this
    claim is the control, or the experiment has none)."""
    if gate_failed:
        return Verdict("no verdict", f"quality gate failed: {', '.join(gate_failed)}")
    if m is None:
        return Verdict("no verdict", "no measurement (missing or unsupported)")
    if margin < 0:
        raise ValueError(f"margin ({margin}) must be >= 0")
    lo, hi = m.lo, m.hi
    mde = f"minimum detectable effect {m.mde:.3g}"
    if expect == "lower":
        status = "pass" if hi < -margin else "fail" if lo > -margin else "inconclusive"
    elif expect == "higher":
        status = "pass" if lo > margin else "fail" if hi < margin else "inconclusive"
    elif expect == "equal":
        status = (
            "pass"
            if -margin < lo and hi < margin
            else "fail"
            if lo > margin or hi < -margin
            else "inconclusive"
        )
        if status == "pass" and control_passed is False:
            return Verdict("inconclusive", f"positive control did not pass; {mde}")
    else:
        raise ValueError(f"expect must be 'lower', 'higher' or 'equal', got {expect!r}")
    return Verdict(status, mde if status == "inconclusive" else "")

"""How many paired seeds a claim needs, and what power a finished measurement had: the plan
behind `attnlab lab run NAME --plan MAX` (src/attnlab/lab/runner.py) and the power column of the
report (src/attnlab/lab/report.py).

For a claim whose per-seed effects d_s have spread sd, n paired seeds give the interval
mean ± t(0.975, n−1)·sd/√n (src/attnlab/lab/verdict.py). A true effect δ beyond the margin m is
then declared with probability

    power(n) = P(T_{n−1} > t(0.975, n−1) − (|δ| − m)·√n / sd)

(the usual approximation of the noncentral t by a shifted central one; Student's t CDF below is
the regularized incomplete beta function). `seeds_for` is the smallest n with power ≥ 80 %. The
plan is sequential: start at 3 seeds, measure sd on them, add the seeds the plan asks for, and
stop when every claim is decided or the stated maximum is reached. The effect planned for is the
claim's stated `effect` (what the experiment is meant to detect), else the effect measured so far.
"""

from __future__ import annotations

import math

from .verdict import t_quantiles

START = 3  # seeds a plan starts with: the first spread needs df >= 2 to mean anything
TARGET = 0.8


def _betacf(a: float, b: float, x: float) -> float:
    """The continued fraction of the incomplete beta function (modified Lentz)."""
    tiny, qab, qap, qam = 1e-300, a + b, a + 1.0, a - 1.0
    c, d = 1.0, 1.0 - qab * x / qap
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 300):
        m2 = 2 * m
        for num in (m * (b - m) * x / ((qam + m2) * (a + m2)),
                    -(a + m) * (qab + m) * x / ((a + m2) * (qap + m2))):  # fmt: skip
            d = 1.0 + num * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + num / c
            c = c if abs(c) > tiny else tiny
            h *= d * c
        if abs(d * c - 1.0) < 1e-15:
            break
    return h


def _ibeta(a: float, b: float, x: float) -> float:
    """The regularized incomplete beta function I_x(a, b)."""
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    front = math.exp(
        math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x)
    )
    if x < (a + 1.0) / (a + b + 2.0):
        return front * _betacf(a, b, x) / a
    return 1.0 - front * _betacf(b, a, 1.0 - x) / b


def t_cdf(x: float, df: float) -> float:
    """Student's t distribution function with df degrees of freedom (the normal's for inf)."""
    if math.isinf(df):
        return 0.5 * math.erfc(-x / math.sqrt(2.0))
    tail = 0.5 * _ibeta(df / 2.0, 0.5, df / (df + x * x))
    return 1.0 - tail if x > 0 else tail


def power(effect: float, se: float, df: float, margin: float = 0.0) -> float:
    """The probability that the 95 % interval of a measurement with standard error `se` (df
    degrees of freedom) lies beyond `margin` on the side of a true effect `effect`."""
    if se <= 0:
        return 1.0 if abs(effect) > margin else 0.0
    t975, _ = t_quantiles(df)
    return 1.0 - t_cdf(t975 - (abs(effect) - margin) / se, df)


def seeds_for(effect: float, sd: float, margin: float = 0.0, most: int = 1000) -> int | None:
    """The fewest paired seeds (>= 2) that detect `effect` beyond `margin` with 80 % power when
    the per-seed effects spread by `sd`; None when not even `most` seeds would."""
    if abs(effect) <= margin:
        return None
    for n in range(2, most + 1):
        if power(effect, sd / math.sqrt(n), n - 1, margin) >= TARGET:
            return n
    return None

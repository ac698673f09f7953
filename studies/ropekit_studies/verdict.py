"""The one rule that turns paired differences into a word: every study, ``ropekit experiment verify`` and the
generated tables read a comparison through :func:`judge`.

Seeds pair the arms (the same seed is the same initialisation, data order and split), so a claimed difference
``Δ`` is read from its per-seed values ``Δ_1..Δ_n``: mean ``m``, sample standard deviation ``sd``, standard
error ``se = sd/√n`` and the 95 % interval ``m ± t_{0.975, n−1}·se`` (or, for studies with episodes inside
seeds, a bootstrap that resamples seeds and then episodes: :func:`bootstrap_interval`). A study declares the
comparisons its papers make -- its *claims*, each with the sign the paper claims -- before it runs, and the
two-sided p-values of those claims are Holm-corrected together (the family). Then:

* ``holds``: the Holm-corrected test rejects 0 and the mean has the claimed sign (the corrected interval, at
  confidence ``1 − α/(m − k + 1)`` for the claim ranked ``k`` of ``m`` by p-value, excludes 0 on that side);
* ``reversed``: the same, with the other sign;
* ``trend``: not that, but the uncorrected 80 % interval excludes 0 (:attr:`Verdict.sign` says on which side);
* ``null``: otherwise; reported with the smallest difference the same design detects at 80 % power,
  ``MDE = (t_{0.975, n−1} + t_{0.8, n−1})·se`` (with a given interval, e.g. a bootstrap over seeds and episodes,
  its standard error ``(high − low)/(2 z_{0.975})`` times ``z_{0.975} + z_{0.8}``, so that the episodes' spread
  counts as the interval does);
* ``not assessable``: one seed (no spread, no interval).

A null therefore says "not measurable at this size" as much as "no effect": read it beside its MDE.
:func:`seeds_needed` gives the seeds a pilot's spread asks for to detect a target difference,
``n ≈ ((z_{0.975} + z_{0.8})·sd/δ)²``.

>>> judge({"a - b": [0.03, 0.02, 0.04]}, {"a - b": +1})["a - b"].word
'holds'
>>> judge({"a - b": [0.01, -0.02, 0.0]}, {"a - b": +1})["a - b"].word
'null'
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any, Dict, Mapping, Optional, Sequence

import numpy as np
from scipy import stats

__all__ = ["Verdict", "judge", "judge_one", "seeds_needed", "bootstrap_interval", "WORDS", "ALPHA", "RULE"]

#: The family-wise error rate of a study's claims.
ALPHA = 0.05
#: Every word the rule gives.
WORDS = ("holds", "reversed", "trend", "null", "not assessable")
#: One sentence for tables and reports.
RULE = ("holds / reversed: the 95 % interval of the paired mean, Holm-corrected over the study's declared claims, "
        "excludes 0 with the claimed / the other sign; trend: only the uncorrected 80 % interval excludes 0; "
        "null: neither (MDE: the smallest difference these seeds detect at 80 % power); one seed: not assessable")


@dataclass(frozen=True)
class Verdict:
    """The reading of one comparison. Interval bounds are ``nan`` for one seed; ``corrected_level`` is the
    confidence of the Holm step this claim was tested at; ``p_holm`` its Holm-adjusted p-value."""

    word: str
    sign: int
    claimed: int
    n: int
    mean: float
    sd: float
    se: float
    low95: float
    high95: float
    low80: float
    high80: float
    corrected_level: float
    low_corrected: float
    high_corrected: float
    p: float
    p_holm: float
    mde: float
    family: int

    @property
    def label(self) -> str:
        """The word, with ``"trend against the claim"`` for a trend on the other side of the claimed sign."""
        return "trend against the claim" if self.word == "trend" and self.sign == -self.claimed else self.word

    def as_dict(self) -> Dict[str, Any]:
        return asdict(self)

    def text(self, scale: float = 1.0, digits: int = 3) -> str:
        """``"holds, +0.034 [+0.012, +0.056]"``; a null with its MDE; one seed as its value alone."""
        f = f"{{:+.{digits}f}}"
        if self.n < 2:
            return f"{self.label}, {f.format(self.mean * scale)} (one seed)"
        s = f"{self.label}, {f.format(self.mean * scale)} [{f.format(self.low95 * scale)}, " \
            f"{f.format(self.high95 * scale)}]"
        if self.word == "null":
            s += f", MDE {self.mde * scale:.{digits}f}"
        return s


def _clean(name: str, diffs: Sequence[float]) -> np.ndarray:
    d = np.asarray(list(diffs), dtype=np.float64)
    if d.ndim != 1 or d.size == 0:
        raise ValueError(f"comparison {name!r}: no paired differences")
    if not np.all(np.isfinite(d)):
        raise ValueError(f"comparison {name!r}: a paired difference is NaN or infinite ({d.tolist()})")
    return d


def _t(q: float, n: int) -> float:
    return float(stats.t.ppf(q, n - 1))


def _p_value(m: float, se: float, n: int) -> float:
    if se == 0.0:
        return 1.0 if m == 0.0 else 0.0
    return float(2.0 * stats.t.sf(abs(m) / se, n - 1))


def judge(diffs: Mapping[str, Sequence[float]], claims: Mapping[str, int], *, alpha: float = ALPHA,
          p_values: Optional[Mapping[str, float]] = None,
          intervals: Optional[Mapping[str, Mapping[float, tuple]]] = None) -> Dict[str, Verdict]:
    """Read every comparison of a study's family at once.

    ``diffs``: name -> per-seed paired differences (one float per seed, the same seeds for both arms).
    ``claims``: name -> the claimed sign (``+1``: the first arm is claimed above the second, ``-1`` below); every
    name of ``diffs`` must be in it, and the names of ``diffs`` are the Holm family. ``p_values`` and
    ``intervals`` (name -> {confidence: (low, high)}) replace the t-based ones, e.g. from
    :func:`bootstrap_interval`, and the MDE then follows from the given 95 % interval. Returns name ->
    :class:`Verdict`.
    """
    if not 0.0 < alpha < 1.0:
        raise ValueError(f"alpha must lie in (0, 1), got {alpha}")
    missing = [k for k in diffs if k not in claims]
    if missing:
        raise ValueError(f"comparisons without a declared claim sign: {missing}")
    bad = {k: v for k, v in claims.items() if k in diffs and v not in (1, -1)}
    if bad:
        raise ValueError(f"claimed signs must be +1 or -1, got {bad}")
    data = {k: _clean(k, v) for k, v in diffs.items()}
    base: Dict[str, Dict[str, float]] = {}
    for k, d in data.items():
        n = int(d.size)
        m = float(d.mean())
        sd = float(d.std(ddof=1)) if n > 1 else float("nan")
        se = sd / math.sqrt(n) if n > 1 else float("nan")
        p = float("nan") if n < 2 else (p_values[k] if p_values and k in p_values else _p_value(m, se, n))
        base[k] = {"n": n, "m": m, "sd": sd, "se": se, "p": p}
    testable = sorted((k for k in data if base[k]["n"] > 1), key=lambda k: (base[k]["p"], k))
    fam = len(testable)
    p_holm: Dict[str, float] = {}
    level: Dict[str, float] = {}
    running = 0.0
    for rank, k in enumerate(testable):
        factor = fam - rank
        running = max(running, min(1.0, factor * base[k]["p"]))
        p_holm[k] = running
        level[k] = 1.0 - alpha / factor

    def interval(k: str, conf: float):
        b = base[k]
        if intervals and k in intervals and conf in intervals[k]:
            return tuple(float(x) for x in intervals[k][conf])
        if intervals and k in intervals:  # a bootstrap at the levels it was asked for only
            raise ValueError(f"comparison {k!r}: no interval at confidence {conf}")
        h = _t(0.5 + conf / 2.0, b["n"]) * b["se"]
        return b["m"] - h, b["m"] + h

    out: Dict[str, Verdict] = {}
    nan = float("nan")
    for k, d in data.items():
        b = base[k]
        sign = int(np.sign(b["m"]))
        claimed = int(claims[k])
        if b["n"] < 2:
            out[k] = Verdict("not assessable", sign, claimed, 1, b["m"], nan, nan, nan, nan, nan, nan, nan, nan, nan,
                             nan, nan, nan, fam)
            continue
        lo95, hi95 = interval(k, 0.95)
        lo80, hi80 = interval(k, 0.80)
        loc, hic = interval(k, level[k]) if not intervals else (nan, nan)
        if p_holm[k] < alpha and sign != 0:
            word = "holds" if sign == claimed else "reversed"
        elif lo80 > 0 or hi80 < 0:
            word = "trend"
        else:
            word = "null"
        if intervals and k in intervals:  # the standard error the given interval implies
            z = float(stats.norm.ppf(0.975))
            mde = (hi95 - lo95) / (2 * z) * (z + float(stats.norm.ppf(0.8)))
        else:
            mde = (_t(0.975, b["n"]) + _t(0.8, b["n"])) * b["se"]
        out[k] = Verdict(word, sign, claimed, b["n"], b["m"], b["sd"], b["se"], lo95, hi95, lo80, hi80, level[k],
                         loc, hic, b["p"], p_holm[k], mde, fam)
    return out


def judge_one(diffs: Sequence[float], claimed: int = 1, *, alpha: float = ALPHA) -> Verdict:
    """:func:`judge` of a family of one comparison (no correction)."""
    return judge({"Δ": diffs}, {"Δ": claimed}, alpha=alpha)["Δ"]


def seeds_needed(sd: float, delta: float, *, alpha: float = ALPHA, power: float = 0.8) -> int:
    """Seeds for a paired design with per-seed spread ``sd`` to detect a difference ``delta`` (two-sided test at
    ``alpha``, the given power): ``ceil(((z_{1−α/2} + z_{power})·sd/δ)²)``, at least 2."""
    if not (sd >= 0 and math.isfinite(sd)) or not (delta > 0 and math.isfinite(delta)):
        raise ValueError(f"seeds_needed needs sd >= 0 and delta > 0, got sd={sd}, delta={delta}")
    z = stats.norm.ppf(1 - alpha / 2) + stats.norm.ppf(power)
    return max(2, int(math.ceil((z * sd / delta) ** 2)))


def bootstrap_interval(per_seed: Sequence[Sequence[float]], levels: Sequence[float] = (0.95, 0.8), *,
                       per_seed_b: Optional[Sequence[Sequence[float]]] = None, resamples: int = 10000,
                       seed: int = 0) -> Dict[str, Any]:
    """The mean paired difference of episodes inside seeds, with percentile intervals from a two-level bootstrap:
    resample seeds with replacement, then episodes with replacement inside each drawn seed; the statistic is the
    mean over seeds of the per-seed episode means.

    ``per_seed``: one sequence of per-episode paired differences per seed (lengths may differ). With
    ``per_seed_b`` the episodes are not paired: ``per_seed`` holds arm A's per-episode outcomes and
    ``per_seed_b`` arm B's (e.g. 1 for a success, 0 for a failure), each resampled inside the drawn seed, and the
    statistic is the mean over seeds of ``mean(A) − mean(B)``. Returns ``{"mean", "per_seed", "intervals":
    {level: (low, high)}, "p"}`` with ``per_seed`` the observed per-seed differences and ``p`` the two-sided
    bootstrap p-value ``min(1, 2·min(P(mean* ≤ 0), P(mean* ≥ 0)))``.
    """
    arms = [per_seed] if per_seed_b is None else [per_seed, per_seed_b]
    groups = [[np.asarray(list(g), dtype=np.float64) for g in arm] for arm in arms]
    if not groups[0] or any(len(g) != len(groups[0]) for g in groups):
        raise ValueError("bootstrap_interval needs the same number (at least one) of seeds for both arms")
    if any(g.size == 0 for arm in groups for g in arm):
        raise ValueError("bootstrap_interval needs at least one episode in every seed")
    if any(not np.all(np.isfinite(g)) for arm in groups for g in arm):
        raise ValueError("bootstrap_interval: an episode outcome is NaN or infinite")
    rng = np.random.default_rng(seed)
    k = len(groups[0])

    def seed_value(i: int, draw: bool) -> float:
        vals = []
        for arm in groups:
            g = arm[i]
            vals.append(g[rng.integers(0, g.size, size=g.size)].mean() if draw else g.mean())
        return vals[0] - (vals[1] if len(vals) > 1 else 0.0)

    observed = [seed_value(i, False) for i in range(k)]
    picks = rng.integers(0, k, size=(resamples, k))
    stat = np.array([np.mean([seed_value(i, True) for i in row]) for row in picks])
    iv = {float(c): (float(np.quantile(stat, (1 - c) / 2)), float(np.quantile(stat, (1 + c) / 2))) for c in levels}
    p = float(min(1.0, 2 * min((stat <= 0).mean(), (stat >= 0).mean())))
    return {"mean": float(np.mean(observed)), "per_seed": observed, "intervals": iv, "p": p}

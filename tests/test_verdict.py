"""The verdict rule (ropekit_studies.verdict) against hand-computed cases and scipy references."""

import math

import numpy as np
import pytest
from scipy import stats

from ropekit_studies.verdict import bootstrap_interval, judge, judge_one, seeds_needed


def test_hand_computed_interval_and_mde():
    # diffs 0.01, 0.02, 0.03: mean 0.02, sd 0.01, se 0.01/sqrt(3); t_{0.975,2} = 4.302652729749464
    v = judge_one([0.01, 0.02, 0.03])
    se = 0.01 / math.sqrt(3)
    assert v.mean == pytest.approx(0.02, abs=1e-15)
    assert v.sd == pytest.approx(0.01, rel=1e-12)
    assert v.low95 == pytest.approx(0.02 - 4.302652729749464 * se, rel=1e-10)
    assert v.high95 == pytest.approx(0.02 + 4.302652729749464 * se, rel=1e-10)
    # t = 0.02 / se = 3.4641; two-sided p with 2 df = 0.0742 > 0.05: not "holds"; t_{0.9,2} = 1.885618 -> trend
    assert v.p == pytest.approx(2 * stats.t.sf(0.02 / se, 2), rel=1e-12)
    assert v.p > 0.05 and v.word == "trend" and v.sign == 1
    assert v.mde == pytest.approx((4.302652729749464 + 1.0606601717798212) * se, rel=1e-10)


def test_holds_reversed_null_and_one_seed():
    assert judge_one([0.03, 0.031, 0.029, 0.032]).word == "holds"
    assert judge_one([0.03, 0.031, 0.029, 0.032], claimed=-1).word == "reversed"
    v = judge_one([0.01, -0.02, 0.0])
    assert v.word == "null" and v.mde > 0
    one = judge_one([0.05])
    assert one.word == "not assessable" and math.isnan(one.low95) and one.n == 1


def test_ties_zero_spread():
    # every seed the same nonzero difference: p = 0, holds; all zero: null with MDE 0
    assert judge_one([0.01, 0.01, 0.01]).word == "holds"
    z = judge_one([0.0, 0.0, 0.0])
    assert z.word == "null" and z.mde == 0.0 and z.sign == 0


def test_bad_input_raises():
    with pytest.raises(ValueError, match="NaN"):
        judge_one([0.1, float("nan")])
    with pytest.raises(ValueError, match="no paired"):
        judge_one([])
    with pytest.raises(ValueError, match="claim"):
        judge({"a": [1.0, 2.0]}, {})
    with pytest.raises(ValueError, match="signs"):
        judge({"a": [1.0, 2.0]}, {"a": 0})


def test_holm_against_hand_computed_adjustment():
    # three claims with t-test p-values p1 < p2 < p3; Holm: 3 p1, max(that, 2 p2), max(that, p3)
    rng = np.random.default_rng(5)
    diffs = {"a": rng.normal(0.03, 0.01, 5), "b": rng.normal(0.01, 0.01, 5), "c": rng.normal(0.0, 0.01, 5)}
    out = judge(diffs, {k: 1 for k in diffs})
    p = {k: stats.ttest_1samp(v, 0.0).pvalue for k, v in diffs.items()}
    order = sorted(p, key=p.get)
    expect, run = {}, 0.0
    for i, k in enumerate(order):
        run = max(run, min(1.0, (3 - i) * p[k]))
        expect[k] = run
    for k in diffs:
        assert out[k].p == pytest.approx(p[k], rel=1e-10)
        assert out[k].p_holm == pytest.approx(expect[k], rel=1e-10)
        assert out[k].word in ("holds", "reversed") if expect[k] < 0.05 else out[k].word in ("trend", "null")
    # the first step's corrected interval is the 1 - 0.05/3 t interval
    k = order[0]
    v = diffs[k]
    h = stats.t.ppf(1 - 0.05 / 6, 4) * v.std(ddof=1) / math.sqrt(5)
    assert out[k].low_corrected == pytest.approx(v.mean() - h, rel=1e-10)


def test_correction_changes_a_word():
    # p about 0.03 alone is "holds"; among four claims (three with p ~ 1) Holm multiplies it by 4
    d = [0.02, 0.03, 0.01, 0.025, 0.0]
    alone = judge_one(d)
    assert alone.p < 0.05 and alone.word == "holds"
    fam = {"x": d, "y": [0.01, -0.01, 0.0, 0.005, -0.005], "z": [1.0, -1.0, 0.5, -0.5, 0.0],
           "w": [0.2, -0.2, 0.1, -0.1, 0.0]}
    assert judge(fam, {k: 1 for k in fam})["x"].word == "trend"


@pytest.mark.slow
@pytest.mark.parametrize("n", [3, 5, 10])
def test_false_holds_rate_under_zero_effect(n):
    # the rule's "holds or reversed" under a true zero effect is the test's type-I error: <= 5 % (one claim)
    rng = np.random.default_rng(1000 + n)
    trials = 4000
    hits = sum(judge_one(rng.normal(0.0, 0.02, n)).word in ("holds", "reversed") for _ in range(trials))
    # binomial(4000, 0.05): sd 0.0034; allow 3 sd above 0.05
    assert hits / trials <= 0.05 + 3 * math.sqrt(0.05 * 0.95 / trials)
    holds = sum(judge_one(rng.normal(0.0, 0.02, n)).word == "holds" for _ in range(trials))
    assert holds / trials <= 0.025 + 3 * math.sqrt(0.025 * 0.975 / trials)


@pytest.mark.slow
def test_family_wise_rate_under_zero_effect():
    # 10 null claims: the chance that any is called "holds"/"reversed" stays <= 5 % with Holm
    rng = np.random.default_rng(7)
    trials, fam = 1500, 10
    any_hit = 0
    for _ in range(trials):
        d = {f"c{i}": rng.normal(0, 1, 5) for i in range(fam)}
        any_hit += any(v.word in ("holds", "reversed") for v in judge(d, {k: 1 for k in d}).values())
    assert any_hit / trials <= 0.05 + 3 * math.sqrt(0.05 * 0.95 / trials)


@pytest.mark.slow
def test_power_under_the_mde():
    # at a true effect equal to the MDE computed from the true sd, "holds" comes about 80 % of the time
    rng = np.random.default_rng(3)
    n, sd = 8, 0.02
    se = sd / math.sqrt(n)
    mde = (stats.t.ppf(0.975, n - 1) + stats.t.ppf(0.8, n - 1)) * se
    trials = 3000
    hits = sum(judge_one(rng.normal(mde, sd, n)).word == "holds" for _ in range(trials))
    # the MDE formula is the usual approximation of the noncentral t power: 0.75-0.85
    assert 0.74 <= hits / trials <= 0.86


def test_seeds_needed_closed_form():
    z = stats.norm.ppf(0.975) + stats.norm.ppf(0.8)
    assert seeds_needed(0.02, 0.01) == math.ceil((z * 2) ** 2)  # 31.4 -> 32
    assert seeds_needed(0.0, 0.01) == 2
    with pytest.raises(ValueError):
        seeds_needed(0.01, 0.0)


def test_bootstrap_matches_t_interval_for_many_seeds():
    # one episode per seed: the two-level bootstrap reduces to a bootstrap over seeds, close to the t interval
    rng = np.random.default_rng(11)
    d = rng.normal(0.1, 1.0, 60)
    b = bootstrap_interval([[x] for x in d], resamples=4000, seed=1)
    v = judge_one(d)
    assert b["mean"] == pytest.approx(d.mean(), rel=1e-12)
    width_t = v.high95 - v.low95
    lo, hi = b["intervals"][0.95]
    # percentile bootstrap of the mean: width ≈ 2·1.96·sd/√n·sqrt((n-1)/n); t width uses 2.0; within 10 %
    assert abs((hi - lo) - width_t) < 0.1 * width_t
    with pytest.raises(ValueError):
        bootstrap_interval([[0.1], []])
    out = judge({"r": [float(np.mean(x)) for x in ([1.0, 0.0], [1.0, 1.0])]}, {"r": 1},
                p_values={"r": 0.5}, intervals={"r": {0.95: (-0.1, 1.2), 0.8: (0.1, 1.0)}})
    assert out["r"].word == "trend"


def test_bootstrap_of_unpaired_episodes():
    # two arms, three seeds of 100 episodes each: the statistic is the mean over seeds of rate A - rate B
    a = [[1.0] * 80 + [0.0] * 20, [1.0] * 70 + [0.0] * 30, [1.0] * 90 + [0.0] * 10]
    b = [[1.0] * 50 + [0.0] * 50, [1.0] * 55 + [0.0] * 45, [1.0] * 45 + [0.0] * 55]
    out = bootstrap_interval(a, per_seed_b=b, resamples=3000, seed=2)
    assert out["per_seed"] == pytest.approx([0.30, 0.15, 0.45])
    assert out["mean"] == pytest.approx(0.30)
    lo, hi = out["intervals"][0.95]
    # every resample's seeds lie in {0.15, 0.30, 0.45} ± episode noise (sd ~ 0.07 per seed): the interval is
    # inside [0.15 - 4*0.07, 0.45 + 4*0.07] and clear of 0
    assert 0 < lo < out["mean"] < hi < 0.45 + 0.28 and out["p"] < 0.01
    with pytest.raises(ValueError, match="same number"):
        bootstrap_interval(a, per_seed_b=b[:2])


def test_a_given_interval_sets_the_mde():
    """With a bootstrap interval the MDE is its implied standard error times z_0.975 + z_0.8, not the t-based one
    of the per-seed spread: three identical seeds (sd 0) over 1,200 Bernoulli(0.5) captions still have the
    binomial's MDE, (z_0.975 + z_0.8) sqrt(0.25 / 1200)."""
    from scipy import stats

    z = stats.norm.ppf(0.975)
    half = z * np.sqrt(0.25 / 1200)
    out = judge({"c": [0.0, 0.0, 0.0]}, {"c": 1}, p_values={"c": 1.0},
                intervals={"c": {0.95: (-half, half), 0.8: (-0.5 * half, 0.5 * half)}})["c"]
    assert out.word == "null"
    assert out.mde == pytest.approx((z + stats.norm.ppf(0.8)) * np.sqrt(0.25 / 1200), rel=1e-12)
    assert judge_one([0.0, 0.0, 0.0]).mde == 0.0  # the t-based one: no spread, no detectable difference

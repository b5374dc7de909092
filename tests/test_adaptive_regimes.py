"""The adaptive engine's measured outcomes per load regime (``ultraep.policies.outcomes``): a candidate is estimated
from what it measured at the size of the load now, where it has measured there, so a ratio to the anchor model
measured on small calls is not carried to large ones (and back).

Driven as the runtime's engine drives it: every decision committed and its measured layer time fed back."""

from __future__ import annotations

import math
from collections import Counter

import numpy as np

from ultraep.policies import AdaptivePolicy
from ultraep.policies import outcomes as outcomes_mod
from ultraep.policies import probes as probes_mod
from ultraep.policies.outcomes import OUTCOME_WARMUP, REGIMES, OutcomeTracker, regime_of

from test_adaptive_settled import _cm, _drive, _load  # noqa: E402


def _feed(t: OutcomeTracker, name: str, regime: int, ratio: float, n: int) -> None:
    """``n`` measurements of ``name`` at ``regime``, each ``ratio`` times its anchor prediction (1 s)."""
    for _ in range(n):
        t.decisions += 1
        t.observing = (name, 1.0, regime)
        t.observe(name, 1.0, ratio, current=name)


def test_regime_is_the_routed_tokens_per_rank_to_a_power_of_two():
    load = np.full((2, 16), 32)  # 512 token-expert assignments per rank
    assert regime_of(load) == 9
    assert regime_of(load * 1.3) == 9 and regime_of(load * 1.5) == 10 and regime_of(load // 4) == 7
    assert regime_of(np.zeros((2, 16))) == 0


def test_an_outcome_is_read_at_the_regime_of_the_load_now():
    t = OutcomeTracker(None, window=5, switch_now=0.02, probe_every=32)
    t.at(8)
    _feed(t, "none", 8, 0.5, OUTCOME_WARMUP + 5)
    t.at(6)
    _feed(t, "none", 6, 1.2, 5)
    assert math.isclose(t.scale("none"), 1.2)
    t.at(8)  # back at the first size: what it measured there, not the last calls' ratio
    assert math.isclose(t.scale("none"), 0.5)
    t.at(7)  # a size it never ran at: its last calls, at any size
    assert math.isclose(t.scale("none"), 1.2)
    assert t.runs("none") == 10
    for r in range(10, 10 + REGIMES + 2):  # bounded: the last window of each of the REGIMES latest regimes
        _feed(t, "none", r, 2.0, 7)
    hist = t._outcome_hist[("anchor", "none")]
    assert len(hist) == REGIMES * 5 and {e[3] for e in hist} == set(range(12, 12 + REGIMES))


def test_a_size_measured_before_is_estimated_from_its_own_calls_when_the_run_goes_back(monkeypatch):
    """At 4096 tokens per rank ``none`` measures 0.35x the anchor's prediction and is the fastest; at 512 it measures
    1.6x and is still the fastest. Back at 4096, the small calls' ratio would price it 4.6x too high, out of every
    probe's reach, and ``quota`` would stay in force (the negative control: one regime for every load, and no re-check
    of ``none`` after the switch away from it, owed whatever the probe ledger holds, which would also take it back)."""
    big, small, n = _load(1.2, 4096), _load(1.2, 512), 60

    def truth(i, name):
        if n <= i < 2 * n:
            return {"none": 1.6, "quota": 1.0}.get(name, 1.5)
        return {"none": 0.35, "quota": 1.0}.get(name, 1.2)

    def back_at_big(one_regime: bool) -> Counter:
        if one_regime:
            monkeypatch.setattr(outcomes_mod, "regime_of", lambda load: 0)
            monkeypatch.setattr(probes_mod, "_owed", lambda schedule: False)
        cm = _cm()
        out = _drive(AdaptivePolicy(cost_model=cm), cm, [big] * n + [small] * n + [big] * n, truth)
        assert Counter(a["chosen"] for a in out[n + 10:2 * n])["none"] >= n - 15  # none runs the small calls
        return Counter(a["chosen"] for a in out[2 * n:])

    assert back_at_big(False)["none"] >= n - 5
    assert back_at_big(True)["quota"] >= n - 5

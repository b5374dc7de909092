"""FEPLB: the worked example, moves stay inside the domain, the maximum never rises, plan invariants."""

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from ultraep.policies import FeplbPolicy
from ultraep.policies.feplb import feplb_greedy
from ultraep.topology import Topology


def test_worked_example():
    # Module docstring: lambda = [8, 4, 1, 1, 2, 2, 1, 1], R = 4 (one domain), M = 2, N = 1.
    t = Topology(num_ranks=4, num_experts=8, num_redundant_slots=1)
    load = np.zeros((4, 8), dtype=np.int64)
    load[0] = [8, 4, 1, 1, 2, 2, 1, 1]  # one source rank holds every token
    plan = FeplbPolicy().plan(load, t)
    plan.check()
    moves = [(m["expert"], m["src"], m["dst"], m["tokens"]) for m in plan.info["moves"]]
    # expert 0 -> rank 1 (12 > 2 + 8), expert 2 -> rank 3, expert 3 -> rank 0 (lowest id among loads 4, 4)
    assert moves == [(0, 0, 1, 8), (2, 1, 3, 1), (3, 1, 0, 1)]
    assert plan.rank_load_after_R.tolist() == [5, 8, 4, 3]
    assert plan.info["token_straggler_before"] == 7.0 and plan.info["token_straggler_after"] == 3.0
    # a move is a replica that takes all of the expert's tokens; the master keeps quota 0
    assert plan.quota_RS[0, 0] == 0 and plan.quota_RS[1, 2] == 8


def test_no_move_when_it_would_not_lower_the_maximum():
    ell = np.array([10, 9], dtype=np.int64)
    lam = np.array([10, 9], dtype=np.int64)
    masters = np.array([[0], [1]], dtype=np.int64)
    e, r, s, q, after = feplb_greedy(ell, lam, masters, np.ones(2, bool), 2, 1, 1)
    assert len(e) == 0 and after.tolist() == [10, 9]  # 9 + 10 > 10: moving expert 0 would raise the max


def test_dynamic_experts_follow_the_predictor():
    t = Topology(num_ranks=2, num_experts=8, num_redundant_slots=1)
    pol = FeplbPolicy(num_dynamic=1, ewma=1.0)
    hot_first = np.array([[1, 9, 1, 1, 5, 1, 1, 1]] * 2, dtype=np.int64)
    pol.commit(pol.plan(hot_first, t))
    dyn = pol.dynamic_experts(np.zeros(8, np.int64), t)
    assert dyn.tolist() == [False, True, False, False, True, False, False, False]


@settings(max_examples=60, deadline=None)
@given(
    shape=st.sampled_from([(4, 4, 8), (8, 4, 16), (8, 8, 32), (16, 4, 32), (6, 3, 12)]),
    slots=st.integers(0, 2),
    dyn=st.integers(0, 4),
    seed=st.integers(0, 2**16),
    skew=st.floats(0.0, 3.0),
)
def test_moves_stay_in_domain_and_never_raise_the_maximum(shape, slots, dyn, seed, skew):
    R, D, E = shape
    M = E // R
    slots = min(slots, (D - 1) * M)
    t = Topology(num_ranks=R, num_experts=E, num_redundant_slots=slots, domain_size=D)
    rng = np.random.default_rng(seed)
    w = (np.arange(E) + 1.0) ** -skew
    load = rng.poisson(200 * w[rng.permutation(E)], size=(R, E)).astype(np.int64)
    plan = FeplbPolicy(num_dynamic=dyn).plan(load, t)
    plan.check()
    before, after = plan.rank_load_before_R, plan.rank_load_after_R
    assert after.max() <= before.max()
    for m in plan.info["moves"]:
        assert t.domain_R[m["src"]] == t.domain_R[m["dst"]]
        assert m["tokens"] == load[:, m["expert"]].sum()
    for d in range(t.num_domains):  # whole-expert moves only shift load inside a domain
        sel = t.domain_R == d
        assert after[sel].sum() == before[sel].sum()

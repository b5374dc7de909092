"""The fit of every rank's expert compute (ultraep.cost.fit.ComputeFit): it recovers what generated the measurements, takes
no co-run slowdown that the calls cannot show, and sets the calibrated model's compute parameters."""

import dataclasses
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ultraep.cost import FIT_MIN_CALLS as MIN_CALLS
from ultraep.cost import FIT_SLOWDOWNS as SLOWDOWNS
from ultraep.cost import Calibrator, ComputeFit, CostModel, CostParams, corun_finish, corun_matrices, expected_max
from ultraep.planning import plan_layer
from ultraep.topology import Topology

SPT = 1e-4  # model seconds per token


def _finish(work_R, k):
    A0, A1 = corun_matrices(work_R)
    return (A0 + k * A1) @ work_R


def _calls(rng, R, n_calls, balanced=False):
    for _ in range(n_calls):
        if balanced:
            n, i, p = np.full(R, int(rng.integers(100, 2000))), np.full(R, int(rng.integers(2, 7))), np.zeros(R, int)
        else:
            n, i, p = rng.integers(50, 2000, R), rng.integers(2, 7, R), rng.integers(0, 3, R)
        yield n, i, p


def test_ranks_finish_one_after_another_slowed_by_those_still_computing():
    w = np.array([3.0, 1.0, 2.0])
    # the least busy computes beside 2 others (1 + 2k), the next beside 1 for its remaining work, the last alone
    assert _finish(w, 0.5) == pytest.approx([2.0 + 1.5 + 1.0, 2.0, 2.0 + 1.5])
    assert _finish(w, 0.0) == pytest.approx(w)
    # the busiest rank: its own work plus k times the others' (what the cost model charges)
    cm = CostModel(Topology(num_ranks=3, num_experts=6, num_redundant_slots=0)).with_params(
        CostParams(corun_slowdown=0.5))
    assert cm.busiest_compute_s(w) == pytest.approx(_finish(w, 0.5).max())


@settings(max_examples=25, deadline=None)
@given(R=st.sampled_from([2, 4, 8]), kk=st.integers(0, len(SLOWDOWNS) - 1), a=st.floats(0.05, 3.0),
       h=st.floats(0.0, 100.0), d=st.floats(0.0, 0.01), seed=st.integers(0, 2**32 - 1))
def test_the_fit_recovers_what_generated_every_rank_s_time(R, kk, a, h, d, seed):
    rng = np.random.default_rng(seed)
    k = float(SLOWDOWNS[kk])
    fit = ComputeFit()
    for n, i, p in _calls(rng, R, 12):
        assert fit.add(n, i, p, _finish(a * (n + h * i) * SPT + d * p, k), SPT)
    got = fit.solve()
    assert got.k == pytest.approx(k)
    assert got.a == pytest.approx(a, rel=1e-5)
    assert got.b / got.a == pytest.approx(h, rel=1e-4, abs=1e-3)  # tokens' worth per instance
    assert got.d == pytest.approx(d, rel=1e-4, abs=1e-7)  # seconds per replica (calls of ~10-200 ms)


def test_balanced_calls_cannot_show_a_slowdown_so_none_is_taken():
    rng = np.random.default_rng(3)
    fit = ComputeFit()
    for n, i, p in _calls(rng, 2, 10, balanced=True):
        fit.add(n, i, p, _finish(0.3 * (n + 20 * i) * SPT, 0.3), SPT)
    got = fit.solve()
    assert got.k == 0.0  # a slower machine explains them as well
    assert got.a == pytest.approx(0.3 * 1.3, rel=1e-6)  # ...and predicts every balanced call exactly
    assert got.b == pytest.approx(0.3 * 1.3 * 20, rel=1e-5)


def test_no_fit_before_enough_calls_and_idle_ranks_are_left_out():
    fit = ComputeFit()
    for _ in range(MIN_CALLS - 1):
        assert fit.add([100, 0], [2, 0], [0, 0], [0.01, 0.0], SPT)  # rank 1 computed nothing: one row
        assert fit.solve() is None
    assert not fit.add([0, 0], [0, 0], [0, 0], [0.0, 0.0], SPT)  # nothing to learn from
    assert fit.add([300, 0], [3, 0], [0, 0], [0.03, 0.0], SPT)
    assert fit.solve() is not None


def test_the_calibrator_takes_the_compute_parameters_from_the_fit():
    """Every rank's measured compute, forward and backward: once fitted, the model predicts an uneven plan's busiest
    rank as the measurements were generated, slowdown included."""
    topo = Topology(num_ranks=2, num_experts=8, num_redundant_slots=2)
    cm = CostModel(topo)
    cal = Calibrator(cm)
    rng = np.random.default_rng(1)
    spt = cm.sec_per_token
    truth = {"a": 0.3, "h": 16.0, "d": 0.002, "k": 0.1, "ab": 0.6, "hb": 40.0, "kb": 0.5}
    bd0 = cm.ideal(np.full((2, 8), 64))
    for n, i, p in _calls(rng, 2, 8):
        bd = dataclasses.replace(bd0, rank_tokens_R=n.astype(float), instances_R=i.astype(float),
                                 replicas_R=p.astype(float))
        fwd = _finish(truth["a"] * (n + truth["h"] * i) * spt + truth["d"] * p, truth["k"])
        # a replica's backward extra is not the forward's times the factor (2x): fitted apart, it is 5x here
        bwd = _finish(truth["ab"] * (n + truth["hb"] * i) * spt + 5 * truth["d"] * p, truth["kb"])
        cal.observe(bd, {"compute_fwd_s": float(fwd.max()), "compute_bwd_s": float(bwd.max())},
                    rank_compute_s={"compute_fwd_s": fwd, "compute_bwd_s": bwd})
    q = cal.params
    assert q.compute_scale == pytest.approx(truth["a"], rel=1e-6)
    assert q.half_tokens == pytest.approx(truth["h"], rel=1e-5)
    assert q.replica_instance_s == pytest.approx(truth["d"], rel=1e-5)
    assert q.corun_slowdown == pytest.approx(truth["k"])
    assert q.backward_compute_factor == pytest.approx(truth["ab"] / truth["a"], rel=1e-6)
    assert q.backward_half_tokens == pytest.approx(truth["hb"], rel=1e-5)
    assert q.backward_corun_slowdown == pytest.approx(truth["kb"])
    # kept before the factor, as the model applies it: factor x it = 5 d
    assert q.backward_replica_instance_s * q.backward_compute_factor == pytest.approx(5 * truth["d"], rel=1e-5)
    assert q.compute_noise < 1e-5 and q.backward_compute_noise < 1e-5  # exact timings: no spread around the fit
    m = cal.model
    n, i = np.array([1500.0, 300.0]), np.array([4.0, 4.0])
    want = _finish(truth["a"] * (n + truth["h"] * i) * spt, truth["k"]).max()
    assert m.busiest_compute_s(m.compute_time_R(n, i)) == pytest.approx(want, rel=1e-6)
    # a replicated plan's backward, as the model predicts it for a whole call
    load = np.full((2, 8), 20)
    load[:, 0] = 400  # expert 0 (rank 0's) is hot: quota replicates it onto rank 1
    plan = plan_layer(load, "quota", topology=topo)
    got = m.predict(plan).compute_bwd_s
    tr = m.traffic(plan)
    want_b = _finish(truth["ab"] * (tr.tokens_R + truth["hb"] * tr.instances_R) * spt
                     + 5 * truth["d"] * tr.replica_instances_R, truth["kb"]).max()
    assert tr.replica_instances_R.sum() >= 1 and got == pytest.approx(want_b, rel=1e-6)


def test_a_fit_whose_solve_fails_keeps_its_last_solution_against_the_others_new_one(monkeypatch):
    """The backward's solve fails (a fixed routing's two ranks can be fitted without a token cost) while the forward's
    is solved anew at 3x the scale: the model's backward stays the backward fit's, not its old factor times the new
    scale (a 64-token feplb run predicted 158 ms against 50 measured for four calls, 2026-11-27)."""
    topo = Topology(num_ranks=2, num_experts=8, num_redundant_slots=2)
    cm = CostModel(topo)
    cal = Calibrator(cm)
    rng = np.random.default_rng(2)
    spt = cm.sec_per_token
    bd0 = cm.ideal(np.full((2, 8), 64))

    def call(n, i, p, a_fwd):
        bd = dataclasses.replace(bd0, rank_tokens_R=n.astype(float), instances_R=i.astype(float),
                                 replicas_R=p.astype(float))
        fwd = _finish(a_fwd * (n + 16.0 * i) * spt, 0.1)
        bwd = _finish(0.6 * (n + 40.0 * i) * spt, 0.5)
        cal.observe(bd, {"compute_fwd_s": float(fwd.max()), "compute_bwd_s": float(bwd.max())},
                    rank_compute_s={"compute_fwd_s": fwd, "compute_bwd_s": bwd})

    for n, i, p in _calls(rng, 2, 8):
        call(n, i, p, 0.3)
    n, i = np.array([1500.0, 300.0]), np.array([4.0, 4.0])
    want = _finish(0.6 * (n + 40.0 * i) * spt, 0.5).max()

    def backward(model):
        p = model.params
        return p.backward_compute_factor * model.busiest_compute_s(model.compute_time_R(n, i, backward=True), True)

    assert backward(cal.model) == pytest.approx(want, rel=1e-6)
    old_bwd = cal.fits["compute_bwd_s"].solve()
    new_fwd = dataclasses.replace(cal.fits["compute_fwd_s"].solve(), a=0.9, b=0.0)  # solved anew: 3x, no per-instance
    monkeypatch.setattr("ultraep.cost.fit.FIT_SOLVE_EVERY", 1)  # every call solves again
    monkeypatch.setattr(cal.fits["compute_fwd_s"], "_solve", lambda: new_fwd)
    monkeypatch.setattr(cal.fits["compute_bwd_s"], "_solve", lambda: None)
    for n_, i_, p_ in _calls(rng, 2, 4):
        call(n_, i_, p_, 0.9)
        assert cal.params.compute_scale == pytest.approx(0.9) and cal.params.half_tokens == 0.0
        assert backward(cal.model) == pytest.approx(want, rel=1e-6)  # the backward fit's, against the new forward
        assert cal.params.backward_compute_factor == pytest.approx(old_bwd.a / 0.9)


def test_a_probe_s_calls_keep_their_weight_while_another_policy_runs():
    """A few calls of a balanced policy (instance counts that differ), then many of ``none`` (every rank the same
    count) that the model does not describe exactly (the least busy rank measures 15 % over it, as on a shared
    host): kept per policy, the balanced calls weigh 1 to 9 against ``none``'s, and the fit predicts the balanced plan
    better than with every call decayed alike, where they weigh 1 to 30."""
    def truth(n, i, p):
        return _finish(0.3 * (n + 40 * i) * SPT + 0.004 * p, 0.6)

    probe = (np.array([900, 880]), np.array([3, 6]), np.array([0, 0]))
    errs = {}
    for keep in (True, False):
        fit, rng = ComputeFit(), np.random.default_rng(0)
        for _ in range(5):
            fit.add(*probe, truth(*probe), SPT, regime="quota" if keep else "")
        for _ in range(40):
            n = np.array([int(rng.integers(1200, 2000)), int(rng.integers(200, 600))])
            i, p = np.array([4, 4]), np.array([0, 0])
            fit.add(n, i, p, truth(n, i, p) * np.array([1.0, 1.15]), SPT, regime="none" if keep else "")
        fit._solved = None
        f = fit.solve()
        pred = _finish(f.a * (probe[0] + f.b / f.a * probe[1]) * SPT + f.d * probe[2], f.k).max()
        errs[keep] = abs(pred / truth(*probe).max() - 1)
    assert errs[True] < 0.8 * errs[False], errs  # 6.6 % off against 9.0 %
    # ...and a regime's own calls still decay: the fit follows a machine that got slower
    fit = ComputeFit()
    for scale, name, calls in ((1.0, "quota", 20), (1.0, "none", 40), (1.5, "none", 100)):
        for n, i, p in _calls(np.random.default_rng(7), 2, calls):
            fit.add(n, i, p, _finish(scale * 0.3 * (n + 16 * i) * SPT, 0.0), SPT, regime=name)
    fit._solved = None
    assert fit.solve().a == pytest.approx(0.45, rel=0.04)


# --------------------------------------------------------------------------------------- the ranks' noise
def _emax_reference(mean_R, noise):
    """E[max] by a fine integral with math.erf (independent of the cost model's approximation)."""
    m = np.asarray(mean_R, float)
    s = noise * m
    x = np.linspace(m.max() - 12 * s.max(), m.max() + 12 * s.max(), 200001)
    F = np.ones_like(x)
    erf = np.vectorize(math.erf)
    for mu, sd in zip(m, s):
        F *= 0.5 * (1 + erf((x - mu) / (sd * math.sqrt(2))))
    return x[0] + np.trapezoid(1 - F, x)


def test_two_balanced_noisy_ranks_finish_after_their_mean():
    # E[max] of two independent N(m, s^2) is m + s / sqrt(pi)
    for noise in (0.01, 0.05, 0.1, 0.3):
        assert expected_max(np.array([2.0, 2.0]), noise) == pytest.approx(2.0 * (1 + noise / math.sqrt(math.pi)),
                                                                          rel=1e-4)
    assert expected_max(np.array([2.0, 1.0]), 0.0) == 2.0
    assert expected_max(np.array([5.0, 1.0, 0.5]), 0.05) == pytest.approx(5.0, rel=1e-6)  # one far ahead
    assert expected_max(np.array([1.0, 0.0]), 0.3) == pytest.approx(1.0, rel=1e-4)  # an idle rank: no term


@settings(max_examples=40, deadline=None)
@given(work=st.lists(st.floats(0.01, 10.0), min_size=1, max_size=64), k=st.sampled_from([0.0, 0.05, 0.3]),
       noise=st.floats(0.001, 0.5))
def test_the_compiled_busiest_rank_is_the_expected_maximum_of_the_corun_finishes(work, k, noise):
    """``busiest_compute_s``'s compiled pass (every prediction prices the busiest rank twice) is
    ``expected_max(corun_finish(t, k), noise)`` to rounding; where a rank is narrow it hands over to the refined
    grid."""
    from ultraep.cost.model import EMAX_POINTS, EMAX_REACH, _noisy_busiest

    t = np.array(work)
    want = expected_max(corun_finish(t, k), noise)
    got = _noisy_busiest(t, k, noise, EMAX_POINTS, EMAX_REACH)
    if got < 0:  # a narrow rank: refused, the caller integrates on the refined grid
        f = corun_finish(t, k)
        step = 2 * EMAX_REACH * noise * f.max() / (EMAX_POINTS - 1)
        assert (noise * f[f > f.max() * (1 - EMAX_REACH * noise) / (1 + EMAX_REACH * noise)] < 4 * step).any()
    else:
        assert got == pytest.approx(want, rel=1e-9)
    cm = CostModel(Topology(num_ranks=len(work), num_experts=len(work)), params=CostParams(compute_noise=noise,
                                                                                          corun_slowdown=k))
    assert cm.busiest_compute_s(t) == pytest.approx(want, rel=1e-9)


@settings(max_examples=25, deadline=None)
@given(means=st.lists(st.floats(0.01, 10.0), min_size=1, max_size=64), noise=st.floats(0.001, 0.5))
def test_the_expected_maximum_matches_a_fine_integral(means, noise):
    m = np.array(means)
    got = expected_max(m, noise)
    assert got >= m.max() * (1 - 1e-9)  # never below the largest mean
    assert got == pytest.approx(_emax_reference(m, noise), rel=2e-4)


def test_every_rank_s_finish_in_sorted_order_is_the_matrices_one():
    rng = np.random.default_rng(5)
    for R in (1, 2, 3, 8, 64):
        w = rng.uniform(0.1, 2.0, R)
        for k in (0.0, 0.3, 1.0):
            assert corun_finish(w, k) == pytest.approx(_finish(w, k))


def test_the_busiest_rank_is_the_expected_maximum_of_the_noisy_finishes():
    topo = Topology(num_ranks=2, num_experts=8, num_redundant_slots=2)
    w = np.array([1.0, 1.0])
    cm = CostModel(topo).with_params(CostParams(corun_slowdown=0.2, compute_noise=0.1))
    assert cm.busiest_compute_s(w) == pytest.approx(1.2 * (1 + 0.1 / math.sqrt(math.pi)), rel=1e-4)
    assert cm.busiest_compute_s(np.array([1.0, 0.1])) == pytest.approx(1.02, rel=1e-5)  # the other far behind
    # the backward takes its own noise when set
    cm2 = cm.with_params(cm.params.model_copy(update={"backward_compute_noise": 0.0}))
    assert cm2.busiest_compute_s(w, backward=True) == pytest.approx(1.2)
    plan_bd = cm.ideal(np.full((2, 8), 64))
    quiet = CostModel(topo).with_params(CostParams(corun_slowdown=0.2)).ideal(np.full((2, 8), 64))
    assert plan_bd.compute_fwd_s > quiet.compute_fwd_s and plan_bd.compute_bwd_s > quiet.compute_bwd_s


@settings(max_examples=10, deadline=None)
@given(R=st.sampled_from([2, 4, 8]), noise=st.sampled_from([0.0, 0.03, 0.1]), seed=st.integers(0, 2**32 - 1))
def test_the_fit_learns_the_ranks_noise_around_it(R, noise, seed):
    rng = np.random.default_rng(seed)
    fit = ComputeFit()
    for n, i, p in _calls(rng, R, 400):
        t = _finish(0.3 * (n + 16 * i) * SPT, 0.1)
        fit.add(n, i, p, t * (1 + noise * rng.standard_normal(R)), SPT)
    fit._solved = None
    got = fit.solve()
    # the decayed sums hold ~20 calls' worth of rows: the estimate's own spread is a few tens of per cent of it
    assert got.noise == pytest.approx(noise, rel=0.45, abs=2e-3)
    # a call-wide slowdown (every rank alike) is no spread between ranks
    fit2 = ComputeFit()
    for n, i, p in _calls(rng, R, 60):
        fit2.add(n, i, p, _finish(0.3 * (n + 16 * i) * SPT, 0.1) * rng.uniform(0.7, 1.3), SPT)
    assert fit2.solve().noise < 0.6 * 0.3 / math.sqrt(3)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_fit_tells_a_replica_copy_from_a_replica(seed):
    """A rank that sends or receives replica copies computes slower on a host whose transport copies run on its cores
    (at 64 tokens per rank the rank that only sent its experts computed its backward 26-29 % slower, 2026-11-26): the
    copies each rank moved are their own unknown, apart from the replicas it computes."""
    rng = np.random.default_rng(seed)
    a, h, d, e = 0.4, 20.0, 0.003, 0.005
    fit, blind = ComputeFit(), ComputeFit()
    for n, i, p in _calls(rng, 2, 16):
        m = np.array([p[1], p[1]]) + rng.integers(0, 2, 2)  # rank 0 sends what rank 1 receives, and some more
        t = _finish(a * (n + h * i) * SPT + d * p + e * m, 0.1)
        assert fit.add(n, i, p, t, SPT, moves_R=m) and blind.add(n, i, p, t, SPT)
    got = fit.solve()
    assert (got.a, got.b / got.a, got.d, got.e) == (pytest.approx(a, rel=1e-5), pytest.approx(h, rel=1e-4),
                                                   pytest.approx(d, rel=1e-4), pytest.approx(e, rel=1e-4))
    # blind to the copies, the sending rank of a replicated call is predicted short by its copies' cost
    n, i, p, m = np.array([300.0, 300.0]), np.array([4.0, 6.0]), np.array([0.0, 2.0]), np.array([2.0, 2.0])
    want = a * (n + h * i) * SPT + d * p + e * m
    b = blind.solve()
    assert ((b.a * n + b.b * i) * SPT + b.d * p)[0] < 0.95 * want[0]
    assert (got.a * n + got.b * i) * SPT + got.d * p + got.e * m == pytest.approx(want, rel=1e-4)


def test_the_model_charges_each_rank_its_replica_copies_on_a_host():
    """Where the host runtime copies replicas (copy_s_per_byte > 0) every rank's compute carries replica_move_s per copy
    it sends or receives, forward and (before the factor) backward; on GPUs (no host copies) nothing."""
    topo = Topology(num_ranks=2, num_experts=8, num_redundant_slots=2)
    load = np.full((2, 8), 20)
    load[:, 0] = 400  # expert 0 (rank 0's) is hot: quota replicates it onto rank 1
    plan = plan_layer(load, "quota", topology=topo)
    gpu = CostModel(topo).with_params(CostParams(replica_move_s=0.01))
    assert gpu.predict(plan).moves_R is None
    host = CostModel(topo).with_params(CostParams(copy_s_per_byte=1e-10, corun_slowdown=0.0))
    moved = host.with_params(host.params.model_copy(update={"replica_move_s": 0.01, "backward_replica_move_s": 0.03}))
    m = moved.predict(plan).moves_R
    tree = host.replica_tree(plan)
    assert m.tolist() == [float(np.sum(tree.src == r) + np.sum(tree.dst == r)) for r in range(2)] and m.min() >= 1
    base, more = host.predict(plan), moved.predict(plan)
    tr = host.traffic(plan)
    assert more.compute_fwd_s == pytest.approx(float((host.compute_time_R(tr.tokens_R, tr.instances_R,
                                                replicas_R=tr.replica_instances_R) + 0.01 * m).max()))
    f = host.params.backward_compute_factor
    assert more.compute_bwd_s == pytest.approx(f * float((host.compute_time_R(
        tr.tokens_R, tr.instances_R, backward=True, replicas_R=tr.replica_instances_R) + 0.03 * m).max()))
    assert more.total_s > base.total_s and more.copy_s == base.copy_s  # the exposed copies are their own term


def test_the_calibrator_learns_what_a_replica_copy_costs_each_way():
    topo = Topology(num_ranks=2, num_experts=8, num_redundant_slots=2)
    cm = CostModel(topo).with_params(CostParams(copy_s_per_byte=1e-10))
    cal = Calibrator(cm)
    rng = np.random.default_rng(3)
    spt = cm.sec_per_token
    bd0 = cm.ideal(np.full((2, 8), 64))
    for n, i, p in _calls(rng, 2, 12):
        m = np.array([p[1], p[1]]) + rng.integers(0, 2, 2)
        bd = dataclasses.replace(bd0, rank_tokens_R=n.astype(float), instances_R=i.astype(float),
                                 replicas_R=p.astype(float), moves_R=m.astype(float))
        fwd = _finish(0.3 * (n + 16 * i) * spt + 0.002 * p + 0.001 * m, 0.1)
        bwd = _finish(0.6 * (n + 40 * i) * spt + 0.004 * p + 0.006 * m, 0.5)
        cal.observe(bd, {"compute_fwd_s": float(fwd.max()), "compute_bwd_s": float(bwd.max())},
                    rank_compute_s={"compute_fwd_s": fwd, "compute_bwd_s": bwd}, policy="quota")
    q = cal.params
    assert q.replica_move_s == pytest.approx(0.001, rel=1e-4)
    # kept before the factor (2x here), as the model applies it: factor x it = the backward's 6 ms per copy
    assert q.backward_replica_move_s * q.backward_compute_factor == pytest.approx(0.006, rel=1e-4)


# --------------------------------------------------------------------------- what only uneven calls show (issue 56)
def _uneven_then_balanced(rng, balanced_calls):
    """Truth: a 0.3 co-run slowdown on 2 ranks, every rank's time 1 % noisy. 30 uneven calls (none's: one rank 2-4x
    the other's tokens), then ``balanced_calls`` balanced ones (every rank the same tokens and instances). Returns the
    solved fit and the truth."""
    def truth(n, i):
        return _finish(0.3 * (n + 20 * i) * SPT, 0.3)

    fit = ComputeFit()
    for _ in range(30):
        lo = int(rng.integers(200, 500))
        n, i = np.array([lo, lo * int(rng.integers(2, 5))]), np.array([4, 4])
        fit.add(n, i, np.zeros(2), truth(n, i) * (1 + 0.01 * rng.standard_normal(2)), SPT, regime="none")
    for _ in range(balanced_calls):
        n, i = np.full(2, int(rng.integers(300, 1500))), np.array([4, 4])
        fit.add(n, i, np.zeros(2), truth(n, i) * (1 + 0.01 * rng.standard_normal(2)), SPT, regime="quota")
    fit._solved = None
    return fit.solve(), truth


def _none_error(f, truth):
    """The fit's relative error on an uneven call (what it predicts ``none`` costs)."""
    n, i = np.array([300, 1200]), np.array([4, 4])
    pred = _finish(f.a * (n + f.b / f.a * i) * SPT, f.k).max()
    return pred / truth(n, i).max() - 1


def test_the_slowdown_only_uneven_calls_show_is_kept_through_a_thousand_balanced_calls():
    f, truth = _uneven_then_balanced(np.random.default_rng(5), 1000)
    assert f.k == pytest.approx(0.3, abs=0.05)
    assert f.a == pytest.approx(0.3, rel=0.03)  # the scale from the balanced calls, at the kept slowdown
    assert abs(_none_error(f, truth)) < 0.02


def test_without_keeping_them_apart_the_balanced_calls_decay_the_slowdown_away(monkeypatch):
    """Negative control: every call decayed alike (FIT_UNEVEN None, the fit before issue 56) loses the slowdown and
    over-states what an uneven call (``none``) costs."""
    import ultraep.cost.fit as fit_module

    monkeypatch.setattr(fit_module, "FIT_UNEVEN", None)
    f, truth = _uneven_then_balanced(np.random.default_rng(5), 1000)
    assert f.k == 0.0
    assert _none_error(f, truth) > 0.05


def test_the_kept_slowdown_follows_new_uneven_calls():
    """Kept is not frozen: uneven calls of another slowdown move it (their own sums decay by FIT_DECAY)."""
    fit, rng = ComputeFit(), np.random.default_rng(2)
    for k, calls in ((0.3, 30), (0.0, 200), (0.6, 200)):
        for _ in range(calls):
            lo = int(rng.integers(200, 500))
            n, i = np.array([lo, 3 * lo]), np.array([4, 4])
            fit.add(n, i, np.zeros(2), _finish(0.3 * (n + 20 * i) * SPT, k), SPT, regime="none")
        for _ in range(calls):
            n, i = np.full(2, int(rng.integers(300, 1500))), np.array([3, 6])
            fit.add(n, i, np.zeros(2), _finish(0.3 * (n + 20 * i) * SPT, k), SPT, regime="quota")
        fit._solved = None
        assert fit.solve().k == pytest.approx(k)


# ------------------------------------------------------------------------------------------- the compiled kernels
def _reference_best(G, g, c):
    """The fit's per-slowdown least squares in numpy (every subset of the unknowns for every k, one batched solve):
    what ultraep.cost.fit._best_fits compiles."""
    from ultraep.cost.fit import _FIT_MASKS, FIT_UNKNOWNS

    U, k = FIT_UNKNOWNS, SLOWDOWNS[:, None]
    GK = G[0] + SLOWDOWNS[:, None, None] * G[1] + (SLOWDOWNS ** 2)[:, None, None] * G[2]
    gK = g[0] + k * g[1]
    diag = np.einsum("kii->ki", GK)
    u = np.where(diag > 0, 1.0 / np.sqrt(np.where(diag > 0, diag, 1.0)), 1.0)
    GU = GK * u[:, :, None] * u[:, None, :] + 1e-12 * np.eye(U)
    M = _FIT_MASKS[:, None, :]
    A = np.where((M[..., :, None] * M[..., None, :]) > 0, GU[None], np.eye(U))
    W = np.linalg.solve(A, (gK * u)[None, ..., None] * M[..., None])[..., 0] * u[None]
    resid = np.einsum("ski,kij,skj->sk", W, GK, W) - 2 * np.einsum("ski,ki->sk", W, gK) + c
    resid = np.where((W >= 0).all(axis=2) & (W.sum(axis=2) > 0), resid, np.inf)
    s = resid.argmin(axis=0)
    return resid[s, np.arange(len(SLOWDOWNS))], W[s, np.arange(len(SLOWDOWNS))]


@pytest.mark.parametrize("R", [2, 3, 8])
def test_the_compiled_fit_computes_what_its_numpy_formulation_does(R):
    """The rows, the sums and the per-slowdown solves run compiled (they run on every measured layer call); against the
    numpy formulation (corun_matrices, matrix products, a batched solve) they agree to rounding, and the fit takes the
    same slowdown and every unknown within 1e-9 — and a rank left out, or a perturbed sum, shows (negative controls)."""
    from ultraep.cost.fit import _FitSums, _best_fits, _rows, _FIT_MASKS

    rng = np.random.default_rng(R)
    sums, G, H, gg, rows = _FitSums(), np.zeros((3, 4, 4)), np.zeros((3, 4, 4)), np.zeros((2, 4)), 0
    for _ in range(12):
        n, i, p = (x.astype(float) for x in next(_calls(rng, R, 1)))
        m = rng.integers(0, 3, R).astype(float)
        t = _finish(SPT * n + 3 * SPT * i + 1e-3 * p, 0.25) * rng.lognormal(0.0, 0.05, R)
        use = np.ones(R, bool)
        use[0] = R > 2  # a rank that measured nothing is left out of the rows
        X = np.stack([n * SPT, i * SPT, p, m], axis=1)
        D0, D1 = X[use] / t[use, None], (corun_matrices(t)[1] @ X)[use] / t[use, None]
        got0, got1 = _rows(n, i, p, m, t, SPT, use)
        np.testing.assert_allclose(got0, D0, rtol=1e-13)
        np.testing.assert_allclose(got1, D1, rtol=1e-13)
        sums.add(got0, got1)
        C0, C1 = D0 - D0.mean(axis=0), D1 - D1.mean(axis=0)
        for acc, (a, b) in ((G, (D0, D1)), (H, (C0, C1))):
            acc += np.stack([a.T @ a, a.T @ b + b.T @ a, b.T @ b])
        gg += np.stack([D0.sum(axis=0), D1.sum(axis=0)])
        rows += D0.shape[0]
    np.testing.assert_allclose(sums.G, G, rtol=1e-12)
    np.testing.assert_allclose(sums.g, gg, rtol=1e-12)
    np.testing.assert_allclose(sums.H, H, rtol=1e-9, atol=1e-12 * np.abs(H).max())
    assert sums.c == rows
    ref_r, ref_w = _reference_best(G, gg, float(rows))
    got_r, got_w, ok = _best_fits(sums.G, sums.g, float(sums.c), SLOWDOWNS, _FIT_MASKS)
    assert ok and np.isfinite(got_r).any()
    fin = np.isfinite(ref_r)
    assert np.array_equal(np.isfinite(got_r), fin)
    np.testing.assert_allclose(got_r[fin], ref_r[fin], rtol=1e-9, atol=1e-9 * rows)
    np.testing.assert_allclose(got_w[fin], ref_w[fin], rtol=1e-9, atol=1e-15)
    assert int(np.argmin(got_r)) == int(np.argmin(ref_r))
    bad = sums.G.copy()
    bad[2, 0, 0] *= 1.01  # negative control: a perturbed sum moves the fit
    moved = _best_fits(bad, sums.g, float(sums.c), SLOWDOWNS, _FIT_MASKS)[1]
    assert not np.allclose(moved[fin], ref_w[fin], rtol=1e-9, atol=1e-15)
    lost = _rows(np.array([1.0, 2.0]), np.ones(2), np.zeros(2), np.zeros(2), np.ones(2), SPT, np.array([True, False]))
    assert lost[0].shape == (1, 4)  # the rank left out has no row

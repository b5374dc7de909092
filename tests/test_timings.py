"""One set of phase names (docs/design.md): the runtime's measurement, the cost model's prediction and the
telemetry columns use the same terms, so predicted and measured line up without translation. A call's phases
are typed (:class:`CallTimings`), and what rides with the load all-gather is a :class:`LoadHeader`."""

import dataclasses

import numpy as np
import pytest
import torch

from ultraep.cost import CostBreakdown
from ultraep.runtime.call_timings import CallTimings
from ultraep.runtime.load_header import GatheredLoad, LoadHeader, pack_load
from ultraep.runtime.phases import RANK_PHASES, rank_phases, reduce_phases
from ultraep.timings import TERMS


def _call(**kw) -> CallTimings:
    base = dict(load_s=0.01, plan_s=0.01, reroute_s=0.0, dispatch_s=0.1, master_compute_s=1.0, combine_s=0.1,
                forward_s=1.0, predicted=CostBreakdown(total_s=2.0, compute_fwd_s=0.5), activation_bytes_before=8.0,
                activation_bytes_after=4.0, replica_compute_s=0.5)
    return CallTimings(**{**base, **kw})


def test_every_term_is_predicted_recorded_and_measured():
    fields = {f.name for f in dataclasses.fields(CostBreakdown)}
    assert set(TERMS) <= fields  # the cost model predicts each
    # a training call measures every term, a serving call every forward one
    t = _call(weight_sync_flight_s=0.2, backward_s=3.0, combine_bwd_s=0.1, dispatch_bwd_s=0.1)
    ph = rank_phases(t)
    assert ph.shape == (len(RANK_PHASES),)
    measured, total = reduce_phases(np.stack([ph, ph * 2]))
    assert set(measured) | {"total_s"} == set(TERMS)
    assert measured["compute_fwd_s"] == 3.0 and measured["a2a_fwd_s"] == 0.2 and total == 8.0  # slowest / fastest
    measured, _ = reduce_phases(rank_phases(_call())[None, :])
    assert set(measured) | {"total_s", "compute_bwd_s", "a2a_bwd_s"} == set(TERMS)
    row = t.to_record()
    assert {f"predicted.{k}" for k in TERMS} <= set(row) and {f"measured.{k}" for k in TERMS} <= set(row)
    # what the runtime records is what the dashboard reads: every predicted./measured. key of a call's record
    # has its column in the timing facts, and every such column is recorded (a term added on one side only fails)
    from ultraep.dashboard.facts import TERM_COLS

    assert {k for k in row if k.startswith(("predicted.", "measured."))} == set(TERM_COLS)


def test_call_timings_refuse_a_misspelt_phase():
    t = _call()
    with pytest.raises(AttributeError):
        t.weight_wiat_s = 1.0  # slots: a typo is an error, never a phase silently read as 0 s
    with pytest.raises(TypeError):
        _call(dispach_s=0.1)
    with pytest.raises(KeyError, match="weight_wiat_s"):
        t.add_job_forward({"weight_wiat_s": 1.0}, kept=True, bytes_sent=0)  # the job's names are checked too


def test_call_timings_record_keys_follow_what_the_call_ran():
    """The record has exactly the keys a call measured (the ``timings`` columns and the ``other`` map)."""
    serve = _call().to_record()
    assert "weight_post_s" not in serve and "backward_s" not in serve and "grad_bytes" not in serve
    assert serve["experts_s"] == 1.5 and serve["measured_s"] == serve["forward_s"] == 1.0
    assert serve["transfer_s"] == 0.0 and serve["predicted_s"] == 2.0
    t = _call()
    t.add_job_forward({"weight_post_s": 0.1, "weight_wait_s": 0.2, "weight_sync_flight_s": 0.5,
                       "replica_compute_s": 0.5}, kept=True, bytes_sent=1000)
    t.add_job_backward({"grad_post_s": 0.05, "grad_wait_s": 0.1, "grad_reduce_s": 0.02, "restore_s": 0.3},
                       grad_bytes_sent=400)
    t.backward_s, t.combine_bwd_s, t.dispatch_bwd_s = 3.0, 0.1, 0.2
    row = t.to_record()
    assert row["transfer_s"] == pytest.approx(0.3) and row["relay_s"] == 0.0 and row["replica_kept"] == 1.0
    assert row["weight_sync_hidden_s"] == pytest.approx(0.3) and row["transfer_bytes"] == 1000.0
    assert row["backward_reduce_s"] == pytest.approx(0.47) and row["grad_bytes"] == 400.0
    assert row["backward_compute_s"] == pytest.approx(3.0 - 0.1 - 0.2 - 0.12 - 0.3)
    assert row["measured_s"] == 4.0 and "recompute_s" not in row
    assert list(row)[:11] == ["load_s", "plan_s", "reroute_s", "dispatch_s", "master_compute_s", "replica_compute_s",
                              "experts_s", "transfer_s", "combine_s", "forward_s", "measured_s"]
    assert t.rank_vector()[RANK_PHASES.index("copy_s")] == pytest.approx(0.1 + 0.05 + 0.02)


def test_load_header_round_trips():
    E = 5
    phases = np.array([1.5, 2.0, 1e-4, 2e-4, 0.0, 3e-9, 0.25, 0.0, 1e-3, 4.0, 0.5, 2e-5])
    headers = [LoadHeader(phases_s=phases, master_epoch=7, cache_free=True),
               LoadHeader(phases_s=None, master_epoch=3, cache_free=False)]
    for h in headers:
        back = LoadHeader.unpack(h.pack().numpy())
        assert (back.master_epoch, back.cache_free, back.bad_ids) == (h.master_epoch, h.cache_free, 0)
        assert (back.phases_s is None) == (h.phases_s is None)
        if h.phases_s is not None:
            assert np.array_equal(back.phases_s, np.round(h.phases_s * 1e9) * 1e-9)  # whole nanoseconds
    # as the all-gather sees them: counts, then the header; ids above the sentinel summed into the header
    counts = [torch.tensor([1, 0, 2, 0, 3, 0, 4]), torch.tensor([0, 1, 0, 1, 0, 0, 0])]  # ids 0..6: 6 is above E=5
    rows = np.stack([pack_load(c, E, h).numpy() for c, h in zip(counts, headers)])
    g = GatheredLoad.unpack(rows, E)
    assert np.array_equal(g.load_RE, [[1, 0, 2, 0, 3], [0, 1, 0, 1, 0]])
    assert g.bad_ranks == [0] and g.bad_ids == 4
    assert np.array_equal(g.epoch_R, [7, 3]) and not g.cache_free and g.phases_RK() is None
    with pytest.raises(ValueError, match="load header"):
        LoadHeader.unpack(np.zeros(3, dtype=np.int64))


def test_the_engine_also_hears_the_least_busy_rank_and_the_replicas():
    """Beside the slowest rank's terms, the least busy rank's compute (forward, backward) and every rank's replica
    compute reach the calibrator, and the replica weights' exposed wait; every rank's compute goes to the fit."""
    from ultraep.runtime.phases import compute_spread, rank_compute

    meas = np.zeros((2, len(RANK_PHASES)))
    col = RANK_PHASES.index
    meas[:, col("compute_fwd_s")] = [0.6, 0.2]
    meas[:, col("compute_bwd_s")] = [1.3, 0.5]
    meas[:, col("replica_compute_s")] = [0.0, 0.05]
    meas[:, col("weight_wait_s")] = [0.0, 0.003]
    assert compute_spread(meas) == pytest.approx({"compute_fwd_fastest_s": 0.2, "compute_bwd_fastest_s": 0.5,
                                                  "replica_compute_s": 0.05, "weight_wait_s": 0.003})
    assert {k: v.tolist() for k, v in rank_compute(meas).items()} == {"compute_fwd_s": [0.6, 0.2],
                                                                      "compute_bwd_s": [1.3, 0.5]}
    meas[:, col("compute_bwd_s")] = 0.0  # serving: no backward measured
    assert "compute_bwd_fastest_s" not in compute_spread(meas)
    assert list(rank_compute(meas)) == ["compute_fwd_s"]

"""One set of phase names (docs/design.md): the runtime's measurement, the cost model's prediction and the
telemetry columns use the same terms, so predicted and measured line up without translation."""

import dataclasses

import numpy as np

from ultraep.cost import CostBreakdown
from ultraep.runtime.layer import PREDICTED
from ultraep.runtime.phases import RANK_PHASES, rank_phases, reduce_phases
from ultraep.telemetry import semconv
from ultraep.timings import TERMS


def test_every_term_is_predicted_recorded_and_measured():
    fields = {f.name for f in dataclasses.fields(CostBreakdown)}
    assert set(TERMS) <= fields  # the cost model predicts each
    assert semconv.PREDICTED_TERMS == TERMS and PREDICTED == TERMS  # telemetry and the runtime record each
    # a training call measures every term, a serving call every forward one
    t = {"master_compute_s": 1.0, "replica_compute_s": 0.5, "backward_s": 3.0, "backward_compute_s": 2.0,
         "dispatch_s": 0.1, "combine_s": 0.1, "combine_bwd_s": 0.1, "dispatch_bwd_s": 0.1, "plan_s": 0.01,
         "weight_sync_flight_s": 0.2, "measured_s": 4.0}
    ph = rank_phases(t)
    assert ph.shape == (len(RANK_PHASES),)
    measured, total = reduce_phases(np.stack([ph, ph * 2]))
    assert set(measured) | {"total_s"} == set(TERMS)
    assert measured["compute_fwd_s"] == 3.0 and measured["a2a_fwd_s"] == 0.2 and total == 8.0  # slowest / fastest
    serve = {k: v for k, v in t.items() if not k.startswith("backward") and "bwd" not in k}
    measured, _ = reduce_phases(rank_phases(serve)[None, :])
    assert set(measured) | {"total_s", "compute_bwd_s", "a2a_bwd_s"} == set(TERMS)

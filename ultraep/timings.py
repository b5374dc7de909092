"""One set of phase names: what the runtime measures, the cost model predicts and telemetry records.

Each name is a field of :class:`~ultraep.cost.CostBreakdown` (the prediction), a key the runtime's layers
measure per call (``ultraep.runtime.phases`` reduces a call's raw timings to them, over every rank), and a
timing key telemetry stores twice per layer call, as ``predicted.<name>`` and ``measured.<name>``, so that
predicted and measured line up without translation (the dashboard's Policies page and the canned query
``phase_prediction_errors`` read them by these names).
"""

from __future__ import annotations

#: name -> what it covers, in the cost model's terms (seconds of one layer call)
PHASES: dict[str, str] = {
    "compute_fwd_s": "expert compute of the forward: the busiest rank's masters and replicas",
    "compute_bwd_s": "expert backward compute: the busiest rank's",
    "a2a_fwd_s": "token dispatch + combine all-to-alls of the forward (the exchange itself, not waiting)",
    "a2a_bwd_s": "the same two all-to-alls in the backward",
    "weight_sync_s": "replica weights in flight (posted before the dispatch, waited for before the replicas run)",
    "copy_s": "host copies on the critical path: weights packed and unpacked, gradients packed and reduced",
    "plan_s": "planning (the engine's decision included)",
    "total_s": "the whole layer: forward, plus backward when training",
}
#: the names, in a fixed order (telemetry columns, the runtime's all-gathered fields)
TERMS: tuple[str, ...] = tuple(PHASES)

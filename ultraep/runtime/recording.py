"""What a model's balanced layers record through: :class:`Recording`.

One per wrapped model, owned by the runtime (:class:`~ultraep.runtime.wrap.EPRuntime`) and handed to each layer, so
the layer (:mod:`ultraep.runtime.layer`) and its token path reach the recorder without importing the runtime that
builds them. Recording never stops training: a failing telemetry or calibration step is counted and logged once.

    layer forward      event("planned" | "dispatched" | ...)   the order of a call's steps, when ``events`` is a list
    calibration        safe(engine.observe, ...)                 a failure is counted, never raised
    call's backward    record_layer(layer, call, timings, row)   ``history`` row; the engine records plan and timings
"""

from __future__ import annotations

import logging

log = logging.getLogger("ultraep")

#: calls ``Recording.history`` keeps at least (the newest; trimmed to this once it holds twice as many): a run of
#: 10^5 steps over dozens of layers kept millions of rows
HISTORY_CALLS = 10_000


class Recording:
    """The recorder of one wrapped model and what its layers record into it.

    ``recorder``: an ``ultraep.telemetry`` recorder for this rank, or None (then only ``history`` is kept)."""

    def __init__(self, recorder=None) -> None:
        self.recorder = recorder
        #: the runtime's :class:`~ultraep.engine.Engine`, through which a call is recorded (set once it is built)
        self.engine = None
        #: recording steps that failed (counted, logged once, never raised)
        self.errors = 0
        #: (step, layer, policy, imbalance before, after, replicas, plan s, transfer s, layer fwd s) per call, the
        #: newest HISTORY_CALLS at least
        self.history: list[tuple] = []
        #: when a list: (event, layer) in the order the balanced layers' steps ran (tests pin the order)
        self.events: list[tuple[str, int]] | None = None

    def event(self, name: str, layer: int) -> None:
        if self.events is not None:
            self.events.append((name, layer))

    def safe(self, fn, *args, **kwargs) -> None:
        """Call ``fn`` (a telemetry or calibration step) so that its failure is counted in ``errors`` and logged
        once, never raised: the layers and the step bookkeeping record through this."""
        try:
            fn(*args, **kwargs)
        except Exception as exc:  # recording must never stop a training step
            self.errors += 1
            if self.errors == 1:
                log.warning("ultraep: recording failed (%s: %s); training continues", type(exc).__name__, exc)

    def record_layer(self, layer: int, call, timings, row: dict) -> None:
        """Record one layer call (a :class:`~ultraep.runtime.call_record.LayerCall` with its
        :class:`~ultraep.runtime.call_timings.CallTimings`, ``row`` = their record) once its backward ran (or never
        will): into ``history`` and, when recording, through :meth:`~ultraep.engine.Engine.record`."""
        plan = call.plan
        self.history.append((call.key[0], layer, plan.chosen_policy, plan.imbalance_before, plan.imbalance_after,
                             plan.num_replicas, timings.plan_s, timings.transfer_s, timings.measured_s))
        if len(self.history) >= 2 * HISTORY_CALLS:  # bounded, trimmed once per HISTORY_CALLS calls
            del self.history[:-HISTORY_CALLS]
        if self.recorder is not None:
            self.safe(self._record_call, call, row)

    def _record_call(self, call, row: dict) -> None:
        job, plan = call.job, call.plan
        secs = job.transfer_seconds() if job is not None and len(plan.transfers) else None
        self.engine.record(call.decision, plan=plan, timings=row, transfer_seconds=secs)

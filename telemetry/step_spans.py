"""Per-step OpenTelemetry spans and metrics, built on the recorder's flush path (never the hot path).

A step's span covers ``[end - step_time_s, end]`` (or, without a step time, from the previous step's end)
and carries the step's aggregates: plans, tokens, transfers, mean imbalance before/after, summed timings.
Two aggregate child spans show the step's planning and transfer time. Plans of a step may be flushed
before its ``record_step`` arrives; their aggregates wait in :attr:`StepSpans.pending`.

Imported only when the OpenTelemetry part is on (it loads the SDK's API).
"""

from __future__ import annotations

import operator
from typing import Any

from opentelemetry import trace

from ultraep.telemetry import semconv as sc
from ultraep.telemetry.batches import StepAggregate

MAX_PENDING_STEPS = 256


class StepSpans:
    """Turns flushed step records and plan aggregates into spans and metrics on one pipeline."""

    def __init__(self, pipeline, started_ns: int) -> None:
        self.pipeline = pipeline
        self.pending: dict[int, StepAggregate] = {}
        self.last_step_end = started_ns

    def emit(self, built_steps: dict, step_records: list) -> None:
        """Add this flush's per-step aggregates, then one span (and metrics) per step record."""
        m = self.pipeline.instruments
        total = StepAggregate()
        for s, agg in built_steps.items():
            self.pending.setdefault(s, StepAggregate()).add(agg)
            total.add(agg)
        if total.plans:
            m[sc.METRIC_PLANS].add(total.plans)
            m[sc.METRIC_TOKENS].add(total.tokens)
            m[sc.METRIC_PLAN_SOLVE_TIME].add(total.solve_time_s)
            m[sc.METRIC_TRANSFERS].add(total.transfers)
            m[sc.METRIC_TRANSFER_BYTES].add(total.transfer_bytes)
        for rec in step_records:
            fields = _step_fields(rec)
            if fields is not None:
                self._emit_step(*fields)
        if len(self.pending) > MAX_PENDING_STEPS:  # steps that never got a record_step: keep the newest only
            for s in sorted(self.pending)[:-MAX_PENDING_STEPS]:
                del self.pending[s]

    def _emit_step(self, step: int, end: int, loss: float | None, st: float | None, warm: bool) -> None:
        """The step's span with its two aggregate children, and the per-step metrics."""
        o, m = self.pipeline, self.pipeline.instruments
        start = end - int(st * 1e9) if st is not None and st >= 0 else self.last_step_end
        self.last_step_end = end
        agg = self.pending.pop(step, None) or StepAggregate()
        span = o.tracer.start_span(sc.SPAN_STEP, start_time=start, attributes=_step_attributes(step, loss, st,
                                                                                                warm, agg))
        ctx = trace.set_span_in_context(span)
        plan_s = agg.timings.get("plan_s", agg.solve_time_s)
        if agg.plans or plan_s:
            child = o.tracer.start_span(sc.SPAN_PLAN, context=ctx, start_time=start, attributes={
                sc.ATTR_AGGREGATE: True, sc.ATTR_STEP: step, sc.ATTR_PLAN_COUNT: agg.plans,
                sc.ATTR_PLAN_SOLVE_TIME: agg.solve_time_s})
            child.end(end_time=start + int(plan_s * 1e9))
        transfer_s = agg.timings.get("transfer_s", 0.0)
        if agg.transfers or transfer_s:
            child = o.tracer.start_span(sc.SPAN_TRANSFER, context=ctx, start_time=start, attributes={
                sc.ATTR_AGGREGATE: True, sc.ATTR_STEP: step, sc.ATTR_TRANSFER_COUNT: agg.transfers,
                sc.ATTR_TRANSFER_BYTES: agg.transfer_bytes})
            child.end(end_time=start + int(transfer_s * 1e9))
        span.end(end_time=end)
        m[sc.METRIC_STEPS].add(1)
        m[sc.METRIC_STEP_DURATION].record((end - start) / 1e9)
        if loss is not None:
            m[sc.METRIC_LOSS].set(loss)
        if agg.plans:
            m[sc.METRIC_IMBALANCE_BEFORE].set(agg.imbalance_before_sum / agg.plans)
            m[sc.METRIC_IMBALANCE_AFTER].set(agg.imbalance_after_sum / agg.plans)


def _step_fields(rec: tuple):
    """``(step, end_ns, loss, step_time_s, warmup)`` of a step record, or ``None`` for a bad one (the
    steps table refuses and counts it already)."""
    try:
        step = operator.index(rec[0])
        end = int(rec[1])
        loss = None if rec[2] is None else float(rec[2])
        st = None if rec[3] is None else float(rec[3])
        warm = rec[5]
        if not isinstance(warm, bool) and type(warm).__name__ != "bool_":  # numpy's bool too
            raise TypeError(warm)
        return step, end, loss, st, bool(warm)
    except Exception:
        return None


def _step_attributes(step: int, loss: float | None, st: float | None, warm: bool,
                     agg: StepAggregate) -> dict[str, Any]:
    attrs: dict[str, Any] = {sc.ATTR_STEP: step}
    if warm:
        attrs[sc.ATTR_WARMUP] = True
    if loss is not None:
        attrs[sc.ATTR_LOSS] = loss
    if st is not None:
        attrs[sc.ATTR_STEP_TIME] = st
    if agg.plans:
        attrs.update({
            sc.ATTR_PLAN_COUNT: agg.plans, sc.ATTR_PLAN_SOLVE_TIME: agg.solve_time_s,
            sc.ATTR_TOKENS: agg.tokens, sc.ATTR_TRANSFER_COUNT: agg.transfers,
            sc.ATTR_TRANSFER_BYTES: agg.transfer_bytes,
            sc.ATTR_IMBALANCE_BEFORE: agg.imbalance_before_sum / agg.plans,
            sc.ATTR_IMBALANCE_AFTER: agg.imbalance_after_sum / agg.plans,
        })
    for k, v in agg.timings.items():
        attrs[sc.ATTR_TIMING_PREFIX + k] = v
    return attrs

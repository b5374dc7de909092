"""A balanced layer's calls between their forward and their record: :class:`CallLog`.

A training call is recorded once its backward ran (its backward phases are part of the record), a serving call
right after its forward (on CUDA when its events completed: at the latest after the next call's load all-gather).
At most one call per layer waits: the next call's forward records it first (its backward never came: an
evaluation under grad, a dropped graph). On CUDA the call's events are read only when they
completed (``clock.ready()``), so recording never adds a host synchronisation.

    forward   CallLog.open(call, out, send)  →  hooks at the call's backward start and end (or record now)
    backward  (end hook)                    →  CallLog.flush(): CallTimings read into seconds, the backward
                                               phases added, recorded through ``record`` (the runtime's
                                               ``record_layer``: plan, decision, timings via the engine)
    next call CallLog.take_observation()    →  this rank's phases of the last complete call, sent with the load
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from ultraep.runtime.call_timings import CallTimings


class LayerCall:
    """One forward of a layer waiting for its backward before it is recorded."""

    __slots__ = ("plan", "timings", "job", "marks", "key", "needs_backward", "decision", "clock", "replay")

    def __init__(self, plan, timings: CallTimings | None, job, key: tuple[int, int], needs_backward: bool,
                 decision, marks: dict, clock, replay=None) -> None:
        self.plan, self.timings, self.job, self.key = plan, timings, job, key
        self.clock = clock
        self.replay = replay  # the activation-checkpoint replay kept for this call (None: not training)
        self.needs_backward, self.decision = needs_backward, decision
        self.marks = marks  # backward times: bwd_start, bwd_end, and the two all-to-alls' seconds


class CallLog:
    """One layer's pending call, its last record and the phases it sends with its next load.

    ``record(call, timings, row)``: records a finished call (``row`` = ``timings.to_record()``);
    ``on_backward_end(call)``: told when a call's backward ran (the layer drops its recompute replay)."""

    def __init__(self, record: Callable[[LayerCall, CallTimings, dict], None],
                 on_backward_end: Callable[[LayerCall], None]) -> None:
        self._record = record
        self._on_backward_end = on_backward_end
        self.pending: LayerCall | None = None
        #: the last complete call's (step, microbatch, [K] phases), sent with the next load all-gather
        self._observation: tuple[int, int, np.ndarray] | None = None
        #: this rank's record of the last recorded call (``CallTimings.to_record()`` keys, seconds)
        self.last_timings: dict[str, float] = {}

    def ready(self) -> bool:
        """A call waits and its times can be read without a host synchronisation."""
        return self.pending is not None and self.pending.clock.ready()

    def take_observation(self) -> tuple[int, int, np.ndarray] | None:
        obs, self._observation = self._observation, None
        return obs

    def open(self, call: LayerCall, out, send) -> None:
        """``call``'s forward finished with output ``out`` and dispatched rows ``send``: record it after its
        backward (hooks at its start and end), or now when it has none."""
        self.pending = call
        if call.needs_backward and out.requires_grad:
            hook_backward(out, send, call, self._backward_end)
        elif call.clock.ready():  # (CUDA: else at the next call's load all-gather, never a sync here)
            self.flush()

    def _backward_end(self, call: LayerCall) -> None:
        call.marks["bwd_end"] = call.clock.now()
        self._on_backward_end(call)
        if self.pending is call and call.clock.ready():  # (CUDA: else at the next call, never a sync here)
            self.flush()

    def flush(self) -> None:
        """Record the pending call (forward phases, and backward phases if its backward ran)."""
        call, self.pending = self.pending, None
        if call is None:
            return
        read = call.clock.read  # device times become seconds here, never on the hot path
        t = call.timings.read(read)
        if call.job is not None:
            t.add_job_backward({k: read(v) for k, v in call.job.phases.items()}, call.job.grad_bytes_sent)
        m = {k: read(v) for k, v in call.marks.items()}
        if "bwd_start" in m and "bwd_end" in m:
            # the layer's backward and its two all-to-alls (timed inside); CallTimings derives the rest
            t.backward_s = m["bwd_end"] - m["bwd_start"]
            t.combine_bwd_s = m.get("combine_bwd_s", 0.0)
            t.dispatch_bwd_s = m.get("dispatch_bwd_s", 0.0)
        vec = t.rank_vector()
        row = t.to_record(vec)
        self.last_timings = row
        if t.backward_s is not None or not call.needs_backward:  # complete: sent with the next call's load,
            self._observation = (call.key[0], call.key[1], vec)  # the engine calibrates from every rank's
        self._record(call, t, row)


def hook_backward(out, send, call: LayerCall, end: Callable[[LayerCall], None]) -> None:
    """Hooks at a call's backward start (gradient of its output) and end (gradient of its dispatched rows).
    (The replica-gradient receives are posted with the sends, by the replicas' backward: docs/design.md.)"""

    def start(grad):
        call.marks["bwd_start"] = call.clock.now()

    out.register_hook(start)
    if send.requires_grad:
        send.register_hook(lambda grad: end(call))

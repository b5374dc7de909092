"""One balanced layer's collectives under a guard: a backend failure names the layer, the phase and the peers.

A peer that dies or stops answering surfaces on the other ranks as a ``RuntimeError`` from the backend somewhere
inside a collective. :class:`CollectiveGuard` turns it into :class:`~ultraep.errors.CollectiveFailedError` (one
line: layer, phase, rank, step, peers, what to do), after flushing this rank's telemetry so the run's record
reaches its last call. The layer's token exchanges, load all-gather and plan-hash check run under it, and so do
its replica jobs' point-to-point batches (``guard(phase, peers)``).
"""

from __future__ import annotations

from contextlib import contextmanager

from ultraep.errors import CollectiveFailedError, PlanDivergenceError


class CollectiveGuard:
    """``with guard(phase, peers): ...`` around one collective of layer ``layer`` (module path ``name``).

    ``runtime``: what a failure report reads and flushes (rank, world size, step, ``flush_records`` and its
    :class:`~ultraep.runtime.recording.Recording`)."""

    def __init__(self, runtime, layer: int, name: str) -> None:
        self.runtime, self.layer, self.name = runtime, layer, name

    @contextmanager
    def __call__(self, phase: str, peers: list[int] | None = None):
        try:
            yield
        except (CollectiveFailedError, PlanDivergenceError):
            raise
        except RuntimeError as exc:
            rt = self.runtime
            rec = rt.recording
            flushed = rec.recorder is not None
            if flushed:
                rt.flush_records()
                rec.safe(rec.recorder.flush)
            if peers is None:
                peers = [r for r in range(rt.world_size) if r != rt.rank]
            text = str(exc).strip()
            cause = text.splitlines()[0] if text else type(exc).__name__
            raise CollectiveFailedError(
                f"layer {self.layer} ({self.name}): {phase} failed on rank {rt.rank} of {rt.world_size} at step "
                f"{rt.step} while exchanging with rank(s) {peers}: a peer died or did not answer within the "
                f"process group timeout ({type(exc).__name__}: {cause}). {'Telemetry was flushed; ' if flushed else ''}"
                "stop every rank and restart from the last checkpoint.",
                layer=self.layer, name=self.name, phase=phase, rank=rt.rank, peers=list(peers), step=rt.step,
            ) from exc

    @contextmanager
    def timed(self, clock, marks: dict, key: str, phase: str):
        """The guard, also adding the seconds it took to ``marks[key]`` (the backward all-to-alls)."""
        t0 = clock.now()
        with self(phase):
            yield
        marks[key] = marks.get(key, 0.0) + (clock.now() - t0)

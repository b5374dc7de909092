"""Telemetry off: :class:`NullRecorder`, the recorder's interface doing nothing."""

from __future__ import annotations


class _NullSpan:
    def __enter__(self):
        return None

    def __exit__(self, *exc) -> bool:
        return False


NULL_SPAN = _NullSpan()
"""A span that does nothing (telemetry or OpenTelemetry off)."""


class NullRecorder:
    """Telemetry off: the :class:`~ultraep.telemetry.recorder.Recorder` interface, doing nothing (one
    method call per record)."""

    run_id = ""
    run_dir = None
    rank = 0
    world_size = 1
    errors = 0
    dropped_rows = 0
    first_error = None

    @classmethod
    def open(cls, runs_dir=None, run_name=None, **kwargs) -> "NullRecorder":
        return cls()

    def record_plan(self, step: int, microbatch: int, layer: int, plan, *, record_routes: bool = False) -> None:
        pass

    def record_decision(self, step: int, microbatch: int, layer: int, *, policy: str, reason: str,
                        predictions: dict[str, float] | None = None,
                        chosen_predicted_s: float | None = None) -> None:
        pass

    def record_timings(self, step: int, microbatch: int, layer: int, timings: dict[str, float]) -> None:
        pass

    def record_transfer_times(self, step: int, microbatch: int, layer: int, seconds_per_transfer) -> None:
        pass

    def record_step(self, step: int, *, loss: float | None = None, step_time_s: float | None = None,
                    extra: dict | None = None, warmup: bool = False) -> None:
        pass

    def span(self, name: str, **attributes):
        return NULL_SPAN

    def flush(self) -> None:
        pass

    def close(self) -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> bool:
        return False

"""The clock of a layer call's phases: ``perf_counter`` on CPU, CUDA events on CUDA (issue 34).

On CUDA, kernels and NCCL transfers run asynchronously: ``perf_counter`` around them measures the time to
*enqueue* work, not the work. A :class:`DeviceClock` records a CUDA event on the current stream at each
:meth:`~DeviceClock.now` and hands back a :class:`Seconds` — a value known once the device got there. Phase
arithmetic (``t1 - t0``, sums of phases) builds on those without reading anything; :meth:`read` turns one
into seconds when the call is recorded (``BalancedExperts.flush_record``), after the next call's load
all-gather synchronised the stream anyway, so no phase adds a host synchronisation.

On CPU, :class:`HostClock` returns plain floats: the arithmetic is the float arithmetic it always was.

    clock = clock_for(hidden_states)   # one per layer call
    t0 = clock.now(); ...; t1 = clock.now()
    timings["load_s"] = t1 - t0        # a float on CPU, a Seconds on CUDA
    ...
    if clock.ready(): seconds = clock.read(timings["load_s"])
"""

from __future__ import annotations

import time
from typing import Callable, Union

import torch


class Seconds:
    """A duration read later: ``f(read)`` returns the seconds once the clock's events completed."""

    __slots__ = ("f",)

    def __init__(self, f: Callable) -> None:
        self.f = f

    def __add__(self, other):
        return Seconds(lambda read: read(self) + read(other))

    def __radd__(self, other):
        return Seconds(lambda read: read(other) + read(self))

    def __sub__(self, other):
        return Seconds(lambda read: read(self) - read(other))

    def __rsub__(self, other):
        return Seconds(lambda read: read(other) - read(self))

    def __float__(self):  # a read on the hot path would synchronise: refuse it loudly
        raise TypeError("a device time is read at flush_record (clock.read), not on the hot path")


Time = Union[float, Seconds]


def clamp0(x: Time) -> Time:
    """``max(0, x)`` for a float or a :class:`Seconds` (``max`` itself would compare, i.e. read)."""
    if isinstance(x, Seconds):
        return Seconds(lambda read: max(0.0, read(x)))
    return max(0.0, x)


class HostClock:
    """``perf_counter`` seconds (CPU tensors: the work is done when the call returns)."""

    device = False

    def now(self) -> float:
        return time.perf_counter()

    def ready(self) -> bool:
        return True

    def read(self, x: Time) -> float:
        return float(x)


class DeviceClock:
    """CUDA events on the current stream; ``cuda`` is the ``torch.cuda`` module (a fake in tests)."""

    device = True

    def __init__(self, cuda=None) -> None:
        self.cuda = cuda if cuda is not None else torch.cuda
        self._origin = self._record()
        self._last = self._origin

    def _record(self):
        ev = self.cuda.Event(enable_timing=True)
        ev.record()  # on the current stream: asynchronous, no host synchronisation
        return ev

    def now(self) -> Seconds:
        ev = self._record()
        self._last = ev
        origin = self._origin
        return Seconds(lambda read: origin.elapsed_time(ev) * 1e-3)

    def ready(self) -> bool:
        """Whether every event recorded so far completed (reading then never blocks)."""
        return bool(self._last.query())

    def read(self, x: Time) -> float:
        """Seconds of ``x``; waits for the last event if the device is not there yet (flush only)."""
        if not isinstance(x, Seconds):
            return float(x)
        if not self._last.query():  # (after the next call's load all-gather it has: no wait, no synchronize call)
            self._last.synchronize()
        return float(x.f(self.read))


def clock_for(t: torch.Tensor) -> HostClock | DeviceClock:
    """The clock for work on ``t``'s device."""
    return DeviceClock() if t.is_cuda else HostClock()

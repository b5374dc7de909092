"""User-facing errors.

Every error a user can cause carries the *path* of the offending field (``layers.3.quota.num_redundant_slots``,
``load[2, 5]``, a file name) and the offending value, so the message alone says what to fix. The CLI turns
any :class:`UltraEPError` into a one-line message and exit code 2, without a traceback.
"""

from __future__ import annotations

from typing import Any


class UltraEPError(ValueError):
    """Base of every error caused by user input (config, load, trace, CLI argument)."""

    def __init__(self, path: str, message: str, value: Any = None) -> None:
        self.path = path
        self.value = value
        self.message = message
        super().__init__(f"{path}: {message}" if path else message)

    def __reduce__(self):
        # Pickle with the three constructor arguments (the default would call cls(str(self)) and fail), so an
        # error raised in a worker process (the simulator's pool, a forked rank) reaches the parent intact.
        return type(self), (self.path, self.message, self.value)


class ConfigError(UltraEPError):
    """An invalid configuration or topology field."""


class LoadError(UltraEPError):
    """An invalid load matrix ``λ[R, E]``."""


class TraceError(UltraEPError):
    """An unreadable or malformed routing trace file."""


class PendingGradientsError(UltraEPError):
    """Replica gradients accumulated under ``no_sync()`` would be lost: the masters changed (an optimizer step,
    a weight load) before a backward outside ``no_sync()`` reduced them."""


class DistributedError(UltraEPError):
    """A distributed run failed — a peer, a collective, ranks that disagree — not the user's input: the CLI
    prints it in one line and exits with code 1 (not 2)."""

    def __init__(self, message: str) -> None:
        super().__init__("", message)

    def __reduce__(self):
        return _rebuild, (type(self), (self.message,), {k: v for k, v in self.__dict__.items()
                                                         if k not in ("path", "value", "message")})


def _rebuild(cls, args, state):
    exc = cls.__new__(cls)
    DistributedError.__init__(exc, *args)
    exc.__dict__.update(state)
    return exc


class CollectiveFailedError(DistributedError):
    """A collective of a balanced layer failed on this rank: a peer died, or did not answer within the process
    group's timeout (``init_process_group(timeout=...)``; ``ultraep.launch(..., timeout_s=...)``).

    Raised by every surviving rank that reaches a collective, after its telemetry was flushed. Attributes:
    ``layer`` (MoE layer index), ``name`` (module path), ``phase``, ``rank``, ``peers`` (the ranks this one
    was exchanging with), ``step``.
    """

    def __init__(self, message: str, *, layer: int, name: str, phase: str, rank: int, peers: list[int],
                 step: int) -> None:
        super().__init__(message)
        self.layer, self.name, self.phase, self.rank, self.peers, self.step = layer, name, phase, rank, peers, step


class PlanDivergenceError(DistributedError):
    """Ranks computed different plans for the same layer (``check_plan_hash``): exchanging tokens would be wrong."""


class LaunchedRankError(DistributedError):
    """A rank started by :func:`ultraep.launch.launch` raised or died (the message carries its traceback)."""


def format_pydantic_error(exc: Exception) -> str:
    """One line per pydantic error: ``field.path (value): message``."""
    errors = getattr(exc, "errors", None)
    if errors is None:
        return str(exc)
    lines = []
    for err in errors():
        inner = (err.get("ctx") or {}).get("error")
        if isinstance(inner, UltraEPError):  # our own validators already name the path and the value
            lines.append(str(inner))
            continue
        loc = ".".join(str(p) for p in err.get("loc", ()))
        inp = err.get("input")
        shown = "" if isinstance(inp, dict) else f" ({inp!r})"
        lines.append(f"{loc or '<root>'}{shown}: {err.get('msg')}")
    return "\n".join(lines)

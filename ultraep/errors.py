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

"""Size limits: every size a command or API call will use is turned into bytes and work, and checked
*before* anything is allocated.

Two kinds of limit, both refused with one :class:`~ultraep.errors.ConfigError` line that names the field,
its value, what it would need and what is available (the CLI prints it and exits 2):

* **Sane bounds** (machine independent constants below): sizes no EP deployment reaches and that the
  on-disk formats cannot hold (trace ids are int32, microbatch ids 20 bits, the planners' exact integer
  splits stay in int64).
* **Memory**: the bytes a request implies (dense matrices, their temporaries, trace rows) against what
  this process may still take, times :data:`MEMORY_FRACTION` (the margin for numpy temporaries, the
  interpreter and whatever else runs). "What this process may take" is the smallest of
  ``MemAvailable`` (``/proc/meminfo``), the cgroup's ``memory.max - memory.current`` and the address-space
  limit (``ulimit -v``) minus the process's current ``VmSize``. Where none of these can be read (not
  Linux) only the bounds apply.
* **Work**: element operations a request implies, bounded by :data:`MAX_WORK` (hours of numpy, not a
  hard machine limit: long work the user asked for runs with a progress bar and stops on Ctrl-C).

Estimates are deliberately on the high side (measured peaks are recorded next to each estimator); the
point is to refuse what cannot work before it starts, not to predict peak memory to the byte.
``docs/reliability.md`` lists every limit and how to raise it (:func:`configure` for API users).

Legend: R ranks, Rs source ranks of a trace, E experts, N redundant slots, S = E / R + N slots per rank,
L layers, T steps, B microbatches, P = T * B points, k top-k.
"""

from __future__ import annotations

try:  # POSIX only; elsewhere the address-space limit is simply not consulted
    import resource
except ImportError:  # pragma: no cover
    resource = None  # type: ignore[assignment]
from contextlib import contextmanager
from typing import Iterator, Mapping

from ultraep.errors import ConfigError

#: Share of the available memory a request may plan to use; the rest is the margin for the estimates'
#: slack, the interpreter, libraries and other processes.
MEMORY_FRACTION = 0.7
#: EP group size. The largest published EP groups have a few hundred ranks; 2^16 leaves room for
#: what-if simulations while keeping [R, R, S] routes meaningful.
MAX_RANKS = 1 << 16
#: Logical experts per layer (fine-grained MoE such as PEER uses 2^20; trace expert ids are int32).
MAX_EXPERTS = 1 << 24
#: MoE layers (trace layer ids are int32; real models have at most a few hundred).
MAX_LAYERS = 1 << 16
#: Steps of a trace (step ids are int32).
MAX_STEPS = (1 << 31) - 1
#: Microbatches per step (the trace's point index packs the microbatch into 20 bits).
MAX_MICROBATCHES = (1 << 20) - 1
#: Redundant slots per rank (a rank holding more replicas than this is not an EP deployment).
MAX_SLOTS = 1 << 16
#: Tokens of one source rank times ranks: a count above 2^53 is no longer exact in float64, which the
#: samplers' probabilities multiply.
MAX_TOTAL_TOKENS = 1 << 53
#: Element operations (array cells touched) one request may imply: about an hour of numpy on one core.
MAX_WORK = 10**12

#: Requests below this many bytes are not checked against the machine (reading /proc costs ~50 µs).
_ALWAYS_FITS = 64 << 20

_overrides: dict[str, float] = {}


def configure(**limits: float) -> None:
    """Raise (or lower) limits for this process, e.g. ``configure(MAX_RANKS=1 << 20, MEMORY_FRACTION=0.9)``.

    Unknown names are refused. The CLI has no flag for this on purpose: the bounds are the library's
    contract, and the memory limit follows the machine.
    """
    g = globals()
    for name, value in limits.items():
        if not name.isupper() or name not in g or name.startswith("_"):
            known = ", ".join(n for n in g if n.isupper() and not n.startswith("_"))
            raise ConfigError("limits", f"unknown limit {name!r}; known: {known}", name)
        _overrides[name] = value


@contextmanager
def raised(**limits: float) -> Iterator[None]:
    """``with limits.raised(MAX_WORK=1e13): ...``: :func:`configure` for the duration of a block."""
    saved = dict(_overrides)
    configure(**limits)
    try:
        yield
    finally:
        _overrides.clear()
        _overrides.update(saved)


def limit(name: str) -> float:
    """Current value of a limit (its override, else the module constant)."""
    return _overrides.get(name, globals()[name])


# ---------------------------------------------------------------------------------------------- formatting
def fmt_bytes(n: float) -> str:
    for unit, size in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{int(n)} B"


def _fmt_value(value) -> str:
    return f"{value:,}" if isinstance(value, int) and not isinstance(value, bool) else str(value)


# ---------------------------------------------------------------------------------------------- the machine
def _read_int(path: str) -> int | None:
    try:
        with open(path) as f:
            text = f.read().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None  # "max" (no limit) reads as None


def _proc_kib(path: str, key: str) -> int | None:
    try:
        with open(path) as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def available_memory() -> tuple[int | None, str]:
    """``(bytes this process may still allocate, where that number comes from)``; ``None`` when unknown."""
    cands: list[tuple[int, str]] = []
    avail = _proc_kib("/proc/meminfo", "MemAvailable")
    if avail is not None:
        cands.append((avail, "MemAvailable"))
    for lim_path, cur_path in (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
                               ("/sys/fs/cgroup/memory/memory.limit_in_bytes",
                                "/sys/fs/cgroup/memory/memory.usage_in_bytes")):
        lim, cur = _read_int(lim_path), _read_int(cur_path)
        if lim is not None and cur is not None and lim < (1 << 60):
            cands.append((max(lim - cur, 0), "cgroup memory limit"))
            break
    soft = resource.getrlimit(resource.RLIMIT_AS)[0] if resource is not None else -1
    if soft >= 0 and soft != getattr(resource, "RLIM_INFINITY", -1):
        vm = _proc_kib("/proc/self/status", "VmSize") or 0
        cands.append((max(soft - vm, 0), "address-space limit (ulimit -v)"))
    if not cands:
        return None, "unknown"
    return min(cands)


# ---------------------------------------------------------------------------------------------- checks
def check_bound(field: str, value: int, low: int, high_name: str, why: str = "") -> None:
    """Refuse ``value`` outside ``low .. limit(high_name)``."""
    high = int(limit(high_name))
    if not low <= value <= high:
        raise ConfigError(field, f"({_fmt_value(value)}) must be in {low:,}..{high:,}"
                          + (f" ({why})" if why else "") + f"; limits.{high_name} is the upper bound", value)


def check_memory(field: str, value, need_bytes: float, what: str) -> None:
    """Refuse when ``need_bytes`` exceed :data:`MEMORY_FRACTION` of the available memory."""
    if need_bytes < _ALWAYS_FITS:  # the hot path (plan_layer per microbatch) reads no /proc files
        return
    avail, src = available_memory()
    if avail is None:
        return
    budget = avail * float(limit("MEMORY_FRACTION"))
    if need_bytes > budget:
        raise ConfigError(field, f"({_fmt_value(value)}) would need {fmt_bytes(need_bytes)} for {what}; "
                          f"{fmt_bytes(budget)} available ({limit('MEMORY_FRACTION'):.0%} of {fmt_bytes(avail)}, "
                          f"{src})", value)


def check_work(field: str, value, ops: float, what: str) -> None:
    """Refuse when ``ops`` element operations exceed :data:`MAX_WORK`."""
    cap = float(limit("MAX_WORK"))
    if ops > cap:
        raise ConfigError(field, f"({_fmt_value(value)}) would take about {ops:.2g} element operations for {what}; "
                          f"limits.MAX_WORK is {cap:.2g}", value)


def check_dense(field: str, rows: int, cols: int, itemsize: int = 8, *, copies: float = 1.0, value=None,
                what: str | None = None) -> int:
    """Refuse a dense ``[rows, cols]`` array (``copies`` of it alive at once) that would not fit; returns its
    bytes. For importers that infer a width from the data (``E = largest id + 1``): call it before
    allocating, with the field that the size came from and the offending value."""
    need = float(rows) * float(cols) * itemsize * copies
    check_memory(field, cols if value is None else value, need,
                 what or f"a dense [{rows:,}, {cols:,}] matrix ({itemsize}-byte cells)")
    return int(need)


def _name(names: Mapping[str, str] | None, key: str, default_prefix: str) -> str:
    return (names or {}).get(key, f"{default_prefix}.{key}")


# ---------------------------------------------------------------------------------------------- estimators
def plan_bytes(R: int, E: int, N: int, policies: int = 1) -> float:
    """Bytes to plan one layer from a ``[R, E]`` int64 load, ``policies`` plans kept alive at once.

    Measured (tracemalloc, quota/eplb/none, R x E x N in {64x65536x2, 1024x1024x2, 512x8192x4, 2048x2048x2}):
    peak ≈ 0.6-0.9 x (R·E·8 + R·R·S·8) above the load; the estimate takes the load, a copy of it and
    1.5 x the ``[R, R, S]`` routes per plan.
    """
    S = E // max(R, 1) + N
    return 8.0 * (2 * R * E + policies * (R * E + 1.5 * R * R * S))


def check_plan(R: int, E: int, N: int, *, policies: int = 1, names: Mapping[str, str] | None = None) -> None:
    """Bounds and memory of planning one ``[R, E]`` layer with ``N`` redundant slots (``policies`` at once)."""
    if (not _overrides and 1 <= R <= MAX_RANKS and 1 <= E <= MAX_EXPERTS and 0 <= N <= MAX_SLOTS
            and plan_bytes(R, E, N, policies) < _ALWAYS_FITS):
        return  # the runtime's hot path: a few integer comparisons
    nr, ne, nn = (_name(names, k, "topology") for k in ("num_ranks", "num_experts", "num_redundant_slots"))
    check_bound(nr, R, 1, "MAX_RANKS", "EP group size")
    check_bound(ne, E, 1, "MAX_EXPERTS", "experts per layer")
    check_bound(nn, N, 0, "MAX_SLOTS", "redundant slots per rank")
    check_memory(f"{nr} x {ne}", f"{R:,} x {E:,}", plan_bytes(R, E, N, policies),
                 f"the [R, E] load and {policies} plan(s) with [R, R, S] routes")


def check_synthetic_load(R: int, E: int, top_k: int, tokens: int, *, names: Mapping[str, str] | None = None) -> None:
    """Bounds and memory of :func:`ultraep.sim.workload.synthetic_load` (no planning)."""
    nr, ne, nk, nt = (_name(names, k, "synthetic_load") for k in ("num_ranks", "num_experts", "top_k",
                                                                   "tokens_per_rank"))
    check_bound(nr, R, 1, "MAX_RANKS", "EP group size")
    check_bound(ne, E, 1, "MAX_EXPERTS", "experts per layer")
    check_bound(nk, top_k, 1, "MAX_EXPERTS")
    check_bound(nt, tokens, 0, "MAX_TOTAL_TOKENS", "tokens per rank")
    if tokens * R > limit("MAX_TOTAL_TOKENS"):
        raise ConfigError(nt, f"({tokens:,}) x {R:,} ranks = {tokens * R:,} tokens exceeds limits.MAX_TOTAL_TOKENS "
                          f"({int(limit('MAX_TOTAL_TOKENS')):,}, exact in float64)", tokens)
    # [R, E] int64 output, plus ~6 [E] float64 vectors per rank (inclusion, cumsum, breakpoints, counts)
    check_memory(f"{nr} x {ne}", f"{R:,} x {E:,}", 8.0 * R * E + 64.0 * E, "the [R, E] synthetic load")
    # 40 bisection steps x 60 inclusion iterations over [E], then a sort of [E] per rank
    check_work(f"{nr} x {ne}", f"{R:,} x {E:,}", 2400.0 * 4 * E + 30.0 * R * E, "the synthetic load")


def synthetic_trace_bytes(P: int, L: int, R: int, E: int, per_source: bool, T: int) -> tuple[float, float]:
    """``(bytes, cells)`` of :func:`ultraep.traces.synthetic.synthetic_trace`.

    Per layer: ``[T, E]`` weights, index, bursts and inclusion (~6 float64/int64 copies) and ``[P, E]``
    probabilities; overall ``[P, L, (R,) E]`` int64 counts, then up to one trace row per cell: 4 int64
    ``nonzero`` indices + tokens (40 B), the int32/int64 columns (28 B), the sort order and the sorted
    Arrow copy (36 B) → 104 B per non-zero cell, taken for every cell (top-k traces are dense).
    Measured peak RSS of ``ultraep trace synth`` (whole process): 2.85 GiB for 200 steps x 2 layers x 65,536
    experts (estimate 3.5 GiB); 2.49 GiB for 100 steps x 4 layers x 64 ranks x 1,024 experts per source
    (estimate 2.84 GiB).
    """
    cells = float(P) * L * (R if per_source else 1) * E
    per_layer = 8.0 * (6 * T * E + 2 * P * E * (R if per_source else 1))
    return 8.0 * cells + 104.0 * cells + per_layer, cells


def check_synthetic_trace(spec, *, names: Mapping[str, str] | None = None) -> None:
    """Memory and work of generating and writing the trace ``spec`` (a ``SyntheticSpec``)."""
    T, B, L, R, E = spec.num_steps, spec.microbatches, spec.num_layers, spec.num_ranks, spec.num_experts
    P = T * B
    need, cells = synthetic_trace_bytes(P, L, R, E, spec.per_source, T)
    sizes = "steps x microbatches x layers x " + ("ranks x " if spec.per_source else "") + "experts"
    field = " x ".join(_name(names, k, "synthetic") for k in
                       ("num_steps", "microbatches", "num_layers", *(("num_ranks",) if spec.per_source else ()),
                        "num_experts"))
    value = f"{T:,} x {B:,} x {L:,} x " + (f"{R:,} x " if spec.per_source else "") + f"{E:,}"
    check_memory(field, value, need, f"{cells:,.0f} trace cells ({sizes}) at up to 112 B each")
    # solve_inclusion: 60 iterations over [T, E] per layer, ~4 passes each; sampling and rows: ~20 per cell
    check_work(field, value, L * (240.0 * T * E + 2400.0 * 4 * E) + 20.0 * cells, "the synthetic trace")


def check_trace_densify(num_ranks: int, source_ranks: int | None, E: int, path: str = "trace") -> None:
    """Memory of densifying one point of a trace (``Trace.layer_loads``): the ``[R, E]`` load, the
    ``[Rs, E]`` per-source matrix (float64 bincount + int64) and the ``[R, E]`` spread of global counts."""
    check_bound(f"{path}.num_experts", E, 1, "MAX_EXPERTS", "experts per layer")
    Rs = source_ranks or 0
    check_memory(f"ranks x {path}.num_experts", f"{num_ranks:,} x {E:,}", 8.0 * E * (3 * num_ranks + 2 * Rs),
                 f"the dense per-point load of {num_ranks:,} ranks ({Rs:,} source ranks) x {E:,} experts")


__all__ = [
    "MEMORY_FRACTION", "MAX_RANKS", "MAX_EXPERTS", "MAX_LAYERS", "MAX_STEPS", "MAX_MICROBATCHES", "MAX_SLOTS",
    "MAX_TOTAL_TOKENS", "MAX_WORK", "configure", "raised", "limit", "available_memory", "check_bound",
    "check_memory", "check_work", "check_dense", "check_plan", "check_synthetic_load", "check_synthetic_trace",
    "check_trace_densify", "plan_bytes", "synthetic_trace_bytes", "fmt_bytes",
]

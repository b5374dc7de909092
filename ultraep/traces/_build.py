"""Shared pieces of the importers: count checks, a row builder that conserves counts, size limits.

Every importer turns a peer's dump into canonical rows through :class:`RowBuilder`. The builder keeps the
total it was handed and :meth:`RowBuilder.finish` checks it against the total of the trace it built, so a
record dropped or double-counted on the way is an error, not a quietly different trace ("counts are
conserved", issue 21).
"""

from __future__ import annotations

import numpy as np

from ultraep.errors import TraceError

from .trace import COLUMNS, Trace, TraceMeta


def first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def int_array(arr, path: str, what: str) -> np.ndarray:
    """``arr`` as int64 counts (whole-valued floats accepted); anything else raises naming the index."""
    a = np.asarray(arr)
    if a.dtype == object or a.dtype.kind not in "biuf":
        raise TraceError(path, f"{what} must hold counts, got dtype {a.dtype}", str(a.dtype))
    if a.dtype.kind == "f":
        if not np.all(np.isfinite(a)) or np.any(a != np.round(a)):
            bad = tuple(int(i) for i in np.argwhere(~np.isfinite(a) | (a != np.round(a)))[0])
            raise TraceError(f"{path}{list(bad)}", f"{what} holds a non-integer count ({a[bad]})", float(a[bad]))
        if a.size and np.abs(a).max() >= 2.0**63:
            bad = tuple(int(i) for i in np.argwhere(np.abs(a) >= 2.0**63)[0])
            raise TraceError(f"{path}{list(bad)}", f"{what} holds a count beyond int64 ({a[bad]})", float(a[bad]))
    elif a.dtype.kind == "u" and a.size and a.max() > np.iinfo(np.int64).max:
        bad = tuple(int(i) for i in np.argwhere(a > np.iinfo(np.int64).max)[0])
        raise TraceError(f"{path}{list(bad)}", f"{what} holds a count beyond int64 ({a[bad]})", int(a[bad]))
    a = a.astype(np.int64)
    if (a < 0).any():
        bad = tuple(int(i) for i in np.argwhere(a < 0)[0])
        raise TraceError(f"{path}{list(bad)}", f"{what} holds a negative count ({a[bad]})", int(a[bad]))
    return a


def check_num_experts(num_experts: int, path: str, inferred: bool) -> int:
    """Refuse an expert count beyond :data:`ultraep.limits.MAX_EXPERTS` or too wide to densify, before
    anything of that width is allocated (an id of 2e9 in a file must not decide an array's width)."""
    E = int(num_experts)
    field = f"{path}.num_experts" + (" (inferred: largest expert id + 1; pass --trace-opt num_experts=E)"
                                     if inferred else "")
    try:
        from ultraep import limits  # issue 22's size checks (landing beside this change)
    except ImportError:  # until then, the same bound checked here
        if not 1 <= E <= 1 << 24:
            raise TraceError(field, f"({E:,}) must be in 1..16,777,216 (experts per layer)", E) from None
        return E
    limits.check_bound(field, E, 1, "MAX_EXPERTS", "experts per layer")
    limits.check_dense(field, 4, E, what=f"the per-record [{E:,}] counts of the import")
    return E


def resolve_num_experts(given, largest_id: int, path: str, what: str = "expert id") -> tuple[int, bool]:
    """``(E, inferred)``: ``given`` (an option or the dump's own count) or ``largest_id + 1``; every id must fit."""
    if given is None:
        return check_num_experts(largest_id + 1 if largest_id >= 0 else 1, path, True), True
    if type(given) is not int:  # 8.5 or "8" from a file or --trace-opt would be truncated or fail later
        raise TraceError(f"{path}.num_experts", f"must be an integer, got {given!r}", given)
    E = check_num_experts(given, path, False)
    if largest_id >= E:
        raise TraceError(path, f"{what} {largest_id} >= num_experts {E}", largest_id)
    return E, False


def dense_ranks(ranks, path: str) -> tuple[dict[int, int], list[int] | None]:
    """Map the source ranks present in a dump onto ``0..n-1`` (sorted), so one rank's file alone is a
    one-rank trace rather than a trace whose other ranks are empty. Returns the map and, when it is not the
    identity, the original ranks (kept in ``TraceMeta.extra['source_ranks']``)."""
    rs = sorted(set(int(r) for r in ranks))
    if rs and rs[0] < 0:
        raise TraceError(path, f"rank must be >= 0, got {rs[0]}", rs[0])
    mapping = {r: i for i, r in enumerate(rs)}
    return mapping, (None if rs == list(range(len(rs))) else rs)


class RowBuilder:
    """Collects canonical rows; remembers how many token–expert assignments it was handed."""

    def __init__(self) -> None:
        self.cols: dict[str, list[np.ndarray]] = {c: [] for c in COLUMNS}
        self.total_in = 0

    def add_counts(self, step: int, microbatch: int, layer: int, src_rank: int, counts_E: np.ndarray) -> None:
        """One ``[E]`` count vector (zeros dropped)."""
        nz = np.flatnonzero(counts_E)
        self.add_rows(np.full(nz.size, step), np.full(nz.size, microbatch), np.full(nz.size, layer),
                      np.full(nz.size, src_rank), nz, counts_E[nz])
        self.total_in += int(counts_E.sum())

    def add_rows(self, step, microbatch, layer, src_rank, expert, tokens, *, count: bool = False) -> None:
        """Rows as columns (each ``[n]``); ``count=True`` adds their tokens to the conserved total."""
        for c, v in zip(COLUMNS, (step, microbatch, layer, src_rank, expert, tokens)):
            self.cols[c].append(np.asarray(v))
        if count:
            self.total_in += int(np.asarray(tokens, dtype=np.int64).sum())

    def add_total(self, tokens: int) -> None:
        """Tokens read by a path that fills rows itself (e.g. ``[n, Rs, E]`` blocks)."""
        self.total_in += int(tokens)

    def finish(self, meta: TraceMeta, path: str) -> Trace:
        cols = {c: (np.concatenate(v) if v else np.zeros(0, dtype=np.int64)) for c, v in self.cols.items()}
        trace = Trace.from_columns(meta, path, **cols)
        out = int(trace.columns["tokens"].sum()) if trace.num_rows else 0
        if out != self.total_in:  # an internal invariant, but one that must never pass silently
            raise TraceError(path, f"import lost counts: read {self.total_in} token-expert assignments, wrote {out}",
                             self.total_in - out)
        return trace

"""The canonical trace: :class:`Trace`, its metadata, and the source-rank mapping of its loads.

Defined here rather than in the package's ``__init__`` so the importers (which build traces) import this
module and not the package that imports them: the package re-exports every name (see its docstring for
the table's columns and the global-count rule).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any, Iterator

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from ultraep.errors import TraceError
from ultraep.load import validate_load

COLUMNS = ("step", "microbatch", "layer", "src_rank", "expert", "tokens")
META_KEY = b"ultraep.trace"


class TraceMeta(BaseModel):
    """What a trace says about itself."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    num_experts: int = Field(ge=1, description="Logical experts per layer (E).")
    num_ranks: int | None = Field(
        default=None, ge=1, description="Source ranks recorded in the trace; None when it has global counts only."
    )
    top_k: int | None = Field(default=None, ge=1, description="Experts per token, when known.")
    source: str = Field(default="ultraep", description="Format the trace came from.")
    model: str | None = Field(default=None, description="Model that produced the routing, when known.")
    description: str = Field(default="", description="Free text (generator settings, import notes).")
    inferred: list[str] = Field(
        default_factory=list,
        description="Fields above that the dump did not give and the importer inferred (e.g. num_experts as the "
        "largest expert id + 1); `ultraep trace info` lists them.",
    )
    extra: dict[str, Any] = Field(default_factory=dict, description="Format-specific details kept for reference.")


def spread_even(count_E: np.ndarray, num_ranks: int) -> np.ndarray:
    """``[E] -> [R, E]``: global per-expert counts spread over ``R`` source ranks (module docstring)."""
    c = np.asarray(count_E, dtype=np.int64)
    base, rem = np.divmod(c, num_ranks)
    return base[None, :] + (_rotation(num_ranks, c.shape[0]) < rem[None, :])


@lru_cache(maxsize=16)
def _rotation(num_ranks: int, num_experts: int) -> np.ndarray:
    """``[R, E]`` ``(r - e) mod R``: rank r is the j-th receiver of expert e's remainder."""
    out = (np.arange(num_ranks)[:, None] - np.arange(num_experts)[None, :]) % num_ranks
    out.setflags(write=False)
    return out


def remap_sources(load_SE: np.ndarray, num_ranks: int, path: str = "trace") -> np.ndarray:
    """``[Rs, E] -> [R, E]``: merge ``Rs / R`` consecutive sources, or spread each over ``R / Rs`` ranks."""
    Rs, E = load_SE.shape
    if Rs == num_ranks:
        return load_SE
    if Rs % num_ranks == 0:
        return load_SE.reshape(num_ranks, Rs // num_ranks, E).sum(axis=1)
    if num_ranks % Rs == 0:
        k = num_ranks // Rs
        out = np.empty((num_ranks, E), dtype=np.int64)
        for s in range(Rs):
            out[s * k:(s + 1) * k] = spread_even(load_SE[s], k)
        return out
    raise TraceError(
        path, f"the trace has {Rs} source ranks, which neither divides nor is divisible by --ranks {num_ranks}",
        num_ranks,
    )


@dataclass
class Trace:
    """A routing trace: the canonical columns as numpy arrays plus :class:`TraceMeta`.

    Build one with :meth:`from_columns`, :meth:`from_global_counts` or :meth:`from_rank_counts`; store it
    with :meth:`write`, read it with :meth:`read` (or any importer via :func:`load_trace`).
    """

    columns: dict[str, np.ndarray]
    meta: TraceMeta
    _index: tuple | None = field(default=None, init=False, repr=False, compare=False)

    def _point_index(self) -> tuple[np.ndarray, np.ndarray]:
        """``(points [P, 2], point of every row [n])``, computed once."""
        if self._index is None:
            keys = (self.columns["step"].astype(np.int64) << 20) + self.columns["microbatch"]
            uk, inv = np.unique(keys, return_inverse=True)
            pts = np.stack([uk >> 20, uk & ((1 << 20) - 1)], axis=1)
            self._index = (pts, inv)
        return self._index

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_columns(cls, meta: TraceMeta, path: str = "trace", **cols) -> "Trace":
        missing = [c for c in COLUMNS if c not in cols]
        if missing:
            raise TraceError(path, f"missing column(s) {missing}; a trace needs {list(COLUMNS)}", missing)
        n = len(cols["tokens"])
        out = {}
        for c in COLUMNS:
            a = np.asarray(cols[c])
            if a.shape != (n,):
                raise TraceError(f"{path}.{c}", f"has shape {a.shape}, expected ({n},)", a.shape)
            if a.dtype.kind not in "iu":
                if a.dtype.kind == "f" and n and np.all(np.isfinite(a)) and np.all(a == np.round(a)):
                    pass
                elif n:
                    raise TraceError(f"{path}.{c}", f"must hold integers, got dtype {a.dtype}", str(a.dtype))
            target = np.int64 if c == "tokens" else np.int32
            if n and not np.can_cast(a.dtype, target):  # refuse values that would wrap around in the cast
                lim = np.iinfo(target)
                if a.min() < lim.min or a.max() > lim.max:
                    i = int(np.argmax((a < lim.min) | (a > lim.max)))
                    raise TraceError(f"{path}.{c}[{i}]", f"({a[i]}) does not fit in {np.dtype(target).name}", a[i].item())
            out[c] = a.astype(target, copy=False)
        if n:
            neg = out["tokens"] < 0
            if neg.any():
                i = int(np.argmax(neg))
                raise TraceError(f"{path}.tokens[{i}]", f"is negative ({out['tokens'][i]})", int(out["tokens"][i]))
            bad = (out["expert"] < 0) | (out["expert"] >= meta.num_experts)
            if bad.any():
                i = int(np.argmax(bad))
                raise TraceError(
                    f"{path}.expert[{i}]", f"({out['expert'][i]}) is outside 0..{meta.num_experts - 1}",
                    int(out["expert"][i]),
                )
            for c, top in (("step", None), ("microbatch", (1 << 20) - 1), ("layer", None)):
                bad = (out[c] < 0) if top is None else ((out[c] < 0) | (out[c] > top))
                if bad.any():
                    i = int(np.argmax(bad))
                    raise TraceError(f"{path}.{c}[{i}]", f"({out[c][i]}) must be >= 0"
                                     + ("" if top is None else f" and <= {top}"), int(out[c][i]))
            lo = -1
            hi = (meta.num_ranks - 1) if meta.num_ranks is not None else -1
            bad = (out["src_rank"] < lo) | (out["src_rank"] > hi)
            if bad.any():
                i = int(np.argmax(bad))
                raise TraceError(
                    f"{path}.src_rank[{i}]", f"({out['src_rank'][i]}) is outside {lo}..{hi}", int(out["src_rank"][i])
                )
        return cls(out, meta)

    @classmethod
    def from_global_counts(cls, counts_PLE: np.ndarray, meta: TraceMeta, *, steps=None, microbatches=None,
                           layers=None, path: str = "trace") -> "Trace":
        """``counts[P, L, E]`` per-expert totals (no source rank) → trace rows with ``src_rank = -1``."""
        c = np.asarray(counts_PLE)
        if c.ndim != 3:
            raise TraceError(path, f"global counts must be [points, layers, experts], got shape {c.shape}", c.shape)
        P, L, E = c.shape
        return cls._from_dense(c.reshape(P, L, 1, E), meta, steps, microbatches, layers, path, src=None)

    @classmethod
    def from_rank_counts(cls, counts_PLRE: np.ndarray, meta: TraceMeta, *, steps=None, microbatches=None,
                         layers=None, path: str = "trace") -> "Trace":
        """``counts[P, L, Rs, E]`` per source rank → trace rows."""
        c = np.asarray(counts_PLRE)
        if c.ndim != 4:
            raise TraceError(path, f"rank counts must be [points, layers, ranks, experts], got shape {c.shape}", c.shape)
        return cls._from_dense(c, meta, steps, microbatches, layers, path, src=c.shape[2])

    @classmethod
    def _from_dense(cls, c, meta, steps, microbatches, layers, path, src):
        P, L, Rs, E = c.shape
        steps = np.arange(P) if steps is None else np.asarray(steps)
        microbatches = np.zeros(P, dtype=np.int64) if microbatches is None else np.asarray(microbatches)
        layers = np.arange(L) if layers is None else np.asarray(layers)
        if steps.shape != (P,) or microbatches.shape != (P,) or layers.shape != (L,):
            raise TraceError(path, "steps/microbatches must have one entry per point and layers one per layer", P)
        p, l, r, e = np.nonzero(c)
        tokens = c[p, l, r, e]
        return cls.from_columns(
            meta, path, step=steps[p], microbatch=microbatches[p], layer=layers[l],
            src_rank=(r if src is not None else np.full(p.shape, -1)), expert=e, tokens=tokens,
        )

    # ------------------------------------------------------------------ storage
    def write(self, path) -> Path:
        """Write Parquet (sorted by layer, step, microbatch, source, expert) with the metadata."""
        import pyarrow as pa
        import pyarrow.parquet as pq

        path = Path(path)
        order = np.lexsort((self.columns["expert"], self.columns["src_rank"], self.columns["microbatch"],
                            self.columns["step"], self.columns["layer"]))
        table = pa.table({c: self.columns[c][order] for c in COLUMNS})
        table = table.replace_schema_metadata({META_KEY: self.meta.model_dump_json().encode()})
        path.parent.mkdir(parents=True, exist_ok=True)
        # Write beside the target and rename on success: an interrupted or failed write (Ctrl-C, full disk)
        # leaves no file under the final name that looks like a complete trace.
        tmp = path.with_name(f".{path.name}.{os.getpid()}.partial")
        try:
            pq.write_table(table, tmp, compression="zstd", row_group_size=1 << 20)
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)
        return path

    @classmethod
    def read(cls, path, *, layers=None) -> "Trace":
        """Read a Parquet trace written by :meth:`write` (optionally only some layers)."""
        import pyarrow.parquet as pq

        p = str(path)
        try:
            schema = pq.read_schema(p)
        except Exception as exc:
            raise TraceError(p, f"is not a readable Parquet file ({exc})") from None
        md = schema.metadata or {}
        if META_KEY not in md:
            raise TraceError(p, "has no ultraep trace metadata (write traces with Trace.write or `ultraep trace`)")
        meta = TraceMeta.model_validate_json(md[META_KEY])
        missing = [c for c in COLUMNS if c not in schema.names]
        if missing:
            raise TraceError(p, f"lacks column(s) {missing}", missing)
        filters = [("layer", "in", [int(x) for x in layers])] if layers is not None else None
        table = pq.read_table(p, columns=list(COLUMNS), filters=filters)
        cols = {c: table.column(c).to_numpy() for c in COLUMNS}
        return cls.from_columns(meta, p, **cols)

    # ------------------------------------------------------------------ views
    @property
    def num_rows(self) -> int:
        return int(self.columns["tokens"].shape[0])

    @property
    def layers(self) -> np.ndarray:
        return np.unique(self.columns["layer"])

    def points(self) -> np.ndarray:
        """``[P, 2]`` sorted unique ``(step, microbatch)`` pairs."""
        return self._point_index()[0]

    def summary(self) -> dict[str, Any]:
        pts = self.points()
        return {
            "rows": self.num_rows, "steps": int(np.unique(pts[:, 0]).size) if len(pts) else 0,
            "points": int(len(pts)), "layers": self.layers.tolist(), "num_experts": self.meta.num_experts,
            "num_ranks": self.meta.num_ranks, "top_k": self.meta.top_k, "source": self.meta.source,
            "model": self.meta.model, "tokens": int(self.columns["tokens"].sum()),
            "inferred": list(self.meta.inferred), "notes": self.meta.description,
            **({"layer_names": self.meta.extra["layer_names"]} if self.meta.extra.get("layer_names") else {}),
            **({"source_ranks": self.meta.extra["source_ranks"]} if self.meta.extra.get("source_ranks") else {}),
        }

    def tiled(self, num_ranks: int) -> "Trace":
        """The workload of a job ``num_ranks / Rs`` times larger: simulated rank ``r`` replays source rank ``r mod Rs``
        (every rank keeps its tokens, as when the same model and batch per rank run on more GPUs), where
        :meth:`layer_loads` alone spreads the trace's tokens over more ranks (the same job on more GPUs).
        Needs per-source counts and ``num_ranks`` a multiple of the source ranks ``Rs``."""
        Rs = self.meta.num_ranks
        if Rs is None or (self.columns["src_rank"] < 0).any():
            raise TraceError("--tile-ranks", "the trace holds global counts (no source ranks): there is no per-rank "
                             "workload to repeat", None)
        if num_ranks % Rs:
            raise TraceError("--ranks", f"({num_ranks}) must be a multiple of the trace's {Rs} source ranks to repeat "
                             "its ranks", num_ranks)
        k = num_ranks // Rs
        cols = {c: np.tile(v, k) for c, v in self.columns.items()}
        cols["src_rank"] = cols["src_rank"] + np.repeat(np.arange(k, dtype=np.int64) * Rs, len(self.columns["tokens"]))
        meta = self.meta.model_copy(update={"num_ranks": num_ranks, "extra": {**self.meta.extra, "tiled_from": Rs}})
        return Trace.from_columns(meta, **cols)

    def layer_loads(self, layer: int, num_ranks: int, *, point_stride: int = 1,
                    max_points: int | None = None) -> Iterator[tuple[int, int, np.ndarray]]:
        """Yield ``(step, microbatch, load[R, E])`` of one layer for every ``point_stride``-th point (in
        step, microbatch order), densified for an EP group of ``num_ranks``."""
        E = self.meta.num_experts
        cols = self.columns
        sel = np.flatnonzero(cols["layer"] == layer)
        pts, row_pt = self._point_index()
        if sel.size == 0 or len(pts) == 0:
            return
        pt = row_pt[sel]
        order = np.argsort(pt, kind="stable")
        sel, pt = sel[order], pt[order]
        bounds = np.searchsorted(pt, np.arange(len(pts) + 1))
        chosen = np.arange(0, len(pts), max(1, point_stride))
        if max_points is not None:
            chosen = chosen[:max_points]
        Rs = self.meta.num_ranks
        from ultraep.limits import check_trace_densify  # the dense width comes from the file: check it fits

        check_trace_densify(num_ranks, Rs, E, path="trace")
        for i in chosen:
            rows = sel[bounds[i]:bounds[i + 1]]
            load = np.zeros((num_ranks, E), dtype=np.int64)
            if rows.size:
                src = cols["src_rank"][rows]
                ex = cols["expert"][rows]
                tok = cols["tokens"][rows]
                g = src < 0
                if g.any():
                    load += spread_even(np.bincount(ex[g], weights=tok[g], minlength=E).astype(np.int64), num_ranks)
                if (~g).any():
                    dense = np.bincount(src[~g].astype(np.int64) * E + ex[~g], weights=tok[~g],
                                        minlength=Rs * E).astype(np.int64).reshape(Rs, E)
                    load += remap_sources(dense, num_ranks)
            step, mb = int(pts[i, 0]), int(pts[i, 1])
            # counts beyond what the planners split exactly (MAX_EXPERT_LOAD) stop here, not in a planner
            yield step, mb, validate_load(load, path=f"trace (layer {layer}, step {step}, microbatch {mb}) load")

"""Routing traces: one canonical table, importers for peers' dumps, synthetic generators.

The canonical trace is a long table, stored as Parquet (DuckDB reads it directly:
``SELECT layer, sum(tokens) FROM read_parquet('trace.parquet') GROUP BY layer``):

===========  =======  =====================================================================
column       type     meaning
===========  =======  =====================================================================
step         int32    training step / serving forward pass
microbatch   int32    microbatch within the step (0 when the source has none)
layer        int32    MoE layer id (as the source numbers it; need not be contiguous)
src_rank     int32    source rank that routed the tokens; **-1 = unknown** (global counts)
expert       int32    logical expert id
tokens       int64    token–expert assignments (a top-k token counts k times)
===========  =======  =====================================================================

Zero counts may be omitted. Metadata (:class:`TraceMeta`: experts, source ranks, top-k, format, model)
lives in the Parquet schema metadata under ``ultraep.trace``.

**Global counts.** Many dumps (SGLang ``logical_count``, OLMoE) only have per-expert totals. Their rows
carry ``src_rank = -1`` and are spread over the ``R`` source ranks of the simulated EP group
deterministically by :func:`spread_even`: every rank gets ``c // R`` and the remainder ``c % R`` goes one
token each to ranks ``(e + j) mod R``, ``j < c % R`` (rotating with the expert id so no rank is favoured).
Rows with a known source are mapped onto ``R`` ranks by :func:`remap_sources` (merged in contiguous
groups when the trace has more source ranks, spread evenly when it has fewer).

Legend: R ranks of the simulated group, Rs source ranks in the trace, E experts, P (step, microbatch)
points, L layers.
"""
from __future__ import annotations

from .importers import FORMATS, load_trace
from .trace import COLUMNS, META_KEY, Trace, TraceMeta, remap_sources, spread_even

__all__ = ["COLUMNS", "META_KEY", "Trace", "TraceMeta", "spread_even", "remap_sources", "load_trace", "FORMATS"]

"""UltraEP load profiler (``ULTRA_EP_LOAD_PROFILING=1``) → canonical trace.

Writer: Dots-Infra/UltraEP ``ultra_ep/profiling.py`` (``ExpertLoadProfiler``, v1.0.0 = commit
``94cab099b44fffa99a82fea99e7c12d89cf65e4f``, per the project's peers list (``shared/references/peers.md``); the index we read
it from holds the file without its commit), called from ``ultra_ep/manager.py`` (``Manager.update_placement``
passes ``runtime.get_global_logical_expert_loads_tensor()``). Layout, as that writer produces it in
``ULTRA_EP_LOAD_PROFILE_DIR`` (default ``ultra_ep_traces``), written by rank 0 of each EP group:

* ``{trace_id}.manifest.json`` with ``trace_id = epg{ep_group_id}_gr0_r{global_rank}_{ms}``: the Manager's
  metadata (``ep_size``, ``num_layers``, ``max_microbatches``, ``num_local_master_experts``,
  ``num_local_physical_experts``, ``num_global_logical_experts``, ``num_global_physical_experts``, ...),
  ``schema = "ultra_ep_trace_v1"``, ``record_interval``, ``flush_interval``, ``chunks`` (an int: how many
  chunks were written) and ``dropped_records``. The manifest is written at start (``chunks: 0``) and again
  at ``close()``: a run that did not close its profiler leaves ``chunks: 0`` beside its chunk files.
* ``{trace_id}.chunk{k:06d}.npz`` for ``k < chunks``: ``metadata`` (a 0-d JSON string), ``layers`` i4
  ``[n]`` (real layer id), ``virtual_layers`` i4 ``[n]`` (``layer * max_microbatches + slot``),
  ``microbatches`` i8 ``[n]`` (a per-layer counter of forward calls that never resets and counts
  unrecorded calls too), ``pre_logical_loads`` i4 ``[n, E]`` (the EP group's global load per logical
  expert before rerouting) and ``post_physical_loads`` i4 ``[n, P]`` (per physical slot after).

Mapping: ``pre_logical_loads`` are global counts (``src_rank = -1``; the writer keeps no source rank);
``num_experts`` = ``num_global_logical_experts``; ``ep_size`` is kept in ``extra['ep_size']`` and is the
default ``--ranks`` of ``ultraep simulate``. There is no step: by default every recorded microbatch is its
own step (``step`` = the microbatch counter); ``--trace-opt microbatches_per_step=K`` folds them into
steps of K. ``virtual_layers`` are checked against ``layers`` and ``max_microbatches`` and then dropped
(they name a buffer slot, not a layer). Each record's pre and post totals must agree (the writer's own
conservation). ``dropped_records`` (records the writer skipped when its queue was full) are reported in
``ultraep trace info``. A directory is read by its manifest; several manifests (several EP groups) are
refused unless ``trace_id=`` picks one; chunks the manifest does not count are refused unless
``chunks=N`` says how many to read.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np

from ultraep.errors import TraceError

from .trace import Trace, TraceMeta
from ._build import RowBuilder, check_num_experts, int_array

MANIFEST = ".manifest.json"
CHUNK = re.compile(r"^(.+)\.chunk(\d{6})\.npz$")
_CHUNK_KEYS = {"metadata", "layers", "virtual_layers", "microbatches", "pre_logical_loads", "post_physical_loads"}


def is_ultraep_dir(d: Path) -> bool:
    return any(f.name.endswith(MANIFEST) for f in d.iterdir())


def _manifest_path(p: Path, trace_id: str | None) -> Path:
    if p.is_dir():
        found = sorted(f for f in p.iterdir() if f.name.endswith(MANIFEST))
        if trace_id is not None:
            found = [f for f in found if f.name[: -len(MANIFEST)] == trace_id]
        if len(found) != 1:
            names = [f.name[: -len(MANIFEST)] for f in found]
            raise TraceError(str(p), (f"holds {len(found)} UltraEP manifests {names[:4]} (one per EP group); pick one "
                             "with --trace-opt trace_id=..." if found else f"holds no {trace_id or '*'}{MANIFEST}"),
                             names)
        return found[0]
    m = CHUNK.match(p.name)
    if m:
        mp = p.parent / (m.group(1) + MANIFEST)
        if not mp.exists():
            raise TraceError(str(p), f"has no {mp.name} beside it", mp.name)
        return mp
    return p


def _chunk_arrays(fp: Path):
    try:
        npz = np.load(str(fp), allow_pickle=False)
    except FileNotFoundError:
        raise TraceError(str(fp), "is counted by the manifest but does not exist", fp.name) from None
    except Exception as exc:
        raise TraceError(str(fp), f"is not a readable .npz ({type(exc).__name__}: {exc})") from None
    with npz:
        keys = set(npz.files)
        if keys != _CHUNK_KEYS:
            odd = sorted(keys ^ _CHUNK_KEYS)
            raise TraceError(f"{fp}:{odd[0]}", "is missing" if odd[0] in _CHUNK_KEYS else
                             "is not an array UltraEP's profiler writes; refusing to guess", odd[0])
        try:
            return {k: npz[k] for k in _CHUNK_KEYS}
        except ValueError as exc:  # an object array: would need pickle
            raise TraceError(str(fp), f"holds an array that needs pickle ({exc})") from None


def import_ultraep_npz(path, trace_id: str | None = None, chunks: int | None = None,
                       microbatches_per_step: int | None = None, **_) -> Trace:
    """UltraEP load profile: a manifest, one of its chunks, or the profile directory."""
    mp = _manifest_path(Path(path), trace_id)
    ms = str(mp)
    manifest, tid, need = _read_manifest(mp)
    n_chunks = need["chunks"]
    on_disk = sorted(int(m.group(2)) for f in mp.parent.iterdir() if (m := CHUNK.match(f.name)) and m.group(1) == tid)
    if chunks is not None:
        if type(chunks) is not int or chunks < 1:
            raise TraceError("ultraep-npz.chunks", f"must be an integer >= 1, got {chunks!r}", chunks)
        n_chunks = chunks
    elif len(on_disk) > n_chunks:
        raise TraceError(f"{ms}.chunks", f"is {n_chunks} but {len(on_disk)} chunk files lie beside it (the run did not "
                         f"close its profiler?); pass --trace-opt chunks={len(on_disk)} to read them", n_chunks)
    if n_chunks == 0:
        raise TraceError(f"{ms}.chunks", "is 0: the profiler wrote no chunks", 0)
    if microbatches_per_step is not None and (type(microbatches_per_step) is not int or microbatches_per_step < 1):
        raise TraceError("ultraep-npz.microbatches_per_step", f"must be an integer >= 1, got {microbatches_per_step!r}",
                         microbatches_per_step)
    E = check_num_experts(need["num_global_logical_experts"], ms, False)
    max_mb = max(1, need["max_microbatches"])
    rows = RowBuilder()
    for k in range(n_chunks):
        _add_chunk(mp.parent / f"{tid}.chunk{k:06d}.npz", E, max_mb, microbatches_per_step, rows)
    dropped = manifest.get("dropped_records", 0)
    meta = TraceMeta(
        num_experts=E, source="ultraep-npz",
        description=f"UltraEP load profile {tid}: global pre-reroute loads; "
        + ("step = microbatch counter" if microbatches_per_step is None else
           f"{microbatches_per_step} microbatches per step") + (f"; {dropped} records dropped by the writer"
                                                                if dropped else ""),
        extra={"trace_id": tid, "ep_size": need["ep_size"], "dropped_records": dropped,
               "record_interval": manifest.get("record_interval"), "chunks": n_chunks},
    )
    return rows.finish(meta, ms)


def _read_manifest(mp: Path) -> tuple[dict, str, dict[str, int]]:
    """The manifest as written, its trace id (from the file name) and its required integer fields."""
    ms = str(mp)
    try:
        manifest = json.loads(mp.read_text())
    except FileNotFoundError:
        raise TraceError(ms, "does not exist") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise TraceError(ms, f"is not valid JSON ({exc})") from None
    if not isinstance(manifest, dict):
        raise TraceError(ms, "must hold a JSON object", type(manifest).__name__)
    if manifest.get("schema") != "ultra_ep_trace_v1":
        raise TraceError(f"{ms}.schema", f"must be 'ultra_ep_trace_v1', got {manifest.get('schema')!r}",
                         manifest.get("schema"))
    tid = mp.name[: -len(MANIFEST)]
    if manifest.get("trace_id", tid) != tid:
        raise TraceError(f"{ms}.trace_id", f"({manifest.get('trace_id')!r}) differs from the file name's {tid!r}",
                         manifest.get("trace_id"))
    need = {}
    for key in ("chunks", "ep_size", "num_global_logical_experts", "max_microbatches"):
        v = manifest.get(key)
        if type(v) is not int or v < 0:
            raise TraceError(f"{ms}.{key}", f"must be an integer >= 0, got {v!r}", v)
        need[key] = v
    return manifest, tid, need


def _add_chunk(fp: Path, E: int, max_mb: int, microbatches_per_step: int | None, rows: RowBuilder) -> None:
    """Check one chunk (shapes, token conservation pre/post reroute, virtual-layer slots) and add its global
    pre-reroute loads to ``rows``."""
    a = _chunk_arrays(fp)
    pre = int_array(a["pre_logical_loads"], f"{fp}:pre_logical_loads", "pre_logical_loads")
    post = int_array(a["post_physical_loads"], f"{fp}:post_physical_loads", "post_physical_loads")
    layers, vlayers, mbs = (int_array(a[n], f"{fp}:{n}", n) for n in ("layers", "virtual_layers", "microbatches"))
    n = pre.shape[0] if pre.ndim == 2 else -1
    if pre.ndim != 2 or pre.shape[1] != E:
        raise TraceError(f"{fp}:pre_logical_loads", f"has shape {pre.shape}, expected [records, {E}]", pre.shape)
    for name, arr in (("layers", layers), ("virtual_layers", vlayers), ("microbatches", mbs)):
        if arr.shape != (n,):
            raise TraceError(f"{fp}:{name}", f"has shape {arr.shape} for {n} records", arr.shape)
    if post.ndim != 2 or post.shape[0] != n:
        raise TraceError(f"{fp}:post_physical_loads", f"has shape {post.shape} for {n} records", post.shape)
    bad = np.flatnonzero(pre.sum(axis=1) != post.sum(axis=1))
    if bad.size:
        i = int(bad[0])
        raise TraceError(f"{fp}:records[{i}]", f"pre-reroute total {int(pre[i].sum())} != post-reroute total "
                         f"{int(post[i].sum())}: the chunk does not conserve tokens", i)
    bad = np.flatnonzero(vlayers // max_mb != layers)
    if bad.size:
        i = int(bad[0])
        raise TraceError(f"{fp}:virtual_layers[{i}]", f"({int(vlayers[i])}) is not a slot of layer {int(layers[i])} "
                         f"with max_microbatches {max_mb}", int(vlayers[i]))
    step, mb = (mbs, np.zeros(n, np.int64)) if microbatches_per_step is None else np.divmod(mbs, microbatches_per_step)
    r, e = np.nonzero(pre)
    rows.add_rows(step[r], mb[r], layers[r], np.full(r.size, -1), e, pre[r, e])
    rows.add_total(int(pre.sum()))

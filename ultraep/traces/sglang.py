"""SGLang expert-distribution dumps → canonical trace.

Writers (read in sgl-project/sglang):

* ``python/sglang/srt/eplb/expert_distribution.py`` at ``02295fe5ac5ccff3e8829800d50450351c56fb53``
  (``ExpertDistributionRecorder``, ``--expert-distribution-recorder-mode``), files under
  ``SGLANG_EXPERT_DISTRIBUTION_RECORDER_DIR``:

  - ``stat`` / ``stat_approx`` (``_StatAccumulator.dump``): rank 0 writes
    ``expert_distribution_recorder_{time.time()}.pt`` = ``torch.save(dict(rank, logical_count,
    average_utilization_rate_over_window))``; ``logical_count`` is ``[buffer, L, E]`` int32, one row per
    forward pass, already summed over all ranks (``all_reduce``). Older versions of the same writer have no
    ``average_utilization_rate_over_window``. The buffer is a ring of
    ``--expert-distribution-recorder-buffer-size`` rows: once it wraps, row order is not time order (the
    dump does not say where it wrapped) and unused rows are zero. → global counts (``src_rank = -1``),
    ``step`` = buffer row, rows of all zeros dropped.
  - ``per_pass`` / ``per_token`` (``_DetailAccumulator.dump``): every rank writes
    ``expert_distribution_recorder_{time.time()}_{rank}.pt`` = ``dict(records=[...],
    last_physical_to_logical_map=[L, P])``; each record has ``forward_pass_id``, ``rank``, ``gatherer_key``
    and ``global_physical_count [L, P]`` (``per_token`` adds ``input_ids``, ``positions``,
    ``extend_seq_lens``, ``forward_mode``, ``topk_ids_of_layer [L, n, 8]`` padded with -1, ``misc_objects``).
    Physical slots are mapped to logical experts with ``last_physical_to_logical_map`` (the writer itself
    warns it is the map at dump time; a rebalance during recording makes the mapping of earlier passes
    wrong, which the dump cannot show). → ``step = forward_pass_id``. ``per_token`` counts are the rank's
    own tokens (``src_rank`` = rank, checked against ``topk_ids_of_layer``); ``per_pass`` counts are the
    rank's own tokens with the default gatherer but tokens *received* with the DeepEP gatherers, which the
    dump does not record, so they are summed over ranks as global counts unless ``per_source=true``.

* ``python/sglang/srt/managers/expert_distribution.py`` at ``001c034f915dfd41fade2553f36245f5169d6f3d``
  (the older recorder): each rank writes ``expert_distribution_rank{r}_timestamp{time.time()}.csv`` with
  header ``layer_id,expert_id,count`` and one row per expert the rank's tokens hit since the last dump.
  → ``src_rank`` = r (ranks renumbered 0..n-1); the k-th dump of every rank is step k; a file whose name
  has no rank is global counts. ``num_experts`` is not in the file: ``--trace-opt num_experts=E`` or the
  largest id + 1 (marked inferred).

Every ``.pt`` is read with ``torch.load(weights_only=True)``: no pickled object is run. A key the writer
does not write is refused. With plain tensor parallelism (no DP attention) every TP rank records the same
tokens, so SGLang's own sums count each token once per TP rank; nothing in the dump tells, so the
importer cannot correct it.
"""

from __future__ import annotations

import csv
import re
from pathlib import Path

import numpy as np

from ultraep.errors import TraceError

from .trace import Trace, TraceMeta
from ._build import RowBuilder, dense_ranks, first_line, int_array, resolve_num_experts

PT_FILE = re.compile(r"^expert_distribution_recorder_(\d+(?:\.\d+)?(?:e[+-]?\d+)?)(?:_(\d+))?\.pt$")
CSV_FILE = re.compile(r"^expert_distribution_rank(\d+)_timestamp(\d+(?:\.\d+)?(?:e[+-]?\d+)?)\.csv$")
_STAT_KEYS = {"rank", "logical_count", "average_utilization_rate_over_window"}
_DETAIL_KEYS = {"records", "last_physical_to_logical_map"}
_RECORD_KEYS = {"forward_pass_id", "rank", "gatherer_key", "global_physical_count", "input_ids", "positions",
                "extend_seq_lens", "forward_mode", "topk_ids_of_layer", "misc_objects"}


def is_sglang_dir(d: Path) -> bool:
    return any(PT_FILE.match(f.name) or CSV_FILE.match(f.name) for f in d.iterdir())


def _np(x, where: str, what: str) -> np.ndarray:
    arr = x.detach().cpu().numpy() if hasattr(x, "detach") else np.asarray(x)
    return int_array(arr, where, what)


def _torch_load(p: str):
    import torch

    try:
        return torch.load(p, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise TraceError(p, "does not exist") from None
    except Exception as exc:
        raise TraceError(p, "is not a loadable torch file with weights_only=True (no pickled objects are run; "
                         f"{type(exc).__name__}: {first_line(exc)})") from None


def _pt_files(p: Path) -> list[Path]:
    if not p.is_dir():
        return [p]
    files = [f for f in p.iterdir() if PT_FILE.match(f.name)]
    if not files:
        raise TraceError(str(p), "holds no expert_distribution_recorder_*.pt files")
    return sorted(files, key=lambda f: (float(PT_FILE.match(f.name).group(1)), f.name))


def import_sglang_pt(path, num_experts: int | None = None, per_source: bool = False, **_) -> Trace:
    """SGLang ``.pt`` dump(s): one file, or the recorder directory (all dumps of one run, in time order)."""
    p = Path(path)
    files = _pt_files(p)
    docs = [(str(f), _torch_load(str(f))) for f in files]
    kinds = set()
    for fp, obj in docs:
        if not isinstance(obj, dict):
            raise TraceError(fp, f"must hold a dict (SGLang's dump), got {type(obj).__name__}", type(obj).__name__)
        keys = set(map(str, obj))
        kind = "stat" if "logical_count" in keys else "detail" if "records" in keys else None
        if kind is None:
            raise TraceError(fp, f"has neither 'logical_count' (stat mode) nor 'records' (per_pass/per_token mode) "
                             f"(keys: {sorted(keys)})", sorted(keys))
        extra = sorted(keys - (_STAT_KEYS if kind == "stat" else _DETAIL_KEYS))
        if extra:
            raise TraceError(f"{fp}:{extra[0]}", f"is not a key SGLang's {kind} dump writes; refusing to guess", extra[0])
        kinds.add(kind)
    if len(kinds) > 1:
        raise TraceError(str(p), "mixes stat dumps and per_pass/per_token dumps; import them separately")
    if kinds == {"stat"}:
        if per_source:
            raise TraceError(f"{p}.per_source", "stat dumps hold counts already summed over ranks", per_source)
        return _stat(p, docs, num_experts)
    return _detail(p, docs, num_experts, per_source)


def _stat(p: Path, docs, num_experts) -> Trace:
    rows, step0, E, sizes = RowBuilder(), 0, None, []
    for fp, obj in docs:
        lc = _np(obj["logical_count"], f"{fp}:logical_count", "logical_count")
        if lc.ndim != 3:
            raise TraceError(f"{fp}:logical_count", f"must be [buffer, layers, experts], got shape {tuple(lc.shape)}",
                             tuple(lc.shape))
        if E is None:
            E = lc.shape[2]
            if num_experts is not None and num_experts != E:
                raise TraceError(f"{fp}:logical_count", f"has {E} experts, --trace-opt num_experts says {num_experts}",
                                 E)
            resolve_num_experts(E, E - 1, fp)
        elif lc.shape[2] != E:
            raise TraceError(f"{fp}:logical_count", f"has {lc.shape[2]} experts, the first dump {E}", lc.shape[2])
        for b in range(lc.shape[0]):
            if lc[b].any():
                for layer in range(lc.shape[1]):
                    rows.add_counts(step0 + b, 0, layer, -1, lc[b, layer])
        step0 += lc.shape[0]
        sizes.append(lc.shape[0])
    meta = TraceMeta(num_experts=int(E), source="sglang-pt",
                     description=f"SGLang stat dump(s) {[Path(f).name for f, _ in docs]}: global counts, step = "
                     "ring-buffer row (a wrapped ring is not in time order)",
                     extra={"rank": _scalar(docs[0][1].get("rank")), "buffer_rows": sizes, "mode": "stat"})
    return rows.finish(meta, str(p))


def _scalar(v):
    try:
        return int(v) if v is not None else None
    except (TypeError, ValueError, RuntimeError):
        return None


def _detail(p: Path, docs, num_experts, per_source) -> Trace:
    recs, ranks, E = [], set(), None
    for fp, obj in docs:
        m = _np(obj["last_physical_to_logical_map"], f"{fp}:last_physical_to_logical_map", "physical_to_logical_map")
        if m.ndim != 2:
            raise TraceError(f"{fp}:last_physical_to_logical_map", f"must be [layers, physical], got {m.shape}", m.shape)
        records = obj["records"]
        if not isinstance(records, list):
            raise TraceError(f"{fp}:records", f"must be a list, got {type(records).__name__}", type(records).__name__)
        for i, rec in enumerate(records):
            where = f"{fp}:records[{i}]"
            if not isinstance(rec, dict):
                raise TraceError(where, f"must be a dict, got {type(rec).__name__}", type(rec).__name__)
            extra = sorted(set(map(str, rec)) - _RECORD_KEYS)
            missing = [k for k in ("forward_pass_id", "rank", "gatherer_key", "global_physical_count") if k not in rec]
            if extra or missing:
                raise TraceError(f"{where}.{(extra or missing)[0]}", "is not a key SGLang writes" if extra
                                 else "is missing", (extra or missing)[0])
            if rec["gatherer_key"] != "primary":
                raise TraceError(f"{where}.gatherer_key", f"is {rec['gatherer_key']!r}; only 'primary' is written",
                                 rec["gatherer_key"])
            fid, rank = _scalar(rec["forward_pass_id"]), _scalar(rec["rank"])
            if fid is None or rank is None or fid < 0 or rank < 0:
                raise TraceError(where, f"forward_pass_id and rank must be integers >= 0, got "
                                 f"{rec['forward_pass_id']!r}, {rec['rank']!r}", rec["forward_pass_id"])
            c = _np(rec["global_physical_count"], f"{where}.global_physical_count", "global_physical_count")
            if c.shape != m.shape:
                raise TraceError(f"{where}.global_physical_count", f"has shape {c.shape}, the map {m.shape}", c.shape)
            if "topk_ids_of_layer" in rec:  # per_token: the counts must be the rank's own top-k ids
                ids = np.asarray(rec["topk_ids_of_layer"].numpy() if hasattr(rec["topk_ids_of_layer"], "numpy")
                                 else rec["topk_ids_of_layer"])
                if ids.ndim != 3 or ids.shape[0] != m.shape[0]:
                    raise TraceError(f"{where}.topk_ids_of_layer", f"must be [layers, tokens, k], got {ids.shape}",
                                     ids.shape)
                for layer in range(ids.shape[0]):
                    v = ids[layer].ravel()
                    v = v[v != -1]
                    if v.size and (v.min() < 0 or v.max() >= m.shape[1]):
                        raise TraceError(f"{where}.topk_ids_of_layer", f"holds a slot outside 0..{m.shape[1] - 1}",
                                         int(v.min() if v.min() < 0 else v.max()))
                    if not np.array_equal(np.bincount(v, minlength=m.shape[1]), c[layer]):
                        raise TraceError(f"{where}.global_physical_count[{layer}]",
                                         "differs from the counts of topk_ids_of_layer", layer)
            recs.append((where, fid, rank, c, m, "topk_ids_of_layer" in rec))
            ranks.add(rank)
    if not recs:
        raise TraceError(str(p), "holds no records")
    largest = max(int(r[4].max()) for r in recs)
    E, inferred = resolve_num_experts(num_experts, largest, str(p), "logical expert id")
    per_token = {r[5] for r in recs}
    if len(per_token) > 1:
        raise TraceError(str(p), "mixes per_pass and per_token records; import them separately")
    by_source = per_source or per_token == {True}
    rank_map, source_ranks = dense_ranks(ranks, str(p))
    rows = RowBuilder()
    for _w, fid, rank, c, m, _t in recs:
        for layer in range(c.shape[0]):
            logical = np.bincount(m[layer], weights=c[layer], minlength=E).astype(np.int64)
            rows.add_counts(fid, 0, layer, rank_map[rank] if by_source else -1, logical)
    mode = "per_token" if per_token == {True} else "per_pass"
    meta = TraceMeta(
        num_experts=E, num_ranks=len(rank_map) if by_source else None, source="sglang-pt",
        inferred=["num_experts"] if inferred else [],
        description=f"SGLang {mode} dump: physical slots mapped with last_physical_to_logical_map; "
        + ("per source rank" if by_source else "summed over ranks (global counts)"),
        extra={"mode": mode, "source_ranks": source_ranks if by_source else None, "dump_ranks": sorted(ranks)},
    )
    return rows.finish(meta, str(p))


# ---------------------------------------------------------------------------------------------- CSV
def _read_csv(fp: Path) -> np.ndarray:
    """``[n, 3]`` (layer, expert, count) of one ``layer_id,expert_id,count`` file."""
    p = str(fp)
    try:
        fh = open(p, newline="")
    except FileNotFoundError:
        raise TraceError(p, "does not exist") from None
    need = ["layer_id", "expert_id", "count"]
    with fh:
        reader = csv.reader(fh)
        header = next(reader, None)
        names = [h.strip() for h in header] if header else []
        if sorted(names) != sorted(need):
            raise TraceError(p, f"header must be {','.join(need)} (SGLang's dump_record), got {header}", header)
        idx = [names.index(n) for n in need]
        rows = []
        for lineno, row in enumerate(reader, start=2):
            if not row or all(not c.strip() for c in row):
                continue
            try:
                vals = [int(row[i]) for i in idx] if len(row) == 3 else None
            except ValueError:
                vals = None
            if vals is None:
                raise TraceError(f"{p}:{lineno}", f"expected integers for {','.join(need)}, got {row}", row)
            if min(vals) < 0:
                raise TraceError(f"{p}:{lineno}", f"negative value in {row}", row)
            rows.append(vals)
    return np.asarray(rows, dtype=np.int64).reshape(-1, 3)


def import_sglang_csv(path, num_experts: int | None = None, **_) -> Trace:
    """SGLang's older per-rank CSV dumps: one file, or a directory of one run's files (all ranks, all dumps)."""
    p = Path(path)
    if p.is_dir():
        found = [(int(m.group(1)), float(m.group(2)), f) for f in p.iterdir() if (m := CSV_FILE.match(f.name))]
        if not found:
            raise TraceError(str(p), "holds no expert_distribution_rank<r>_timestamp<t>.csv files")
    else:
        m = CSV_FILE.match(p.name)
        found = [(int(m.group(1)) if m else -1, float(m.group(2)) if m else 0.0, p)]
    by_rank: dict[int, list[Path]] = {}
    for r, t, f in sorted(found, key=lambda x: (x[0], x[1], x[2].name)):
        by_rank.setdefault(r, []).append(f)
    counts = {r: len(fs) for r, fs in by_rank.items()}
    if len(set(counts.values())) > 1:
        raise TraceError(str(p), f"ranks hold different numbers of dumps {counts}; the k-th dump of every rank is "
                         "step k, so each rank needs the same number", counts)
    tables = {(r, k): _read_csv(f) for r, fs in by_rank.items() for k, f in enumerate(fs)}
    if not any(a.size for a in tables.values()):
        raise TraceError(str(p), "has a header but no rows")
    largest = max(int(a[:, 1].max()) for a in tables.values() if a.size)
    E, inferred = resolve_num_experts(num_experts, largest, str(p), "expert_id")
    known = [r for r in by_rank if r >= 0]
    rank_map, source_ranks = dense_ranks(known, str(p))
    rows = RowBuilder()
    for (r, k), a in tables.items():
        n = len(a)
        rows.add_rows(np.full(n, k), np.zeros(n), a[:, 0], np.full(n, rank_map.get(r, -1)), a[:, 1], a[:, 2],
                      count=True)
    meta = TraceMeta(num_experts=E, num_ranks=len(rank_map) or None, source="sglang-csv",
                     inferred=["num_experts"] if inferred else [],
                     description="SGLang dump_record CSV: " + ("per source rank" if rank_map else "global counts")
                     + f"; {next(iter(counts.values()))} dump(s) per rank = steps",
                     extra={"source_ranks": source_ranks, "num_experts_inferred": inferred})
    return rows.finish(meta, str(p))

"""Importers: peers' routing dumps → the canonical :class:`~ultraep.traces.Trace`.

Every importer raises :class:`~ultraep.errors.TraceError` ``(path, message, value)`` naming the file (and
line, key or index) and the offending value. Formats (the layouts follow the peers' published code and
docs, summarised in ``/work/shared/references/peers.md``; what each importer accepts is spelled out here
because some of these dumps have no published schema):

``parquet``
    Our own canonical trace (:meth:`Trace.write`).
``sglang-pt``
    SGLang expert-distribution recorder, ``stat`` mode: ``torch.save`` of a dict with ``logical_count``
    ``[steps, layers, experts]`` (``[layers, experts]`` is read as one step). Loaded with
    ``torch.load(weights_only=True)`` — never unpickled. Global counts (``src_rank = -1``); the dict's
    ``rank`` entry, if any, is kept in the metadata.
``sglang-csv``
    The older SGLang CSV dump: header ``layer_id,expert_id,count`` (any column order), one step.
``megatron-jsonl``
    Megatron-LM ``router_trace`` (``--moe-routing-trace-path``): a directory of
    ``router_trace_rank{r}.jsonl`` or one such file; MTP records become layers of their own
    (:mod:`ultraep.traces.megatron` has the layout, the writer's commit and the mapping).
``ultraep-npz``
    UltraEP load profiling (``ULTRA_EP_LOAD_PROFILING=1``): ``<trace_id>.manifest.json`` (schema
    ``ultra_ep_trace_v1``) next to ``.npz`` chunks. The manifest lists the chunks under ``chunks`` (or
    ``files``; default: ``<trace_id>*.npz`` beside it) and may give ``num_experts``/``ep_size``. Each chunk
    holds the *pre-reroute* load as one of ``load_before``, ``pre_load``, ``loads_before``, ``load``:
    ``[n, R, E]`` per source rank or ``[n, E]`` global, and per record ``layer`` (or ``layer_id``),
    optional ``microbatch`` (``mb``) and ``step`` (``iteration``).
``trtllm``
    TensorRT-LLM ``ExpertStatistic`` dumps: a directory with ``meta_info.json`` (``num_experts``,
    ``num_experts_per_token``) and ``rank<r>.safetensors``, whose tensors are named ``<iter>_<layer>``
    and hold ``[E]`` counts of the tokens rank ``r`` routed. The safetensors header (8-byte little-endian
    length, JSON header, raw buffer) is parsed here; the ``safetensors`` package is not required.
``olmoe``
    ``expert_counts.json`` derived from the OLMoE routing analysis (allenai/OLMoE): per model, kind and
    domain, per-expert counts of layers 0, 7, 15. Each domain becomes one step (in the order given), so
    the trace shows domain shifts. Global counts.
``recorded-run``
    Our own runs: the telemetry store's ``layer_loads`` (exact ``[R, E]`` load of every recorded plan) of
    a run directory, a directory of runs (``run_id=``) or an exported ``.duckdb`` file.
"""

from __future__ import annotations

import csv
import json
import re
import struct
from pathlib import Path

import numpy as np

from ultraep.errors import TraceError, UltraEPError, format_pydantic_error

from . import Trace, TraceMeta
from ._build import first_line as _first_line
from ._build import int_array as _int_array
from .megatron import import_megatron_jsonl, is_megatron_dir


# ---------------------------------------------------------------------------------------------- SGLang
def import_sglang_pt(path, **_) -> Trace:
    """SGLang ``.pt`` dump with ``logical_count`` (see the module docstring)."""
    import torch

    p = str(path)
    try:
        obj = torch.load(p, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise TraceError(p, "does not exist") from None
    except Exception as exc:
        raise TraceError(p, "is not a loadable torch file with weights_only=True (no pickled objects are run; "
                         f"{type(exc).__name__}: {_first_line(exc)})") from None
    if not isinstance(obj, dict):
        raise TraceError(p, f"must hold a dict with 'logical_count', got {type(obj).__name__}", type(obj).__name__)
    if "logical_count" not in obj:
        raise TraceError(p, f"has no 'logical_count' (keys: {sorted(map(str, obj))})", sorted(map(str, obj)))
    lc = obj["logical_count"]
    arr = lc.detach().cpu().numpy() if hasattr(lc, "detach") else np.asarray(lc)
    arr = _int_array(arr, f"{p}:logical_count", "logical_count")
    if arr.ndim == 2:
        arr = arr[None]
    if arr.ndim != 3:
        raise TraceError(f"{p}:logical_count", f"must be [steps, layers, experts] or [layers, experts], got shape "
                         f"{tuple(arr.shape)}", tuple(arr.shape))
    try:
        rank = int(obj["rank"]) if obj.get("rank") is not None else None
    except (TypeError, ValueError, RuntimeError):
        rank = None
    meta = TraceMeta(num_experts=arr.shape[2], source="sglang-pt",
                     description=f"SGLang logical_count from {Path(p).name}", extra={"rank": rank})
    return Trace.from_global_counts(arr, meta, path=p)


def import_sglang_csv(path, num_experts: int | None = None, **_) -> Trace:
    """Older SGLang CSV ``layer_id,expert_id,count`` (one step)."""
    p = str(path)
    try:
        fh = open(p, newline="")
    except FileNotFoundError:
        raise TraceError(p, "does not exist") from None
    with fh:
        reader = csv.reader(fh)
        header = next(reader, None)
        need = ["layer_id", "expert_id", "count"]
        if header is None or not set(need) <= {h.strip() for h in header}:
            raise TraceError(p, f"header must contain {','.join(need)}, got {header}", header)
        idx = [[h.strip() for h in header].index(n) for n in need]
        rows = []
        for lineno, row in enumerate(reader, start=2):
            if not row or all(not c.strip() for c in row):
                continue
            try:
                vals = [int(row[i]) for i in idx]
            except (ValueError, IndexError):
                raise TraceError(f"{p}:{lineno}", f"expected integers for {','.join(need)}, got {row}", row) from None
            if min(vals) < 0:
                raise TraceError(f"{p}:{lineno}", f"negative value in {row}", row)
            rows.append(vals)
    if not rows:
        raise TraceError(p, "has a header but no rows")
    a = np.asarray(rows, dtype=np.int64)
    E = int(a[:, 1].max()) + 1 if num_experts is None else int(num_experts)
    if a[:, 1].max() >= E:
        raise TraceError(p, f"expert_id {int(a[:, 1].max())} >= num_experts {E}", int(a[:, 1].max()))
    meta = TraceMeta(num_experts=E, source="sglang-csv", extra={"num_experts_inferred": num_experts is None})
    n = len(a)
    return Trace.from_columns(meta, p, step=np.zeros(n), microbatch=np.zeros(n), layer=a[:, 0],
                              src_rank=np.full(n, -1), expert=a[:, 1], tokens=a[:, 2])


# ---------------------------------------------------------------------------------------------- UltraEP
_LOAD_KEYS = ("load_before", "pre_load", "loads_before", "load")


def _pick(npz, names, where, required=True):
    for n in names:
        if n in npz.files:
            return npz[n]
    if required:
        raise TraceError(where, f"needs one of {list(names)} (found: {sorted(npz.files)})", sorted(npz.files))
    return None


def import_ultraep_npz(path, **_) -> Trace:
    """UltraEP load profile: a ``<trace_id>.manifest.json`` (or one ``.npz`` chunk beside it)."""
    p = Path(path)
    if p.suffix == ".npz":
        manifests = sorted(p.parent.glob("*.manifest.json"))
        manifest_path = next((m for m in manifests if p.name.startswith(m.name[: -len(".manifest.json")])), None)
        if manifest_path is None:
            raise TraceError(str(p), "has no <trace_id>.manifest.json beside it", p.name)
    else:
        manifest_path = p
    mp = str(manifest_path)
    try:
        manifest = json.loads(manifest_path.read_text())
    except FileNotFoundError:
        raise TraceError(mp, "does not exist") from None
    except json.JSONDecodeError as exc:
        raise TraceError(mp, f"is not valid JSON ({exc.msg})") from None
    if not isinstance(manifest, dict):
        raise TraceError(mp, "must hold a JSON object", type(manifest).__name__)
    schema = str(manifest.get("schema", ""))
    if not schema.startswith("ultra_ep_trace"):
        raise TraceError(f"{mp}.schema", f"must be 'ultra_ep_trace_v1', got {schema!r}", schema)
    trace_id = str(manifest.get("trace_id", manifest_path.name[: -len(".manifest.json")]))
    chunks = manifest.get("chunks", manifest.get("files"))
    if chunks is None:
        files = sorted(manifest_path.parent.glob(f"{trace_id}*.npz"))
    else:
        files = [manifest_path.parent / (c if isinstance(c, str) else c.get("file", c.get("path", ""))) for c in chunks]
    if not files:
        raise TraceError(mp, f"lists no chunks and no {trace_id}*.npz lies beside it", trace_id)
    parts = []
    num_ranks = manifest.get("ep_size", manifest.get("num_ranks"))
    E = manifest.get("num_experts")
    mb_counter: dict[tuple[int, int], int] = {}
    for f in files:
        fp = str(f)
        if not f.exists():
            raise TraceError(fp, "is listed in the manifest but does not exist", f.name)
        try:
            npz = np.load(fp, allow_pickle=False)
        except Exception as exc:
            raise TraceError(fp, f"is not a readable .npz ({exc})") from None
        with npz:
            load = _int_array(_pick(npz, _LOAD_KEYS, fp), f"{fp}:load", "load")
            layer = _pick(npz, ("layer", "layer_id"), fp)
            n = load.shape[0]
            mb = _pick(npz, ("microbatch", "micro_batch", "mb"), fp, required=False)
            step = _pick(npz, ("step", "iteration"), fp, required=False)
        layer = np.asarray(layer).reshape(-1)
        if layer.shape[0] != n:
            raise TraceError(f"{fp}:layer", f"has {layer.shape[0]} entries for {n} load records", layer.shape[0])
        if load.ndim == 2:
            load = load[:, None, :]
            src_known = False
        elif load.ndim == 3:
            src_known = True
        else:
            raise TraceError(f"{fp}:load", f"must be [n, ranks, experts] or [n, experts], got {load.shape}", load.shape)
        if E is None:
            E = load.shape[2]
        if load.shape[2] != E:
            raise TraceError(f"{fp}:load", f"has {load.shape[2]} experts, the manifest says {E}", load.shape[2])
        step = np.zeros(n, dtype=np.int64) if step is None else np.asarray(step).reshape(-1)
        for what, arr in (("step", step), ("microbatch", mb)):
            if arr is not None and np.asarray(arr).size != n:
                raise TraceError(f"{fp}:{what}", f"has {np.asarray(arr).size} entries for {n} load records",
                                 np.asarray(arr).size)
        if mb is None:  # successive records of a layer within a step are microbatches
            mb = np.empty(n, dtype=np.int64)
            for i in range(n):
                k = (int(step[i]), int(layer[i]))
                mb[i] = mb_counter.get(k, 0)
                mb_counter[k] = mb[i] + 1
        parts.append((np.asarray(step), np.asarray(mb).reshape(-1), layer, load, src_known))
    known = {pk[4] for pk in parts}
    if len(known) > 1:
        raise TraceError(mp, "chunks mix per-rank [n, R, E] and global [n, E] loads", sorted(known))
    src_known = known.pop()
    Rs = parts[0][3].shape[1] if src_known else None
    if src_known and num_ranks is not None and int(num_ranks) != Rs:
        raise TraceError(f"{mp}.ep_size", f"is {num_ranks} but the chunks hold {Rs} ranks", num_ranks)
    cols = {c: [] for c in ("step", "microbatch", "layer", "src_rank", "expert", "tokens")}
    for step, mb, layer, load, _k in parts:
        i, r, e = np.nonzero(load)
        cols["step"].append(step[i])
        cols["microbatch"].append(mb[i])
        cols["layer"].append(layer[i])
        cols["src_rank"].append(r if src_known else np.full(i.shape, -1))
        cols["expert"].append(e)
        cols["tokens"].append(load[i, r, e])
    meta = TraceMeta(num_experts=int(E), num_ranks=Rs, source="ultraep-npz",
                     extra={"trace_id": trace_id, "schema": schema})
    return Trace.from_columns(meta, mp, **{c: np.concatenate(v) for c, v in cols.items()})


# ---------------------------------------------------------------------------------------------- TensorRT-LLM
_ST_DTYPES = {"F64": "<f8", "F32": "<f4", "F16": "<f2", "I64": "<i8", "I32": "<i4", "I16": "<i2", "I8": "i1",
              "U64": "<u8", "U32": "<u4", "U16": "<u2", "U8": "u1", "BOOL": "?", "BF16": "BF16"}


def read_safetensors(path) -> dict[str, np.ndarray]:
    """Tensors of a ``.safetensors`` file as numpy arrays (header: u64 little-endian length + JSON)."""
    p = str(path)
    try:
        data = Path(p).read_bytes()
    except FileNotFoundError:
        raise TraceError(p, "does not exist") from None
    if len(data) < 8:
        raise TraceError(p, f"is too short for a safetensors header ({len(data)} bytes)", len(data))
    (n,) = struct.unpack("<Q", data[:8])
    if n > len(data) - 8 or n > 100_000_000:
        raise TraceError(p, f"declares a header of {n} bytes in a {len(data)}-byte file", n)
    try:
        header = json.loads(data[8:8 + n])
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise TraceError(p, f"has an unreadable safetensors header ({exc})") from None
    buf = memoryview(data)[8 + n:]
    out = {}
    for name, spec in header.items():
        if name == "__metadata__":
            continue
        try:
            dt, shape, (b0, b1) = spec["dtype"], list(spec["shape"]), spec["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise TraceError(f"{p}:{name}", f"has a malformed header entry {spec}", spec) from None
        if dt not in _ST_DTYPES:
            raise TraceError(f"{p}:{name}", f"has unsupported dtype {dt}", dt)
        if not 0 <= b0 <= b1 <= len(buf):
            raise TraceError(f"{p}:{name}", f"data offsets {[b0, b1]} fall outside the {len(buf)}-byte buffer", [b0, b1])
        raw = bytes(buf[b0:b1])
        if dt == "BF16":
            arr = (np.frombuffer(raw, dtype="<u2").astype(np.uint32) << 16).view(np.float32)
        else:
            arr = np.frombuffer(raw, dtype=_ST_DTYPES[dt])
        if arr.size != int(np.prod(shape)):
            raise TraceError(f"{p}:{name}", f"holds {arr.size} elements for shape {shape}", shape)
        out[name] = arr.reshape(shape)
    return out


def write_safetensors(path, tensors: dict[str, np.ndarray]) -> None:
    """Write numpy arrays in the safetensors layout (used by tests and by our own dumps)."""
    inv = {v: k for k, v in _ST_DTYPES.items() if k != "BF16"}
    header, blobs, off = {}, [], 0
    for name, arr in tensors.items():
        a = np.ascontiguousarray(arr)
        key = a.dtype.newbyteorder("<").str if a.dtype.itemsize > 1 else a.dtype.str.lstrip("|")
        dt = inv.get(key) or inv.get(a.dtype.str)
        if dt is None:
            raise TraceError(f"{path}:{name}", f"dtype {a.dtype} has no safetensors code", str(a.dtype))
        raw = a.astype(a.dtype.newbyteorder("<")).tobytes()
        header[name] = {"dtype": dt, "shape": list(a.shape), "data_offsets": [off, off + len(raw)]}
        blobs.append(raw)
        off += len(raw)
    hb = json.dumps(header).encode()
    Path(path).write_bytes(struct.pack("<Q", len(hb)) + hb + b"".join(blobs))


_RANK_FILE = re.compile(r"^rank(\d+)\.safetensors$")
_ITER_LAYER = re.compile(r"^(\d+)_(\d+)$")


def import_trtllm(path, **_) -> Trace:
    """TensorRT-LLM expert statistics directory (see the module docstring)."""
    d = Path(path)
    if d.is_file():
        d = d.parent
    dp = str(d)
    if not d.is_dir():
        raise TraceError(dp, "is not a directory of rank*.safetensors files")
    files = sorted((int(m.group(1)), f) for f in d.iterdir() if (m := _RANK_FILE.match(f.name)))
    if not files:
        raise TraceError(dp, "holds no rank<r>.safetensors files")
    meta_path = d / "meta_info.json"
    info = {}
    if meta_path.exists():
        try:
            info = json.loads(meta_path.read_text())
        except json.JSONDecodeError as exc:
            raise TraceError(str(meta_path), f"is not valid JSON ({exc.msg})") from None
    E = info.get("num_experts")
    cols = {c: [] for c in ("step", "microbatch", "layer", "src_rank", "expert", "tokens")}
    for rank, f in files:
        for name, arr in read_safetensors(f).items():
            m = _ITER_LAYER.match(name)
            if not m:
                raise TraceError(f"{f}:{name}", "tensor names must be '<iter>_<layer>'", name)
            counts = _int_array(arr, f"{f}:{name}", "expert counts").reshape(-1)
            if E is None:
                E = counts.size
            if counts.size != E:
                raise TraceError(f"{f}:{name}", f"has {counts.size} experts, expected {E}", counts.size)
            nz = np.flatnonzero(counts)
            cols["step"].append(np.full(nz.size, int(m.group(1))))
            cols["microbatch"].append(np.zeros(nz.size, dtype=np.int64))
            cols["layer"].append(np.full(nz.size, int(m.group(2))))
            cols["src_rank"].append(np.full(nz.size, rank))
            cols["expert"].append(nz)
            cols["tokens"].append(counts[nz])
    if E is None:
        raise TraceError(dp, "has no tensors and meta_info.json gives no num_experts")
    meta = TraceMeta(num_experts=int(E), num_ranks=max(r for r, _ in files) + 1,
                     top_k=info.get("num_experts_per_token"), source="trtllm", extra={"meta_info": info})
    return Trace.from_columns(meta, dp, **{c: np.concatenate(v) if v else np.zeros(0) for c, v in cols.items()})


# ---------------------------------------------------------------------------------------------- OLMoE
_TOPK = {"olmoe": 8, "olmoe-sft": 8, "olmoe-dpo": 8, "mistral": 2}


def import_olmoe(path, model: str = "olmoe", kind: str = "expert_counts", domains: list[str] | None = None, **_) -> Trace:
    """OLMoE routing-analysis counts (``expert_counts.json``): one step per domain, layers 0, 7, 15."""
    p = str(path)
    try:
        obj = json.loads(Path(p).read_text())
    except FileNotFoundError:
        raise TraceError(p, "does not exist") from None
    except json.JSONDecodeError as exc:
        raise TraceError(p, f"is not valid JSON ({exc.msg})") from None
    data = obj.get("data") if isinstance(obj, dict) else None
    if not isinstance(data, dict):
        raise TraceError(p, "must hold {'layers': [...], 'data': {model: {kind: {domain: counts}}}}")
    if model not in data:
        raise TraceError(f"{p}:data", f"has no model {model!r}; available: {sorted(data)}", model)
    if kind not in data[model]:
        raise TraceError(f"{p}:data.{model}", f"has no kind {kind!r}; available: {sorted(data[model])}", kind)
    by_domain = data[model][kind]
    names = list(by_domain) if domains is None else list(domains)
    unknown = [d for d in names if d not in by_domain]
    if unknown:
        raise TraceError(f"{p}:data.{model}.{kind}", f"has no domain {unknown[0]!r}; available: {sorted(by_domain)}",
                         unknown[0])
    counts = np.stack([_int_array(by_domain[d], f"{p}:data.{model}.{kind}.{d}", "counts") for d in names])
    if counts.ndim != 3:
        raise TraceError(f"{p}:data.{model}.{kind}", f"expects [layers][experts] per domain, got {counts.shape[1:]}",
                         counts.shape)
    layers = obj.get("layers", list(range(counts.shape[1])))
    meta = TraceMeta(num_experts=counts.shape[2], top_k=_TOPK.get(model), source="olmoe", model=model,
                     description=f"{kind}; steps = domains {names}", extra={"domains": names, "kind": kind})
    return Trace.from_global_counts(counts, meta, layers=np.asarray(layers), path=p)


# ---------------------------------------------------------------------------------------------- recorded runs
def import_recorded_run(path, run_id: str | None = None, **_) -> Trace:
    """Loads recorded by ultraep's telemetry (``layer_loads``: the exact ``[R, E]`` load of every recorded
    plan) from a run directory, a directory of runs (pick one with ``run_id``) or an exported ``.duckdb``.
    When several ranks recorded the same layer, the lowest rank's copy is used."""
    from ultraep.telemetry import open_run

    p = str(path)
    try:
        con = open_run(path)
    except Exception as exc:
        raise TraceError(p, f"is not a readable ultraep run ({exc})") from None
    runs = [r[0] for r in con.execute("SELECT DISTINCT run_id FROM layer_loads ORDER BY 1").fetchall()]
    if not runs:
        raise TraceError(p, "holds no recorded loads (layer_loads is empty; record plans with record_plan)")
    if run_id is None:
        if len(runs) > 1:
            raise TraceError(p, f"holds {len(runs)} runs; pick one with run_id= ({', '.join(runs[:5])}...)", runs)
        run_id = runs[0]
    elif run_id not in runs:
        raise TraceError(f"{p}:run_id", f"{run_id!r} has no recorded loads; runs: {', '.join(runs[:5])}", run_id)
    rows = con.execute(
        "SELECT step, microbatch, layer, num_experts, num_ranks, load FROM layer_loads WHERE run_id = ? "
        "QUALIFY row_number() OVER (PARTITION BY step, microbatch, layer ORDER BY rank) = 1 "
        "ORDER BY layer, step, microbatch", [run_id]).fetchall()
    E, R = int(rows[0][3]), int(rows[0][4])
    cols = {c: [] for c in ("step", "microbatch", "layer", "src_rank", "expert", "tokens")}
    for step, mb, layer, e_, r_, load in rows:
        a = np.asarray(load, dtype=np.int64)
        if a.shape != (R, E):
            raise TraceError(f"{p}:layer_loads", f"step {step} layer {layer} has a load of shape {a.shape}, "
                             f"expected {(R, E)}", a.shape)
        r, e = np.nonzero(a)
        for c, v in (("step", step), ("microbatch", mb), ("layer", layer)):
            cols[c].append(np.full(r.size, v))
        cols["src_rank"].append(r)
        cols["expert"].append(e)
        cols["tokens"].append(a[r, e])
    meta = TraceMeta(num_experts=E, num_ranks=R, source="recorded-run", extra={"run_id": run_id})
    return Trace.from_columns(meta, p, **{c: np.concatenate(v) for c, v in cols.items()})


# ---------------------------------------------------------------------------------------------- dispatch
FORMATS = {
    "parquet": lambda path, **kw: Trace.read(path),
    "sglang-pt": import_sglang_pt,
    "sglang-csv": import_sglang_csv,
    "megatron-jsonl": import_megatron_jsonl,
    "ultraep-npz": import_ultraep_npz,
    "trtllm": import_trtllm,
    "olmoe": import_olmoe,
    "recorded-run": import_recorded_run,
}


def detect_format(path) -> str:
    p = Path(path)
    name = p.name
    if p.is_dir():
        if any(_RANK_FILE.match(f.name) for f in p.iterdir()):
            return "trtllm"
        if is_megatron_dir(p):
            return "megatron-jsonl"
        return "recorded-run"
    if p.suffix == ".duckdb":
        return "recorded-run"
    if name.endswith(".manifest.json") or p.suffix == ".npz":
        return "ultraep-npz"
    if _RANK_FILE.match(name):
        return "trtllm"
    by_suffix = {".parquet": "parquet", ".pt": "sglang-pt", ".pth": "sglang-pt", ".csv": "sglang-csv",
                 ".jsonl": "megatron-jsonl", ".json": "olmoe"}
    if p.suffix in by_suffix:
        return by_suffix[p.suffix]
    raise TraceError(str(p), f"cannot tell the trace format from the name; pass format= one of {sorted(FORMATS)}", name)


def _importer_options(fn) -> list[str]:
    """Options an importer takes by name (everything after ``path``; ``**_`` catch-alls excluded)."""
    import inspect

    named = [n for n, p in inspect.signature(fn).parameters.items()
             if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    return named[1:]


def load_trace(path, format: str = "auto", **options) -> Trace:
    """Read any supported trace (``format="auto"`` guesses from the name).

    A file is user input: whatever is wrong with it (truncated, binary where text belongs, a JSON value of the
    wrong kind, ...) raises :class:`TraceError` naming the file, never another exception. An option the
    format does not take raises too (it would otherwise be ignored without a word).
    """
    if not Path(path).exists():
        raise TraceError(str(path), "does not exist")
    fmt = detect_format(path) if format == "auto" else format
    if fmt not in FORMATS:
        raise TraceError("format", f"unknown trace format {fmt!r}; available: {', '.join(sorted(FORMATS))}", fmt)
    importer = FORMATS[fmt]
    accepted = _importer_options(importer)
    unknown = sorted(set(options) - set(accepted))
    if unknown:
        raise TraceError(f"{fmt}.{unknown[0]}", f"unknown option for trace format {fmt!r}; accepted: "
                         f"{', '.join(accepted) or '(none)'}", unknown[0])
    try:
        return importer(path, **options)
    except (TraceError, MemoryError):
        raise
    except UltraEPError:
        raise
    except Exception as exc:  # malformed content the importer did not anticipate: still one line naming the file
        from pydantic import ValidationError

        detail = (format_pydantic_error(exc).replace("\n", "; ") if isinstance(exc, ValidationError)
                  else f"{type(exc).__name__}: {_first_line(exc)}")
        raise TraceError(str(path), f"is not a readable {fmt} trace ({detail})", fmt) from None

"""TensorRT-LLM expert statistics → canonical trace.

Writer: NVIDIA/TensorRT-LLM ``tensorrt_llm/_torch/expert_statistic.py`` (``ExpertStatistic``, read at
commit ``0fccc5b97dd7b23c438e740b3bf4dcde607266c4``; the variant at guqiqi/TensorRT-LLM
``df9e45e384e46618e8c453de815b7927b3dfdd3f`` adds ``EXPERT_STATISTIC_DUMP_DISPATCH``). Enabled by
``EXPERT_STATISTIC_ITER_RANGE=start-stop``; at iteration ``stop`` (or, in the dispatch variant, after every
iteration and at exit) each rank writes to ``EXPERT_STATISTIC_PATH``:

* ``rank{r}.safetensors``: one int64 ``[num_experts]`` tensor per ``"{iter}_{layer}"``, the
  ``bincount`` of the expert ids the rank's tokens selected (summed over the calls of that iteration and
  layer, i.e. over microbatches);
* ``meta_info.json`` (rank 0 only): ``num_experts``, ``num_experts_per_token``; the dispatch variant adds
  ``ep_size`` and ``experts_per_rank``;
* dispatch variant only: ``rank{r}_numtokens.json``, ``{"{iter}_{layer}": tokens}``.

Mapping: ``step`` = iter, ``microbatch`` 0, ``layer`` = layer, ``src_rank`` = r (ranks renumbered 0..n-1);
``top_k`` from ``num_experts_per_token``. Where ``rank{r}_numtokens.json`` exists, every tensor must sum to
tokens x top-k (the writer's own invariant). A tensor name other than ``{iter}_{layer}`` or a
``meta_info.json`` key the writers do not write is refused. The safetensors header (8-byte little-endian
length, JSON header, raw buffer) is parsed here; the ``safetensors`` package is not required.
"""

from __future__ import annotations

import json
import re
import struct
from pathlib import Path

import numpy as np

from ultraep.errors import TraceError

from .trace import Trace, TraceMeta
from ._build import RowBuilder, dense_ranks, int_array, resolve_num_experts

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
    if not isinstance(header, dict):
        raise TraceError(p, f"has a safetensors header that is not a JSON object ({type(header).__name__})",
                         type(header).__name__)
    buf = memoryview(data)[8 + n:]
    out = {}
    for name, spec in header.items():
        if name == "__metadata__":
            continue
        try:
            dt, shape, (b0, b1) = spec["dtype"], list(spec["shape"]), spec["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise TraceError(f"{p}:{name}", f"has a malformed header entry {spec}", spec) from None
        if not all(type(v) is int and v >= 0 for v in (*shape, b0, b1)):
            raise TraceError(f"{p}:{name}", f"has a malformed header entry {spec}: shape and data offsets must be "
                             "non-negative integers", spec)
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


RANK_FILE = re.compile(r"^rank(\d+)\.safetensors$")
_ITER_LAYER = re.compile(r"^(\d+)_(\d+)$")
_META_KEYS = {"num_experts", "num_experts_per_token", "ep_size", "experts_per_rank"}


def is_trtllm_dir(d: Path) -> bool:
    return any(RANK_FILE.match(f.name) for f in d.iterdir())


def _json(path: Path):
    try:
        return json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise TraceError(str(path), f"is not valid JSON ({exc})") from None


def import_trtllm(path, num_experts: int | None = None, **_) -> Trace:
    """TensorRT-LLM expert statistics directory (or one ``rank<r>.safetensors`` in it)."""
    d = Path(path)
    if d.is_file():
        d = d.parent
    dp = str(d)
    if not d.is_dir():
        raise TraceError(dp, "is not a directory of rank*.safetensors files")
    files = sorted((int(m.group(1)), f) for f in d.iterdir() if (m := RANK_FILE.match(f.name)))
    if not files:
        raise TraceError(dp, "holds no rank<r>.safetensors files")
    info = _json(d / "meta_info.json") if (d / "meta_info.json").exists() else {}
    if not isinstance(info, dict):
        raise TraceError(str(d / "meta_info.json"), "must hold a JSON object", type(info).__name__)
    odd = sorted(set(info) - _META_KEYS)
    if odd:
        raise TraceError(f"{d / 'meta_info.json'}.{odd[0]}", "is not a key TensorRT-LLM writes", odd[0])
    for k in ("num_experts", "num_experts_per_token"):
        if k in info and (type(info[k]) is not int or info[k] < 1):
            raise TraceError(f"{d / 'meta_info.json'}.{k}", f"must be an integer >= 1, got {info[k]!r}", info[k])
    top_k = info.get("num_experts_per_token")
    tensors = []
    for rank, f in files:
        ntok = _json(d / f"rank{rank}_numtokens.json") if (d / f"rank{rank}_numtokens.json").exists() else None
        for name, arr in read_safetensors(f).items():
            m = _ITER_LAYER.match(name)
            if not m:
                raise TraceError(f"{f}:{name}", "tensor names must be '<iter>_<layer>'", name)
            counts = int_array(arr, f"{f}:{name}", "expert counts")
            if counts.ndim != 1:
                raise TraceError(f"{f}:{name}", f"must be [num_experts], got shape {counts.shape}", counts.shape)
            if ntok is not None:
                t = ntok.get(name) if isinstance(ntok, dict) else None
                if type(t) is not int or top_k is None or int(counts.sum()) != t * top_k:
                    raise TraceError(f"{f}:{name}", f"sums to {int(counts.sum())}, but rank{rank}_numtokens.json gives "
                                     f"{t!r} tokens x top-k {top_k}", int(counts.sum()))
            tensors.append((f"{f}:{name}", int(m.group(1)), int(m.group(2)), rank, counts))
    widths = {t[4].size for t in tensors}
    given = num_experts if num_experts is not None else info.get("num_experts")
    if given is None and len(widths) > 1:
        raise TraceError(dp, f"tensors have different widths {sorted(widths)} and meta_info.json gives no num_experts",
                         sorted(widths))
    if not tensors and given is None:
        raise TraceError(dp, "has no tensors and meta_info.json gives no num_experts")
    E, _ = resolve_num_experts(given if given is not None else widths.pop(),
                                      max((t[4].size - 1 for t in tensors), default=0), dp, "expert count index")
    rank_map, source_ranks = dense_ranks((r for r, _ in files), dp)
    rows = RowBuilder()
    for where, it, layer, rank, counts in tensors:
        if counts.size != E:
            raise TraceError(where, f"has {counts.size} experts, expected {E}", counts.size)
        rows.add_counts(it, 0, layer, rank_map[rank], counts)
    meta = TraceMeta(num_experts=E, num_ranks=len(rank_map), top_k=top_k, source="trtllm",
                     description="TensorRT-LLM ExpertStatistic: per source rank, microbatches of an iteration summed",
                     extra={"meta_info": info, "source_ranks": source_ranks})
    return rows.finish(meta, dp)

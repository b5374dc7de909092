"""OLMoE routing-analysis counts → canonical trace.

Writer: allenai/OLMoE ``scripts/run_routing_analysis.py`` (read at commit
``2aecf25991ac1bbfb75d96f01853fe65e1f46e3f``; the published outputs under ``scripts/routing_output/`` at
``357454f4f647385839c0ff6b99a688dc7cd9c13f``). For each domain it writes
``routing_output/{model}/expert_counts/{domain}.pkl`` = ``pickle.dump([Counter, Counter, Counter])``: how
often each expert was picked in MoE layers 0, 7 and 15 (top-8 of 64 for ``olmoe``, top-2 of 8 for
``mistral``); the published outputs also hold ``expert_counts_top1`` (rank-1 choice only). Counter keys are
numpy int64 scalars (the ids come from ``np.argsort``), so the pickle references ``collections.Counter``,
``numpy.dtype`` and ``numpy.core.multiarray.scalar`` (``numpy._core`` under numpy 2).

**Pickles are code.** :class:`_CountsUnpickler` resolves exactly those three names, each to a stand-in
written here (a Counter built from a plain dict of counts; a dtype placeholder that accepts only integer
type codes; a scalar decoder that reads integer bytes), and refuses every other global with one line, so
a malicious pickle cannot run anything. The other pickles the script writes (``expert_counts_crosslayer``:
Counters keyed by pairs; ``eid2token``: ``defaultdict``) are refused.

Mapping: each domain is one step (in the order of ``domains=``, else the writer's order github, arxiv, c4,
book, wikipedia, then any others by name), layers 0/7/15, global counts. ``model`` and ``kind`` come from
the path ``{model}/{kind}/{domain}.pkl`` when it has them (``--trace-opt model=...`` otherwise); the model
gives ``num_experts`` and ``top_k`` (``olmoe``: 64 and 8, ``mistral``: 8 and 2; top-1 kinds: k = 1);
otherwise ``num_experts`` is the largest id + 1, marked inferred.

Also read: ``expert_counts.json``, a lossless JSON of the same pickles made for this project
(``{"layers": [0, 7, 15], "data": {model: {kind: {domain: [[count per expert] per layer]}}}}``).
"""

from __future__ import annotations

import io
import json
import pickle
from collections import Counter
from pathlib import Path

import numpy as np

from ultraep.errors import TraceError

from .trace import Trace, TraceMeta
from ._build import RowBuilder, int_array, resolve_num_experts

LAYERS = (0, 7, 15)
MODELS = {"olmoe": (64, 8), "olmoe-sft": (64, 8), "olmoe-dpo": (64, 8), "mistral": (8, 2)}
KINDS = ("expert_counts", "expert_counts_top1")
WRITER_DOMAINS = ("github", "arxiv", "c4", "book", "wikipedia")


# ---------------------------------------------------------------------------------------------- unpickling
class _IntDType:
    """Stands in for ``numpy.dtype(code)``; only integer codes, byte order from the pickled state."""

    def __init__(self, code, align=False, copy=True):
        if not isinstance(code, str) or code not in ("i1", "i2", "i4", "i8", "u1", "u2", "u4", "u8"):
            raise pickle.UnpicklingError(f"numpy dtype {code!r} is not an integer type")
        self.code, self.order = code, "<"

    def __setstate__(self, state):
        if not isinstance(state, tuple) or len(state) < 2 or state[1] not in ("<", ">", "|", "="):
            raise pickle.UnpicklingError(f"unexpected numpy dtype state {state!r}"[:120])
        self.order = "<" if state[1] in ("|", "=") else state[1]


def _int_scalar(dtype, data):
    """Stands in for ``numpy.core.multiarray.scalar(dtype, bytes)``: a Python int."""
    if not isinstance(dtype, _IntDType) or not isinstance(data, bytes):
        raise pickle.UnpicklingError("numpy scalar of a non-integer dtype")
    dt = np.dtype(dtype.order + dtype.code)
    if len(data) != dt.itemsize:
        raise pickle.UnpicklingError(f"numpy scalar of {len(data)} bytes for dtype {dt}")
    return int(np.frombuffer(data, dtype=dt)[0])


def _counter(mapping=None):
    if mapping is None:
        return Counter()
    if not isinstance(mapping, dict):
        raise pickle.UnpicklingError(f"Counter built from a {type(mapping).__name__}, expected a dict")
    return Counter(mapping)


_ALLOWED = {
    ("collections", "Counter"): _counter,
    ("numpy", "dtype"): _IntDType,
    ("numpy.core.multiarray", "scalar"): _int_scalar,
    ("numpy._core.multiarray", "scalar"): _int_scalar,
}


class _CountsUnpickler(pickle.Unpickler):
    def find_class(self, module, name):
        fn = _ALLOWED.get((module, name))
        if fn is None:
            raise pickle.UnpicklingError(f"refusing to load global {module}.{name} (only collections.Counter and "
                                         "numpy integer scalars are allowed)")
        return fn

    def persistent_load(self, pid):
        raise pickle.UnpicklingError("persistent ids are not allowed")


def load_counts_pickle(path) -> list[Counter]:
    """The list of Counters of one OLMoE ``expert_counts`` pickle, unpickled with only the allowed globals."""
    p = str(path)
    try:
        data = Path(p).read_bytes()
    except FileNotFoundError:
        raise TraceError(p, "does not exist") from None
    try:
        obj = _CountsUnpickler(io.BytesIO(data)).load()
    except pickle.UnpicklingError as exc:
        raise TraceError(p, f"is not an OLMoE counts pickle: {exc}") from None
    except Exception as exc:  # truncated or corrupt stream
        raise TraceError(p, f"is not a readable pickle ({type(exc).__name__}: {exc})") from None
    if not isinstance(obj, list) or not all(type(c) is Counter for c in obj):
        raise TraceError(p, f"must hold a list of Counters (one per layer), got {type(obj).__name__}",
                         type(obj).__name__)
    for i, c in enumerate(obj):
        for k, v in c.items():
            if type(k) is not int or type(v) is not int or k < 0 or v < 0:
                raise TraceError(f"{p}[{i}]", f"maps {k!r} -> {v!r}; expected expert id -> count (integers >= 0)", k)
    return obj


# ---------------------------------------------------------------------------------------------- import
def is_olmoe_dir(d: Path) -> bool:
    return any(f.suffix == ".pkl" for f in d.iterdir()) or any((d / k).is_dir() for k in KINDS)


def _domain_order(names):
    known = [d for d in WRITER_DOMAINS if d in names]
    return known + sorted(n for n in names if n not in WRITER_DOMAINS)


def import_olmoe(path, model: str | None = None, kind: str | None = None, domains: list[str] | None = None,
                 num_experts: int | None = None, **_) -> Trace:
    """OLMoE counts: a ``{domain}.pkl``, an ``expert_counts`` directory of them, or ``expert_counts.json``."""
    p = Path(path)
    if p.suffix == ".json":
        return _import_json(p, model or "olmoe", kind or "expert_counts", domains, num_experts)
    if p.is_dir() and not any(f.suffix == ".pkl" for f in p.iterdir()):
        sub = [k for k in KINDS if (p / k).is_dir()]  # the model directory: pick the kind
        k = kind or (sub[0] if len(sub) == 1 or "expert_counts" not in sub else "expert_counts")
        if k not in sub:
            raise TraceError(str(p), f"has no {k}/ directory (has {sub})", k)
        p = p / k
    files = sorted(p.glob("*.pkl")) if p.is_dir() else [p]
    by_domain = {f.stem: f for f in files}
    kind = kind or (p.name if p.is_dir() else p.parent.name)
    model = model or (p.parent.name if p.is_dir() else p.parent.parent.name)
    names = _domain_order(by_domain) if domains is None else list(domains)
    if not names:
        raise TraceError(f"{p}.domains" if domains is not None else str(p),
                         "the olmoe importer needs at least one domain" if domains is not None else "holds no .pkl files")
    unknown = [d for d in names if d not in by_domain]
    if unknown:
        raise TraceError(f"{p}.domains", f"has no domain {unknown[0]!r}; available: {sorted(by_domain)}", unknown[0])
    counters = {d: load_counts_pickle(by_domain[d]) for d in names}
    for d, cs in counters.items():
        if len(cs) != len(LAYERS):
            raise TraceError(str(by_domain[d]), f"holds {len(cs)} Counters; the writer saves layers {list(LAYERS)}",
                             len(cs))
    largest = max((max(c) for cs in counters.values() for c in cs if c), default=-1)
    E, inferred = resolve_num_experts(num_experts if num_experts is not None else MODELS.get(model, (None,))[0],
                                      largest, str(p))
    rows = RowBuilder()
    for step, d in enumerate(names):
        for layer, c in zip(LAYERS, counters[d]):
            vec = np.zeros(E, dtype=np.int64)
            for k, v in c.items():
                vec[k] += v
            rows.add_counts(step, 0, layer, -1, vec)
    return rows.finish(_meta(model, kind, names, E, inferred), str(p))


def _meta(model, kind, names, E, inferred) -> TraceMeta:
    top_k = 1 if kind.endswith("_top1") else MODELS.get(model, (None, None))[1]
    return TraceMeta(num_experts=E, top_k=top_k, source="olmoe", model=model if model in MODELS else None,
                     inferred=["num_experts"] if inferred else [],
                     description=f"{kind}; steps = domains {names}",
                     extra={"domains": names, "kind": kind, "model_dir": model})


def _import_json(p: Path, model: str, kind: str, domains, num_experts) -> Trace:
    ps = str(p)
    try:
        obj = json.loads(p.read_text())
    except FileNotFoundError:
        raise TraceError(ps, "does not exist") from None
    except json.JSONDecodeError as exc:
        raise TraceError(ps, f"is not valid JSON ({exc.msg})") from None
    data = obj.get("data") if isinstance(obj, dict) else None
    if not isinstance(data, dict):
        raise TraceError(ps, "must hold {'layers': [...], 'data': {model: {kind: {domain: counts}}}}")
    if model not in data:
        raise TraceError(f"{ps}:data", f"has no model {model!r}; available: {sorted(data)}", model)
    if kind not in data[model]:
        raise TraceError(f"{ps}:data.{model}", f"has no kind {kind!r}; available: {sorted(data[model])}", kind)
    by_domain = data[model][kind]
    names = list(by_domain) if domains is None else list(domains)
    unknown = [d for d in names if d not in by_domain]
    if unknown:
        raise TraceError(f"{ps}:data.{model}.{kind}", f"has no domain {unknown[0]!r}; available: {sorted(by_domain)}",
                         unknown[0])
    if not names:
        raise TraceError(f"{ps}.domains", "the olmoe importer needs at least one domain", names)
    counts = np.stack([int_array(by_domain[d], f"{ps}:data.{model}.{kind}.{d}", "counts") for d in names])
    if counts.ndim != 3:
        raise TraceError(f"{ps}:data.{model}.{kind}", f"expects [layers][experts] per domain, got {counts.shape[1:]}",
                         counts.shape)
    layers = obj.get("layers", list(range(counts.shape[1])))
    if not isinstance(layers, list) or len(layers) != counts.shape[1]:
        raise TraceError(f"{ps}:layers", f"must list {counts.shape[1]} layer ids, got {layers!r}", layers)
    E, inferred = resolve_num_experts(num_experts if num_experts is not None else counts.shape[2],
                                      counts.shape[2] - 1, ps)
    rows = RowBuilder()
    for step in range(len(names)):
        for li, layer in enumerate(layers):
            rows.add_counts(step, 0, int(layer), -1, np.pad(counts[step, li], (0, E - counts.shape[2])))
    return rows.finish(_meta(model, kind, names, E, inferred), ps)

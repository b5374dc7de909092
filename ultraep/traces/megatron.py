"""Megatron-LM router traces (``--moe-routing-trace-path``) → canonical trace.

Writer: NVIDIA/Megatron-LM ``megatron/core/transformer/moe/router_trace.py`` (read at commits
``4addead2c91082e43e8548c838db5dfe5a48d008`` and ``059f0f5c78cddcfa10e34842607d68b745631aeb``; the
``yuzhongw-nvidia/Megatron-LM`` branch at ``b52717395c837e9def6a80517d35ebe61891524c`` adds single-layer MTP
heads and ``logit_dtype``). Layout, as that writer produces it:

* a directory (the ``--moe-routing-trace-path``) with one ``router_trace_rank{r}.jsonl`` per rank, plus
  optional sidecars ``hidden_states_rank{r}.bin``, ``logits_rank{r}.bin``, ``router_state_rank{r}.pt``
  (not needed for counts, ignored);
* one JSON object per line and per router call::

      {"step": 0, "stage": "pre_dispatch", "block": "decoder", "layer": 3, "rank": 0,
       "num_tokens": 128, "topk": 8, "top_indices": [[12, 45, ...], ...]}

  ``top_indices`` is ``[num_tokens][topk]`` int; ``block`` is ``"decoder"`` or ``"mtp"``; MTP records add
  ``mtp_idx`` (the MTP head) and their ``layer`` is the layer inside that head, so it repeats decoder layer
  numbers. Sidecar records add ``hs_offset``/``hs_bytes``/``hs_shape`` and
  ``logit_offset``/``logit_bytes``/``logit_shape``/``logit_dtype``.

How records map to canonical rows:

* **Layers.** Decoder layer ``l`` keeps id ``l``. MTP head ``m``'s layer ``l`` gets id
  ``MTP_LAYER_BASE * (m + 1) + l`` (1000, 1001, ... for head 0), so MTP routing never lands in a decoder
  layer; the names are kept in ``TraceMeta.extra['layer_names']`` and shown by ``ultraep trace info``.
  A decoder layer or MTP inner layer >= ``MTP_LAYER_BASE`` is refused (ids would collide).
* **Microbatches.** The writer gives no microbatch: a training step runs every microbatch through the
  same routers, so the k-th record of one ``(step, block, mtp_idx, layer)`` on one rank is microbatch k.
* **Ranks.** ``src_rank`` comes from each record's ``rank`` (checked against the file name in a directory).
  The ranks present are renumbered ``0..n-1`` in order (``extra['source_ranks']`` keeps the originals when
  that is not the identity), so one rank's file alone is a one-rank trace.
* **Experts.** ``num_experts`` is not in the dump: ``--trace-opt num_experts=E``, otherwise the largest id
  + 1 (marked inferred). ``top_k`` is the records' ``topk``.

Refused with one line: a key the writer does not write, a ``stage`` other than ``pre_dispatch``, a
``block`` other than decoder/mtp, ``mtp_idx`` on a decoder record or missing on an MTP one,
``num_tokens``/``topk`` that disagree with ``top_indices``, a rank that differs from the file name.

Known limit (not detectable from the dump): with pipeline parallelism the writer's decoder ``layer`` is
the index inside the stage's layer list, so two stages both write layer 0. Import one pipeline stage's
ranks at a time (copy their files into a directory of their own).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np

from ultraep.errors import TraceError

from .trace import Trace, TraceMeta
from ._build import RowBuilder, dense_ranks, int_array, resolve_num_experts

MTP_LAYER_BASE = 1000
RANK_FILE = re.compile(r"^router_trace_rank(\d+)\.jsonl$")
_REQUIRED = ("step", "stage", "block", "layer", "rank", "num_tokens", "topk", "top_indices")
_SIDECAR = ("hs_offset", "hs_bytes", "hs_shape", "logit_offset", "logit_bytes", "logit_shape", "logit_dtype")
_KNOWN = frozenset(_REQUIRED + _SIDECAR + ("mtp_idx",))


def is_megatron_dir(d: Path) -> bool:
    return any(RANK_FILE.match(f.name) for f in d.iterdir())


def _files(p: Path) -> list[tuple[int | None, Path]]:
    if p.is_dir():
        files = sorted((int(m.group(1)), f) for f in p.iterdir() if (m := RANK_FILE.match(f.name)))
        if not files:
            raise TraceError(str(p), "holds no router_trace_rank<r>.jsonl files")
        return files
    m = RANK_FILE.match(p.name)
    return [(int(m.group(1)) if m else None, p)]


def _read_records(fp: Path, file_rank: int | None):
    """Yield ``(where, step, block, mtp_idx, layer, rank, top_indices [n, k])`` of one file, checked."""
    try:
        fh = open(fp)
    except FileNotFoundError:
        raise TraceError(str(fp), "does not exist") from None
    with fh:
        for lineno, line in enumerate(fh, start=1):
            if not line.strip():
                continue
            where = f"{fp}:{lineno}"
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as exc:
                raise TraceError(where, f"is not valid JSON ({exc.msg})", line[:80]) from None
            if not isinstance(obj, dict):
                raise TraceError(where, "must be a JSON object", type(obj).__name__)
            unknown = sorted(set(obj) - _KNOWN)
            if unknown:
                raise TraceError(f"{where}.{unknown[0]}", "is not a key Megatron's router_trace writes; refusing to "
                                 f"guess what it means (known: {', '.join(_REQUIRED)}, mtp_idx, sidecar offsets)",
                                 unknown[0])
            missing = [k for k in _REQUIRED if k not in obj]
            if missing:
                raise TraceError(where, f"lacks {missing[0]!r} (keys: {sorted(obj)})", missing[0])
            ints = {k: obj[k] for k in ("step", "layer", "rank", "num_tokens", "topk")}
            if "mtp_idx" in obj:
                ints["mtp_idx"] = obj["mtp_idx"]
            for k, v in ints.items():
                if type(v) is not int or v < 0:  # 1.5 or true would be truncated silently
                    raise TraceError(f"{where}.{k}", f"must be an integer >= 0, got {v!r}", v)
            if obj["stage"] != "pre_dispatch":
                raise TraceError(f"{where}.stage", f"is {obj['stage']!r}; the writer records only 'pre_dispatch'",
                                 obj["stage"])
            block, mtp_idx = obj["block"], obj.get("mtp_idx")
            if block == "decoder":
                if mtp_idx is not None:
                    raise TraceError(f"{where}.mtp_idx", f"({mtp_idx}) on a decoder record", mtp_idx)
            elif block == "mtp":
                if mtp_idx is None:
                    raise TraceError(f"{where}.mtp_idx", "is missing on an MTP record (which MTP head?)")
            else:
                raise TraceError(f"{where}.block", f"is {block!r}; expected 'decoder' or 'mtp'", block)
            if file_rank is not None and obj["rank"] != file_rank:
                raise TraceError(f"{where}.rank", f"({obj['rank']}) differs from the file name's rank {file_rank}",
                                 obj["rank"])
            n, k = obj["num_tokens"], obj["topk"]
            ids = int_array(obj["top_indices"], f"{where}.top_indices", "top_indices")
            if n == 0 and ids.size == 0:
                ids = ids.reshape(0, k)
            if ids.shape != (n, k):
                raise TraceError(f"{where}.top_indices", f"has shape {list(ids.shape)}, but num_tokens={n} and "
                                 f"topk={k} say [{n}, {k}]", list(ids.shape))
            yield where, obj["step"], block, mtp_idx, obj["layer"], obj["rank"], ids


def import_megatron_jsonl(path, num_experts: int | None = None, **_) -> Trace:
    """Megatron-LM router trace: a ``router_trace_rank{r}.jsonl`` file or the directory of them."""
    p = Path(path)
    ps = str(p)
    recs = []
    for file_rank, fp in _files(p):
        recs.extend(_read_records(fp, file_rank))
    if not recs:
        raise TraceError(ps, "holds no router records")
    largest = max((int(r[6].max()) if r[6].size else -1) for r in recs)
    E, inferred = resolve_num_experts(num_experts, largest, ps)
    rank_map, source_ranks = dense_ranks((r[5] for r in recs), ps)
    topks = sorted({r[6].shape[1] for r in recs})
    layer_names: dict[str, str] = {}
    for where, _s, block, mtp_idx, layer, _r, _i in recs:
        if layer >= MTP_LAYER_BASE:
            raise TraceError(f"{where}.layer", f"({layer}) >= {MTP_LAYER_BASE}: MTP layer ids start there", layer)
        if block == "mtp":
            layer_names[str(MTP_LAYER_BASE * (mtp_idx + 1) + layer)] = f"mtp head {mtp_idx}, layer {layer}"
    seen: dict[tuple, int] = {}
    rows = RowBuilder()
    for _w, step, block, mtp_idx, layer, rank, ids in recs:
        key = (step, block, mtp_idx, layer, rank)
        mb = seen.get(key, 0)
        seen[key] = mb + 1
        lid = layer if block == "decoder" else MTP_LAYER_BASE * (mtp_idx + 1) + layer
        rows.add_counts(step, mb, lid, rank_map[rank], np.bincount(ids.ravel(), minlength=E))
    notes = []
    if layer_names:
        notes.append(f"MTP layers mapped to their own ids: {', '.join(f'{k} = {v}' for k, v in layer_names.items())}")
    if len(topks) > 1:
        notes.append(f"records disagree on topk {topks}; top_k left unknown")
    meta = TraceMeta(
        num_experts=E, num_ranks=len(rank_map), top_k=topks[0] if len(topks) == 1 and topks[0] > 0 else None,
        source="megatron-jsonl", inferred=["num_experts"] if inferred else [], description="; ".join(notes),
        extra={"layer_names": layer_names, "source_ranks": source_ranks, "num_experts_inferred": inferred},
    )
    return rows.finish(meta, ps)

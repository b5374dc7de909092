"""Peers' dumps, written here in exactly their writers' layouts (from the documented formats, issue 21),
imported and compared count by count; directories, multi-rank merges and refusals.

Each ``_write_*`` helper produces the files the writer produces (names, container, keys, dtypes, shapes)
and returns the counts it wrote, keyed ``(step, microbatch, layer, src_rank) -> [E]``, so a test compares
the imported trace cell by cell with what was written.
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

import numpy as np
import pytest

from ultraep.errors import TraceError
from ultraep.traces import Trace, load_trace


def _cells(trace: Trace) -> dict[tuple[int, int, int, int], np.ndarray]:
    """The trace as ``(step, microbatch, layer, src_rank) -> [E]`` counts."""
    out: dict = defaultdict(lambda: np.zeros(trace.meta.num_experts, dtype=np.int64))
    c = trace.columns
    for i in range(trace.num_rows):
        key = (int(c["step"][i]), int(c["microbatch"][i]), int(c["layer"][i]), int(c["src_rank"][i]))
        out[key][int(c["expert"][i])] += int(c["tokens"][i])
    return dict(out)


def _assert_same(trace: Trace, expected: dict) -> None:
    got = _cells(trace)
    want = {k: v for k, v in expected.items() if np.any(v)}
    assert sorted(got) == sorted(want)
    for k in want:
        assert got[k].tolist() == list(want[k]), k
    assert int(trace.columns["tokens"].sum()) == sum(int(v.sum()) for v in want.values())


# ---------------------------------------------------------------------------------------------- Megatron
def _megatron_record(step, block, layer, rank, ids, mtp_idx=None) -> dict:
    """One record as Megatron's RouterTracer writes it: keys in its order, top_indices [num_tokens][topk]."""
    rec = {"step": step, "stage": "pre_dispatch", "block": block, "layer": layer, "rank": rank,
           "num_tokens": int(ids.shape[0]), "topk": int(ids.shape[1])}
    if mtp_idx is not None:
        rec["mtp_idx"] = mtp_idx
    rec["top_indices"] = ids.tolist()
    return rec


def _write_megatron(d: Path, ranks=(0, 1), steps=2, microbatches=3, layers=(0, 1, 2), mtp_layers=(1,), E=8,
                    topk=2, tokens=16, seed=0) -> dict:
    """A training run traced with ``--moe-routing-trace-path d``: per rank, per step, per microbatch every
    decoder layer's router fires, then the MTP head 0 routers (whose ``layer`` repeats decoder numbers).
    Expected cells use MTP ids 1000 + layer (the importer's documented mapping)."""
    rng = np.random.default_rng(seed)
    d.mkdir(parents=True, exist_ok=True)
    expected: dict = {}
    for r in ranks:
        lines = []
        for step in range(steps):
            for mb in range(microbatches):
                for block, ls in (("decoder", layers), ("mtp", mtp_layers)):
                    for layer in ls:
                        ids = rng.integers(0, E, (tokens, topk))
                        lines.append(_megatron_record(step, block, layer, r, ids, 0 if block == "mtp" else None))
                        lid = layer if block == "decoder" else 1000 + layer
                        expected[(step, mb, lid, list(ranks).index(r))] = np.bincount(ids.ravel(), minlength=E)
        (d / f"router_trace_rank{r}.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    (d / "hidden_states_rank0.bin").write_bytes(b"\0" * 8)  # a sidecar the writer may leave beside the traces
    return expected


def test_megatron_mtp_records_are_their_own_layers(tmp_path):
    # Before the fix the MTP records of layer 1 were counted as extra microbatches of decoder layer 1:
    # 6 microbatches there instead of 3 and 4/3 of the tokens.
    expected = _write_megatron(tmp_path / "trace")
    tr = load_trace(tmp_path / "trace")  # the directory, detected by its router_trace_rank*.jsonl files
    assert tr.meta.source == "megatron-jsonl"
    assert tr.meta.num_ranks == 2 and tr.meta.num_experts == 8 and tr.meta.top_k == 2
    assert tr.meta.inferred == ["num_experts"]
    assert tr.layers.tolist() == [0, 1, 2, 1001]
    assert tr.meta.extra["layer_names"] == {"1001": "mtp head 0, layer 1"}
    _assert_same(tr, expected)
    decoder1 = tr.columns["layer"] == 1
    assert sorted(set(tr.columns["microbatch"][decoder1].tolist())) == [0, 1, 2]
    assert int(tr.columns["tokens"][decoder1].sum()) == 2 * 2 * 3 * 16 * 2  # ranks * steps * mbs * tokens * k
    info = tr.summary()
    assert info["inferred"] == ["num_experts"] and "1001 = mtp head 0, layer 1" in info["notes"]


def test_megatron_one_rank_file_and_options(tmp_path):
    expected = _write_megatron(tmp_path / "t", ranks=(3,), mtp_layers=())
    tr = load_trace(tmp_path / "t" / "router_trace_rank3.jsonl", num_experts=16)
    assert tr.meta.num_ranks == 1 and tr.meta.extra["source_ranks"] == [3]  # not 4 ranks with 3 empty
    assert tr.meta.num_experts == 16 and tr.meta.inferred == []
    _assert_same(tr, {k: np.pad(v, (0, 8)) for k, v in expected.items()})
    with pytest.raises(TraceError, match=r"expert id 7 >= num_experts 4"):
        load_trace(tmp_path / "t", num_experts=4)


@pytest.mark.parametrize("change, fragments", [
    (lambda r: r.update(stage="post_dispatch"), [".stage", "'post_dispatch'", "pre_dispatch"]),
    (lambda r: r.update(block="encoder"), [".block", "'encoder'"]),
    (lambda r: r.update(block="mtp"), [".mtp_idx", "missing on an MTP record"]),
    (lambda r: r.update(mtp_idx=0), [".mtp_idx", "decoder record"]),
    (lambda r: r.update(tokens_per_expert=[1, 2]), [".tokens_per_expert", "not a key"]),
    (lambda r: r.update(num_tokens=5), [".top_indices", "num_tokens=5"]),
    (lambda r: r.update(rank=1), [".rank", "file name's rank 0"]),
    (lambda r: r.pop("block"), ["lacks 'block'"]),
    (lambda r: r.update(layer=1000), [".layer", "(1000)"]),
    (lambda r: r.update(step=1.5), [".step", "1.5"]),
])
def test_megatron_refuses_what_the_writer_does_not_write(tmp_path, change, fragments):
    rec = _megatron_record(0, "decoder", 0, 0, np.array([[0, 1], [2, 3]]))
    change(rec)
    (tmp_path / "router_trace_rank0.jsonl").write_text(json.dumps(rec) + "\n")
    with pytest.raises(TraceError) as info:
        load_trace(tmp_path)
    msg = str(info.value)
    assert "\n" not in msg and "router_trace_rank0.jsonl:1" in msg
    for f in fragments:
        assert f in msg, (f, msg)


def test_megatron_huge_expert_id_is_refused_before_allocating(tmp_path):
    rec = _megatron_record(0, "decoder", 0, 0, np.array([[0, 2_000_000_000]]))
    (tmp_path / "router_trace_rank0.jsonl").write_text(json.dumps(rec) + "\n")
    with pytest.raises(TraceError, match=r"num_experts: \(2000000001, inferred .*exceeds"):
        load_trace(tmp_path)

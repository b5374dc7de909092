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

from ultraep.errors import TraceError, UltraEPError
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
    with pytest.raises(UltraEPError, match=r"num_experts \(inferred: largest expert id \+ 1.*\(2,000,000,001\) must be in 1\.\.16,777,216"):
        load_trace(tmp_path)


# ---------------------------------------------------------------------------------------------- SGLang
def _sglang_stat_dump(path: Path, passes: list[np.ndarray], buffer_size: int, new_writer: bool = True) -> np.ndarray:
    """``_StatAccumulator.dump``: a ring buffer of ``buffer_size`` rows ([L, E] int32 each, summed over ranks)
    that wraps; returns the ``[buffer, L, E]`` it holds, in the writer's (ring) order."""
    import torch

    L, E = passes[0].shape
    ring = np.zeros((buffer_size, L, E), dtype=np.int32)
    for i, counts in enumerate(passes):
        ring[i % buffer_size] = counts
    obj = {"rank": 0, "logical_count": torch.from_numpy(ring)}
    if new_writer:
        obj["average_utilization_rate_over_window"] = None
    torch.save(obj, path)
    return ring


def test_sglang_stat_dumps_with_a_wrapped_ring(tmp_path):
    rng = np.random.default_rng(1)
    passes = [rng.integers(0, 50, (3, 8)) for _ in range(7)]  # 7 forward passes into a ring of 5 rows
    ring = _sglang_stat_dump(tmp_path / "expert_distribution_recorder_1712345678.5.pt", passes, 5)
    tr = load_trace(tmp_path / "expert_distribution_recorder_1712345678.5.pt")
    assert tr.meta.source == "sglang-pt" and tr.meta.num_ranks is None and tr.meta.num_experts == 8
    _assert_same(tr, {(b, 0, layer, -1): ring[b, layer] for b in range(5) for layer in range(3)})
    # the older writer (no utilisation entry) and a second, later dump: the directory is one run, in time order
    ring2 = _sglang_stat_dump(tmp_path / "expert_distribution_recorder_1712345999.25.pt", passes[:2], 4, False)
    both = load_trace(tmp_path)
    expected = {(b, 0, layer, -1): ring[b, layer] for b in range(5) for layer in range(3)}
    expected.update({(5 + b, 0, layer, -1): ring2[b, layer] for b in range(2) for layer in range(3)})
    _assert_same(both, expected)


def test_sglang_pt_refusals(tmp_path):
    import torch

    torch.save({"logical_count": torch.ones(1, 2, 4, dtype=torch.int32), "physical_count": 1}, tmp_path / "a.pt")
    with pytest.raises(TraceError, match=r"a.pt:physical_count: is not a key SGLang's stat dump writes"):
        load_trace(tmp_path / "a.pt")
    torch.save({"logical_count": torch.ones(2, 4, dtype=torch.int32)}, tmp_path / "b.pt")
    with pytest.raises(TraceError, match=r"must be \[buffer, layers, experts\], got shape \(2, 4\)"):
        load_trace(tmp_path / "b.pt")
    torch.save({"logical_count": torch.zeros(1, 2, 2), "x": _Gadget()}, tmp_path / "evil.pt")
    with pytest.raises(TraceError, match="weights_only=True"):
        load_trace(tmp_path / "evil.pt")


class _Gadget:  # an arbitrary class: weights_only loading must refuse it
    pass


def _sglang_detail_dumps(d: Path, mode: str, ranks=(0, 1), passes=(3, 4, 5), L=2, topk=2, tokens=6, seed=0):
    """``_DetailAccumulator.dump`` of every rank: per forward pass ``global_physical_count [L, P]`` over
    physical slots (6 slots for 4 logical experts: slots 4, 5 replicate experts 0, 1); ``per_token`` adds the
    top-k slot ids padded to 8 with -1. Returns logical counts per (pass, layer, rank)."""
    import torch

    rng = np.random.default_rng(seed)
    p2l = torch.tensor([[0, 1, 2, 3, 0, 1]] * L, dtype=torch.int64)
    d.mkdir(parents=True, exist_ok=True)
    expected = {}
    for r in ranks:
        records = []
        for fid in passes:
            ids = np.full((L, tokens, 8), -1, dtype=np.int32)
            ids[:, :, :topk] = rng.integers(0, 6, (L, tokens, topk))
            phys = np.stack([np.bincount(ids[layer][ids[layer] >= 0], minlength=6) for layer in range(L)])
            rec = dict(forward_pass_id=fid, rank=r, gatherer_key="primary",
                       global_physical_count=torch.from_numpy(phys.astype(np.int32)))
            if mode == "per_token":
                rec = dict(forward_pass_id=fid, rank=r, gatherer_key="primary", input_ids=[1] * tokens,
                           positions=list(range(tokens)), extend_seq_lens=[tokens], forward_mode=1,
                           topk_ids_of_layer=torch.from_numpy(ids), misc_objects=[],
                           global_physical_count=torch.from_numpy(phys.astype(np.int32)))
            records.append(rec)
            for layer in range(L):
                expected[(fid, layer, r)] = np.bincount(p2l[layer].numpy(), weights=phys[layer], minlength=4)
        torch.save(dict(records=records, last_physical_to_logical_map=p2l),
                   d / f"expert_distribution_recorder_1712345678.{r}5_{r}.pt")
    return expected


def test_sglang_per_pass_and_per_token_dumps(tmp_path):
    logical = _sglang_detail_dumps(tmp_path / "pp", "per_pass")
    tr = load_trace(tmp_path / "pp")  # per-rank files, detected by name and merged
    assert tr.meta.num_experts == 4 and tr.meta.extra["mode"] == "per_pass" and tr.meta.num_ranks is None
    summed: dict = {}
    for (fid, layer, _r), v in logical.items():
        summed[(fid, 0, layer, -1)] = summed.get((fid, 0, layer, -1), 0) + v
    _assert_same(tr, summed)
    by_rank = load_trace(tmp_path / "pp", per_source=True)
    _assert_same(by_rank, {(f, 0, layer, r): v for (f, layer, r), v in logical.items()})
    logical = _sglang_detail_dumps(tmp_path / "pt", "per_token", ranks=(2, 5))
    tok = load_trace(tmp_path / "pt")
    assert tok.meta.extra["mode"] == "per_token" and tok.meta.num_ranks == 2
    assert tok.meta.extra["source_ranks"] == [2, 5]
    _assert_same(tok, {(f, 0, layer, [2, 5].index(r)): v for (f, layer, r), v in logical.items()})


def test_sglang_per_token_counts_must_match_the_ids(tmp_path):
    import torch

    _sglang_detail_dumps(tmp_path, "per_token", ranks=(0,))
    f = next(tmp_path.glob("*.pt"))
    obj = torch.load(f, weights_only=True)
    obj["records"][1]["global_physical_count"][0, 0] += 1
    torch.save(obj, f)
    with pytest.raises(TraceError, match=r"records\[1\].global_physical_count\[0\]: differs from the counts"):
        load_trace(f)


def _sglang_csv_dumps(d: Path, ranks=(0, 1, 2), dumps=2, L=3, E=16, seed=0) -> dict:
    """``dump_record`` of the older recorder: per rank and dump one CSV of the experts its tokens hit."""
    rng = np.random.default_rng(seed)
    d.mkdir(parents=True, exist_ok=True)
    expected = {}
    for r in ranks:
        for k in range(dumps):
            lines = ["layer_id,expert_id,count"]
            for layer in range(L):
                ids = rng.integers(0, E - 1, 40)  # expert E-1 is never hit: num_experts is inferred as E-1
                c = np.bincount(ids, minlength=E)
                expected[(k, 0, layer, list(ranks).index(r))] = c[:E - 1]
                lines += [f"{layer},{e},{c[e]}" for e in np.flatnonzero(c)]
            (d / f"expert_distribution_rank{r}_timestamp{1712345678.25 + 10 * k + r}.csv").write_text(
                "\n".join(lines) + "\n")
    return expected


def test_sglang_per_rank_csvs_merge_with_their_source_ranks(tmp_path):
    expected = _sglang_csv_dumps(tmp_path / "run")
    tr = load_trace(tmp_path / "run")
    assert tr.meta.source == "sglang-csv" and tr.meta.num_ranks == 3 and tr.meta.num_experts == 15
    assert tr.meta.inferred == ["num_experts"]
    _assert_same(tr, expected)
    one = load_trace(next((tmp_path / "run").glob("expert_distribution_rank1_*.csv")), num_experts=16)
    assert one.meta.num_ranks == 1 and one.meta.extra["source_ranks"] == [1] and one.meta.inferred == []
    (tmp_path / "run" / "expert_distribution_rank2_timestamp1712349999.0.csv").write_text("layer_id,expert_id,count\n")
    with pytest.raises(TraceError, match=r"different numbers of dumps \{0: 2, 1: 2, 2: 3\}"):
        load_trace(tmp_path / "run")
    bad = tmp_path / "expert_distribution_rank0_timestamp1.0.csv"
    bad.write_text("layer_id,expert_id,count\nUNKNOWN,3,4\n")  # set_current_layer never called
    with pytest.raises(TraceError, match=r"timestamp1.0.csv:2: expected integers.*UNKNOWN"):
        load_trace(bad)


# ---------------------------------------------------------------------------------------------- UltraEP
def _ultraep_profile(d: Path, records: int = 10, flush: int = 4, E: int = 8, R: int = 2, N: int = 1,
                     layers=(1, 2), max_mb: int = 2, closed: bool = True, dropped: int = 0, seed: int = 0) -> dict:
    """``ExpertLoadProfiler`` of one EP group: chunks of ``flush`` records ([n, E] global logical loads before
    rerouting, [n, R*(E/R+N)] physical after, same totals), manifest with ``chunks`` rewritten at close."""
    rng = np.random.default_rng(seed)
    d.mkdir(parents=True, exist_ok=True)
    meta = {"ep_group_id": "7f00", "ep_rank": 0, "ep_size": R, "num_layers": max(layers), "max_microbatches": max_mb,
            "num_local_master_experts": E // R, "num_local_redundant_experts": N,
            "num_local_physical_experts": E // R + N, "num_global_logical_experts": E,
            "num_global_physical_experts": R * (E // R + N), "nvl_domain_size": R, "placement_mode": "quota"}
    tid = "epg7f00_gr0_r0_1712345678000"
    man = {**meta, "trace_id": tid, "schema": "ultra_ep_trace_v1", "created_unix": 1712345678.0,
           "writer_group_rank": 0, "max_pending_records": 16, "record_interval": 1, "flush_interval": flush}
    counters = {layer: 0 for layer in layers}
    recs, expected = [], {}
    for i in range(records):
        layer = layers[i % len(layers)]
        mb = counters[layer]
        counters[layer] += 1
        pre = rng.integers(0, 30, E)
        post = np.zeros(R * (E // R + N), dtype=np.int64)
        post[: E] = pre  # any split with the same total: the importer only checks the totals
        recs.append((layer, layer * max_mb + mb % max_mb, mb, pre, post))
        expected[(mb, 0, layer, -1)] = pre
    chunk_ids = range((records + flush - 1) // flush)
    for k in chunk_ids:
        part = recs[k * flush:(k + 1) * flush]
        cmeta = {**man, "chunk_id": k, "records": len(part), "dropped_records": dropped}
        with open(d / f"{tid}.chunk{k:06d}.npz", "wb") as fh:
            np.savez(fh, metadata=np.asarray(json.dumps(cmeta, separators=(",", ":"))),
                     layers=np.asarray([r[0] for r in part], np.int32),
                     virtual_layers=np.asarray([r[1] for r in part], np.int32),
                     microbatches=np.asarray([r[2] for r in part], np.int64),
                     pre_logical_loads=np.stack([r[3] for r in part]).astype(np.int32),
                     post_physical_loads=np.stack([r[4] for r in part]).astype(np.int32))
    (d / f"{tid}.manifest.json").write_text(json.dumps(
        {**man, "chunks": len(chunk_ids) if closed else 0, "dropped_records": dropped}, indent=2, sort_keys=True))
    return expected


def test_ultraep_profile_manifest_chunks_and_directory(tmp_path):
    expected = _ultraep_profile(tmp_path / "ultra_ep_traces", dropped=3)
    d = tmp_path / "ultra_ep_traces"
    for src in (d, next(d.glob("*.manifest.json")), next(d.glob("*.chunk000001.npz"))):
        tr = load_trace(src)
        assert tr.meta.source == "ultraep-npz" and tr.meta.num_experts == 8 and tr.meta.num_ranks is None
        assert tr.meta.extra["ep_size"] == 2 and tr.meta.extra["dropped_records"] == 3
        assert "3 records dropped" in tr.summary()["notes"]
        _assert_same(tr, expected)
    folded = load_trace(d, microbatches_per_step=2)
    _assert_same(folded, {(mb // 2, mb % 2, layer, -1): v for (mb, _, layer, _s), v in expected.items()})


def test_ultraep_profile_refusals(tmp_path):
    _ultraep_profile(tmp_path / "open", closed=False)
    with pytest.raises(TraceError, match=r"chunks: is 0 but 3 chunk files lie beside it.*chunks=3"):
        load_trace(tmp_path / "open")
    assert load_trace(tmp_path / "open", chunks=3).num_rows > 0
    _ultraep_profile(tmp_path / "two", seed=1)
    _ultraep_profile(tmp_path / "two2", seed=2)
    for f in (tmp_path / "two2").iterdir():  # a second EP group's files in the same directory
        f.rename(tmp_path / "two" / f.name.replace("epg7f00", "epg7f01"))
    with pytest.raises(TraceError, match=r"holds 2 UltraEP manifests.*trace_id="):
        load_trace(tmp_path / "two")
    assert load_trace(tmp_path / "two", trace_id="epg7f00_gr0_r0_1712345678000").num_rows > 0
    _ultraep_profile(tmp_path / "bad")
    f = next((tmp_path / "bad").glob("*.chunk000000.npz"))
    with np.load(f) as z:
        arrays = dict(z)
    arrays["post_physical_loads"][1, 0] += 1
    np.savez(f, **arrays)
    with pytest.raises(TraceError, match=r"chunk000000.npz:records\[1\]: pre-reroute total .* != post-reroute"):
        load_trace(tmp_path / "bad")
    arrays["post_physical_loads"][1, 0] -= 1
    arrays["virtual_layers"][0] = 99
    np.savez(f, **arrays)
    with pytest.raises(TraceError, match=r"virtual_layers\[0\]: \(99\) is not a slot of layer 1"):
        load_trace(tmp_path / "bad")
    np.savez(f, **{**arrays, "load_before": arrays["pre_logical_loads"]})
    with pytest.raises(TraceError, match=r"chunk000000.npz:load_before: is not an array UltraEP's profiler writes"):
        load_trace(tmp_path / "bad")


# ---------------------------------------------------------------------------------------------- TensorRT-LLM
def _trtllm_dump(d: Path, ranks=(0, 1), iters=(10, 11), layers=(0, 1), E=8, k=2, tokens=12, dispatch=False,
                 seed=0) -> dict:
    """``ExpertStatistic``: per rank a safetensors of int64 [E] bincounts named "{iter}_{layer}" (two calls per
    iteration and layer, summed); rank 0 writes meta_info.json; the dispatch variant adds numtokens files."""
    from ultraep.traces.importers import write_safetensors

    rng = np.random.default_rng(seed)
    d.mkdir(parents=True, exist_ok=True)
    expected = {}
    for r in ranks:
        tensors, ntok = {}, {}
        for it in iters:
            for layer in layers:
                sel = rng.integers(0, E, (2 * tokens, k))  # two microbatches of `tokens` tokens
                tensors[f"{it}_{layer}"] = np.bincount(sel.ravel(), minlength=E).astype(np.int64)
                ntok[f"{it}_{layer}"] = 2 * tokens
                expected[(it, 0, layer, list(ranks).index(r))] = tensors[f"{it}_{layer}"]
        write_safetensors(d / f"rank{r}.safetensors", tensors)
        if dispatch:
            (d / f"rank{r}_numtokens.json").write_text(json.dumps(ntok))
    meta = {"num_experts": E, "num_experts_per_token": k}
    if dispatch:
        meta.update(ep_size=len(ranks), experts_per_rank=E // len(ranks))
    (d / "meta_info.json").write_text(json.dumps(meta))
    return expected


def test_trtllm_both_writer_versions(tmp_path):
    expected = _trtllm_dump(tmp_path / "stat")
    tr = load_trace(tmp_path / "stat")
    assert tr.meta.source == "trtllm" and tr.meta.num_ranks == 2 and tr.meta.top_k == 2 and tr.meta.inferred == []
    _assert_same(tr, expected)
    expected = _trtllm_dump(tmp_path / "disp", dispatch=True, seed=1)
    _assert_same(load_trace(tmp_path / "disp"), expected)
    (tmp_path / "disp" / "rank1_numtokens.json").write_text(json.dumps({"10_0": 1}))
    with pytest.raises(TraceError, match=r"rank1.safetensors:10_0: sums to 48, but rank1_numtokens.json gives 1"):
        load_trace(tmp_path / "disp")
    (tmp_path / "stat" / "meta_info.json").write_text(json.dumps({"num_experts": 8, "topk": 2}))
    with pytest.raises(TraceError, match=r"meta_info.json.topk: is not a key TensorRT-LLM writes"):
        load_trace(tmp_path / "stat")


# ---------------------------------------------------------------------------------------------- OLMoE
def _olmoe_outputs(root: Path, model="olmoe", kind="expert_counts", E=64, k=8, tokens=64, seed=0) -> dict:
    """``run_routing_analysis.py``: per domain ``pickle.dump([Counter, Counter, Counter])`` of the expert ids
    (numpy int64, from argsort) picked in layers 0, 7, 15, under ``routing_output/{model}/{kind}/``."""
    import pickle
    from collections import Counter

    rng = np.random.default_rng(seed)
    d = root / "routing_output" / model / kind
    d.mkdir(parents=True, exist_ok=True)
    expected = {}
    for step, domain in enumerate(("github", "arxiv", "c4", "book", "wikipedia")):
        counters = []
        for layer in (0, 7, 15):
            logits = rng.normal(size=(tokens, 16, E))
            exp_ids = np.stack([np.argsort(-lg, -1)[:, :k].tolist() for lg in logits.transpose(1, 0, 2)], -1)
            counters.append(Counter(exp_ids[:, :, 0].flatten()))  # keys: numpy.int64, as the writer's
            expected[(step, 0, layer, -1)] = np.bincount(exp_ids[:, :, 0].ravel(), minlength=E)
        with open(d / f"{domain}.pkl", "wb") as f:
            pickle.dump(counters, f)
    return expected


def test_olmoe_pickles_file_directory_and_model_dir(tmp_path):
    expected = _olmoe_outputs(tmp_path)
    kind_dir = tmp_path / "routing_output" / "olmoe" / "expert_counts"
    tr = load_trace(kind_dir)  # detected by its .pkl files; domains in the writer's order
    assert tr.meta.source == "olmoe" and tr.meta.model == "olmoe" and tr.meta.top_k == 8 and tr.meta.num_experts == 64
    assert tr.meta.extra["domains"] == ["github", "arxiv", "c4", "book", "wikipedia"] and tr.meta.inferred == []
    _assert_same(tr, expected)
    _assert_same(load_trace(kind_dir.parent), expected)  # the model directory
    one = load_trace(kind_dir / "c4.pkl")
    _assert_same(one, {(0, 0, layer, -1): v for (s, _, layer, _r), v in expected.items() if s == 2})
    top1 = _olmoe_outputs(tmp_path / "m", model="mistral", kind="expert_counts_top1", E=8, k=1, seed=3)
    mis = load_trace(tmp_path / "m" / "routing_output" / "mistral" / "expert_counts_top1", domains=["c4", "book"])
    assert mis.meta.num_experts == 8 and mis.meta.top_k == 1
    _assert_same(mis, {(s - 2, 0, layer, -1): v for (s, _, layer, _r), v in top1.items() if s in (2, 3)})


def test_olmoe_malicious_and_foreign_pickles_are_refused(tmp_path):
    import pickle
    from collections import Counter, defaultdict

    from ultraep.cli import main

    marker = tmp_path / "pwned"
    # protocol-0 opcodes for [open(marker, "w")]: unpickling it creates the marker file
    (tmp_path / "evil.pkl").write_bytes(f"(lp0\ncbuiltins\nopen\n(V{marker}\nVw\ntRa.".encode())
    with pytest.raises(TraceError, match=r"evil.pkl: is not an OLMoE counts pickle: refusing to load global "
                       r"builtins\.open"):
        load_trace(tmp_path / "evil.pkl")
    assert main(["trace", "info", str(tmp_path / "evil.pkl")]) == 2
    assert not marker.exists()
    pickle.loads((tmp_path / "evil.pkl").read_bytes())[0].close()  # the payload is live
    assert marker.exists()
    (tmp_path / "cross.pkl").write_bytes(pickle.dumps([Counter({(np.int64(1), np.int64(2)): 3})] * 3))
    with pytest.raises(TraceError, match=r"cross.pkl\[0\]: maps \(1, 2\) -> 3"):
        load_trace(tmp_path / "cross.pkl")
    (tmp_path / "eid.pkl").write_bytes(pickle.dumps([defaultdict(Counter)] * 3))
    with pytest.raises(TraceError, match=r"refusing to load global collections.defaultdict"):
        load_trace(tmp_path / "eid.pkl")
    (tmp_path / "f.pkl").write_bytes(pickle.dumps([Counter({np.float64(1.0): 3})] * 3))
    with pytest.raises(TraceError, match=r"numpy dtype 'f8' is not an integer type"):
        load_trace(tmp_path / "f.pkl")


# ---------------------------------------------------------------------------------------------- canonical
def test_plain_parquet_and_csv_infer_the_metadata(tmp_path):
    import duckdb

    from ultraep.cli import main

    con = duckdb.connect()
    con.execute(f"""COPY (SELECT (i // 6)::INT AS step, 0 AS microbatch, (i % 2)::INT AS layer,
                   (i % 3)::INT AS src_rank, (i % 5)::INT AS expert, (10 + i)::BIGINT AS tokens
                   FROM range(24) t(i)) TO '{tmp_path / "t.parquet"}' (FORMAT PARQUET)""")
    tr = load_trace(tmp_path / "t.parquet")
    assert tr.meta.num_experts == 5 and tr.meta.num_ranks == 3 and tr.meta.top_k is None
    assert tr.meta.inferred == ["num_experts", "top_k", "num_ranks"]
    assert int(tr.columns["tokens"].sum()) == sum(range(10, 34))
    fixed = load_trace(tmp_path / "t.parquet", num_experts=8, top_k=2)
    assert fixed.meta.num_experts == 8 and fixed.meta.top_k == 2 and fixed.meta.inferred == ["num_ranks"]
    with pytest.raises(TraceError, match=r"src_rank\[2\].*outside -1..1"):
        load_trace(tmp_path / "t.parquet", num_ranks=2)
    con.execute(f"COPY (SELECT * FROM '{tmp_path / 't.parquet'}') TO '{tmp_path / 't.csv'}' (HEADER)")
    csv_tr = load_trace(tmp_path / "t.csv")  # told apart from SGLang's CSV by its header
    assert csv_tr.meta.source == "csv" and csv_tr.num_rows == 24 and csv_tr.meta.num_experts == 5
    assert main(["trace", "info", str(tmp_path / "t.csv"), "--trace-opt", "num_experts=64"]) == 0
    con.execute(f"COPY (SELECT *, 1 AS extra FROM '{tmp_path / 't.parquet'}') TO '{tmp_path / 'x.parquet'}'")
    with pytest.raises(TraceError, match=r"x.parquet.extra: is not a trace column"):
        load_trace(tmp_path / "x.parquet")


def test_trace_info_says_what_was_inferred(tmp_path, capsys):
    from ultraep.cli import main

    _write_megatron(tmp_path / "m", ranks=(0,), steps=1, microbatches=1)
    assert main(["trace", "info", str(tmp_path / "m")]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["inferred"] == ["num_experts"] and info["layer_names"] == {"1001": "mtp head 0, layer 1"}
    assert info["source"] == "megatron-jsonl" and info["num_ranks"] == 1


@pytest.mark.parametrize("header", [b"1", b"[]", b'"x"',
                                    b'{"a": {"dtype": "F32", "shape": ["x"], "data_offsets": [0, 4]}}',
                                    b'{"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, "4"]}}',
                                    b'{"a": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 4]}}'])
def test_a_safetensors_header_of_the_wrong_shape_is_refused_in_one_line(tmp_path, header):
    """Valid JSON that is not a header (a number, a list; shapes or offsets that are not non-negative integers)
    is a TraceError naming the file, never an AttributeError or TypeError from inside the reader."""
    import struct

    from ultraep.traces.importers import read_safetensors

    p = tmp_path / "rank0.safetensors"
    p.write_bytes(struct.pack("<Q", len(header)) + header + b"\0" * 4)
    with pytest.raises(TraceError, match="rank0.safetensors"):
        read_safetensors(p)

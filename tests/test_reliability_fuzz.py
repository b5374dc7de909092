"""Fuzzing (hypothesis) of the planners and the trace importers, on a bounded budget (< 30 s in all).

Planners (all six policies, including FEPLB, HybridEP and adaptive, which ``test_planners.py`` does not
cover): random EP groups (domains, explicit home mappings), random load *sequences* planned and committed
in order (so history takes part), loads up to the int64-safe bound. Every plan satisfies ``Plan.check``,
conserves tokens exactly and is reproduced bit-for-bit by planning the same load again.

Importers: random bytes and mutations (truncation, bit flips, spliced garbage) of valid files of every
format, plus random JSON documents for the JSON-based formats. ``load_trace`` must either return a trace
or raise a user error (``TraceError``/``LoadError``) — never another exception, never a hang — and a
returned trace must replay into valid loads.
"""

from __future__ import annotations

import json
import shutil
import struct
import tempfile
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ultraep.errors import UltraEPError
from ultraep.load import MAX_EXPERT_LOAD, validate_load
from ultraep.topology import Topology

POLICIES = ["none", "quota", "eplb", "feplb", "hybridep", "adaptive"]
FAST = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])


# --------------------------------------------------------------------------------------------- planners
@st.composite
def groups(draw):
    R = draw(st.sampled_from([1, 2, 4, 6, 8]))
    M = draw(st.integers(1, 3))
    E = R * M
    D = draw(st.sampled_from([d for d in range(1, R + 1) if R % d == 0]))
    home = None
    if draw(st.booleans()) and R > 1:  # explicit home mapping: a random permutation of the contiguous one
        perm = draw(st.permutations(list(range(E))))
        home = tuple(int(e // M) for e in perm)
    N = draw(st.integers(0, min(3, (D - 1) * M)))
    return Topology(num_ranks=R, num_experts=E, num_redundant_slots=N, domain_size=D, home=home,
                    expert_bytes=draw(st.sampled_from([0, 4096, 1 << 26])))


@st.composite
def load_sequences(draw, topo):
    R, E = topo.num_ranks, topo.num_experts
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    seq = []
    for _ in range(draw(st.integers(1, 4))):
        kind = draw(st.sampled_from(["uniform", "skewed", "sparse", "zeros", "one_hot", "huge"]))
        if kind == "zeros":
            load = np.zeros((R, E), np.int64)
        elif kind == "one_hot":
            load = np.zeros((R, E), np.int64)
            load[:, draw(st.integers(0, E - 1))] = rng.integers(0, 10_000, size=R)
        elif kind == "sparse":
            load = rng.integers(0, 100, size=(R, E)) * (rng.random((R, E)) < 0.15)
        elif kind == "huge":  # every expert's total just under the bound the exact split can hold
            w = rng.random((R, E)) + 1e-3
            load = np.floor(w / w.sum(axis=0) * MAX_EXPERT_LOAD)
        elif kind == "skewed":
            w = rng.pareto(0.8, size=E) + 1e-3
            load = rng.multinomial(int(rng.integers(1, 50_000)), w / w.sum(), size=R)
        else:
            load = rng.integers(0, 2000, size=(R, E))
        seq.append(np.ascontiguousarray(load, dtype=np.int64))
    return seq


@st.composite
def planner_cases(draw):
    topo = draw(groups())
    return topo, draw(load_sequences(topo))


@pytest.mark.parametrize("policy", POLICIES)
@settings(max_examples=25, **FAST)
@given(case=planner_cases())
def test_fuzz_planners_keep_every_invariant(policy, case):
    from ultraep.policies import make_policy

    topo, seq = case
    pol = make_policy(policy)
    for load in seq:
        plan = pol.plan(load, topo)
        plan.check()
        assert int(plan.rank_load_after_R.sum()) == int(load.sum())
        np.testing.assert_array_equal(plan.routes_RRS.sum(axis=(1, 2)), load.sum(axis=1))
        assert (plan.quota_RS >= 0).all() and plan.num_replicas <= topo.num_ranks * topo.num_redundant_slots
        assert pol.plan(load, topo).digest() == plan.digest()  # same input, same plan (read-only planning)
        pol.commit(plan)


@settings(max_examples=150, deadline=None)
@given(arr=st.one_of(
    st.lists(st.lists(st.integers(-5, 2**40), min_size=1, max_size=4), min_size=1, max_size=4),
    st.lists(st.lists(st.floats(allow_nan=True, allow_infinity=True), min_size=1, max_size=3), min_size=1, max_size=3),
    st.lists(st.integers(0, 9), max_size=5),
    st.text(max_size=5), st.none(), st.booleans(),
))
def test_fuzz_validate_load_returns_int64_or_a_load_error(arr):
    try:
        out = validate_load(arr)
    except UltraEPError as exc:
        assert str(exc).startswith("load")
        return
    assert out.dtype == np.int64 and out.ndim == 2 and (out >= 0).all()
    assert out.sum(axis=0).max() <= MAX_EXPERT_LOAD


# --------------------------------------------------------------------------------------------- importers
def _seeds(d: Path) -> dict[str, Path]:
    """One small valid file (or directory) per format."""
    import torch

    from ultraep.traces import Trace, TraceMeta
    from ultraep.traces.importers import write_safetensors

    out = {}
    counts = np.random.default_rng(0).integers(0, 9, (2, 2, 2, 4))
    out["parquet"] = Trace.from_rank_counts(counts, TraceMeta(num_experts=4, num_ranks=2)).write(d / "t.parquet")
    torch.save({"logical_count": torch.arange(24).reshape(2, 3, 4)}, d / "s.pt")
    out["sglang-pt"] = d / "s.pt"
    (d / "s.csv").write_text("layer_id,expert_id,count\n0,0,5\n0,3,2\n1,1,7\n")
    out["sglang-csv"] = d / "s.csv"
    rec = {"step": 0, "stage": "pre_dispatch", "block": "decoder", "layer": 0, "rank": 0, "num_tokens": 2,
           "topk": 2, "top_indices": [[0, 1], [2, 3]]}  # Megatron router_trace's keys
    (d / "m.jsonl").write_text(json.dumps(rec) + "\n" + json.dumps({**rec, "block": "mtp", "mtp_idx": 0}) + "\n")
    out["megatron-jsonl"] = d / "m.jsonl"
    np.savez(d / "u.chunk000000.npz", metadata=np.asarray("{}"), layers=np.array([1, 2], np.int32),  # UltraEP's
             virtual_layers=np.array([1, 2], np.int32), microbatches=np.array([0, 0], np.int64),  # profiler layout
             pre_logical_loads=np.ones((2, 4), np.int32), post_physical_loads=np.eye(2, 6, dtype=np.int32) * 4)
    (d / "u.manifest.json").write_text(json.dumps({"schema": "ultra_ep_trace_v1", "trace_id": "u", "chunks": 1,
                                                   "ep_size": 2, "num_global_logical_experts": 4,
                                                   "max_microbatches": 1}))
    out["ultraep-npz"] = d / "u.manifest.json"
    (d / "trt").mkdir()
    write_safetensors(d / "trt" / "rank0.safetensors", {"0_0": np.arange(4, dtype=np.int32),
                                                        "1_2": np.ones(4, dtype=np.int64)})
    out["trtllm"] = d / "trt" / "rank0.safetensors"
    (d / "o.json").write_text(json.dumps({"layers": [0, 7], "data": {"olmoe": {"expert_counts": {
        "c4": [[1, 2, 3, 4], [4, 3, 2, 1]], "github": [[0, 0, 9, 1], [1, 1, 1, 1]]}}}}))
    out["olmoe"] = d / "o.json"
    return out


@pytest.fixture(scope="module")
def seeds():
    d = Path(tempfile.mkdtemp(prefix="ultraep-fuzz-"))
    try:
        yield d, _seeds(d)
    finally:
        shutil.rmtree(d, ignore_errors=True)


def _mutate(data: bytes, ops) -> bytes:
    b = bytearray(data)
    for kind, pos, val in ops:
        if not b:
            b = bytearray(bytes([val]))
            continue
        i = pos % len(b)
        if kind == "flip":
            b[i] ^= 1 << (val % 8)
        elif kind == "set":
            b[i] = val
        elif kind == "cut":
            del b[i:]
        elif kind == "insert":
            b[i:i] = bytes([val]) * (1 + val % 7)
    return bytes(b)


def _load_and_replay(path: Path, fmt: str) -> None:
    from ultraep.traces import load_trace

    try:
        tr = load_trace(path, fmt)
    except UltraEPError:
        return  # a user error naming the file: fine
    ranks = tr.meta.num_ranks or 2
    try:
        for layer in tr.layers[:2]:
            for _, _, load in tr.layer_loads(int(layer), ranks, max_points=3):
                assert load.dtype == np.int64 and (load >= 0).all()
    except UltraEPError:
        return  # e.g. counts beyond what a plan can take: refused at replay, naming layer and step


mutations = st.lists(st.tuples(st.sampled_from(["flip", "set", "cut", "insert"]), st.integers(0, 1 << 20),
                               st.integers(0, 255)), min_size=1, max_size=6)


@pytest.mark.parametrize("fmt", ["parquet", "sglang-pt", "sglang-csv", "megatron-jsonl", "ultraep-npz", "trtllm", "olmoe"])
@settings(max_examples=30, **FAST)
@given(ops=mutations)
def test_fuzz_importers_on_mutated_files(seeds, fmt, ops):
    d, files = seeds
    src = files[fmt]
    if fmt == "ultraep-npz":  # mutate the chunk; the manifest stays valid
        src = d / "u.chunk000000.npz"
    work = Path(tempfile.mkdtemp(dir=d))
    try:
        if fmt == "trtllm":
            target = work / "rank0.safetensors"
        elif fmt == "ultraep-npz":
            shutil.copy(files[fmt], work / "u.manifest.json")
            target = work / "u.chunk000000.npz"
        else:
            target = work / src.name
        target.write_bytes(_mutate(src.read_bytes(), ops))
        path = work / "u.manifest.json" if fmt == "ultraep-npz" else (work if fmt == "trtllm" else target)
        _load_and_replay(path, fmt)
    finally:
        shutil.rmtree(work, ignore_errors=True)


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-3, 300) | st.floats(allow_nan=False, width=32) | st.text(max_size=4),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(
        st.sampled_from(["step", "layer", "rank", "top_indices", "tokens_per_expert", "data", "layers", "olmoe",
                         "expert_counts", "c4", "schema", "chunks", "num_experts", "x"]), inner, max_size=5),
    max_leaves=12)


@settings(max_examples=120, **FAST)
@given(docs=st.lists(json_values, min_size=1, max_size=3), fmt=st.sampled_from(["megatron-jsonl", "olmoe", "ultraep-npz"]))
def test_fuzz_importers_on_random_json(seeds, docs, fmt):
    d, _ = seeds
    work = Path(tempfile.mkdtemp(dir=d))
    try:
        if fmt == "megatron-jsonl":
            path = work / "r.jsonl"
            path.write_text("".join(json.dumps(x) + "\n" for x in docs))
        elif fmt == "olmoe":
            path = work / "r.json"
            path.write_text(json.dumps(docs[0]))
        else:
            path = work / "r.manifest.json"
            doc = docs[0] if not isinstance(docs[0], dict) else {"schema": "ultra_ep_trace_v1", **docs[0]}
            path.write_text(json.dumps(doc))
        _load_and_replay(path, fmt)
    finally:
        shutil.rmtree(work, ignore_errors=True)


@settings(max_examples=60, **FAST)
@given(header=st.binary(max_size=64), length=st.integers(0, 1 << 62) | st.integers(0, 80), tail=st.binary(max_size=64))
def test_fuzz_safetensors_headers(seeds, header, length, tail):
    from ultraep.traces.importers import read_safetensors

    d, _ = seeds
    p = Path(tempfile.mkdtemp(dir=d)) / "rank0.safetensors"
    p.write_bytes(struct.pack("<Q", length) + header + tail)
    try:
        read_safetensors(p)
    except UltraEPError:
        pass
    finally:
        shutil.rmtree(p.parent, ignore_errors=True)

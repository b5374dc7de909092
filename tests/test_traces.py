"""Traces: canonical Parquet round trip, every importer on a small file in its format, synthetic generators."""

import json
import time

import numpy as np
import pytest

from shared_data import shared_path
from ultraep.errors import TraceError
from ultraep.plan.metrics import imbalance
from ultraep.traces import Trace, TraceMeta, load_trace, remap_sources, spread_even
from ultraep.traces.importers import read_safetensors, write_safetensors
from ultraep.traces.synthetic import SyntheticSpec, synthetic_trace

OLMOE = shared_path("data", "OLMoE", "expert_counts.json")


def _loads(trace, layer, R):
    return [load for _, _, load in trace.layer_loads(layer, R)]


# ---------------------------------------------------------------------------------------------- format
def test_spread_even_and_remap_sources():
    c = np.array([10, 3, 0, 7])
    s = spread_even(c, 4)
    assert s.sum(axis=0).tolist() == [10, 3, 0, 7]
    # expert 1 (3 tokens): one token each to ranks (1 + j) mod 4, j < 3 -> ranks 1, 2, 3
    assert s[:, 1].tolist() == [0, 1, 1, 1]
    assert s.max() - s.min() <= 3
    src = np.arange(8 * 2).reshape(8, 2)
    assert remap_sources(src, 4).tolist() == [[2, 4], [10, 12], [18, 20], [26, 28]]
    assert remap_sources(np.array([[4, 1]]), 2).sum(axis=0).tolist() == [4, 1]
    with pytest.raises(TraceError, match="3 source ranks"):
        remap_sources(np.zeros((3, 2), np.int64), 2)


def test_parquet_round_trip(tmp_path):
    counts = np.arange(2 * 3 * 2 * 4).reshape(2, 3, 2, 4)  # [points, layers, ranks, experts]
    meta = TraceMeta(num_experts=4, num_ranks=2, top_k=2, model="toy")
    tr = Trace.from_rank_counts(counts, meta, steps=[5, 5], microbatches=[0, 1], layers=[0, 7, 15])
    path = tr.write(tmp_path / "t.parquet")
    back = Trace.read(path)
    assert back.meta == meta and back.num_rows == tr.num_rows
    assert back.points().tolist() == [[5, 0], [5, 1]]
    loads = _loads(back, 7, 2)
    assert [l.tolist() for l in loads] == [counts[0, 1].tolist(), counts[1, 1].tolist()]
    assert Trace.read(path, layers=[15]).layers.tolist() == [15]
    # merged onto one rank
    assert _loads(back, 0, 1)[1].tolist() == [counts[1, 0].sum(axis=0).tolist()]
    import duckdb

    assert duckdb.sql(f"SELECT sum(tokens) FROM read_parquet('{path}')").fetchall()[0][0] == counts.sum()


def test_trace_validation_errors(tmp_path):
    meta = TraceMeta(num_experts=4)
    with pytest.raises(TraceError, match=r"expert\[0\].*outside 0..3"):
        Trace.from_columns(meta, step=[0], microbatch=[0], layer=[0], src_rank=[-1], expert=[9], tokens=[1])
    with pytest.raises(TraceError, match=r"tokens\[0\].*negative"):
        Trace.from_columns(meta, step=[0], microbatch=[0], layer=[0], src_rank=[-1], expert=[1], tokens=[-1])
    with pytest.raises(TraceError, match="missing column"):
        Trace.from_columns(meta, step=[0])
    bad = tmp_path / "x.parquet"
    bad.write_text("not parquet")
    with pytest.raises(TraceError, match="not a readable Parquet"):
        Trace.read(bad)
    with pytest.raises(TraceError, match="does not exist"):
        load_trace(tmp_path / "missing.parquet")
    (tmp_path / "x.bin").write_text("")
    with pytest.raises(TraceError, match="cannot tell the trace format"):
        load_trace(tmp_path / "x.bin")


# SGLang, Megatron, UltraEP and TensorRT-LLM dumps: tests/test_trace_importers.py (fixtures in each writer's
# exact layout)


# ---------------------------------------------------------------------------------------------- TensorRT-LLM
def test_safetensors_reader(tmp_path):
    arrs = {"a": np.arange(6, dtype=np.int64).reshape(2, 3), "b": np.array([1.5, 2.0], dtype=np.float32)}
    write_safetensors(tmp_path / "x.safetensors", arrs)
    back = read_safetensors(tmp_path / "x.safetensors")
    assert back["a"].tolist() == arrs["a"].tolist() and back["b"].tolist() == [1.5, 2.0]
    raw = (tmp_path / "x.safetensors").read_bytes()
    (tmp_path / "bad.safetensors").write_bytes(raw[:8] + b"]" + raw[9:])
    with pytest.raises(TraceError, match="unreadable safetensors header"):
        read_safetensors(tmp_path / "bad.safetensors")
    (tmp_path / "short.safetensors").write_bytes((10**9).to_bytes(8, "little"))
    with pytest.raises(TraceError, match="declares a header"):
        read_safetensors(tmp_path / "short.safetensors")


# ---------------------------------------------------------------------------------------------- OLMoE
def test_olmoe_counts_small_file(tmp_path):
    obj = {"layers": [0, 7, 15], "data": {"olmoe": {"expert_counts": {
        "c4": [[1, 2, 3, 4]] * 3, "github": [[4, 3, 2, 1]] * 3}}}}
    p = tmp_path / "expert_counts.json"
    p.write_text(json.dumps(obj))
    tr = load_trace(p)
    assert tr.layers.tolist() == [0, 7, 15] and tr.meta.top_k == 8
    assert [l.sum(axis=0).tolist() for l in _loads(tr, 7, 2)] == [[1, 2, 3, 4], [4, 3, 2, 1]]
    with pytest.raises(TraceError, match="no domain 'wiki'"):
        load_trace(p, domains=["wiki"])
    with pytest.raises(TraceError, match="no model 'mixtral'; available: \\['olmoe'\\]"):
        load_trace(p, model="mixtral")


@pytest.mark.skipif(not OLMOE.exists(), reason="shared OLMoE data (../shared/data/OLMoE) is not available")
def test_olmoe_real_counts():
    tr = load_trace(OLMOE)
    assert tr.meta.num_experts == 64 and tr.layers.tolist() == [0, 7, 15]
    assert len(tr.points()) == 6  # arxiv, book, c4, github, tulu, wikipedia
    per_domain = [l.sum(axis=0) for l in _loads(tr, 7, 8)]
    hot = {int(np.argmax(c)) for c in per_domain}
    assert len(hot) > 1  # hot experts differ by domain
    mixtral = load_trace(OLMOE, model="mistral", domains=["c4", "github"])
    assert mixtral.meta.num_experts == 8 and mixtral.meta.top_k == 2


# ---------------------------------------------------------------------------------------------- synthetic
def test_synthetic_hits_imbalance_targets_and_drifts():
    spec = SyntheticSpec(num_ranks=16, num_experts=64, num_layers=3, num_steps=40, imbalance=(1.5, 3.0), drift=0.25,
                         seed=3)
    tr = synthetic_trace(spec)
    targets = tr.meta.extra["layer_targets"]
    for layer in range(3):
        loads = _loads(tr, layer, 16)
        ims = [imbalance(l.sum(axis=0).reshape(16, -1).sum(axis=1)) for l in loads]
        assert ims[0] == pytest.approx(targets[layer], rel=0.03)
        hot = [int(np.argmax(l.sum(axis=0).reshape(16, -1).sum(axis=1))) for l in loads]
        assert hot[0] != hot[8] and hot[8] == (hot[0] + 2) % 16  # 0.25 ranks per step: 2 ranks in 8 steps


def test_synthetic_bursts_domain_shifts_and_per_source():
    base = dict(num_ranks=8, num_experts=16, num_layers=1, num_steps=30, imbalance=(2.0, 2.0), seed=1)
    shifted = synthetic_trace(SyntheticSpec(**base, domain_shift_every=10))
    hot = [int(np.argmax(l.sum(axis=0))) for l in _loads(shifted, 0, 8)]
    assert len(set(hot[:10])) == 1 and len({hot[0], hot[10], hot[20]}) > 1
    few = dict(base, num_experts=64, top_k=2, imbalance=(1.2, 1.2))
    burst = np.stack([l.sum(axis=0) for l in _loads(synthetic_trace(SyntheticSpec(**few, burst_prob=0.3,
                                                                                  burst_factor=20.0)), 0, 8)])
    plain = np.stack([l.sum(axis=0) for l in _loads(synthetic_trace(SyntheticSpec(**few)), 0, 8)])
    assert (burst / np.maximum(plain, 1)).max() > 5  # a bursting expert takes many times its usual share
    ps = synthetic_trace(SyntheticSpec(**base, per_source=True, microbatches=2))
    assert ps.meta.num_ranks == 8 and len(ps.points()) == 60
    with pytest.raises(Exception, match="multiple of"):
        SyntheticSpec(num_ranks=3, num_experts=16)


def test_synthetic_is_fast_at_ep256():
    t0 = time.perf_counter()
    tr = synthetic_trace(SyntheticSpec(num_ranks=256, num_experts=256, num_layers=6, num_steps=200,
                                       imbalance=(1.3, 4.0), drift=0.05, burst_prob=0.01, seed=0))
    assert tr.num_rows > 200 * 6 * 200
    assert time.perf_counter() - t0 < 20  # ~1/50 of the 1000-step, 60-layer trace


def test_recorded_run_round_trip(tmp_path):
    # record plans of a toy run, read its loads back as a trace
    from ultraep.policies import make_policy
    from ultraep.telemetry import Recorder
    from ultraep.topology import Topology

    t = Topology(num_ranks=4, num_experts=8, num_redundant_slots=1)
    rng = np.random.default_rng(0)
    loads = [rng.integers(0, 50, size=(4, 8)) for _ in range(3)]
    rec = Recorder.open(tmp_path / "runs", "toy", kind="train", flush_interval_s=None, otel=False)
    for step, load in enumerate(loads):
        rec.record_plan(step, 0, 2, make_policy("quota").plan(load.astype(np.int64), t))
    rec.close()
    tr = load_trace(tmp_path / "runs" / "toy")
    assert tr.meta.source == "recorded-run" and tr.meta.num_ranks == 4
    assert [l.tolist() for l in _loads(tr, 2, 4)] == [l.tolist() for l in loads]
    assert load_trace(tmp_path / "runs", run_id="toy").num_rows == tr.num_rows
    with pytest.raises(TraceError, match="'nope' has no recorded loads"):
        load_trace(tmp_path / "runs", run_id="nope")

"""Bad-input corpus: configs, topologies, loads, traces and CLI arguments.

Every case is a mistake a user can make. The guarantee pinned here: the error is an
:class:`~ultraep.errors.UltraEPError` (or a pydantic ``ValidationError`` wrapping one, for models built
directly) whose one-line message names the field or the file *and* the offending value; from the CLI it
is exit code 2 with no traceback; and nothing already recorded is damaged by a failing call. Trace
importers never unpickle user files: a malicious pickle whose payload would create a file is refused and
the file is not created.

The CLI cases run ``ultraep.cli.main`` in-process (an escaping exception would fail the test, which is
what a traceback is); one test runs the real entry point in a subprocess for a few of them.
"""

from __future__ import annotations

import ast
import hashlib
import json
import os
import pickle
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from pydantic import ValidationError

from ultraep import BalancerConfig, Topology, plan_layer, validate_load
from ultraep.cli import main
from ultraep.errors import LoadError, TraceError, UltraEPError, format_pydantic_error
from ultraep.load import MAX_EXPERT_LOAD
from ultraep.traces import Trace, TraceMeta, load_trace

REPO = Path(__file__).resolve().parent.parent
POLICIES = ["none", "quota", "eplb", "feplb", "hybridep", "adaptive"]


def message(fn) -> str:
    """The one-line message a user sees for ``fn()`` (which must fail with a user error)."""
    try:
        fn()
    except UltraEPError as exc:
        return str(exc)
    except ValidationError as exc:
        return format_pydantic_error(exc)
    raise AssertionError("no error raised")


# --------------------------------------------------------------------------------------------- configs
CONFIG_CASES = [
    # (id, callable, fragments the message must hold: the field path and the value)
    ("slots wrong type", lambda: BalancerConfig.model_validate({"num_redundant_slots": "two"}),
     ["num_redundant_slots", "'two'"]),
    ("domain wrong type", lambda: BalancerConfig.model_validate({"domain_size": 2.5}), ["domain_size", "2.5"]),
    ("policy wrong type", lambda: BalancerConfig.model_validate({"policy": 3}), ["policy", "3"]),
    ("unknown key", lambda: BalancerConfig.model_validate({"slots": 2}), ["slots", "Extra inputs"]),
    ("unknown layer option", lambda: BalancerConfig.model_validate({"layers": {"0": {"kind": "quota", "bogus": 1}}}),
     ["layers.0.quota.bogus", "(1)"]),
    ("unknown policy", lambda: BalancerConfig.model_validate({"policy": "magic"}), ["policy", "'magic'"]),
    ("unknown layer kind", lambda: BalancerConfig.model_validate({"layers": {"1": {"kind": "foo"}}}),
     ["layers.1", "'foo'"]),
    ("negative layer key", lambda: BalancerConfig.model_validate({"layers": {"-1": {"kind": "quota"}}}),
     ["layers.-1", "'-1'"]),
    ("negative slots", lambda: BalancerConfig.model_validate({"num_redundant_slots": -1}),
     ["num_redundant_slots", "(-1)"]),
    ("eps out of range", lambda: BalancerConfig.model_validate({"quota": {"balance_eps": 2}}),
     ["quota.balance_eps", "(2)"]),
    ("slots > (D-1)*M", lambda: BalancerConfig.model_validate({"num_redundant_slots": 9}).validate_for(8, 1),
     ["num_redundant_slots (9)", "(7)"]),
    ("layer slots > (D-1)*M", lambda: BalancerConfig.model_validate(
        {"layers": {"2": {"kind": "quota", "num_redundant_slots": 5}}}).validate_for(4, 1),
     ["layers.2.quota.num_redundant_slots (5)", "(3)"]),
    ("domain does not divide ranks", lambda: BalancerConfig.model_validate({"domain_size": 3}).validate_for(8, 2),
     ["domain_size (3)", "(8)"]),
    ("empty domain (size 0)", lambda: BalancerConfig.model_validate({"domain_size": 0}), ["domain_size", "(0)"]),
    ("empty HybridEP domain sizes", lambda: BalancerConfig.model_validate(
        {"layers": {"0": {"kind": "hybridep", "domain_sizes": []}}}), ["layers.0.hybridep.domain_sizes", "[]"]),
    ("zero HybridEP domain size", lambda: BalancerConfig.model_validate(
        {"layers": {"0": {"kind": "hybridep", "domain_sizes": [0]}}}), ["layers.0.hybridep.domain_sizes.0", "(0)"]),
    ("adaptive without none", lambda: plan_layer(np.ones((2, 4), np.int64), "adaptive", num_redundant_slots=1,
                                                 candidates=("quota",)), ["adaptive.candidates", "'quota'"]),
    ("experts not divisible by ranks", lambda: Topology(num_ranks=3, num_experts=8),
     ["topology.num_experts", "num_experts (8)", "num_ranks (3)"]),
    ("topology slots > limit", lambda: Topology(num_ranks=4, num_experts=8, num_redundant_slots=7),
     ["topology.num_redundant_slots", "(7)", "(6)"]),
    ("topology domain of one rank with replicas", lambda: Topology(num_ranks=4, num_experts=8, domain_size=1,
                                                                   num_redundant_slots=1),
     ["topology.num_redundant_slots", "(1)", "(0)"]),
    ("home outside ranks", lambda: Topology(num_ranks=2, num_experts=2, home=(0, 5)), ["topology.home.1", "5"]),
    ("plan option out of range", lambda: plan_layer(np.ones((2, 4), np.int64), "quota", num_redundant_slots=1,
                                                    balance_eps=-1), ["quota.balance_eps", "(got -1)"]),
    ("plan option wrong type", lambda: plan_layer(np.ones((2, 4), np.int64), "eplb", num_redundant_slots=1,
                                                  interval="soon"), ["eplb.interval", "'soon'"]),
    ("plan option bad choice", lambda: plan_layer(np.ones((2, 4), np.int64), "quota", num_redundant_slots=1,
                                                  relay="maybe"), ["quota.relay", "'maybe'"]),
    ("plan unknown option", lambda: plan_layer(np.ones((2, 4), np.int64), "quota", num_redundant_slots=1, bogus=1),
     ["quota.bogus", "accepted: balance_eps"]),
]


@pytest.mark.parametrize("fn, fragments", [c[1:] for c in CONFIG_CASES], ids=[c[0] for c in CONFIG_CASES])
def test_config_and_topology_mistakes_name_field_and_value(fn, fragments):
    msg = message(fn).splitlines()[0]  # pydantic may add one line per further error; the first one names it
    for f in fragments:
        assert f in msg, (f, msg)


# --------------------------------------------------------------------------------------------- loads
LOAD_CASES = [
    ("negative", [[1, -2], [3, 4]], ["load[0, 1]", "negative (-2)"]),
    ("NaN", [[1.0, float("nan")], [3.0, 4.0]], ["load[0, 1]", "not finite (nan)"]),
    ("inf", [[1.0, 2.0], [float("inf"), 4.0]], ["load[1, 0]", "not finite (inf)"]),
    ("fractional", [[1.0, 2.5], [3.0, 4.0]], ["load[0, 1]", "whole number of tokens (2.5)"]),
    ("1-D", [1, 2, 3, 4], ["load", "2-D", "(4,)"]),
    ("3-D", np.zeros((2, 2, 2), np.int64), ["load", "(2, 2, 2)"]),
    ("ragged", [[1, 2], [3]], ["load", "not an array of counts"]),
    ("strings", [["a", "b"], ["c", "d"]], ["load", "dtype <U1"]),
    ("booleans", np.ones((2, 2), bool), ["load", "booleans"]),
    ("empty", np.zeros((0, 4), np.int64), ["load", "empty", "(0, 4)"]),
    ("None", None, ["load", "dtype object"]),
    ("entry beyond int64", np.array([[2**63 + 5, 0], [0, 0]], dtype=np.uint64), ["load[0, 0]", "9223372036854775813"]),
    ("expert total beyond 2^31-1", np.full((2, 2), 2**30 + 1, np.int64), ["load[:, 0]", "2147483650"]),
]


@pytest.mark.parametrize("load, fragments", [c[1:] for c in LOAD_CASES], ids=[c[0] for c in LOAD_CASES])
def test_bad_loads_name_the_entry_and_value(load, fragments):
    with pytest.raises(LoadError) as info:
        plan_layer(load, "quota", num_redundant_slots=1)
    for f in fragments:
        assert f in str(info.value), (f, str(info.value))


def test_wrong_shape_for_the_topology():
    topo = Topology(num_ranks=4, num_experts=8, num_redundant_slots=1)
    with pytest.raises(LoadError, match=r"has 2 rows but the EP group has 4 ranks"):
        plan_layer(np.zeros((2, 8), np.int64), "quota", topology=topo)
    with pytest.raises(LoadError, match=r"has 6 columns but the layer has 8 experts"):
        plan_layer(np.zeros((4, 6), np.int64), "quota", topology=topo)


def test_largest_accepted_expert_load_still_plans_exactly():
    """At the bound (every expert's total = 2^31 - 1) every policy still conserves tokens exactly."""
    R, E = 4, 8
    rng = np.random.default_rng(3)
    w = rng.pareto(0.7, size=(R, E)) + 0.01
    load = np.floor(w / w.sum(axis=0) * MAX_EXPERT_LOAD).astype(np.int64)
    assert load.sum(axis=0).max() <= MAX_EXPERT_LOAD
    assert validate_load(load) is load  # the hot path accepts it without a copy
    for pol in POLICIES:
        p = plan_layer(load, pol, num_redundant_slots=2)
        p.check()
        assert int(p.rank_load_after_R.sum()) == int(load.sum())
        np.testing.assert_array_equal(p.routes_RRS.sum(axis=(1, 2)), load.sum(axis=1))


@pytest.mark.parametrize("policy", POLICIES)
def test_all_zero_load_is_a_valid_identity_plan(policy):
    topo = Topology(num_ranks=4, num_experts=8, num_redundant_slots=2, expert_bytes=1000)
    p = plan_layer(np.zeros((4, 8), np.int64), policy, topology=topo)
    p.check()
    assert p.num_replicas == 0 and len(p.transfers) == 0
    assert p.imbalance_before == p.imbalance_after == 1.0
    assert not p.quota_RS.any() and not p.routes_RRS.any()
    M = topo.num_masters
    np.testing.assert_array_equal(p.phy2log_RS[:, :M], topo.masters_RM)  # masters in place, slots empty
    assert (p.phy2log_RS[:, M:] == -1).all()


# --------------------------------------------------------------------------------------------- traces
def _mrec(**changes) -> str:
    """One Megatron router_trace record with every key its writer writes (changes applied), as a JSONL line."""
    rec = {"step": 0, "stage": "pre_dispatch", "block": "decoder", "layer": 0, "rank": 0, "num_tokens": 1,
           "topk": 1, "top_indices": [[1]], **changes}
    return json.dumps(rec) + "\n"


def _good_trace(d: Path) -> Path:
    meta = TraceMeta(num_experts=4, num_ranks=2)
    counts = np.random.default_rng(0).integers(0, 9, (3, 2, 2, 4))
    return Trace.from_rank_counts(counts, meta).write(d / "good.parquet")


def _parquet_variant(d: Path, name: str, edit) -> Path:
    import pyarrow.parquet as pq

    tbl = edit(pq.read_table(_good_trace(d)))
    pq.write_table(tbl, d / name)
    return d / name


def _pa():
    import pyarrow as pa

    return pa


def _mk_truncated_parquet(d):
    raw = _good_trace(d).read_bytes()
    (d / "t.parquet").write_bytes(raw[: len(raw) // 2])
    return d / "t.parquet"


def _mk_torch(d, name, obj):
    import torch

    torch.save(obj, d / name)
    return d / name


def _mk_text(d, name, text):
    p = d / name
    (p.write_bytes if isinstance(text, bytes) else p.write_text)(text)
    return p


def _mk_manifest(d, chunks_written, chunks_counted, name="m", **change):
    """UltraEP's load profiler layout (ultra_ep/profiling.py): ``{name}.chunk{k:06d}.npz`` + manifest."""
    arrays = dict(metadata=np.asarray("{}"), layers=np.array([1, 2], np.int32),
                  virtual_layers=np.array([1, 2], np.int32), microbatches=np.array([0, 0], np.int64),
                  pre_logical_loads=np.ones((2, 4), np.int32), post_physical_loads=np.eye(2, 6, dtype=np.int32) * 4)
    for k in range(chunks_written):
        np.savez(d / f"{name}.chunk{k:06d}.npz", **{**arrays, **change})
    (d / f"{name}.manifest.json").write_text(json.dumps({
        "schema": "ultra_ep_trace_v1", "trace_id": name, "chunks": chunks_counted, "ep_size": 2,
        "num_global_logical_experts": 4, "max_microbatches": 1}))
    return d / f"{name}.manifest.json"


def _mk_safetensors(d, header: bytes):
    tdir = d / "trt"
    tdir.mkdir(exist_ok=True)
    (tdir / "rank0.safetensors").write_bytes(struct.pack("<Q", len(header)) + header + b"\0" * 16)
    return tdir


TRACE_CASES = [
    # (id, make(dir) -> path, load_trace options, fragments of the message besides the file name)
    ("truncated parquet", _mk_truncated_parquet, {}, ["not a readable Parquet file"]),
    ("empty parquet", lambda d: _mk_text(d, "e.parquet", b""), {}, ["not a readable Parquet file", "0 bytes"]),
    ("parquet missing column", lambda d: _parquet_variant(d, "m.parquet", lambda t: t.drop(["tokens"])), {},
     ["lacks column(s) ['tokens']"]),
    ("parquet string tokens", lambda d: _parquet_variant(
        d, "s.parquet", lambda t: t.set_column(5, "tokens", _pa().array(["x"] * t.num_rows))), {},
     [".tokens", "must hold integers", "object"]),
    ("parquet fractional tokens", lambda d: _parquet_variant(
        d, "f.parquet", lambda t: t.set_column(5, "tokens", _pa().array([1.5] * t.num_rows))), {},
     [".tokens", "float64"]),
    ("parquet expert out of range", lambda d: _parquet_variant(
        d, "x.parquet", lambda t: t.set_column(4, "expert", _pa().array([99] * t.num_rows, _pa().int32()))), {},
     [".expert[0]", "(99)", "0..3"]),
    ("parquet bad metadata", lambda d: _parquet_variant(
        d, "b.parquet", lambda t: t.replace_schema_metadata({b"ultraep.trace": b'{"num_experts": 0}'})), {},
     ["num_experts (0)"]),
    ("parquet without metadata, expert beyond num_experts", lambda d: _parquet_variant(
        d, "n.parquet", lambda t: t.replace_schema_metadata({})), {"num_experts": 1}, [".expert[", "outside 0..0"]),
    ("truncated .pt", lambda d: _mk_text(d, "t.pt", _mk_torch(d, "g.pt", {"logical_count": np.ones((2, 3, 4))
                                                                          }).read_bytes()[:100]), {},
     ["weights_only=True"]),
    ("random bytes .pt", lambda d: _mk_text(d, "r.pt", os.urandom(256)), {}, ["weights_only=True"]),
    (".pt fractional counts", lambda d: _mk_torch(d, "f.pt", {"logical_count": __import__("torch").full((2, 2), 0.5)}),
     {}, [":logical_count[0, 0]", "(0.5)"]),
    (".pt wrong shape", lambda d: _mk_torch(d, "w.pt", {"logical_count": __import__("torch").ones(4)}), {},
     [":logical_count", "(4,)"]),
    (".pt without logical_count", lambda d: _mk_torch(d, "k.pt", {"other": 1}), {}, ["neither 'logical_count'", "other"]),
    ("jsonl bad JSON line", lambda d: _mk_text(d, "b.jsonl", _mrec() + "{\"step\":\n"),
     {}, [":2", "not valid JSON"]),
    ("jsonl not an object", lambda d: _mk_text(d, "a.jsonl", "[1, 2]\n"), {}, [":1", "JSON object"]),
    ("jsonl missing step", lambda d: _mk_text(d, "s.jsonl", '{"layer":0,"top_indices":[1]}\n'), {},
     [":1", "lacks 'step'"]),
    ("jsonl fractional step", lambda d: _mk_text(d, "f.jsonl", _mrec(step=1.5)), {},
     [":1.step", "must be an integer", "1.5"]),
    ("jsonl negative expert id", lambda d: _mk_text(d, "n.jsonl", _mrec(top_indices=[[-1]])),
     {}, [":1.top_indices[0, 0]", "(-1)"]),
    ("jsonl ragged indices", lambda d: _mk_text(d, "r.jsonl", _mrec(num_tokens=2, topk=2, top_indices=[[1, 2], [3]])),
     {}, ["megatron-jsonl", "inhomogeneous"]),
    ("jsonl binary garbage", lambda d: _mk_text(d, "g.jsonl", b"\xff\xfe\x00garbage"), {},
     ["megatron-jsonl", "UnicodeDecodeError"]),
    ("jsonl step beyond int32", lambda d: _mk_text(d, "h.jsonl", _mrec(step=99999999999)),
     {}, [".step[0]", "99999999999", "int32"]),
    ("csv short row", lambda d: _mk_text(d, "s.csv", "layer_id,expert_id,count\n0,0\n"), {}, [":2", "['0', '0']"]),
    ("csv negative count", lambda d: _mk_text(d, "n.csv", "layer_id,expert_id,count\n0,0,-5\n"), {}, [":2", "-5"]),
    ("csv binary garbage", lambda d: _mk_text(d, "g.csv", b"\x92\x00\xff"), {}, ["sglang-csv", "UnicodeDecodeError"]),
    ("manifest counting a missing chunk", lambda d: _mk_manifest(d, 1, 2), {},
     ["m.chunk000001.npz", "counted by the manifest but does not exist"]),
    ("manifest bad JSON", lambda d: _mk_text(d, "x.manifest.json", "{bad"), {}, ["not valid JSON"]),
    ("manifest wrong schema", lambda d: _mk_text(d, "y.manifest.json", '{"schema": "v0"}'), {},
     [".schema", "'v0'"]),
    ("npz chunk layers length", lambda d: _mk_manifest(d, 1, 1, "z", layers=np.array([1, 2, 3], np.int32)), {},
     ["z.chunk000000.npz:layers", "shape (3,) for 2 records"]),
    ("safetensors bad header", lambda d: _mk_safetensors(d, b"{bad}"), {}, ["rank0.safetensors", "header"]),
    ("safetensors misaligned data", lambda d: _mk_safetensors(d, json.dumps(
        {"0_0": {"dtype": "I32", "shape": [4], "data_offsets": [0, 15]}}).encode()), {}, ["trtllm", "multiple"]),
    ("olmoe wrong structure", lambda d: _mk_text(d, "o.json", json.dumps({"data": {"olmoe": 5}})), {},
     ["olmoe", "TypeError"]),
    ("olmoe empty domain list", lambda d: _mk_text(d, "p.json", json.dumps(
        {"data": {"olmoe": {"expert_counts": {"c4": [[1, 2]]}}}})), {"domains": []}, ["olmoe", "at least one"]),
    ("unknown trace option", _good_trace, {"model": "olmoe"}, ["parquet.model", "unknown option"]),
    ("unknown format", _good_trace, {"format": "nope"}, ["format", "'nope'"]),
    ("missing file", lambda d: d / "nope.parquet", {}, ["does not exist"]),
]


@pytest.mark.parametrize("make, options, fragments", [c[1:] for c in TRACE_CASES], ids=[c[0] for c in TRACE_CASES])
def test_bad_traces_name_the_file_and_the_problem(tmp_path, make, options, fragments):
    path = make(tmp_path)
    with pytest.raises(TraceError) as info:
        load_trace(path, **options)
    msg = str(info.value)
    assert "\n" not in msg, msg
    if not {"format", "model"} & set(options):  # the file at fault (the trace, or a chunk it lists) is named
        assert str(tmp_path) in msg, msg
    for f in fragments:
        assert f in msg, (f, msg)


def test_trace_counts_beyond_the_planners_range_stop_at_replay(tmp_path):
    path = _parquet_variant(tmp_path, "h.parquet",
                            lambda t: t.set_column(5, "tokens", _pa().array([2**40] * t.num_rows, _pa().int64())))
    tr = load_trace(path)
    with pytest.raises(LoadError, match=r"trace \(layer 0, step 0, microbatch 0\) load.*1099511627776"):
        list(tr.layer_loads(0, 2))


# --------------------------------------------------------------------------------------------- pickles
class _Payload:
    """Unpickling this object calls ``open(marker, 'w')``: a file appears if anyone unpickles it."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (open, (str(self.marker), "w"))


def test_malicious_pickles_are_never_executed(tmp_path):
    import torch

    marker = tmp_path / "pwned"
    payload = _Payload(marker)
    torch.save({"logical_count": torch.ones(2, 2, 4), "x": payload}, tmp_path / "evil_zip.pt")  # torch zip format
    (tmp_path / "evil_raw.pt").write_bytes(pickle.dumps({"logical_count": [[1]], "x": payload}))  # legacy pickle
    np.save(tmp_path / "evil.npy", np.array([payload], dtype=object), allow_pickle=True)  # object .npy
    _mk_manifest(tmp_path, 1, 1, "e", pre_logical_loads=np.array([payload, payload], dtype=object))  # object .npz
    assert not marker.exists()
    for name in ("evil_zip.pt", "evil_raw.pt", "e.manifest.json"):
        with pytest.raises(TraceError):
            load_trace(tmp_path / name)
        assert not marker.exists(), name
    for name in ("evil_zip.pt", "e.manifest.json"):
        assert main(["trace", "info", str(tmp_path / name)]) == 2
    assert main(["plan", "--load", str(tmp_path / "evil.npy"), "--ranks", "1"]) == 2
    assert not marker.exists()
    # the payload is live: a plain unpickle of the same bytes creates the file
    pickle.loads((tmp_path / "evil_raw.pt").read_bytes())["x"].close()
    assert marker.exists()


def _calls(path: Path):
    tree = ast.parse(path.read_text(), filename=str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            f = node.func
            name = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", "")
            owner = getattr(f.value, "id", "") if isinstance(f, ast.Attribute) else ""
            kw = {k.arg: k.value for k in node.keywords}
            yield path, node.lineno, owner, name, kw


def test_no_code_path_unpickles_user_files():
    """Static guard over every module that reads user files: no pickle.load(s), every torch.load passes
    weights_only=True, no np.load with allow_pickle=True."""
    files = [p for d in ("ultraep", "telemetry", "dashboard", "policies") for p in (REPO / d).rglob("*.py")]
    bad = []
    for path, line, owner, name, kw in (c for f in files for c in _calls(f)):
        where = f"{path.relative_to(REPO)}:{line}"
        if owner in ("pickle", "cPickle", "dill") and name in ("load", "loads"):
            bad.append(f"{where} pickle.{name}")
        if owner == "torch" and name == "load":
            w = kw.get("weights_only")
            if not (isinstance(w, ast.Constant) and w.value is True):
                bad.append(f"{where} torch.load without weights_only=True")
        if owner == "np" and name == "load":
            a = kw.get("allow_pickle")
            if not (isinstance(a, ast.Constant) and a.value is False):
                bad.append(f"{where} np.load without allow_pickle=False")
    assert not bad, bad


# --------------------------------------------------------------------------------------------- CLI
@pytest.fixture(scope="module")
def cli_files(tmp_path_factory):
    d = tmp_path_factory.mktemp("cli")
    tr = Trace.from_rank_counts(np.random.default_rng(1).integers(0, 50, (6, 2, 4, 8)),
                                TraceMeta(num_experts=8, num_ranks=4)).write(d / "t.parquet")
    np.save(d / "load.npy", np.arange(32, dtype=np.int64).reshape(4, 8))
    (d / "a-file").write_text("not a directory")
    return {"dir": d, "trace": str(tr), "load": str(d / "load.npy"), "file": str(d / "a-file")}


SIM = ["--policies", "none,quota", "--workers", "1", "--no-progress"]
CLI_CASES = [
    # (id, argv builder, fragments of the error line)
    ("plan missing file", lambda f: ["plan", "--load", f["file"] + ".npy", "--ranks", "4"], ["no such file"]),
    ("plan ranks 0", lambda f: ["plan", "--synthetic", "--ranks", "0", "--experts", "8"], ["--ranks", "got 0"]),
    ("plan rows != ranks", lambda f: ["plan", "--load", f["load"], "--ranks", "3"], ["4 rows", "3 ranks"]),
    ("plan slots > limit", lambda f: ["plan", "--load", f["load"], "--ranks", "4", "--slots", "9"],
     ["num_redundant_slots (9)"]),
    ("plan domain 0", lambda f: ["plan", "--load", f["load"], "--ranks", "4", "--domain-size", "0"],
     ["domain_size (0)"]),
    ("plan domain not dividing", lambda f: ["plan", "--load", f["load"], "--ranks", "4", "--domain-size", "3"],
     ["domain_size (3)", "(4)"]),
    ("plan unknown policy", lambda f: ["plan", "--load", f["load"], "--ranks", "4", "--policy", "best"],
     ["'best'", "available"]),
    ("plan NaN imbalance", lambda f: ["plan", "--synthetic", "--ranks", "2", "--experts", "8", "--imbalance", "nan"],
     ["target_imbalance (nan)"]),
    ("plan negative tokens", lambda f: ["plan", "--synthetic", "--ranks", "2", "--experts", "8", "--tokens", "-5"],
     ["tokens_per_rank (-5)"]),
    ("plan a directory as load", lambda f: ["plan", "--load", str(f["dir"]), "--ranks", "4"], ["cannot be read"]),
    ("simulate missing trace", lambda f: ["simulate", f["file"] + ".parquet", *SIM], ["does not exist"]),
    ("simulate ranks not dividing", lambda f: ["simulate", f["trace"], "--ranks", "3", *SIM], ["--ranks", "(3)"]),
    ("simulate bad option type", lambda f: ["simulate", f["trace"], "--policy-opt", "quota.balance_eps=x", *SIM],
     ["quota.balance_eps", "'x'"]),
    ("simulate unknown option", lambda f: ["simulate", f["trace"], "--policy-opt", "quota.bogus=1", *SIM],
     ["quota.bogus"]),
    ("simulate option for unknown policy", lambda f: ["simulate", f["trace"], "--policy-opt", "magic.x=1", *SIM],
     ["--policy-opt", "'magic'"]),
    ("simulate stride 0", lambda f: ["simulate", f["trace"], "--stride", "0", *SIM], ["--stride", "got 0"]),
    ("simulate negative max-plans", lambda f: ["simulate", f["trace"], "--max-plans", "-3", *SIM],
     ["--max-plans", "got -3"]),
    ("simulate bad preset value", lambda f: ["simulate", f["trace"], "--set", "scale_out.bandwidth_GBps=-1", *SIM],
     ["topology.scale_out.bandwidth_GBps"]),
    ("simulate wrong format", lambda f: ["simulate", f["trace"], "--format", "megatron-jsonl", *SIM],
     ["t.parquet", "megatron-jsonl"]),
    ("simulate unknown trace option", lambda f: ["simulate", f["trace"], "--trace-opt", "model=x", *SIM],
     ["parquet.model"]),
    ("simulate --out under a file", lambda f: ["simulate", f["trace"], "--out", f["file"] + "/runs", *SIM],
     ["a-file"]),
    ("simulate --json under a file", lambda f: ["simulate", f["trace"], "--json", f["file"] + "/x.json", *SIM],
     ["a-file"]),
    ("trace synth experts % ranks", lambda f: ["trace", "synth", str(f["dir"] / "o.parquet"), "--ranks", "3",
                                               "--experts", "8"], ["num_experts (8)", "(3)"]),
    ("trace synth into a file", lambda f: ["trace", "synth", f["file"] + "/o.parquet", "--ranks", "2", "--experts",
                                           "4", "--top-k", "2", "--steps", "1"], ["a-file"]),
    ("trace import bad suffix", lambda f: ["trace", "import", f["trace"], str(f["dir"] / "o.txt")], ["'o.txt'"]),
    ("sql no run", lambda f: ["sql", f["file"] + "-run", "SELECT 1"], ["no such run"]),
    ("report no run", lambda f: ["report", f["file"] + "-run"], ["no such run"]),
]


@pytest.mark.parametrize("argv, fragments", [c[1:] for c in CLI_CASES], ids=[c[0] for c in CLI_CASES])
def test_cli_mistakes_exit_2_with_one_line(cli_files, capsys, argv, fragments):
    rc = main(argv(cli_files))
    err = capsys.readouterr().err.strip()
    assert rc == 2, err
    assert err.startswith("ultraep: error: ") and "\n" not in err, err
    for f in fragments:
        assert f in err, (f, err)


@pytest.mark.parametrize("argv", [["plan", "--ranks", "two", "--synthetic"], ["simulate"], ["bogus-command"],
                                  ["trace", "synth", "x.parquet", "--ranks", "2", "--experts", "4", "--imbalance",
                                   "1:2:3"]])
def test_argparse_mistakes_exit_2(argv, capsys):
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("ultraep: error: ") and not any("Traceback" in line for line in err)


def test_user_error_in_a_simulate_worker_exits_2_instead_of_hanging(cli_files, capsys):
    """The error is raised inside the worker pool and must travel back (it used to kill the pool's result
    thread: the CLI hung forever)."""
    f = cli_files
    argv = ["simulate", f["trace"], "--policy-opt", "quota.bogus=1", "--policies", "quota", "--workers", "2",
            "--no-progress"]
    assert main(argv) == 2
    assert "quota.bogus: unknown option" in capsys.readouterr().err
    # the installed entry point, end to end (interpreter, console script, exit status)
    res = subprocess.run([sys.executable, "-m", "ultraep.cli", *argv], capture_output=True, text=True, timeout=120)
    assert res.returncode == 2, res.stderr
    assert res.stderr.startswith("ultraep: error: quota.bogus") and "Traceback" not in res.stderr, res.stderr


# --------------------------------------------------------------------------------------------- nothing damaged
def _snapshot(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def test_failing_calls_leave_recorded_runs_intact(cli_files, capsys):
    """Record two runs with `simulate --out`, then aim failing calls at the same runs directory: the files
    are byte-identical afterwards and every run still opens and answers the same queries."""
    from ultraep.telemetry import open_run

    f = cli_files
    runs = f["dir"] / "runs"
    assert main(["simulate", f["trace"], "--out", str(runs), "--run-name", "keep", *SIM]) == 0
    export = f["dir"] / "keep.duckdb"
    assert main(["export", str(runs / "keep-quota"), str(export)]) == 0
    capsys.readouterr()
    before = _snapshot(f["dir"])
    query = "SELECT count(*), sum(tokens), min(imbalance_after), max(imbalance_after) FROM layer_balance"
    answers = {r: open_run(runs / r).execute(query).fetchone() for r in ("keep-none", "keep-quota")}
    bad_trace = f["dir"] / "bad.jsonl"
    bad_trace.write_text("{oops\n")
    failing = [
        ["simulate", str(bad_trace), "--out", str(runs), *SIM],                       # unreadable trace
        ["simulate", f["trace"], "--out", str(runs), "--run-name", "keep", *SIM],     # name already taken
        ["simulate", f["trace"], "--out", str(runs), "--policy-opt", "quota.bogus=1", *SIM],
        ["simulate", f["trace"], "--out", str(runs), "--run-name", "../escape", *SIM],
        ["simulate", f["trace"], "--out", str(runs), "--stride", "0", *SIM],
        ["export", str(runs / "keep-quota"), str(export)],                            # exists, no --force
        ["export", str(export), str(f["dir"] / "again.duckdb")],                      # a file is not a run dir
        ["sql", str(runs / "keep-quota"), "DROP VIEW layer_balance"],                 # a view over parts: no-op
        ["sql", str(export), "DELETE FROM plans"],                                    # read-only file
        ["trace", "import", str(bad_trace), str(runs / "keep-none" / "plans" / "x.parquet")],
    ]
    for argv in failing:
        rc = main(argv)
        err = capsys.readouterr().err
        assert rc in (0, 2), (argv, rc, err)
        assert "Traceback" not in err
        if argv[0] != "sql" or argv[1] == str(export):
            assert rc == 2, (argv, err)
    after = _snapshot(f["dir"])
    after.pop("bad.jsonl", None)
    before.pop("bad.jsonl", None)
    assert after == before
    for r, want in answers.items():
        assert open_run(runs / r).execute(query).fetchone() == want
    import duckdb

    con = duckdb.connect(str(export), read_only=True)
    assert con.execute(query).fetchone() == answers["keep-quota"]

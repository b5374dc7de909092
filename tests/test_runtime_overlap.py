"""The balanced layer posts transfers early and waits late (behaviour, not timing), on real gloo ranks.

* event order of one balanced layer: weight sync posted before the token dispatch; between the masters'
  compute and the replicas' compute the only wait is for the replicas' own weights (no collective); the
  gradient reduction completes after the layer's expert backward, right before the dispatch's backward;
* the replica memory budget: within it a layer keeps replicas from forward to backward (no restore, no
  recompute), beyond it layers share buffers and restore; a float budget splits in layer order;
* several forwards before one backward (gradient accumulation, pipeline schedules) stay exact;
* every phase is recorded with its exposed time, and ``transfer_times`` is filled.
"""

import copy

import duckdb
import pytest
import torch
import transformers  # noqa: F401 - imported before fork so ranks start fast

from dist_utils import run_ranks
from numerics import assert_within, master_grad_errors, rel_error
from ultraep.models import build_model, preload

preload()


def _skewed_ids(rank: int, step: int = 0):
    g = torch.Generator().manual_seed(1000 * step + 17 * rank + 1)
    return torch.randint(0, 3, (2, 12), generator=g)  # 3 token ids: concentrated routing, replicas needed


def _events(rank, world):
    import ultraep

    model = build_model("qwen3-moe")
    ultraep.wrap(model, {"policy": "quota", "num_redundant_slots": 2})
    rt = ultraep.runtime_of(model)
    rt.recording.events = []
    out = model(input_ids=_skewed_ids(rank)).logits
    fwd = list(rt.recording.events)
    rt.recording.events = []
    out.float().pow(2).mean().backward()
    return fwd, list(rt.recording.events), [layer.last_plan.num_replicas for layer in rt.layers]


def test_one_layer_event_order():
    for fwd, bwd, replicas in run_ranks(_events, 2):
        assert min(replicas) > 0
        for layer in (0, 1):
            f = [name for name, lay in fwd if lay == layer]
            # posted after the plan and before the dispatch; waited only right before the replicas compute
            assert f == ["planned", "weight_sync_posted", "dispatched", "master_compute", "weight_sync_waited",
                         "replica_compute", "combined"], f
            b = [name for name, lay in bwd if lay == layer]
            # the replica gradients are sent right after the replica backward and reduced once the layer's
            # expert backward is done (the sink sits before the dispatch all-to-all's backward)
            assert b == ["replica_backward", "grad_sent", "grad_reduced"], b
        # backward runs the layers in reverse; each layer's reduction completes before the next layer starts
        assert [lay for name, lay in bwd if name == "grad_reduced"] == [1, 0]


def _budget(rank, world, budget):
    import ultraep

    model = build_model("qwen3-moe")
    ultraep.wrap(model, {"policy": "quota", "num_redundant_slots": 2, "replica_memory_budget": budget})
    rt = ultraep.runtime_of(model)
    model(input_ids=_skewed_ids(rank)).logits.float().pow(2).mean().backward()
    return [layer.store.mode for layer in rt.layers], rt.shared_slots.restorations


@pytest.mark.parametrize("budget, modes", [
    ("auto", ["kept", "kept"]),
    (0, ["restore", "restore"]),
    (0.26, ["kept", "restore"]),  # 2 slots of 8 experts' 2 layers: one layer's replicas are 1/8 of the masters
])
def test_replica_memory_budget_splits_in_layer_order(budget, modes):
    for got, restorations in run_ranks(_budget, 2, budget):
        assert got == modes
        assert (restorations > 0) == (modes[0] == "restore")


def _accumulate(rank, world, budget):
    import ultraep

    model = build_model("qwen3-moe")
    ref = copy.deepcopy(model)
    ultraep.wrap(model, {"policy": "quota", "num_redundant_slots": 2, "replica_memory_budget": budget})
    rt = ultraep.runtime_of(model)
    # two microbatches forward first, then both backwards (the order a pipeline schedule may use)
    outs = [model(input_ids=_skewed_ids(rank, s)).logits for s in range(2)]
    refs = [ref(input_ids=_skewed_ids(rank, s)).logits for s in range(2)]
    for o in reversed(outs):
        o.float().pow(2).mean().backward()
    for o in reversed(refs):
        o.float().pow(2).mean().backward()
    return master_grad_errors(rt, ref, rank), {f"logits {i}": rel_error(a, b) for i, (a, b) in enumerate(zip(outs, refs))}


@pytest.mark.numerics
@pytest.mark.parametrize("budget", ["auto", 0])
def test_two_forwards_before_backward_are_exact(budget):
    for grad, logits in run_ranks(_accumulate, 2, budget):
        assert_within({**grad, **logits})


def _recorded(rank, world, runs):
    import ultraep

    model = build_model("qwen3-moe")
    rec = ultraep.telemetry.Recorder.open(runs, "overlap", world_size=world, rank=rank, flush_interval_s=None)
    ultraep.wrap(model, {"policy": "quota", "num_redundant_slots": 2}, recorder=rec)
    rt = ultraep.runtime_of(model)
    for step in range(2):
        model(input_ids=_skewed_ids(rank, step)).logits.float().pow(2).mean().backward()
        rt.next_step()
    rec.close()
    return True


def test_phases_and_transfer_times_are_recorded(tmp_path):
    run_ranks(_recorded, 2, str(tmp_path))
    con = ultraep_open(tmp_path / "overlap")
    keys = {k for (k,) in con.execute("SELECT DISTINCT unnest(map_keys(other)) FROM timings").fetchall()}
    for k in ("weight_post_s", "weight_wait_s", "weight_sync_hidden_s", "master_compute_s", "replica_compute_s",
              "backward_s", "backward_compute_s", "grad_wait_s", "grad_reduce_s", "dispatch_bwd_s", "replica_kept"):
        assert k in keys, (k, keys)
    # every layer call of both ranks has its backward phases (recorded once the backward ran)
    n, with_bwd = con.execute("SELECT count(*), count(other['backward_s']) FROM timings").fetchone()
    assert n == 2 * 2 * 2 and with_bwd == n
    # measured seconds of the transfers each rank received: finite where it was the destination
    rows = con.execute("SELECT rank, seconds FROM transfer_times").fetchall()
    assert rows and all(s for _, s in rows)
    finite = [x for _, s in rows for x in s if x == x]
    assert finite and all(0 <= x < 60 for x in finite)
    # predicted next to measured per cost-model term, reduced over ranks by the canned report query
    from ultraep.telemetry import queries

    cols, errs = queries.run(con, queries.PHASE_PREDICTION_ERRORS)
    terms = {r[cols.index("term")] for r in errs}
    assert {"compute_fwd_s", "compute_bwd_s", "a2a_fwd_s", "total_s"} <= terms, terms
    # the layer time recorded is forward + backward (what predicted_s predicts)
    fwd, bwd, tot = con.execute("SELECT max(other['forward_s']), max(other['backward_s']), max(measured_s) "
                                "FROM timings WHERE rank = 0 AND step = 1 AND layer = 0").fetchone()
    assert tot == pytest.approx(fwd + bwd)


def ultraep_open(path):
    import ultraep

    con = ultraep.telemetry.open_run(str(path))
    assert isinstance(con, duckdb.DuckDBPyConnection)
    return con

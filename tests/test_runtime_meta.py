"""Issue 54, item 6: every rank holds only its share. A model built on the meta device is wrapped, allocated with
``to_empty`` (the masters at M of E rows), its non-expert weights loaded by the user, its masters loaded by rows
from a checkpoint of the full model (safetensors or DCP); it computes the full model's outputs and gradients on
real gloo ranks, and each rank's expert memory is measured at E/R of the full tensors plus the replica budget.

Negative controls: masters loaded from the wrong rows (another rank's) fail the exactness check; a forward before
the masters are loaded, a load before ``to_empty``, a checkpoint without a key or with another shape are refused
in one line naming the field or key.
"""

from __future__ import annotations

import pytest
import torch
import transformers  # noqa: F401 - imported before fork so ranks start fast

from dist_utils import run_ranks
from numerics import TrainingScale, assert_within, master_grad_errors, param_grad_errors, rel_error, tolerance
from ultraep.models import build_model, preload

pytestmark = pytest.mark.numerics

preload()

E = 8  # experts per layer: 4 per rank on 2 ranks, 2 on 4
#: one replica slot per rank and layer; its buffers are the replica budget (bytes set per model below)
CONFIG = {"policy": "quota", "num_redundant_slots": 2}


def _batch(rank: int):
    g = torch.Generator().manual_seed(17 * rank + 1)
    return torch.randint(0, 3, (2, 12), generator=g)  # 3 token ids: concentrated routing, so replicas are made


def _is_expert(key: str) -> bool:
    return ".experts." in key


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """The full reference models (seed 0) saved as a safetensors file and as a DCP checkpoint, per family."""
    import warnings

    import torch.distributed.checkpoint as dcp
    from safetensors.torch import save_file

    out = {}
    for family in ("qwen3-moe", "mixtral", "gpt-oss", "deepseek-v3"):
        d = tmp_path_factory.mktemp(family)
        sd = {k: v.contiguous() for k, v in build_model(family, num_experts=E).state_dict().items()}
        save_file(sd, str(d / "model.safetensors"))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dcp.save(sd, checkpoint_id=str(d / "dcp"), no_dist=True)
        out[family] = d
    return out


def _user_materializes_the_rest(model, path) -> None:
    """The user's part (what a training script does for its non-expert weights): allocate every parameter, load the
    non-expert tensors from the checkpoint, recompute the buffers no checkpoint holds (RoPE's)."""
    from safetensors import safe_open

    import ultraep

    model.to_empty(device="cpu")
    masters = {f"{la.name}.{n}" for la in ultraep.runtime_of(model).layers for n in la.adapter.param_names}
    own = set(model.state_dict())
    with safe_open(str(path), framework="pt", device="cpu") as f:
        rest = {k: f.get_tensor(k) for k in f.keys() if k in own and k not in masters}
    missing, unexpected = model.load_state_dict(rest, strict=False)
    assert set(missing) == masters and not unexpected, (missing, unexpected)
    for m in model.modules():
        if "RotaryEmbedding" in type(m).__name__:
            model._init_weights(m)


class _ShiftedRows:
    """The negative control's source: reads another rank's rows (``first + M`` modulo E) through a real source."""

    def __new__(cls, inner):
        from ultraep.runtime.master_rows import MasterRead, MasterSource

        class Shifted(MasterSource):
            def fill(self, reads):
                inner.fill([MasterRead(r.key, (r.first + r.out.shape[0]) % r.num_experts, r.num_experts, r.out,
                                       r.field) for r in reads])

        return Shifted()


def _meta_equivalence(rank, world, family, ckpt_dir, kind, shifted):
    import ultraep
    from ultraep.runtime.masters import held_bytes

    ref = build_model(family, num_experts=E)  # what the checkpoint was written from
    with torch.device("meta"):
        model = build_model(family, num_experts=E)
    # the replica budget: room for every layer's 2 replica slots on this rank, in bytes
    expert_bytes = sum(p[0].numel() * p[0].element_size() for n, p in ref.named_parameters() if _is_expert(n)
                       and n.startswith("model.layers.0."))
    budget = 2 * expert_bytes * len(ref.model.layers)
    ultraep.wrap(model, {**CONFIG, "replica_memory_budget": budget}, device="cpu")
    rt = ultraep.runtime_of(model)
    at_wrap = all(p.device.type == "meta" for layer in rt.layers for p in layer.master_params())
    _user_materializes_the_rest(model, ckpt_dir / "model.safetensors")
    source = (ultraep.SafetensorsMasters(ckpt_dir / "model.safetensors") if kind == "safetensors"
              else ultraep.DCPMasters(ckpt_dir / "dcp"))
    ultraep.load_masters(model, _ShiftedRows(source) if shifted else source)
    ids = _batch(rank)
    out = model(input_ids=ids).logits
    ref_out = ref(input_ids=ids).logits
    out.float().pow(2).mean().backward()
    ref_out.float().pow(2).mean().backward()
    rt.next_step()
    held = held_bytes(rt.layers)
    return {
        "logits": rel_error(out, ref_out), "grad": master_grad_errors(rt, ref, rank),
        "other": param_grad_errors(model, ref, skip=_is_expert), "at_wrap_meta": at_wrap, "held": held,
        "budget": budget, "replicas": [layer.last_plan.num_replicas for layer in rt.layers],
        "master_shapes": [tuple(p.shape) for layer in rt.layers for p in layer.master_params()],
    }


def _report_memory(results, world, what):
    for rank, r in enumerate(results):
        h = r["held"]
        print(f"{what} R={world} rank {rank}: masters {h['masters']} B + replicas {h['replicas']} B "
              f"(budget {r['budget']} B) vs full {h['full']} B; "
              f"masters x R / full = {h['masters'] * world / h['full']}")


@pytest.mark.parametrize("world,family,kind", [(2, "qwen3-moe", "safetensors"), (4, "qwen3-moe", "safetensors"),
                                               (2, "mixtral", "dcp"), (4, "qwen3-moe", "dcp"),
                                               (2, "gpt-oss", "safetensors"), (4, "deepseek-v3", "dcp")])
def test_meta_model_loaded_by_rows_equals_the_full_model(checkpoints, world, family, kind):
    results = run_ranks(_meta_equivalence, world, family, checkpoints[family], kind, False)
    _report_memory(results, world, f"{family}/{kind}")
    for r in results:
        assert r["at_wrap_meta"], "wrap allocated masters on a meta model"
        assert_within({"logits": r["logits"], **r["grad"], **r["other"]}, what=f"{family}/{kind}/R={world}")
        assert all(s[0] == E // world for s in r["master_shapes"]), r["master_shapes"]
        h = r["held"]
        # the measured share: masters are exactly E/R of the full expert tensors, the containers hold nothing,
        # and the replica buffers stay within the budget
        assert h["masters"] * world == h["full"], h
        assert h["containers"] == 0, h
        assert 0 < h["replicas"] <= r["budget"], h
        assert h["masters"] + h["replicas"] <= h["full"] // world + r["budget"] < h["full"], h
    assert max(max(r["replicas"]) for r in results) > 0, "no replicas were made: the budget was not exercised"


def test_wrong_rows_fail_the_exactness_check(checkpoints):
    """Negative control: each rank loads the next rank's rows (a real source, shifted): the check must fail."""
    results = run_ranks(_meta_equivalence, 2, "qwen3-moe", checkpoints["qwen3-moe"], "safetensors", True)
    worst = max(max(r["logits"], *r["grad"].values()) for r in results)
    assert worst > 100 * tolerance(torch.float32), worst
    with pytest.raises(AssertionError):
        for r in results:
            assert_within({"logits": r["logits"], **r["grad"]})


def _refusals(rank, world, ckpt_dir):
    import ultraep
    from ultraep.errors import UltraEPError

    out = {}

    def refused(name, fn):
        try:
            fn()
        except UltraEPError as exc:
            out[name] = str(exc)
        else:
            out[name] = "no error"

    with torch.device("meta"):
        model = build_model("qwen3-moe", num_experts=E)
    ultraep.wrap(model, CONFIG, device="cpu")
    ids = _batch(rank)
    refused("forward on meta", lambda: model(input_ids=ids))
    refused("load before to_empty", lambda: ultraep.load_masters(model, ultraep.InitMasters(lambda t, k, e: None)))
    _user_materializes_the_rest(model, ckpt_dir / "model.safetensors")
    refused("forward unloaded", lambda: model(input_ids=ids))
    refused("missing key", lambda: ultraep.load_masters(
        model, ultraep.SafetensorsMasters(ckpt_dir / "model.safetensors", key=lambda k: k + ".nope")))
    refused("missing key dcp", lambda: ultraep.load_masters(
        model, ultraep.DCPMasters(ckpt_dir / "dcp", key=lambda k: k + ".nope")))
    # one expert tensor read from a non-expert tensor of another shape
    def to_embed(k):
        return "model.embed_tokens.weight" if k == "model.layers.0.mlp.experts.gate_up_proj" else k

    refused("shape", lambda: ultraep.load_masters(
        model, ultraep.SafetensorsMasters(ckpt_dir / "model.safetensors", key=to_embed)))
    refused("shape dcp", lambda: ultraep.load_masters(model, ultraep.DCPMasters(ckpt_dir / "dcp", key=to_embed)))
    refused("not a source", lambda: ultraep.load_masters(model, str(ckpt_dir)))
    refused("no dcp folder", lambda: ultraep.DCPMasters(ckpt_dir))
    # an init: each expert's rows from its own seed; the forward runs (loaded) and the rows are this rank's
    seen = []

    def init(t, key, experts):
        seen.append((key, experts))
        for i, e in enumerate(experts):
            t[i].copy_(torch.randn(t.shape[1:], generator=torch.Generator().manual_seed(e)) * 0.02)

    ultraep.load_masters(model, ultraep.InitMasters(init))
    y = model(input_ids=ids).logits
    out["init"] = (bool(torch.isfinite(y).all()), sorted({(e.start, e.stop) for _, e in seen}))
    refused("device", lambda: ultraep.wrap(build_model("qwen3-moe", num_experts=E), CONFIG, device="meta"))
    return out


def test_what_cannot_work_is_refused_in_one_line(checkpoints):
    results = run_ranks(_refusals, 2, checkpoints["qwen3-moe"])
    for rank, out in enumerate(results):
        for name, text in out.items():
            if name != "init":
                assert text != "no error" and "\n" not in text, (name, text)
        assert "model.layers.0.mlp.experts.masters" in out["forward on meta"] and "meta" in out["forward on meta"]
        before = out["load before to_empty"]
        assert "to_empty" in before and before.startswith("model.layers.0.mlp.experts."), before
        assert "never loaded" in out["forward unloaded"] and "load_masters" in out["forward unloaded"]
        assert "gate_up_proj.nope" in out["missing key"] and "not in the safetensors" in out["missing key"]
        assert "gate_up_proj.nope" in out["missing key dcp"] and "not in the DCP" in out["missing key dcp"]
        assert out["shape"].startswith("model.embed_tokens.weight") and "[8, 32, 32]" in out["shape"], out["shape"]
        assert out["shape dcp"].startswith("model.embed_tokens.weight"), out["shape dcp"]
        assert "masters" in out["not a source"] and "str" in out["not a source"]
        assert ".metadata" in out["no dcp folder"]
        assert out["device"].startswith("device"), out["device"]
        finite, ranges = out["init"]
        assert finite and ranges == [(4 * rank, 4 * rank + 4)], out["init"]


def test_sources_read_only_the_rows_asked_for(tmp_path):
    """Without ranks: both checkpoint readers return rows ``first .. first + M - 1`` of the stored tensor (and the
    dtype of the target), and refuse a stored tensor of another shape."""
    import json
    import warnings

    import torch.distributed.checkpoint as dcp
    from safetensors.torch import save_file

    from ultraep.errors import UltraEPError
    from ultraep.runtime.master_rows import DCPMasters, MasterRead, SafetensorsMasters

    full, dbrx = torch.randn(8, 3, 5), torch.randn(24, 5)
    save_file({"a.w": full, "b": torch.zeros(2), "d.w": dbrx}, str(tmp_path / "m.safetensors"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"a.w": full, "b": torch.zeros(2), "d.w": dbrx}, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    # a folder of shards with its index (as transformers saves large models): the index says which file holds a key
    shards = tmp_path / "shards"
    shards.mkdir()
    save_file({"a.w": full}, str(shards / "model-00001-of-00002.safetensors"))
    save_file({"b": torch.zeros(2), "d.w": dbrx}, str(shards / "model-00002-of-00002.safetensors"))
    (shards / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"a.w": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors",
                        "d.w": "model-00002-of-00002.safetensors"}}))
    for source in (SafetensorsMasters(tmp_path / "m.safetensors"), SafetensorsMasters(tmp_path),
                   SafetensorsMasters(shards), DCPMasters(tmp_path / "dcp")):
        out = torch.zeros(2, 3, 5, dtype=torch.float64)
        source.fill([MasterRead("a.w", 6, 8, out, "x.w")])
        assert torch.equal(out, full[6:8].double()), type(source).__name__
        with pytest.raises(UltraEPError, match=r"^a\.w: .*\[4, 3, 5\]"):
            source.fill([MasterRead("a.w", 0, 4, torch.zeros(2, 3, 5), "x.w")])  # a layer of 4 experts
        # DBRX's layout: [E * I, H] stored, [M, I, H] masters (I = 3 stored rows per expert)
        flat = torch.zeros(2, 3, 5)
        source.fill([MasterRead("d.w", 6, 8, flat, "x.d", (24, 5))])
        assert torch.equal(flat, dbrx[18:24].view(2, 3, 5)), type(source).__name__
        folded = type(source)(getattr(source, "path", getattr(source, "checkpoint_id", None)), key=lambda k: "a.w")
        with pytest.raises(UltraEPError, match=r"^a\.w: is the checkpoint key of both x\.w and y\.w"):
            folded.fill([MasterRead("a.w", 0, 8, torch.zeros(2, 3, 5), "x.w"),
                         MasterRead("b.w", 0, 8, torch.zeros(2, 3, 5), "y.w")])
    with pytest.raises(UltraEPError, match=r"^masters\.path: .*does not exist"):
        SafetensorsMasters(tmp_path / "nowhere")
    with pytest.raises(UltraEPError, match=r"^masters\.path: .*no \.safetensors file"):
        SafetensorsMasters(tmp_path / "dcp").fill([MasterRead("a.w", 0, 8, torch.zeros(2, 3, 5), "x.w")])


def _save_wrapped(rank, world, path, plain):
    """A wrapped full model saved with DCP's default planner, each rank writing its masters as its rows of the
    [E, ...] tensors (its state_dict's DTensors). ``plain``: the negative control, masters left plain [M, ...]
    tensors in the state dict."""
    import torch.distributed.checkpoint as dcp

    import ultraep
    from ultraep.runtime import master_checkpoint

    if plain:
        master_checkpoint.as_whole = lambda rows, mesh: rows
    model = build_model("qwen3-moe", num_experts=E)
    ultraep.wrap(model, CONFIG)
    dcp.save(model.state_dict(), checkpoint_id=str(path))


def _meta_from_dcp(rank, world, path):
    """A meta model on another number of ranks, everything loaded from the DCP checkpoint of the wrapped model: the
    non-expert weights by the user (dcp.load of those keys), the masters by rows (load_masters)."""
    import torch.distributed.checkpoint as dcp

    import ultraep

    ref = build_model("qwen3-moe", num_experts=E)
    with torch.device("meta"):
        model = build_model("qwen3-moe", num_experts=E)
    ultraep.wrap(model, CONFIG, device="cpu")
    rt = ultraep.runtime_of(model)
    model.to_empty(device="cpu")
    masters = {f"{la.name}.{n}" for la in rt.layers for n in la.adapter.param_names}
    rest = {k: v for k, v in model.state_dict().items() if k not in masters}
    dcp.load(rest, checkpoint_id=str(path))
    for m in model.modules():
        if "RotaryEmbedding" in type(m).__name__:
            model._init_weights(m)
    try:
        ultraep.load_masters(model, ultraep.DCPMasters(path))
    except ultraep.UltraEPError as exc:
        return {"refused": str(exc)}
    ids = _batch(rank)
    out, ref_out = model(input_ids=ids).logits, ref(input_ids=ids).logits
    out.float().pow(2).mean().backward()
    ref_out.float().pow(2).mean().backward()
    return {"logits": rel_error(out, ref_out), **master_grad_errors(rt, ref, rank)}


def test_a_wrapped_model_saved_with_dcp_loads_by_rows_on_other_ranks(tmp_path):
    """Saved from 4 ranks by plain dcp.save, the checkpoint is the unwrapped model's ([E, ...] expert tensors
    from four chunks); a meta model on 2 ranks loads it (rest and masters) and computes the full model exactly.
    Negative control: with the masters plain [M, ...] tensors in the state dict (before master_checkpoint), DCP
    keeps one rank's rows, and the load is refused."""
    run_ranks(_save_wrapped, 4, tmp_path / "ok", False, p2p=False)  # saving: nothing moves between ranks
    for r in run_ranks(_meta_from_dcp, 2, tmp_path / "ok"):
        assert "refused" not in r, r
        assert_within(r, what="saved on 4 ranks, loaded on 2")
    run_ranks(_save_wrapped, 4, tmp_path / "bad", True, p2p=False)
    for r in run_ranks(_meta_from_dcp, 2, tmp_path / "bad", p2p=False):  # refused before any forward
        assert "refused" in r and "holds shape [2, 32, 32]" in r["refused"], r


def _plain_pytorch(rank, world, path):
    """A plain PyTorch model (a registered experts container, its own router) built on meta, loaded by rows."""
    from safetensors.torch import load_file

    import ultraep
    from test_runtime import TinyExperts, TinyMoE, tiny_errors
    from ultraep.runtime.masters import held_bytes

    ultraep.register_experts(TinyExperts, ("w_in", "w_out"), TinyExperts.expert)
    ref = torch.nn.Sequential(TinyMoE(), TinyMoE())
    ref.load_state_dict(load_file(str(path)))
    with torch.device("meta"):
        model = torch.nn.Sequential(TinyMoE(), TinyMoE())
    ultraep.wrap(model, {**CONFIG, "replica_memory_budget": 0}, device="cpu")  # budget 0: shared buffers only
    model.to_empty(device="cpu")
    sd = load_file(str(path))
    model.load_state_dict({k: v for k, v in sd.items() if "router" in k}, strict=False)
    ultraep.load_masters(model, ultraep.SafetensorsMasters(path))
    return (*tiny_errors(model, ref, rank), held_bytes(ultraep.runtime_of(model).layers))


def test_a_plain_pytorch_model_on_meta(tmp_path):
    from safetensors.torch import save_file

    from test_runtime import skewed_tiny_moes

    full = skewed_tiny_moes()
    save_file({k: v.contiguous() for k, v in full.state_dict().items()}, str(tmp_path / "tiny.safetensors"))
    for logits, grad, replicas, held in run_ranks(_plain_pytorch, 2, tmp_path / "tiny.safetensors"):
        assert_within({"logits": logits, "w_in.grad": grad})
        assert max(replicas) > 0
        assert held["masters"] * 2 == held["full"] and held["containers"] == 0, held


def _fsdp2_from_meta(rank, world, ckpt_dir, steps, break_hooks=False):
    """The order a training engine (torchtitan) runs: build on meta, wrap, fully_shard on meta with the masters
    ignored, to_empty, the rest loaded by DCP into its shards, the masters by rows; then train ``steps`` optimizer
    steps against the unwrapped model on the global batch, each with its own optimizer (tests/test_train_as_users.py's
    comparison: losses, gradients, and every parameter after each step)."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.fsdp import fully_shard

    import ultraep
    from replica_probe import served_rows
    from test_train_as_users import _batch as batch_of, _differs, _grads, _loss, _params

    served = served_rows()

    ref = build_model("qwen3-moe", num_experts=E)
    with torch.device("meta"):
        model = build_model("qwen3-moe", num_experts=E)
    ultraep.wrap(model, CONFIG, device="cpu")
    rt = ultraep.runtime_of(model)
    if break_hooks:  # the negative control: the hooks stay on the meta parameters to_empty replaces
        from ultraep.runtime.masters import MasterState

        MasterState.hook = lambda self, params: None
    ignored = ultraep.expert_params(model)
    for layer in model.model.layers:
        fully_shard(layer, ignored_params=ignored)
    fully_shard(model, ignored_params=ignored)
    model.to_empty(device="cpu")
    masters = {f"{la.name}.{n}" for la in rt.layers for n in la.adapter.param_names}
    dcp.load({k: v for k, v in model.state_dict().items() if k not in masters}, checkpoint_id=str(ckpt_dir / "dcp"))
    for m in model.modules():
        if "RotaryEmbedding" in type(m).__name__:
            model._init_weights(m)
    ultraep.load_masters(model, ultraep.DCPMasters(ckpt_dir / "dcp"))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)  # after to_empty: the new parameters
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
    problems, grad_scale = [], TrainingScale()  # a gradient judged by its largest so far (tests/numerics.py)
    for step in range(steps):
        opt.zero_grad(set_to_none=True)
        ref_opt.zero_grad(set_to_none=True)
        ids = batch_of(rank, step)
        loss = _loss(model(input_ids=ids, use_cache=False).logits, ids)
        loss.backward()
        everyone = torch.cat([batch_of(r, step) for r in range(world)])
        ref_loss = _loss(ref(input_ids=everyone, use_cache=False).logits, everyone)
        ref_loss.backward()
        total = loss.detach().clone()
        dist.all_reduce(total)
        if (d := _differs(total / world, ref_loss.detach())) is not None:
            problems.append(f"step {step} loss: {d}")
        ref_params = dict(ref.named_parameters())
        for name, (g, is_master) in _grads(model, rt, rank).items():
            want = ref_params[name].grad
            if is_master:
                want = want[rank * g.shape[0]:(rank + 1) * g.shape[0]]
            if (d := _differs(g, want, grad_scale.update(name, want))) is not None:
                problems.append(f"step {step} {name}: {d}")
        opt.step()
        ref_opt.step()
        for name, (p, is_master) in _params(model, rt).items():  # each trained on its own: compared
            want = ref_params[name].detach()
            if is_master:
                want = want[rank * p.shape[0]:(rank + 1) * p.shape[0]]
            if (d := _differs(p, want)) is not None:
                problems.append(f"step {step} {name} parameter after the update: {d}")
        rt.next_step(loss=float(total))
    return {"problems": problems[:8], "replicas": sum(served.values())}


def test_the_engine_order_fsdp2_on_meta_trains_like_the_full_model(checkpoints):
    """wrap → fully_shard (masters ignored) → to_empty → dcp.load of the rest → load_masters, on 2 ranks, 2 steps:
    every loss and gradient equals the unwrapped model's on the global batch (the masters' gradient hook, replaced
    by to_empty with the parameters, is attached again: without it FSDP2's averaging would be off by R)."""
    results = run_ranks(_fsdp2_from_meta, 2, checkpoints["qwen3-moe"], 2)
    for rank, r in enumerate(results):
        assert not r["problems"], f"rank {rank}: " + "\n".join(r["problems"])
    assert sum(r["replicas"] for r in results) > 0


def test_without_the_hook_on_the_allocated_masters_fsdp2_training_is_off(checkpoints):
    """Negative control of the test above: with the gradient hook left on the meta parameters that to_empty
    replaced, FSDP2's averaging misses the masters and the master gradients are R times the full model's."""
    results = run_ranks(_fsdp2_from_meta, 2, checkpoints["qwen3-moe"], 1, True)
    for r in results:
        masters_off = [p for p in r["problems"] if ".experts." in p]
        assert masters_off and len(masters_off) == len(r["problems"]), r["problems"]


def _rewritten_from_meta(rank, world, family, path):
    """A family whose MoE block ultraep rewrites (JetMoE: experts under other names; Longcat-Flash: E real experts
    before Z zero-computation rows of one tensor) built on meta, its masters read by rows from the unwrapped model's
    checkpoint in the block's original keys and layouts."""
    import torch.distributed.checkpoint as dcp

    import ultraep
    from test_adapters_conformance import _whole_model

    ref = _whole_model(family)
    with torch.device("meta"):
        model = _whole_model(family)
    ultraep.wrap(model, CONFIG, device="cpu")
    rt = ultraep.runtime_of(model)
    _user_materializes_the_rest(model, path / "model.safetensors")
    ultraep.load_masters(model, ultraep.SafetensorsMasters(path / "model.safetensors"))
    ids = _batch(rank)
    out, ref_out = model(input_ids=ids).logits, ref(input_ids=ids).logits
    out.float().pow(2).mean().backward()
    ref_out.float().pow(2).mean().backward()
    errors = {"logits": rel_error(out, ref_out)}
    # the masters' gradients against the unwrapped block's own parameters (original names and layouts)
    ref_sd = dict(ref.named_parameters())
    for la in rt.layers:
        from ultraep.runtime.master_rows import reads_of

        for read in reads_of([la]):
            g = ref_sd[read.key].grad.clone()
            torch.distributed.all_reduce(g)
            start, stop = read.stored_rows
            name = read.field.rpartition(".")[2]
            errors[read.field] = rel_error(getattr(la, name).grad.reshape(stop - start, *g.shape[1:]), g[start:stop])
    # the wrapped model's own checkpoint (the container's names, each master a Shard(0) DTensor of [E, ...]) round
    # trips into masters overwritten meanwhile
    masters = [p.detach().clone() for la in rt.layers for p in la.master_params()]
    dcp.save(model.state_dict(), checkpoint_id=str(path / "wrapped"))
    with torch.no_grad():
        for la in rt.layers:
            for p in la.master_params():
                p.zero_()
    sd = model.state_dict()
    dcp.load(sd, checkpoint_id=str(path / "wrapped"))
    model.load_state_dict(sd)
    errors["round trip"] = max(rel_error(p, m) for p, m in
                               zip((p for la in rt.layers for p in la.master_params()), masters))
    return errors


@pytest.mark.parametrize("family", ["jetmoe", "longcat_flash"])
def test_a_rewritten_block_on_meta_loads_by_rows_from_its_original_keys(tmp_path, family):
    from safetensors.torch import save_file

    from test_adapters_conformance import _whole_model

    save_file({k: v.detach().clone() for k, v in _whole_model(family).state_dict().items()},
              str(tmp_path / "model.safetensors"))
    for r in run_ranks(_rewritten_from_meta, 2, family, tmp_path):
        assert r.pop("round trip") == 0.0, r
        assert len(r) > 1, r
        assert_within(r, what=family)


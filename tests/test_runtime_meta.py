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
from numerics import assert_within, master_grad_errors, param_grad_errors, rel_error, tolerance
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
    for family in ("qwen3-moe", "mixtral"):
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

    model.to_empty(device="cpu")
    own = set(model.state_dict())
    with safe_open(str(path), framework="pt", device="cpu") as f:
        rest = {k: f.get_tensor(k) for k in f.keys() if not _is_expert(k) and k in own}
    missing, unexpected = model.load_state_dict(rest, strict=False)
    assert all(_is_expert(k) for k in missing) and not unexpected, (missing, unexpected)
    for m in model.modules():
        if "RotaryEmbedding" in type(m).__name__:
            model._init_weights(m)


class _ShiftedRows:
    """The negative control's source: reads another rank's rows (``first + M`` modulo E) through a real source."""

    def __new__(cls, inner):
        from ultraep.runtime.master_source import MasterRead, MasterSource

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
              f"(budget {r['budget']} B) vs full {h['full']} B; masters x R / full = {h['masters'] * world / h['full']}")


@pytest.mark.parametrize("world,family,kind", [(2, "qwen3-moe", "safetensors"), (4, "qwen3-moe", "safetensors"),
                                               (2, "mixtral", "dcp"), (4, "qwen3-moe", "dcp")])
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
    # every expert key read from a non-expert tensor of another shape
    refused("shape", lambda: ultraep.load_masters(
        model, ultraep.SafetensorsMasters(ckpt_dir / "model.safetensors", key=lambda k: "model.embed_tokens.weight")))
    refused("shape dcp", lambda: ultraep.load_masters(
        model, ultraep.DCPMasters(ckpt_dir / "dcp", key=lambda k: "model.embed_tokens.weight")))
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
        assert "to_empty" in out["load before to_empty"] and "model.layers.0.mlp.experts." in out["load before to_empty"]
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
    import warnings

    import torch.distributed.checkpoint as dcp
    from safetensors.torch import save_file

    from ultraep.errors import UltraEPError
    from ultraep.runtime.master_source import DCPMasters, MasterRead, SafetensorsMasters

    full = torch.randn(8, 3, 5)
    save_file({"a.w": full, "b": torch.zeros(2)}, str(tmp_path / "m.safetensors"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"a.w": full, "b": torch.zeros(2)}, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    for source in (SafetensorsMasters(tmp_path / "m.safetensors"), SafetensorsMasters(tmp_path),
                   DCPMasters(tmp_path / "dcp")):
        out = torch.zeros(2, 3, 5, dtype=torch.float64)
        source.fill([MasterRead("a.w", 6, 8, out, "x.w")])
        assert torch.equal(out, full[6:8].double()), type(source).__name__
        with pytest.raises(UltraEPError, match=r"^a\.w: .*\[4, 3, 5\]"):
            source.fill([MasterRead("a.w", 0, 4, torch.zeros(2, 3, 5), "x.w")])  # a layer of 4 experts

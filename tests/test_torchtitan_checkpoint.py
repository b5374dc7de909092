"""A balanced torchtitan model checkpointed by torchtitan's own ``CheckpointManager`` (DCP, default planners), on
gloo ranks: every rank's experts are written, and every load gives each rank its rows.

* saved by the manager (sync, async, and the last step's model-only save) on 2 and 4 ranks, loaded by a new manager into a fresh balanced model
  (other weights), into one built the trainer's way (override, meta, FSDP2, ``init_weights``) and, with plain
  ``dcp.load``, into an unwrapped model in one process and into a balanced model
  on another number of ranks: every expert row equals the saved model's, exactly;
* train 2 steps (torchtitan's FSDP application, its AdamW container), save, build everything anew, load, train 2
  more: losses and parameters equal 4 steps straight;
* a user's own loop (``torch.optim.AdamW``, ``dcp.save`` of ``model.state_dict()`` and ``opt.state_dict()``):
  every master row and every row of its AdamW state comes back;
* negative controls: the plain-tensor path of before (masters left as ``[M, ...]`` tensors in the state dicts)
  loses rows (the row comparison and the resume comparison fail on it), and so does leaving only their optimizer
  state plain (the resume and the AdamW comparisons fail on it); a plain ``[M, ...]`` tensor given to
  ``load_state_dict`` is refused in one line.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("torchtitan")
sys.path.insert(0, str(Path(__file__).resolve().parent))
import titan_models as tm  # noqa: E402
from dist_utils import run_ranks  # noqa: E402
from numerics import rel_error, tolerance  # noqa: E402

tm._registry("qwen3")  # imported before fork: ranks start fast

FAMILY = "qwen3"
CONFIG = {"policy": "quota", "num_redundant_slots": 2}


def _old_path(monkey) -> None:
    """The negative controls: the masters (``True``), or only their optimizer state (``"optimizer"``), stay plain
    ``[M, ...]`` tensors in the state dicts, as before."""
    from ultraep.runtime import master_checkpoint as mc

    if monkey == "optimizer":
        mc._optim_state_dict_hook = lambda optimizer, state_dict: state_dict
        mc._optim_load_pre_hook = lambda optimizer, state_dict: state_dict
    elif monkey:
        mc.as_whole = lambda rows, mesh: rows
        mc.own_rows = lambda value, key, local, layer: value.to_local() if hasattr(value, "to_local") else value


def _manager(model, folder, async_mode="disabled", lr=1e-2):
    """torchtitan's CheckpointManager over ``model``, its AdamW container and LR schedulers, as the trainer builds
    them (no dataloader state)."""
    from torchtitan.components.checkpoint import CheckpointManager
    from torchtitan.components.optimizer.lr_scheduler import LRSchedulersContainer
    from torchtitan.components.optimizer import default_adamw

    cfg = default_adamw(lr=lr)
    cfg.implementation = "for-loop"
    opt = cfg.build(model_parts=[model])
    sched = LRSchedulersContainer(opt, lambda step: 1.0)
    ckpt = CheckpointManager(CheckpointManager.Config(enable=True, folder="ckpt", interval=1, keep_latest_k=0,
                                                      async_mode=async_mode),
                             dataloader=None, model_parts=[model], optimizers=opt, lr_schedulers=sched,
                             states={}, sd_adapter=None, base_folder=str(folder))
    return opt, sched, ckpt


def _expert_keys(model) -> list[str]:
    import ultraep

    return [f"{la.name}.{n}" for la in ultraep.runtime_of(model).layers for n in la.adapter.param_names]


def _row_mismatches(model, full: dict[str, torch.Tensor], rank: int) -> list[str]:
    """Names of the masters whose rows differ from rows ``first .. first + M - 1`` of ``full``'s tensor."""
    import ultraep

    out = []
    for la in ultraep.runtime_of(model).layers:
        for n in la.adapter.param_names:
            p = getattr(la, n).detach()
            want = full[f"{la.name}.{n}"][la.first_expert:la.first_expert + p.shape[0]]
            if not torch.equal(p, want):
                out.append(f"{la.name}.{n}")
    return out


def _save(rank, world, folder, async_mode, old):
    import ultraep

    _old_path(old)
    ref = tm.decoder(FAMILY, seed=0)
    full = {k: v.detach().clone() for k, v in ref.state_dict().items()}
    model = tm.decoder(FAMILY, seed=0)
    ultraep.wrap(model, CONFIG)
    opt, _, ckpt = _manager(model, folder, "disabled" if async_mode == "last-step" else async_mode)
    assert ckpt.save(curr_step=1, last_step=async_mode == "last-step")  # the last step: the model only
    ckpt.maybe_wait_for_saving()
    ckpt.close()
    return _row_mismatches(model, full, rank)


def _load_balanced(rank, world, folder, old):
    """A fresh balanced model (other weights) loaded by a new manager from the latest step."""
    import ultraep

    _old_path(old)
    full = {k: v.detach().clone() for k, v in tm.decoder(FAMILY, seed=0).state_dict().items()}
    model = tm.decoder(FAMILY, seed=5)
    ultraep.wrap(model, CONFIG)
    assert _row_mismatches(model, full, rank), "the fresh model must start from other weights"
    _, _, ckpt = _manager(model, folder)
    try:
        assert ckpt.load()
    except Exception as exc:  # noqa: BLE001 - the old checkpoint may be refused rather than loaded wrong
        return {"refused": f"{type(exc).__name__}: {exc}".splitlines()[0]}
    finally:
        ckpt.close()
    return {"mismatches": _row_mismatches(model, full, rank)}


def _load_trainer_path(rank, world, folder):
    """The trainer's own order on resume: the model spec with ultraep's override, built on the meta device,
    ``parallelize_fn`` (FSDP2), ``to_empty``, ``init_weights`` (masters initialised by rows), then the manager's
    load: every master row and every other parameter equal the saved model's."""
    from torchtitan.config.override import OverrideConfig, apply_overrides

    from test_torchtitan_train import _full, _parallelize_kwargs

    full = {k: v.detach().clone() for k, v in tm.decoder(FAMILY, seed=0).state_dict().items()}
    spec = tm._registry(FAMILY)
    spec.model = tm.decoder_config(FAMILY)
    apply_overrides(OverrideConfig(imports=[("ultraep.integrations.torchtitan.balanced", {"policy": "quota",
                                                                                         "slots": 2})]), spec)
    with torch.device("meta"):
        model = spec.model.build()
    tm.swap_attention(model)
    model = spec.parallelize_fn(model, **_parallelize_kwargs(world, "fsdp"))
    model.to_empty(device="cpu")
    torch.manual_seed(3)
    with torch.no_grad():
        model.init_weights(buffer_device=torch.device("cpu"))
    assert _row_mismatches(model, full, rank), "init_weights must give other weights than the checkpoint's"
    _, _, ckpt = _manager(model, folder)
    assert ckpt.load()
    ckpt.close()
    masters = set(_expert_keys(model))
    others = [k for k, v in model.state_dict().items() if k not in masters and k in full
              and not torch.equal(_full(v), full[k])]
    return _row_mismatches(model, full, rank) + others


def _load_plain_dcp_balanced(rank, world, folder):
    """A user's own ``dcp.load(model.state_dict())`` then ``load_state_dict``, into a balanced model."""
    import torch.distributed.checkpoint as dcp

    import ultraep

    full = {k: v.detach().clone() for k, v in tm.decoder(FAMILY, seed=0).state_dict().items()}
    model = tm.decoder(FAMILY, seed=5)
    ultraep.wrap(model, CONFIG)
    sd = model.state_dict()
    dcp.load(sd, checkpoint_id=str(folder / "ckpt" / "step-1"))
    model.load_state_dict(sd)
    return _row_mismatches(model, full, rank)


def _load_unwrapped(folder) -> list[str]:
    """An unwrapped model in one process: ``dcp.load`` of its state dict (whole ``[E, ...]`` expert tensors)."""
    import torch.distributed.checkpoint as dcp

    full = {k: v.detach().clone() for k, v in tm.decoder(FAMILY, seed=0).state_dict().items()}
    model = tm.decoder(FAMILY, seed=5)
    sd = model.state_dict()
    dcp.load(sd, checkpoint_id=str(folder / "ckpt" / "step-1"), no_dist=True)
    model.load_state_dict(sd)
    experts = [k for k in full if "inner_experts" in k]
    assert experts
    return [k for k in experts if not torch.equal(model.state_dict()[k], full[k])]


@pytest.mark.parametrize("async_mode", ["disabled", "async", "last-step"])
def test_torchtitans_checkpointer_saves_every_ranks_experts(tmp_path, async_mode):
    for r in run_ranks(_save, 2, tmp_path, async_mode, False, p2p=False):
        assert r == [], r  # (the saved model holds the reference's rows)
    if async_mode != "last-step":  # (the last step's model-only checkpoint is an export, not a resume point)
        for r in run_ranks(_load_balanced, 2, tmp_path, False, p2p=False):
            assert r == {"mismatches": []}, r
    if async_mode == "disabled":
        for r in run_ranks(_load_trainer_path, 2, tmp_path, p2p=False):
            assert r == [], r
    assert _load_unwrapped(tmp_path) == []
    for r in run_ranks(_load_plain_dcp_balanced, 4, tmp_path, p2p=False):  # another number of ranks
        assert r == [], r


def test_four_ranks_save_and_two_load(tmp_path):
    run_ranks(_save, 4, tmp_path, "disabled", False, p2p=False)
    for r in run_ranks(_load_balanced, 2, tmp_path, False, p2p=False):
        assert r == {"mismatches": []}, r
    assert _load_unwrapped(tmp_path) == []


def test_the_old_plain_tensor_path_loses_rows(tmp_path):
    """Negative control: masters left plain in the state dicts — DCP keeps one rank's [M, ...] copy."""
    run_ranks(_save, 2, tmp_path, "disabled", True, p2p=False)
    results = run_ranks(_load_balanced, 2, tmp_path, True, p2p=False)
    assert any(r["mismatches"] for r in results), results  # a rank got another rank's rows, silently
    from torch.distributed.checkpoint.api import CheckpointException

    with pytest.raises(CheckpointException, match="Size mismatch"):  # one rank's [M, ...] where [E, ...] belongs
        _load_unwrapped(tmp_path)


def _refuse_rows(rank, world):
    import ultraep

    model = tm.decoder(FAMILY, seed=0)
    ultraep.wrap(model, CONFIG)
    key = _expert_keys(model)[0]
    local = {key: model.state_dict()[key].to_local().clone()}
    try:
        model.load_state_dict(local, strict=False)
    except ultraep.UltraEPError as exc:
        return str(exc)
    return "loaded"


def test_a_plain_tensor_of_masters_rows_is_refused():
    for r in run_ranks(_refuse_rows, 2, p2p=False):
        assert "not the" in r and "experts" in r and "\n" not in r, r


# ------------------------------------------------------------------------------------------------ train and resume
def _train(model, opt, sched, rank, world, steps, first):
    import torch.distributed as dist

    import ultraep
    from test_torchtitan_train import _ce_sum, _ids

    vocab = int(model.lm_head.weight.shape[0])
    losses = []
    for step in range(first, first + steps):
        opt.zero_grad(set_to_none=True)
        ids = _ids(vocab, rank, step)
        loss = _ce_sum(model(ids), ids) / (world * ids[:, 1:].numel())
        loss.backward()
        opt.step()
        sched.step()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(float(total))
        ultraep.runtime_of(model).next_step(loss=float(total))
    return losses


def _state(model) -> dict[str, torch.Tensor]:
    """Every floating-point entry of the model: this rank's master rows, the rest whole."""
    import ultraep
    from test_torchtitan_train import _full

    masters = {f"{la.name}.{n}": getattr(la, n).detach().clone() for la in ultraep.runtime_of(model).layers
               for n in la.adapter.param_names}
    return {**{k: _full(v).detach().clone() for k, v in model.state_dict().items()
               if k not in masters and v.is_floating_point()}, **masters}


def _built(world, seed):
    import ultraep
    from test_torchtitan_train import _parallelize_kwargs, _sum_reduction
    from ultraep.integrations import torchtitan as integration

    spec = tm._registry(FAMILY)
    model = tm.decoder(FAMILY, seed=seed)
    ultraep.wrap(model, CONFIG)
    integration.parallelize(spec.parallelize_fn, model, **_parallelize_kwargs(world, "fsdp"))
    _sum_reduction(model)
    return model


def _resume(rank, world, folder, old):
    _old_path(old)
    straight = _built(world, 0)
    opt, sched, _ = _manager(straight, folder / "unused")
    losses = _train(straight, opt, sched, rank, world, 4, 0)
    want = _state(straight)

    first = _built(world, 0)
    opt, sched, ckpt = _manager(first, folder)
    losses_a = _train(first, opt, sched, rank, world, 2, 0)
    assert ckpt.save(curr_step=2)
    ckpt.close()
    del first, opt, sched, ckpt

    second = _built(world, 7)  # other weights: only the checkpoint can make it the first one
    opt, sched, ckpt = _manager(second, folder)
    assert ckpt.load()
    ckpt.close()
    losses_b = _train(second, opt, sched, rank, world, 2, 2)
    got = _state(second)
    tol = tolerance(torch.bfloat16)
    problems = [f"loss {i}: {a} vs {b}" for i, (a, b) in enumerate(zip(losses, losses_a + losses_b))
                if not rel_error(torch.tensor(a), torch.tensor(b)) <= 1e-3]
    problems += [f"{k}: {rel_error(got[k], want[k]):.3g}" for k in want if not rel_error(got[k], want[k]) <= tol]
    exact = all(torch.equal(got[k], want[k]) for k in want) and losses == losses_a + losses_b
    return problems, exact


@pytest.mark.numerics
def test_train_save_load_train_equals_training_straight(tmp_path):
    for r, (problems, exact) in enumerate(run_ranks(_resume, 2, tmp_path, False, timeout=300)):
        assert not problems, f"rank {r}: " + "\n".join(problems[:20])
        print(f"rank {r}: resumed run bit-identical to the straight one: {exact}")


@pytest.mark.numerics
@pytest.mark.parametrize("old", [True, "optimizer"])
def test_resume_through_the_old_plain_tensor_path_differs(tmp_path, old):
    """Negative controls: with the masters (or only their AdamW state) plain in the state dicts, the resumed run is
    not the straight one."""
    results = run_ranks(_resume, 2, tmp_path, old, timeout=300)
    assert any(problems for problems, _ in results), results


# ------------------------------------------------------------------------------------------------ plain PyTorch
def _plain_torch(rank, world, folder, old):
    """A user's own loop: torch.optim.AdamW, one step, ``dcp.save`` of ``model.state_dict()`` and
    ``opt.state_dict()``; a new model and optimizer (its state made by a zero step), ``dcp.load`` then
    ``load_state_dict`` of both: every master row and every row of its AdamW state is this rank's own again."""
    import torch.distributed.checkpoint as dcp
    from torchtitan.components.optimizer.utils import init_optim_state

    import ultraep

    _old_path(old)

    def built(seed):
        model = tm.decoder(FAMILY, seed=seed)
        ultraep.wrap(model, CONFIG)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-2)

    model, opt = built(0)
    vocab = int(model.lm_head.weight.shape[0])
    from test_torchtitan_train import _ce_sum, _ids

    ids = _ids(vocab, rank, 0)
    _ce_sum(model(ids), ids).backward()
    opt.step()
    masters = [p for la in ultraep.runtime_of(model).layers for p in la.master_params()]
    want = [(p.detach().clone(), {k: v.clone() for k, v in opt.state[p].items()}) for p in masters]
    dcp.save({"model": model.state_dict(), "optim": opt.state_dict()}, checkpoint_id=str(folder))

    model, opt = built(5)
    init_optim_state(opt)  # the state to load into (a zero-gradient, zero-lr step)
    state = {"model": model.state_dict(), "optim": opt.state_dict()}
    dcp.load(state, checkpoint_id=str(folder))
    model.load_state_dict(state["model"])
    opt.load_state_dict(state["optim"])
    masters = [p for la in ultraep.runtime_of(model).layers for p in la.master_params()]
    bad = []
    for i, (p, (w, s)) in enumerate(zip(masters, want)):
        if not torch.equal(p.detach(), w):
            bad.append(f"master {i}")
        bad += [f"master {i} {k}" for k, v in s.items() if not torch.equal(opt.state[p][k], v)]
    return bad


def test_plain_pytorch_get_state_dict_round_trips_masters_and_their_adam_state(tmp_path):
    for r in run_ranks(_plain_torch, 2, tmp_path / "ok", False):
        assert r == [], r
    # negative control: only the optimizer state left plain — one rank's AdamW rows end up on both
    results = run_ranks(_plain_torch, 2, tmp_path / "bad", "optimizer")
    assert any(r for r in results) and all("exp_avg" in b or "step" in b for r in results for b in r), results

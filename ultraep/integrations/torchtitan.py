"""ultraep inside torchtitan: one ``--override.imports`` line, or :func:`parallelize` in a loop of your own.

Switched on the torchtitan way (``torchtitan/overrides/``: an ``@override`` factory named in
``--override.imports``; no edit to torchtitan)::

    --override.imports 'ultraep.integrations.torchtitan.balanced={"policy": "quota", "slots": 2}'

:func:`balanced` replaces the model config (any ``Decoder.Config``: qwen3, deepseek_v3, gpt_oss, kimi_k2_7, ...)
with one that builds the same model class extended by three steps of the trainer's own order (build on the meta
device → ``parallelize_fn`` → ``to_empty`` → ``init_weights`` → optimizer):

1. **build**: the model is built as before; every ``RoutedExperts`` is prepared (``ultraep.models.torchtitan``);
2. **parallelize**: torchtitan's FSDP application (``apply_fsdp_to_decoder``) leaves the prepared experts' tensors
   out of every ``fully_shard`` (:func:`install`: they belong to ultraep; FSDP shards everything else as before);
3. **init_weights**: built on the meta device (the trainer's way), the model was wrapped at build — each rank's
   masters are ``[M, ...]``, ``to_empty`` allocates ``M`` of ``E`` rows — and its masters are initialised by rows
   with the experts class's own ``param_init`` (:func:`_expert_init`); built with real tensors, ``ultraep.wrap``
   splits the initialised experts here. The optimizer, built next, holds the masters.

In a loop of your own: ``ultraep.wrap(model, config)`` first, then :func:`parallelize` with the model spec's
``parallelize_fn`` (the same FSDP exclusion).

What it relies on: torchtitan's FSDP application sums gradients (``set_gradient_divide_factor(1.0)``; its loss is
divided by the global token count): the runtime reads that and sums the masters' gradients too
(``master_grads='auto'``). Activation checkpointing and the ``load_balance_coeff`` hook
(``register_moe_load_balancing_hook``) need nothing: the router, ``expert_bias_E`` and ``tokens_per_expert_E`` stay
in torchtitan's ``MoE``. Refused in one line: EP degree > 1, expert TP, a non-local dispatcher, a converted experts
class (``ultraep.models.torchtitan``), and an SPMD backend other than :data:`SPMD_BACKEND`
(:func:`check_spmd_backend`).

"""

from __future__ import annotations

import dataclasses

from torch import nn

from ultraep.models.torchtitan import SEAM_VERSION, check_seam, prepare, version

_PATCHED = "_ultraep_fully_shard"
#: the ``parallelism.spmd_backend`` ultraep runs under: DTensors for the model-parallel axes only, FSDP2 as usual
SPMD_BACKEND = "partial_dtensor"


def check_spmd_backend(backend: str | None) -> None:
    """Refuse, in one line naming the setting, torchtitan's ``spmd_types`` and ``full_dtensor`` backends: they make
    every parameter a DTensor on the full SPMD mesh (FSDP2 then requires it of every parameter it shards, and
    ``Module.parallelize`` types each module's states by its sharding config). An expert master is a plain tensor
    holding other experts on every rank, which neither a Replicate nor a Shard placement describes."""
    if backend is not None and backend != SPMD_BACKEND:
        from ultraep.models.experts import UnsupportedModelError

        raise UnsupportedModelError("parallelism.spmd_backend", f"refused: '{backend}' types every parameter as a "
                                    "DTensor on the full SPMD mesh, and ultraep's expert masters (other experts on "
                                    "each rank) have no such placement; set --parallelism.spmd_backend "
                                    f"{SPMD_BACKEND}")


_CLASSES: dict[tuple[type, str], type] = {}


def _ultraep_params(module: nn.Module) -> set:
    """Parameters under ``module`` that belong to ultraep: balanced layers' masters and the expert tensors of
    prepared torchtitan blocks (not yet wrapped)."""
    from ultraep.models.torchtitan import _MARK

    out = set()
    for m in module.modules():
        if getattr(m, _MARK, None) is not None or type(m).__name__ == "BalancedExperts":
            out |= set(m.parameters(recurse=False))
    return out


def install() -> None:
    """Make torchtitan's FSDP application (``torchtitan.distributed.fsdp.fully_shard``) leave ultraep's
    parameters out of every ``fully_shard`` (added to the ``ignored_params`` it passes). Idempotent; a module tree
    without ultraep parameters is sharded exactly as before."""
    import torchtitan.distributed.fsdp as titan_fsdp

    check_seam("MoE")
    original = getattr(titan_fsdp, "fully_shard", None)
    if original is None:
        raise ImportError(f"torchtitan {version()}: torchtitan.distributed.fsdp has no fully_shard; ultraep's "
                          f"integration follows torchtitan {SEAM_VERSION}")
    if getattr(original, _PATCHED, False):
        return

    def fully_shard(module, *args, ignored_params=None, **kwargs):
        mods = module if isinstance(module, (list, tuple)) else [module]
        ours = set().union(*(_ultraep_params(m) for m in mods))
        if ours:
            ignored_params = set(ignored_params or ()) | ours
        return original(module, *args, ignored_params=ignored_params, **kwargs)

    setattr(fully_shard, _PATCHED, True)
    fully_shard.original = original  # (tests take it back to show what the exclusion prevents)
    titan_fsdp.fully_shard = fully_shard


def parallelize(parallelize_fn, model: nn.Module, **kwargs) -> nn.Module:
    """``parallelize_fn(model, **kwargs)`` (a torchtitan model spec's ``parallelize_fn``) on a model ``ultraep.wrap``
    balanced, its FSDP application leaving the expert masters to ultraep."""
    parallelism = kwargs.get("parallelism")
    check_spmd_backend(getattr(parallelism, "spmd_backend", None))
    install()
    return parallelize_fn(model, **kwargs)


def _balanced_class(owner: type, config_json: str) -> type:
    """``owner`` (a torchtitan model class) that prepares its MoE blocks when built and is wrapped by ultraep
    once torchtitan initialised its weights."""
    key = (owner, config_json)
    if key in _CLASSES:
        return _CLASSES[key]

    def __init__(self, config, **kwargs):
        owner.__init__(self, config, **kwargs)
        prepare(self, probe=False)  # weights not initialised yet: wrap probes the blocks
        if _on_meta(self):  # the trainer's build: wrap now, so that each rank allocates only its masters
            import ultraep

            ultraep.wrap(self, type(self)._ultraep_config)

    def init_states(self, *, buffer_device=None, **kwargs):
        owner.init_states(self, buffer_device=buffer_device, **kwargs)
        import ultraep
        from ultraep.runtime.wrap import _ATTR

        if getattr(self, _ATTR, None) is None:  # built with real tensors: split the initialised experts now
            ultraep.wrap(self, type(self)._ultraep_config)
        else:  # wrapped on the meta device: this rank's masters, initialised by rows
            ultraep.load_masters(self, _expert_init(self))

    def parallelize(self, parallel_dims, *args, **kwargs):  # the full-mesh backends' first step (parallelize_fn)
        check_spmd_backend(getattr(parallel_dims, "spmd_backend", None))
        return owner.parallelize(self, parallel_dims, *args, **kwargs)

    # torchtitan wires a Config class to the model class that defines it (Configurable.__init_subclass__): the
    # balanced class defines its own Config, a subclass of the original's with the same fields
    config_cls = dataclasses.dataclass(kw_only=True, slots=True)(
        type("Config", (owner.Config,), {"__qualname__": f"{owner.__name__}.Config", "__module__": owner.__module__}))
    cls = type(owner.__name__, (owner,), {
        "Config": config_cls, "__init__": __init__, "init_states": init_states, "parallelize": parallelize,
        "_ultraep_config": _parse(config_json), "_ultraep_fsdp_ignores_experts": True, "__module__": owner.__module__,
        "__doc__": f"{owner.__name__} balanced by ultraep (ultraep.integrations.torchtitan.balanced)."})
    _CLASSES[key] = cls
    return cls


def _on_meta(model: nn.Module) -> bool:
    from ultraep.models.torchtitan import _MARK

    return any(p.device.type == "meta" for m in model.modules() if getattr(m, _MARK, None) is not None
               for p in m.parameters(recurse=False))


def _expert_init(model: nn.Module):
    """Each master row initialised by its experts class's own ``param_init`` (torchtitan's, e.g. ``normal_(std)``),
    one expert at a time from a generator state seeded by (the process's seed, the tensor's key, the expert): every
    expert gets the same weights whatever the number of ranks, and different experts different weights."""
    import zlib

    import torch

    from ultraep.runtime.master_rows import InitMasters
    from ultraep.runtime.wrap import runtime_of

    inits = {f"{layer.name}.{n}": layer.container._param_init[n] for layer in runtime_of(model).layers
             for n in layer.adapter.param_names}
    base = torch.initial_seed()

    def fn(out, key, experts):
        for i, e in enumerate(experts):
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed((base * 1_000_003 + zlib.crc32(key.encode()) * 4099 + e) % (2 ** 63))
                inits[key](out[i:i + 1])

    return InitMasters(fn)


def _parse(config_json: str):
    import json

    from ultraep.config import BalancerConfig

    return BalancerConfig.model_validate(json.loads(config_json))


def balanced_config(cfg, *, policy: str = "quota", slots: int = 2, **options):
    """The model config ``cfg`` (a torchtitan ``Decoder.Config``) that builds the balanced model (module
    docstring). ``policy``, ``slots`` (``num_redundant_slots``) and any other ``BalancerConfig`` field, validated
    now: a bad value is refused before anything is built."""
    import json

    from ultraep.config import BalancerConfig

    config = BalancerConfig.model_validate({"policy": policy, "num_redundant_slots": slots, **options})
    install()
    cls = _balanced_class(cfg._owner, json.dumps(config.model_dump(mode="json"), sort_keys=True))
    return cls.Config(**{f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg) if f.init})


def _register() -> None:
    from torchtitan.config import override
    from torchtitan.models.common.decoder import Decoder

    override(target=Decoder.Config, description="ultraep: exact expert load balancing of every routed-experts "
             "layer (policy, slots)")(balanced)


def balanced(cfg, *, policy: str = "quota", slots: int = 2, **options):
    """The ``@override`` factory for ``--override.imports 'ultraep.integrations.torchtitan.balanced={...}'``:
    :func:`balanced_config`."""
    return balanced_config(cfg, policy=policy, slots=slots, **options)


_register()

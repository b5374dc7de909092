"""torchtitan's parallelize functions on a model ``ultraep.wrap`` balanced (imports torchtitan).

torchtitan applies FSDP2 to its decoders itself (``torchtitan.distributed.fsdp.apply_fsdp_to_decoder``: one
``fully_shard`` per transformer block, then the root), with no ``ignored_params``: on a wrapped model it would
shard the expert masters — each rank's are different experts — which the runtime refuses at the next forward.
:func:`leaving_masters` is the one change: while it is active, every ``fully_shard`` that function issues also
ignores ``ultraep.expert_params(model)``, so torchtitan's FSDP application (its meshes, mixed precision,
reshard policy, gradient-division setting) runs unchanged on everything else. :func:`parallelize` calls a model
spec's ``parallelize_fn`` that way.

torchtitan's FSDP application sums gradients (``set_gradient_divide_factor(1.0)``; its loss is divided by the
global token count): the runtime reads that and sums the masters' gradients too (``master_grads='auto'``).
Activation checkpointing (``ActivationCheckpointingConfig``) and the ``load_balance_coeff`` hook
(``register_moe_load_balancing_hook``) need nothing: the router, its ``expert_bias_E`` and
``tokens_per_expert_E`` stay in torchtitan's ``MoE`` and see every token of the rank, as unwrapped.
"""

from __future__ import annotations

from contextlib import contextmanager

from torch import nn

from ultraep.models.torchtitan import SEAM_VERSION, check_seam, version


@contextmanager
def leaving_masters(model: nn.Module):
    """Within the block, torchtitan's FSDP application leaves ``model``'s expert masters out of every
    ``fully_shard`` (added to the ``ignored_params`` it passes, if any)."""
    import torchtitan.distributed.fsdp as titan_fsdp

    from ultraep.runtime.wrap import expert_params

    check_seam("MoE")
    original = getattr(titan_fsdp, "fully_shard", None)
    if original is None:
        raise ImportError(f"torchtitan {version()}: torchtitan.distributed.fsdp has no fully_shard; ultraep's "
                          f"integration follows torchtitan {SEAM_VERSION}")
    masters = expert_params(model)

    def fully_shard(module, *args, ignored_params=None, **kwargs):
        return original(module, *args, ignored_params=set(ignored_params or ()) | masters, **kwargs)

    titan_fsdp.fully_shard = fully_shard
    try:
        yield
    finally:
        titan_fsdp.fully_shard = original


def parallelize(parallelize_fn, model: nn.Module, **kwargs) -> nn.Module:
    """``parallelize_fn(model, **kwargs)`` (a torchtitan model spec's ``parallelize_fn``) on a wrapped ``model``,
    with its FSDP application leaving the expert masters to ultraep."""
    with leaving_masters(model):
        return parallelize_fn(model, **kwargs)

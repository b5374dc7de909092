"""torchtitan's MoE layers balanced exactly: the seam ultraep reads, and the rewrite that exposes it.

torchtitan (the version in :data:`SEAM_VERSION`) builds every MoE layer of its decoders the same way
(``torchtitan.models.common.moe``)::

    MoE                      router (TokenChoiceTopKRouter) + routed_experts + optional shared_experts
      routed_experts         RoutedExperts: token_dispatcher.dispatch -> inner_experts -> token_dispatcher.combine
        inner_experts        GroupedExperts (w1_EFD, w2_EDF, w3_EFD) or GptOssGroupedExperts (biases, clamped SwiGLU)

The router (softmax or sigmoid, node-limited groups, ``expert_bias_E`` of ``load_balance_coeff``), the shared
experts and the sum stay in ``MoE`` untouched. :func:`prepare` gives each ``RoutedExperts`` a subclass whose
forward is the original code, bit for bit, while ``inner_experts`` is the original module, and which calls
``inner_experts`` as an experts container (``hidden [T, D], top_k_index [T, K], top_k_weights [T, K] -> [T, D]``)
once ``ultraep.wrap`` has put a balanced layer there. ``inner_experts`` itself stays the original module (its
parameters keep their names and checkpoint keys); :func:`adapter_of` tells the adapters how one of its experts
computes.

Exact, with torchtitan's own dtype path: the one-expert functions below are the containers' math for one
group — ``x.bfloat16()``, ``torch._grouped_mm`` through the container's own ``_grouped_mm`` seam, SwiGLU
(GPT-OSS: its clamped ``swiglu`` and biases), cast back as the container casts — and the local dispatcher's
combine (``Σ_k score · y``) is what the balanced layer's combine computes. Every prepared block is **probed**:
its original forward and the protocol run on a few deterministic tokens and must agree (the container computes
in bf16: 3e-2 relative), else it is refused with one line.

Refused, one line naming the setting (:class:`~ultraep.models.experts.UnsupportedModelError`):

* a torchtitan whose seam differs from :data:`SEAM` (a class or config field added, renamed or gone);
* torchtitan's own expert parallelism (``token_dispatcher.ep_mesh`` set: EP degree > 1) and a dispatcher other
  than the local one (DeepEP, HybridEP, minimal async EP): they exchange tokens themselves;
* expert parameters that are already DTensors (expert TP, or ``fully_shard`` applied before ``wrap``);
* an experts class other than :data:`EXPERTS` (a float8 / MXFP8 converter's grouped experts, a fused override).

The core package never imports torchtitan: classes are recognised by module and name.

Legend: B batch, L sequence, D model dim, F expert hidden dim, E experts, K top-k, T = B·L tokens.
"""

from __future__ import annotations

import dataclasses
import sys
from dataclasses import dataclass
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from ultraep.models.experts import ExpertForward, ExpertsAdapter, UnsupportedModelError

#: the torchtitan release whose classes and config fields :data:`SEAM` lists
SEAM_VERSION = "0.3.0"
_MOE_MODULE = "torchtitan.models.common.moe"
_DISPATCH_MODULE = "torchtitan.models.common.token_dispatcher"
#: class -> (its module, the exact fields of its ``Config``): what ultraep reads; any other field could change
#: what the class computes (a ``score_before_experts`` flag, a capacity factor), so a changed set is refused
SEAM = {
    "MoE": (_MOE_MODULE, {"param_init", "sharding_config", "num_experts", "routed_experts", "router",
                          "load_balance_coeff", "shared_experts"}),
    "RoutedExperts": (_MOE_MODULE, {"param_init", "sharding_config", "inner_experts", "token_dispatcher"}),
    "GroupedExperts": (_MOE_MODULE, {"param_init", "sharding_config", "dim", "hidden_dim", "num_experts"}),
    "GptOssGroupedExperts": ("torchtitan.models.gpt_oss.moe", {"param_init", "sharding_config", "dim", "hidden_dim",
                                                                "num_experts", "swiglu_limit"}),
    "LocalTokenDispatcher": (_DISPATCH_MODULE, {"num_experts", "top_k"}),
    "AllToAllTokenDispatcher": (_DISPATCH_MODULE, {"num_experts", "top_k"}),
}
#: dispatchers whose EP-degree-1 path is the local one (AllToAll falls back to it while ``ep_mesh`` is None)
LOCAL_DISPATCHERS = ("LocalTokenDispatcher", "AllToAllTokenDispatcher")
#: the dimension of every expert tensor that indexes the expert (one place: wrap, checkpoint loading by rows)
EXPERT_DIM = 0
_MARK = "_ultraep_titan"  # on an inner_experts module its RoutedExperts block prepared: its ExpertsAdapter


def _refuse(what: str, why: str) -> UnsupportedModelError:
    return UnsupportedModelError(what, f"refused: {why}")


def version() -> str:
    """The installed torchtitan's version ("unknown" when its metadata is missing)."""
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as _v

    try:
        return _v("torchtitan")
    except PackageNotFoundError:
        return "unknown"


def _is(mod: object, name: str) -> bool:
    """Whether ``mod``'s class is torchtitan's class ``name`` itself (subclasses are not: they may compute
    otherwise)."""
    module = SEAM[name][0]
    return type(mod).__name__ == name and type(mod).__module__ == module


def _subclasses(mod: object, name: str) -> bool:
    """Whether ``mod``'s class is a proper subclass of torchtitan's class ``name``."""
    return any(c.__name__ == name and c.__module__ == SEAM[name][0] for c in type(mod).__mro__[1:])


def is_torchtitan(mod: object) -> bool:
    return type(mod).__module__.startswith("torchtitan.")


def check_seam(cls_name: str) -> None:
    """Refuse, in one line naming the installed version, a torchtitan whose ``cls_name`` is gone or whose
    ``Config`` fields differ from :data:`SEAM`."""
    module, fields = SEAM[cls_name]
    cls = getattr(sys.modules.get(module), cls_name, None)
    if cls is None:
        raise _refuse(f"torchtitan {version()}", f"{module}.{cls_name} does not exist; ultraep's adapter follows "
                      f"torchtitan {SEAM_VERSION}")
    have = {f.name for f in dataclasses.fields(cls.Config)} if dataclasses.is_dataclass(
        getattr(cls, "Config", None)) else set()
    if have != fields:
        diff = sorted(have ^ fields)
        raise _refuse(f"torchtitan {version()}", f"{cls_name}.Config fields changed ({', '.join(diff)}); ultraep's "
                      f"adapter follows torchtitan {SEAM_VERSION}")


# --------------------------------------------------------------------------------------------- one expert
def _gmm(mod: nn.Module, a: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``a [T, in] @ w.T`` (``w [out, in]``) through the container's ``_grouped_mm`` with one group, bf16 as the
    container computes (``torch._grouped_mm`` needs 16-byte aligned strides: dims a multiple of 8 in bf16)."""
    if a.shape[0] == 0:
        return a.new_zeros(0, w.shape[0], dtype=torch.bfloat16) + (w.reshape(-1)[:1] * 0).bfloat16()
    offs = torch.tensor([a.shape[0]], dtype=torch.int32, device=a.device)
    return mod._grouped_mm(A=a.bfloat16(), B_t=w.bfloat16().transpose(-2, -1).unsqueeze(0), offs=offs)


def grouped_expert(mod: nn.Module, x: torch.Tensor, t: Sequence[torch.Tensor]) -> torch.Tensor:
    """One ``GroupedExperts`` expert: x [T, D], w1/w3 [F, D], w2 [D, F] -> [T, D] in x's dtype
    (``silu(x W1ᵀ) · (x W3ᵀ)`` then ``W2ᵀ``, each grouped-mm in bf16, as ``GroupedExperts.forward``)."""
    w1, w2, w3 = t
    h = F.silu(_gmm(mod, x, w1)) * _gmm(mod, x, w3)
    return _gmm(mod, h, w2).type_as(x)


def gptoss_expert(mod: nn.Module, x: torch.Tensor, t: Sequence[torch.Tensor]) -> torch.Tensor:
    """One ``GptOssGroupedExperts`` expert: x [T, D], mlp1 [2F, D] + bias [2F], mlp2 [D, F] + bias [D] -> [T, D]
    in bf16 (as the container returns it): interleaved gate/up through torchtitan's clamped ``swiglu`` with the
    container's ``swiglu_limit``; the second bias added in bf16 (its TP scaling is 1 without expert TP)."""
    w1, b1, w2, b2 = t
    swiglu = sys.modules[type(mod).__module__].swiglu
    h = _gmm(mod, x, w1)
    h = swiglu(h + b1.to(h.dtype), limit=mod.swiglu_limit)
    y = _gmm(mod, h, w2)
    return y + b2.to(y.dtype)


@dataclass(frozen=True)
class TitanExperts:
    """An inner-experts class: its ``[E, ...]`` tensors (expert dimension :data:`EXPERT_DIM`, in the order the
    one-expert function takes them) and that function."""

    params: tuple[str, ...]
    forward: ExpertForward


#: every inner-experts class ultraep balances: the one description of their expert tensors
EXPERTS = {
    "GroupedExperts": TitanExperts(("w1_EFD", "w2_EDF", "w3_EFD"), grouped_expert),
    "GptOssGroupedExperts": TitanExperts(("mlp1_weight_EGD", "mlp1_bias_EG", "mlp2_weight_EDF", "mlp2_bias_ED"),
                                         gptoss_expert),
}


def expert_tensors(container: nn.Module) -> dict[str, int]:
    """The expert tensors of a torchtitan inner-experts module: parameter name -> its expert dimension."""
    return {n: EXPERT_DIM for n in EXPERTS[type(container).__name__].params}


def adapter_of(mod: nn.Module) -> tuple[bool, ExpertsAdapter | None]:
    """``(True, adapter)`` for an inner-experts module :func:`prepare` decided on; ``(False, None)`` otherwise.
    An inner-experts module found outside a prepared ``RoutedExperts`` is refused."""
    adapter = getattr(mod, _MARK, None)
    if adapter is not None:
        return True, adapter
    if type(mod).__name__ in EXPERTS and is_torchtitan(mod):
        raise _refuse(type(mod).__name__, "outside a torchtitan RoutedExperts block (the block ultraep.wrap "
                      "prepares): its forward(x_RD, num_tokens_per_expert_E) is not the experts interface")
    return False, None


# --------------------------------------------------------------------------------------------- the block
def _routed_forward(self, x_BLD, topk_scores_BLK, topk_expert_ids_BLK, num_local_tokens_per_expert_E):
    """``RoutedExperts.forward``: the original while ``inner_experts`` is the original module; the experts
    interface once a balanced layer took its place."""
    inner = self.inner_experts
    if type(inner) is self._ultraep_inner_cls:
        return type(self)._ultraep_titan_base.forward(self, x_BLD, topk_scores_BLK, topk_expert_ids_BLK,
                                                      num_local_tokens_per_expert_E)
    _check_dispatcher(self)  # EP switched on after wrap (parallelize wires the mesh) is refused here
    B, L, D = x_BLD.shape
    K = topk_scores_BLK.shape[-1]
    out = inner(x_BLD.reshape(B * L, D), topk_expert_ids_BLK.reshape(B * L, K), topk_scores_BLK.reshape(B * L, K))
    return out.view(B, -1, D)


_CLASSES: dict[type, type] = {}


def _prepared_class(base: type) -> type:
    if base not in _CLASSES:
        _CLASSES[base] = type(base.__name__, (base,), {
            "forward": _routed_forward, "_ultraep_titan_base": base,
            "__doc__": f"{base.__name__} prepared by ultraep.models.torchtitan (exact; see its docstring)."})
    return _CLASSES[base]


def _check_dispatcher(block: nn.Module) -> None:
    d = block.token_dispatcher
    name = type(d).__name__
    if name not in LOCAL_DISPATCHERS or type(d).__module__ != _DISPATCH_MODULE:
        raise _refuse("token_dispatcher", f"{name} exchanges tokens itself (DeepEP, HybridEP, async EP); ultraep "
                      "balances torchtitan's local dispatcher only (moe_comm_backend='standard', EP degree 1)")
    if getattr(d, "ep_mesh", None) is not None:
        raise _refuse("token_dispatcher.ep_mesh", "torchtitan's own expert parallelism is on (EP degree "
                      f"{d.ep_mesh.size()} > 1) and already shards the experts; set "
                      "parallelism.expert_parallel_degree = 1 and let ultraep distribute them")


def _check_tensors(inner: nn.Module, names: Sequence[str]) -> None:
    from torch.distributed.tensor import DTensor

    for n in names:
        p = getattr(inner, n, None)
        if not isinstance(p, nn.Parameter):
            raise _refuse(type(inner).__name__, f"has no parameter '{n}' (torchtitan {version()}; ultraep's "
                          f"adapter follows torchtitan {SEAM_VERSION})")
        if isinstance(p, DTensor):
            dims = tuple(p.device_mesh.mesh_dim_names or ())
            why = ("expert tensor parallelism shards it (mesh " + str(dims) + "): ultraep balances whole experts; "
                   "set parallelism.expert_tensor_parallel_degree = 1" if {"tp", "etp"} & set(dims)
                   else f"it is already sharded (DTensor on mesh {dims}): call ultraep.wrap before torchtitan's "
                        "parallelize function")
            raise _refuse(f"inner_experts.{n}", why)
    extra = [n for n, _ in inner.named_parameters() if n not in names]
    if extra:
        raise _refuse(type(inner).__name__, f"parameter '{extra[0]}' is not one ultraep accounts for")


def _probe(block: nn.Module, adapter: ExpertsAdapter) -> None:
    """Refuse unless the block's original forward equals ``Σ_k score · expert(x)`` (4 tokens, private generator)."""
    from ultraep.models.rewrite import eager_experts

    inner = block.inner_experts
    params = [getattr(inner, n) for n in adapter.param_names]
    if params[0].device.type == "meta":
        return
    E, D = int(params[0].shape[0]), int(inner.w2_EDF.shape[1] if hasattr(inner, "w2_EDF") else
                                         inner.mlp2_weight_EDF.shape[1])
    K = min(int(block.token_dispatcher.top_k), E)
    g = torch.Generator().manual_seed(1234)
    dtype = params[0].dtype if params[0].dtype in (torch.bfloat16, torch.float32) else torch.float32
    if type(inner).__name__ == "GptOssGroupedExperts":
        dtype = torch.bfloat16  # its combine scatters a bf16 output into x's dtype: it runs on bf16 activations
    x = torch.randn(1, 4, D, generator=g).to(device=params[0].device, dtype=dtype)
    idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(4)]).view(1, 4, K).to(params[0].device)
    w = (torch.rand(1, 4, K, generator=g) + 0.5).to(params[0].device)
    counts = torch.bincount(idx.reshape(-1), minlength=E)
    try:
        with torch.no_grad():
            ref = type(block)._ultraep_titan_base.forward(block, x, w, idx, counts).reshape(4, D)
            ours = eager_experts(adapter.forward, inner, params, x.reshape(4, D), idx.reshape(4, K), w.reshape(4, K))
    except Exception as exc:  # noqa: BLE001 - a block we cannot probe is refused, not guessed
        raise _refuse(type(inner).__name__, f"probe of the experts function failed ({type(exc).__name__}: "
                      f"{str(exc).splitlines()[0] if str(exc) else ''})") from None
    ref, ours = ref.float(), ours.float()
    err = float((ours - ref).abs().max()) / max(float(ref.abs().max()), 1e-12)
    if not err <= 3e-2:  # the container computes in bf16
        raise _refuse(type(inner).__name__, f"its forward differs from the expert function ultraep derived by "
                      f"{err:.3g} (relative, > 3e-2) on a probe")


def prepare(model: nn.Module) -> list[str]:
    """Prepare every torchtitan ``RoutedExperts`` of ``model`` (see the module docstring); returns their names.
    Idempotent; refuses (one line) what cannot be balanced exactly."""
    done = []
    for name, block in list(model.named_modules()):
        if getattr(type(block), "_ultraep_titan_base", None) is not None:
            if not getattr(block, "_ultraep_probed", False):  # prepared on the meta device: probe once materialised
                _probe_prepared(block)
            continue
        if not is_torchtitan(block) and not _subclasses(block, "RoutedExperts"):
            continue
        if type(block).__name__ == "MoE" or _is(block, "RoutedExperts"):
            check_seam(type(block).__name__)
        if not _is(block, "RoutedExperts"):
            if _subclasses(block, "RoutedExperts"):
                raise _refuse(name or "model", f"{type(block).__module__}.{type(block).__name__} subclasses torchtitan's "
                              "RoutedExperts (an override's own routing path): ultraep balances RoutedExperts itself")
            continue
        _check_dispatcher(block)
        check_seam(type(block.token_dispatcher).__name__)
        inner = block.inner_experts
        kind = EXPERTS.get(type(inner).__name__)
        if kind is None or type(inner).__module__ != SEAM[type(inner).__name__][0]:
            raise _refuse(f"{name}.inner_experts", f"{type(inner).__module__}.{type(inner).__name__} is not an "
                          f"experts class ultraep implements ({', '.join(EXPERTS)}): a converter or override "
                          "(float8, MXFP8, fused SwiGLU) changed how experts compute")
        check_seam(type(inner).__name__)
        _check_tensors(inner, kind.params)
        adapter = ExpertsAdapter(f"torchtitan:{type(inner).__name__}", kind.params, kind.forward)
        block._ultraep_inner_cls = type(inner)
        block.__class__ = _prepared_class(type(block))
        object.__setattr__(inner, _MARK, adapter)
        _probe_prepared(block)
        done.append(name)
    return done


def _probe_prepared(block: nn.Module) -> None:
    """Probe a prepared block (:func:`_probe`) unless its experts are still on the meta device; a block that fails
    gets its original class back and the refusal is raised."""
    inner = block.inner_experts
    adapter = getattr(inner, _MARK, None)
    if adapter is None or next(inner.parameters()).device.type == "meta":
        return
    try:
        _check_tensors(inner, adapter.param_names)  # (sharded since it was prepared on the meta device)
        _probe(block, adapter)
    except UnsupportedModelError:
        object.__delattr__(inner, _MARK)
        del block._ultraep_inner_cls
        block.__class__ = type(block)._ultraep_titan_base
        raise
    block._ultraep_probed = True


def restore(model: nn.Module) -> nn.Module:
    """Undo :func:`prepare` on an unwrapped model (the original classes; the same modules and parameters)."""
    for name, block in list(model.named_modules()):
        base = getattr(type(block), "_ultraep_titan_base", None)
        if base is None:
            continue
        if type(block.inner_experts) is not block._ultraep_inner_cls:
            raise UnsupportedModelError(name, "is still balanced: call ultraep.unwrap first")
        object.__delattr__(block.inner_experts, _MARK)
        del block._ultraep_inner_cls
        block.__dict__.pop("_ultraep_probed", None)
        block.__class__ = base
    return model

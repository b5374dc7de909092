"""Adapters: how ultraep finds, reads and runs the experts of a model, without touching model code.

The interception point is the **experts container**: a module called as
``experts(hidden_states [T, H], top_k_index [T, K], top_k_weights [T, K]) -> [T, H]`` that holds the
weights of all E experts as 3-D parameters with a leading expert dimension. That is exactly Hugging Face
transformers v5's *experts interface* (``@use_experts_implementation``), so the router, shared experts,
group-limited routing and DeepSeek's ``e_score_correction_bias`` all stay in the MoE block, untouched.

Exact or refused (docs/design.md, Conventions): for an experts-interface container, :func:`adapter_for` reads

* the flags the class declared to the interface (``is_transposed``, ``has_bias``, ``is_concatenated``,
  ``has_gate``, ``has_post_expert_norm``; a flag it does not know is refused),
* every parameter, buffer and submodule of the container (anything it cannot account for is refused),
* ``_is_expert_parallel`` (transformers' own EP, whose sentinel ids ``top_k_index == num_experts`` for
  dropped slots the balanced layer does not take: refused),

builds the one-expert function from them, and finally **probes** it: on a few deterministic tokens it
compares ``Σ_k w · expert(x)`` with the container's own forward and refuses on disagreement (a class that
overrides ``forward`` or ``_apply_gate`` in a way the flags do not describe). Every refusal is one line
naming the flag, parameter or check: :class:`UnsupportedModelError`.

Shared parameters: a post-expert norm's weight is shared by all experts (``ExpertsAdapter.shared``). The
balanced layer registers the norm as its own submodule (same key, whole on every rank, like a data-parallel
parameter) and each rank's copy gets the gradient of the rows that rank computed, masters and replicas: the
sum over ranks equals the unwrapped model's gradient, which data parallelism's all-reduce forms
(``docs/design.md``, § experts adapters).

Plain PyTorch containers register with :func:`register_experts` (see the protocol there). MoE blocks that keep
their experts another way (Llama4, DBRX, JetMoE; Longcat-Flash with zero-computation experts) are rewritten
exactly into a container by :func:`prepare`
(``ultraep/models/rewrite.py``) before ``wrap`` looks for containers.

Legend: E experts, H hidden size, I expert intermediate size, T rows of one expert, K top-k.
"""

from __future__ import annotations

import weakref
from typing import Sequence

import torch
from torch import nn

from ultraep.errors import UltraEPError
from ultraep.models.experts import FLAGS, ExpertForward, ExpertsAdapter, UnsupportedModelError, hf_expert_forward
from ultraep.models import torchtitan as _titan
from ultraep.models.rewrite import adapter_of
from ultraep.models.rewrite import prepare as _prepare
from ultraep.models.rewrite import restore as _restore

# --------------------------------------------------------------------------------------------- HF flags

#: containers that speak the (hidden, top_k_index, top_k_weights) protocol without declaring the interface:
#: class name -> the flags their eager forward implements (read from transformers' source)
KNOWN_NON_INTERFACE = {
    "Step3p7Experts": dict(FLAGS),  # concatenated gate/up through its own clamped _apply_gate
    "LongcatFlashExperts": dict(FLAGS),  # zero-computation experts only inside its rewritten block (below)
}

#: containers ultraep recognises and refuses, with the reason (one line each)
REFUSED = {
    "Llama4TextExperts": "outside a Llama4TextMoe block (the block ultraep.wrap rewrites exactly): forward(hidden "
                         "[E*T, H]) over a dense expert-major layout is not the experts interface",
    "DbrxExperts": "outside a DbrxFFN block (the block ultraep.wrap rewrites exactly): weights w1/v1/w2 live in "
                   "the submodule 'mlp' as [E*I, H] matrices, not [E, ...] parameters",
    "JetMoeParallelExperts": "outside a JetMoeMoE/JetMoeMoA block (the blocks ultraep.wrap rewrites exactly): one "
                             "projection per container, called as forward(inputs, expert_size)",
    "NllbMoeExperts": "experts are separate submodules (ModuleDict), not [E, ...] parameters",
    "SwitchTransformersExperts": "experts are separate submodules (ModuleDict), not [E, ...] parameters",
}

_DECORATOR_CELLS = {"original_init", "original_forward", "experts_interface"}


def _declared_flags(mod: nn.Module) -> dict[str, object] | None:
    """The flags the container's class passed to ``@use_experts_implementation`` (read from the decorator's
    ``__init__`` closure, so a flag added by a later transformers shows up by name), or ``None``."""
    for cls in type(mod).__mro__:
        init = cls.__dict__.get("__init__")
        code = getattr(init, "__code__", None)
        if code is None or "original_init" not in code.co_freevars or "has_gate" not in code.co_freevars:
            continue
        return {n: c.cell_contents for n, c in zip(code.co_freevars, init.__closure__) if n not in _DECORATOR_CELLS}
    if all(hasattr(mod, f) for f in ("has_gate", "is_transposed", "_apply_gate")):
        # an older decorator that keeps no readable closure: the instance attributes are the declaration
        return {f: getattr(mod, f) for f in FLAGS if hasattr(mod, f)}
    return None


def _refuse(mod: nn.Module, why: str) -> UnsupportedModelError:
    return UnsupportedModelError(type(mod).__name__, f"refused: {why}")


def _check_accounted(mod: nn.Module, names: tuple[str, ...], flags: dict[str, object]) -> None:
    """Refuse any parameter, buffer or submodule of ``mod`` the adapter does not account for."""
    allowed_children = {"act_fn", "identity_expert"} | ({"post_expert_norm"} if flags["has_post_expert_norm"] else set())
    for n, _ in mod.named_parameters(recurse=False):
        if n not in names:
            raise _refuse(mod, f"parameter '{n}' is not one ultraep accounts for (expected {', '.join(names)})")
    for n, _ in mod.named_buffers(recurse=False):
        raise _refuse(mod, f"buffer '{n}' is not one ultraep accounts for")
    for n, child in mod.named_children():
        if n not in allowed_children:
            raise _refuse(mod, f"submodule '{n}' ({type(child).__name__}) is not one ultraep accounts for")
        if n in ("act_fn", "identity_expert") and (any(True for _ in child.parameters()) or any(True for _ in child.buffers())):
            raise _refuse(mod, f"submodule '{n}' has parameters or buffers; ultraep expects a stateless function")
    if flags["has_post_expert_norm"] and not isinstance(getattr(mod, "post_expert_norm", None), nn.Module):
        raise _refuse(mod, "has_post_expert_norm=True but the container has no 'post_expert_norm' module")


def _hf_adapter(mod: nn.Module, flags: dict[str, object], label: str) -> ExpertsAdapter:
    unknown = sorted(set(flags) - set(FLAGS))
    if unknown:
        raise _refuse(mod, f"experts-interface flag '{unknown[0]}={flags[unknown[0]]!r}' is not one ultraep implements")
    flags = {**FLAGS, **flags}
    if getattr(mod, "_is_expert_parallel", False):
        raise _refuse(mod, "_is_expert_parallel=True: transformers' own expert parallelism is active (its "
                           "top_k_index carries the sentinel num_experts for dropped slots); load the model "
                           "without a tp_plan/EP and let ultraep distribute the experts")
    if getattr(mod, "zero_expert_num", 0):
        raise _refuse(mod, f"outside a LongcatFlashMoE block (the block ultraep.wrap rewrites exactly): "
                           f"zero_expert_num={mod.zero_expert_num} zero-computation experts (ids past the "
                           "{} real ones) must be mapped to the dropped-slot sentinel by the block".format(
                               getattr(mod, "num_routed_experts", "E")))
    first = "gate_up_proj" if flags["has_gate"] else "up_proj"
    names: tuple[str, ...] = (first, "down_proj")
    if flags["has_bias"]:
        names += (f"{first}_bias", "down_proj_bias")
    for n in names:
        if not isinstance(getattr(mod, n, None), nn.Parameter):
            flag = "has_bias" if n.endswith("_bias") else "has_gate"
            raise _refuse(mod, f"{flag}={flags[flag]} but the container has no parameter '{n}'")
    _check_accounted(mod, names, flags)
    params = [getattr(mod, n) for n in names]
    E = int(params[0].shape[0])
    want = [3, 3, 2, 2]
    for n, p, d in zip(names, params, want):
        if p.dim() != d or int(p.shape[0]) != E:
            raise _refuse(mod, f"parameter '{n}' has shape {tuple(p.shape)}; expected {d}-D with leading dimension "
                               f"E={E}")
    declared_E = getattr(mod, "num_experts", E)
    if isinstance(declared_E, int) and declared_E != E:
        raise _refuse(mod, f"num_experts={declared_E} but parameter '{names[0]}' holds {E} experts")
    if flags["has_gate"] and not flags["is_concatenated"] and "_apply_gate" not in _own_attrs(mod):
        raise _refuse(mod, "is_concatenated=False (interleaved gate/up) but the class has no _apply_gate of its own")
    # the post-expert norm is shared by all experts: trained data-parallel style (ExpertsAdapter.shared)
    adapter = ExpertsAdapter(label, names, hf_expert_forward(flags),
                             ("post_expert_norm",) if flags["has_post_expert_norm"] else ())
    # down_proj is [E, H, I], or [E, I, H] when transposed
    _probe(mod, adapter, int(params[1].shape[2] if flags["is_transposed"] else params[1].shape[1]))
    return adapter


def _own_attrs(mod: nn.Module) -> set[str]:
    """Attributes defined by the container's classes themselves, not by transformers' default gate."""
    out: set[str] = set()
    for cls in type(mod).__mro__:
        for k, v in cls.__dict__.items():
            if not (k == "_apply_gate" and getattr(v, "__name__", "") == "_default_apply_gate"):
                out.add(k)
    return out


# --------------------------------------------------------------------------------------------- probe
def _probe(mod: nn.Module, adapter: ExpertsAdapter, H: int) -> None:
    """Refuse unless ``Σ_k w[t, k] · adapter.forward(expert idx[t, k])(x[t])`` equals the container's own
    forward on a few deterministic tokens (fp32: 1e-4 relative; 16-bit: 3e-2)."""
    params = [getattr(mod, n) for n in adapter.param_names]
    if params[0].device.type == "meta":
        return  # nothing to compute with; the static checks above stand alone
    E = int(params[0].shape[0])
    T, K = 4, min(2, E)
    g = torch.Generator().manual_seed(1234)  # a private generator: the user's RNG stream is untouched
    x = torch.randn(T, H, generator=g).to(device=params[0].device, dtype=params[0].dtype)
    idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]).to(params[0].device)
    w = (torch.rand(T, K, generator=g) + 0.5).to(device=params[0].device, dtype=params[0].dtype)
    try:
        with torch.no_grad():
            ref = mod.forward(x, idx, w)  # .forward, not __call__: user hooks do not fire for a probe
            ours = torch.zeros_like(ref, dtype=torch.float32)
            for t in range(T):
                for k in range(K):
                    e = int(idx[t, k])
                    y = adapter.forward(mod, x[t:t + 1], [p[e] for p in params])
                    ours[t] += (y[0] * w[t, k]).float()
    except Exception as exc:  # noqa: BLE001 - a container we cannot run the probe on is refused, not guessed
        raise _refuse(mod, f"probe of the experts function failed ({type(exc).__name__}: "
                           f"{str(exc).splitlines()[0] if str(exc) else ''})") from None
    ref = ref.float()
    err = float((ours - ref).abs().max()) / max(float(ref.abs().max()), 1e-12)
    tol = 1e-4 if params[0].dtype in (torch.float32, torch.float64) else 3e-2
    if not err <= tol:
        raise _refuse(mod, f"its forward differs from the experts function ultraep derived from its flags and "
                           f"parameters by {err:.3g} (relative, > {tol:g}) on a probe: it overrides forward or "
                           "_apply_gate in a way the flags do not describe")


# --------------------------------------------------------------------------------------------- registry
# Model families tested end to end (tests/test_runtime.py); every other family the conformance test checks
# (tests/test_adapters_conformance.py, docs/models.md).
HF_EXPERTS = {
    "MixtralExperts": "mixtral",
    "Qwen3MoeExperts": "qwen3_moe",
    "DeepseekV3Experts": "deepseek_v3",
    "GptOssExperts": "gpt_oss",
}

_CUSTOM: dict[type, ExpertsAdapter] = {}
_CACHE: "weakref.WeakKeyDictionary[nn.Module, ExpertsAdapter]" = weakref.WeakKeyDictionary()


def register_experts(cls: type, param_names: Sequence[str], forward: ExpertForward, name: str | None = None) -> None:
    """Register a plain PyTorch experts container class.

    Protocol: instances of ``cls`` are called as ``experts(hidden [T, H], top_k_index [T, K] (int),
    top_k_weights [T, K]) -> [T, H]`` and return ``Σ_k w[t, k] * expert_{idx[t, k]}(hidden[t])``; each name in
    ``param_names`` is an ``nn.Parameter`` of shape ``[E, ...]``; ``forward(container, x, tensors)`` applies
    one expert (tensors = that expert's slices, in ``param_names`` order) to rows ``x`` without the routing
    weight. Any other trainable parameter of the container is refused at ``wrap`` (it would not be trained).
    ``wrap`` then balances every instance of ``cls`` in the model. A block whose experts live in an
    ``nn.ModuleList`` stacks them into such a container once (see ``tests/test_runtime.py``'s custom block).
    """
    if not param_names:
        raise UltraEPError("param_names", "must name at least one [E, ...] parameter")
    _CUSTOM[cls] = ExpertsAdapter(name or f"custom:{cls.__name__}", tuple(param_names), forward)
    _CACHE.clear()


def _custom_checked(mod: nn.Module, adapter: ExpertsAdapter) -> ExpertsAdapter:
    params = []
    for n in adapter.param_names:
        p = getattr(mod, n, None)
        if not isinstance(p, nn.Parameter) or p.dim() < 1:
            raise _refuse(mod, f"registered parameter '{n}' is not an [E, ...] nn.Parameter of the container")
        params.append(p)
    E = int(params[0].shape[0])
    for n, p in zip(adapter.param_names, params):
        if int(p.shape[0]) != E:
            raise _refuse(mod, f"parameter '{n}' has leading dimension {int(p.shape[0])}, not E={E}")
    extra = [n for n, p in mod.named_parameters() if n not in adapter.param_names and p.requires_grad]
    if extra:
        raise _refuse(mod, f"trainable parameter '{extra[0]}' is not among the registered expert parameters; "
                           "the balanced layer would not train it")
    return adapter


def adapter_for(mod: nn.Module) -> ExpertsAdapter | None:
    """The adapter of an experts container; ``None`` if ``mod`` is not one.

    Raises :class:`UnsupportedModelError` (one line) for an experts container ultraep recognises but cannot
    balance exactly. Results are cached per module (the probe runs once).
    """
    try:
        return _CACHE[mod]
    except (KeyError, TypeError):
        pass
    adapter = _adapter_uncached(mod)
    if adapter is not None:
        _CACHE[mod] = adapter
    return adapter


def _adapter_uncached(mod: nn.Module) -> ExpertsAdapter | None:
    decided, adapter = adapter_of(mod)  # a container prepare() built or marked
    if decided:
        return adapter
    decided, adapter = _titan.adapter_of(mod)  # a torchtitan inner-experts module prepare() marked
    if decided:
        return adapter
    for cls, adapter in _CUSTOM.items():
        if isinstance(mod, cls):
            return _custom_checked(mod, adapter)
    name = type(mod).__name__
    if name in REFUSED:
        raise _refuse(mod, REFUSED[name])
    flags = _declared_flags(mod)
    if flags is None and name in KNOWN_NON_INTERFACE:
        flags = KNOWN_NON_INTERFACE[name]
    if flags is None:
        return None
    return _hf_adapter(mod, flags, f"transformers:{name}")


def supported() -> list[str]:
    """Human-readable list of what ``wrap`` accepts."""
    out = [f"transformers v5 {cls} ({fam})" for cls, fam in HF_EXPERTS.items()]
    out.append("every transformers v5 experts-interface module whose flags ultraep implements (docs/models.md)")
    out.append("Llama4TextMoe, DbrxFFN, JetMoeMoE and LongcatFlashMoE blocks (rewritten exactly into experts "
               "containers)")
    out.append(f"torchtitan {_titan.SEAM_VERSION} RoutedExperts with " + " or ".join(_titan.EXPERTS)
               + " (docs/guide/torchtitan.md)")
    out += [a.name for a in _CUSTOM.values()]
    return out


def prepare(model: nn.Module) -> list[str]:
    """Rewrite, in place and exactly, MoE blocks whose experts are not an experts container (Llama4, DBRX,
    JetMoE, Longcat-Flash; torchtitan's RoutedExperts) into one, before :func:`~ultraep.runtime.wrap` looks for
    containers; returns the rewritten blocks' names. See :mod:`ultraep.models.rewrite` and
    :mod:`ultraep.models.torchtitan` (and :func:`restore` to undo it after ``unwrap``)."""
    return _prepare(model) + _titan.prepare(model)


def restore(model: nn.Module) -> nn.Module:
    """Undo :func:`prepare` on an unwrapped model: the original module classes, holding the current weights."""
    return _titan.restore(_restore(model))

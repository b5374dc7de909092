"""Exact rewrites of MoE blocks whose experts are not an experts container (called by ``ultraep.wrap``).

``wrap`` balances *experts containers*: ``experts(hidden [T, H], top_k_index [T, K], top_k_weights [T, K])
-> [T, H]`` with 3-D ``[E, ...]`` parameters (``ultraep/models/adapters.py``). Three transformers families keep their
experts another way (and Longcat-Flash adds experts that are no weights at all); :func:`prepare` rewrites
their MoE block, in place, into that form, exactly:

* **Llama4** (``Llama4TextMoe``): the block feeds *every* token to *every* expert in an expert-major
  ``[E·T, H]`` layout, the input pre-scaled by the router score (sigmoid of the top-k logits, exactly 0 for
  an unselected expert), and sums the E outputs. An expert has no bias, so on a zero row its ``up`` half is 0
  and ``f_e(0) = (act(0) · 0) W_down = 0`` for any finite activation: an unselected expert contributes exactly
  zero, and zero gradient to every weight (the unselected scores are constants). The output is
  therefore ``Σ_k f_{idx[t,k]}(s[t,k] · x[t])``: the experts protocol applied to ``T·K`` rows ``s · x`` with
  unit weights, summed over ``k``. The container stays the *original* ``Llama4TextExperts`` (its
  ``gate_up_proj [E, H, 2I]`` / ``down_proj [E, I, H]`` are already ``[E, ...]``: transposed layout); only
  the block's forward changes, and it runs the original code whenever its experts are not balanced (so
  ``unwrap`` gives back the original model, state_dict keys unchanged).
* **DBRX** (``DbrxFFN``): ``DbrxExperts`` speaks the protocol but keeps ``mlp.w1/v1/w2`` as ``[E·I, H]``
  matrices. The new container holds ``w1, v1, w2 [E, I, H]``: views of the same storage (no copy).
* **JetMoE** (``JetMoeMoE``): two ``JetMoeParallelExperts`` (``input_linear.weight [E, 2I, H]``,
  ``output_linear.weight [E, H, I]``) with the gated activation in the block. The new container re-registers
  the *same* parameter objects as ``gate_up_proj`` / ``down_proj``; the block keeps its router and its shared
  output ``bias``. Its mixture-of-attention (``JetMoeMoA``) experts are attention projections split around
  the attention itself, not an MLP: they stay replicated (data-parallel, exact) and are not balanced.
* **Longcat-Flash** (``LongcatFlashMoE``): its router picks among ``E + Z`` ids; ids ``E..E+Z-1`` are
  *zero-computation experts* whose output is the input times the routing weight. The block sends those slots
  to the container as the experts interface's sentinel ``E`` (dropped exactly by the balanced layer and by
  :func:`eager_experts`: no load, no compute, no transfer, no gradient) and adds ``Σ_{k: idx ≥ E} w[t, k] ·
  x[t]`` itself, on the token's own rank: zero experts are free for the planner, which never sees them. The
  container holds ``gate_up_proj [E, 2I, H]`` (a view of the first E rows: no copy) and the same ``down_proj``
  object; the original ``gate_up_proj`` is ``[E + Z, 2I, H]`` and its Z rows are never read (zero gradient in
  the original too), so they are kept beside the container, in a non-persistent buffer of the block, only so
  that a checkpoint round-trips with its original keys, shapes and values (they are not trained).

Every rewrite is **probed** before it is committed: the block's original forward and the rewritten one run on
a few deterministic tokens (eval mode, private generator) and must agree (1e-4 relative in fp32), else the
block is refused with one line. A checkpoint keeps its keys: DBRX/JetMoE/Longcat blocks translate their
state_dict to (and load from) the original keys and shapes while unwrapped; a *wrapped* model's state_dict holds
this rank's masters under the container's names (``experts.w1 [M, I, H]``), as for every family (Longcat's Z
dead rows are not in it). :func:`restore` gives back the original module classes (``unwrap`` first).

Legend: E experts (real ones), Z zero-computation experts, H hidden size, I expert intermediate size, T tokens,
K top-k, M masters per rank.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from ultraep.models.experts import FLAGS, ExpertsAdapter, UnsupportedModelError, hf_expert_forward

#: block class name -> the container class name it holds (the conformance test builds the block instead)
BLOCKS = {"Llama4TextMoe": "Llama4TextExperts", "DbrxFFN": "DbrxExperts", "JetMoeMoE": "JetMoeParallelExperts",
          "LongcatFlashMoE": "LongcatFlashExperts"}
_MARK = "_ultraep_rewrite"  # on a Llama4TextExperts its block rewrote; "replicated" on JetMoE's MoA experts
_TAIL = "_ultraep_zero_rows"  # Longcat block: gate_up_proj's Z never-read rows (checkpoint round trip only)


def _refuse(block: nn.Module, why: str) -> UnsupportedModelError:
    return UnsupportedModelError(type(block).__name__, f"refused: {why}")


# --------------------------------------------------------------------------------------------- containers
def eager_experts(forward, container: nn.Module, params: Sequence[torch.Tensor], x: torch.Tensor,
                  idx: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The protocol computed locally: ``out[t] = Σ_k w[t, k] · forward(container, x[t], params[·][idx[t, k]])``;
    a slot whose id is the sentinel E (``params[0].shape[0]``) is dropped, as in the interface's eager forwards.

    x [T, H], idx [T, K] (int), w [T, K] -> [T, H] (x's dtype)."""
    out = torch.zeros_like(x)
    E = int(params[0].shape[0])
    for e in torch.unique(idx).tolist():
        if e == E:
            continue
        tok, k = torch.where(idx == e)
        y = forward(container, x[tok], [p[e] for p in params])
        out.index_add_(0, tok, (y * w[tok, k, None]).to(out.dtype))
    return out


def _dbrx_expert(mod: nn.Module, x: torch.Tensor, t: Sequence[torch.Tensor]) -> torch.Tensor:
    """One DBRX expert: x [T, H], w1/v1/w2 [I, H] -> [T, H] (``DbrxExpertGLU.forward``'s math)."""
    return (mod.act_fn(F.linear(x, t[0])) * F.linear(x, t[1])) @ t[2]


class StackedExperts(nn.Module):
    """An experts container :func:`prepare` built from a block's own parameters (same storage, ``[E, ...]``).

    ``forward(hidden [T, H], top_k_index [T, K], top_k_weights [T, K]) -> [T, H]``; ``act_fn`` is the block's
    stateless activation. ``origin`` (not a submodule) keeps what :func:`restore` puts back.
    """

    def __init__(self, label: str, params: dict[str, nn.Parameter], act_fn: nn.Module, forward, origin) -> None:
        super().__init__()
        for n, p in params.items():
            self.register_parameter(n, p)
        self.act_fn = act_fn
        self.param_names = tuple(params)
        object.__setattr__(self, "adapter", ExpertsAdapter(label, self.param_names, forward))
        object.__setattr__(self, "origin", origin)

    def forward(self, hidden_states, top_k_index, top_k_weights):
        params = [getattr(self, n) for n in self.param_names]
        return eager_experts(self.adapter.forward, self, params, hidden_states, top_k_index, top_k_weights)


_LLAMA4 = ExpertsAdapter("rewrite:Llama4TextExperts", ("gate_up_proj", "down_proj"),
                         hf_expert_forward({**FLAGS, "is_transposed": True}))


def adapter_of(mod: nn.Module) -> tuple[bool, ExpertsAdapter | None]:
    """``(True, adapter or None)`` for a module a rewrite decided on (None: deliberately not balanced);
    ``(False, None)`` otherwise."""
    if isinstance(mod, StackedExperts):
        return True, mod.adapter
    mark = getattr(mod, _MARK, None)
    if mark == "llama4":
        _probe_dense(mod)
        return True, _LLAMA4
    if mark == "replicated":
        return True, None
    return False, None


def _probe_dense(mod: nn.Module) -> None:
    """Refuse unless ``Σ_k f_e(s · x)`` from the adapter equals ``Llama4TextExperts.forward`` on the dense
    expert-major layout (4 tokens, K = 2, zero score for unselected experts)."""
    p = mod.gate_up_proj
    if p.device.type == "meta":
        return
    E, H = int(p.shape[0]), int(p.shape[1])
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(4, H, generator=g).to(p)
    idx = torch.stack([torch.randperm(E, generator=g)[:min(2, E)] for _ in range(4)]).to(p.device)
    s = (torch.rand(idx.shape, generator=g) + 0.5).to(p)
    dense = torch.zeros(4, E, dtype=p.dtype, device=p.device).scatter(1, idx, s)  # [T, E]
    with torch.no_grad():
        ref = mod.forward((x.repeat(E, 1) * dense.t().reshape(-1, 1))).view(E, 4, H).sum(0)
        rows = (x[:, None, :] * s[..., None]).reshape(-1, H)
        ours = eager_experts(_LLAMA4.forward, mod, [p, mod.down_proj], rows, idx.reshape(-1, 1),
                             torch.ones_like(s).reshape(-1, 1)).view(4, -1, H).sum(1)
    _agree(mod, ref, ours, "its dense forward differs from the expert function ultraep derived")


def _agree(block: nn.Module, ref: torch.Tensor, ours: torch.Tensor, what: str) -> None:
    tol = 1e-4 if ref.dtype in (torch.float32, torch.float64) else 3e-2  # 16-bit weights: 3e-2
    ref, ours = ref.float(), ours.float()
    err = float((ours - ref).abs().max()) / max(float(ref.abs().max()), 1e-12)
    if not err <= tol:
        raise _refuse(block, f"{what} by {err:.3g} (relative, > {tol:g}) on a probe")


# --------------------------------------------------------------------------------------------- block forwards
def _llama4_protocol(self, hidden_states, experts: Callable):
    """``Llama4TextMoe.forward`` as the protocol: hidden [..., H] -> ([T, H], router_logits [T, E])."""
    hidden = hidden_states.reshape(-1, self.hidden_dim)
    scores, logits = self.router(hidden)  # scores [T, E]: sigmoid of the top-k logits, 0 elsewhere
    idx = torch.topk(logits, self.router.top_k, dim=1).indices  # the router's own selection, same call
    w = scores.gather(1, idx)  # [T, K]
    T, K = idx.shape
    rows = (hidden[:, None, :] * w[..., None]).reshape(T * K, -1)  # s · x, as the block's routed_in rows
    y = experts(rows, idx.reshape(T * K, 1), rows.new_ones(T * K, 1))
    out = self.shared_expert(hidden)
    out.add_(y.view(T, K, -1).sum(dim=1))
    return out, logits


def _dbrx_protocol(self, hidden_states, experts: Callable):
    """``DbrxFFN.forward`` with [T, H] rows for the container: hidden [B, S, H] -> [B, S, H]."""
    router_logits = self.router(hidden_states)  # (its jitter, in training, scales hidden_states in place)
    top_k_weights, top_k_index = self.route_tokens_to_experts(router_logits)
    H = hidden_states.shape[-1]
    out = experts(hidden_states.reshape(-1, H), top_k_index, top_k_weights)
    return out.view(hidden_states.shape[0], -1, H)  # DbrxExperts' own output layout


def _jetmoe_protocol(self, layer_input, experts: Callable):
    """``JetMoeMoE.forward`` as the protocol: [B, S, H] -> [B, S, H]. The router's expert-sorted outputs are
    scattered back to ``[T, K]`` (``index_sorted_experts`` is a permutation of the row-major ``T·K`` pairs)."""
    bsz, length, emb = layer_input.size()
    x = layer_input.reshape(-1, emb)
    index_sorted, _batch_index, batch_gates, expert_size, _logits = self.router(x)
    T = x.shape[0]
    ids = torch.repeat_interleave(torch.arange(len(expert_size), device=x.device),
                                  torch.as_tensor(expert_size, device=x.device))
    idx = torch.empty_like(index_sorted).scatter_(0, index_sorted, ids).view(T, -1)
    w = batch_gates.new_zeros(index_sorted.numel()).scatter(0, index_sorted, batch_gates).view(T, -1)
    return experts(x, idx, w).view(bsz, length, emb) + self.bias


def _longcat_protocol(self, hidden_states, experts: Callable):
    """``LongcatFlashMoE.forward`` as the protocol: hidden [..., H] -> [..., H]. Zero-expert slots (ids >= E) go
    to the container as the sentinel E (dropped there) and are added here: ``Σ_{k: idx >= E} w[t, k] · x[t]``."""
    _, w, idx = self.router(hidden_states)  # w [T, K] (router dtype), idx [T, K] in [0, E + Z)
    x = hidden_states.reshape(-1, hidden_states.shape[-1])
    E = int(self.config.n_routed_experts)
    zero = idx >= E
    out = experts(x, idx.masked_fill(zero, E), w)
    out = out + (x * (w * zero).sum(dim=1, keepdim=True)).to(out.dtype)  # the identity experts, weighted
    return out.view(hidden_states.shape)


def _balanced(block: nn.Module) -> bool:
    return not isinstance(block.experts, type(block)._ultraep_experts_cls)


def _llama4_forward(self, hidden_states):
    if not _balanced(self):  # the original container, unwrapped: the original code, bit for bit
        return type(self)._ultraep_base.forward(self, hidden_states)
    return _llama4_protocol(self, hidden_states, self.experts)


def _dbrx_forward(self, hidden_states):
    return _dbrx_protocol(self, hidden_states, self.experts)


def _jetmoe_forward(self, layer_input):
    return _jetmoe_protocol(self, layer_input, self.experts)


def _longcat_forward(self, hidden_states):
    return _longcat_protocol(self, hidden_states, self.experts)


_CLASSES: dict[type, type] = {}


def _prepared_class(base: type, forward, experts_cls: type) -> type:
    """A subclass of the block's class with the protocol forward (one per class; deepcopy-able, not picklable
    by name: save a prepared model's state_dict, not the object)."""
    if base not in _CLASSES:
        _CLASSES[base] = type(base.__name__, (base,), {
            "forward": forward, "_ultraep_base": base, "_ultraep_experts_cls": experts_cls,
            "__doc__": f"{base.__name__} rewritten by ultraep.models.rewrite.prepare (exact; see its docstring)."})
    return _CLASSES[base]


# --------------------------------------------------------------------------------------------- state_dict keys
def _keymap(block: nn.Module) -> dict[str, tuple[str, tuple[int, ...]]] | None:
    """container key (relative to the block) -> (original key, original shape), while unwrapped."""
    experts = block._modules.get("experts")
    if not isinstance(experts, StackedExperts):
        return None
    return experts.origin["keys"]


def _tail(block: nn.Module, new: str) -> torch.Tensor | None:
    """Rows the original parameter had past the container's (Longcat's zero-expert rows of gate_up_proj)."""
    return block._buffers.get(_TAIL) if new == "experts.gate_up_proj" else None


def _state_dict_hook(block, state_dict, prefix, local_metadata):
    for new, (old, shape) in (_keymap(block) or {}).items():
        if prefix + new in state_dict:
            t, tail = state_dict.pop(prefix + new), _tail(block, new)
            if tail is not None:
                t = torch.cat([t.detach(), tail.to(t.dtype)])
            state_dict[prefix + old] = t.view(shape)


def _load_pre_hook(block, state_dict, prefix, local_metadata, strict, missing, unexpected, errors):
    keymap = _keymap(block) or {}
    for new, (old, _shape) in keymap.items():
        if prefix + old in state_dict:
            want = getattr(block.experts, new.split(".", 1)[1]).shape
            t, tail = state_dict.pop(prefix + old), _tail(block, new)
            if tail is not None and t.dim() >= 1 and t.shape[0] == want[0] + tail.shape[0]:
                with torch.no_grad():
                    tail.copy_(t[want[0]:])
                t = t[:want[0]]
            # a tensor of another size goes through as it is: load_state_dict reports the size mismatch
            state_dict[prefix + new] = t.reshape(want) if t.numel() == want.numel() else t


def _commit(block: nn.Module, forward, experts_cls: type, container: nn.Module | None) -> None:
    if container is not None:
        block.experts = container
        if not getattr(block, "_ultraep_hooked", False):
            block.register_state_dict_post_hook(_state_dict_hook)
            block.register_load_state_dict_pre_hook(_load_pre_hook)
            block._ultraep_hooked = True
    block.__class__ = _prepared_class(type(block), forward, experts_cls)


# --------------------------------------------------------------------------------------------- per family
def _need(block: nn.Module, attr: str, cls_name: str) -> nn.Module:
    sub = getattr(block, attr, None)
    if type(sub).__name__ != cls_name:
        raise _refuse(block, f"expected '{attr}' to be a {cls_name}, found {type(sub).__name__}")
    return sub


def _probe_block(block: nn.Module, protocol, experts: Callable, x: torch.Tensor) -> None:
    """Refuse unless the original forward and ``protocol(block, x, experts)`` agree (eval mode, no grad)."""
    if x.device.type == "meta":
        return
    modes = [(m, m.training) for m in block.modules()]
    block.eval()
    try:
        with torch.no_grad():
            ref, ours = type(block).forward(block, x.clone()), protocol(block, x.clone(), experts)
    except Exception as exc:  # noqa: BLE001 - a block the rewrite cannot run is refused, not guessed
        raise _refuse(block, f"probe of the rewritten block failed ({type(exc).__name__}: "
                             f"{str(exc).splitlines()[0] if str(exc) else ''})") from None
    finally:
        for m, mode in modes:
            m.training = mode
    pick = (lambda o: o[0] if isinstance(o, tuple) else o)
    _agree(block, pick(ref), pick(ours), "the rewritten block differs from its original forward")


def _probe_input(p: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    g = torch.Generator().manual_seed(4321)  # private: the user's RNG stream is untouched
    return torch.randn(shape, generator=g).to(device=p.device, dtype=p.dtype)


def _prepare_llama4(block: nn.Module) -> None:
    experts = _need(block, "experts", "Llama4TextExperts")
    _need(block, "router", "Llama4Router")
    gu, down = experts.gate_up_proj, experts.down_proj
    if gu.dim() != 3 or down.dim() != 3 or gu.shape[0] != down.shape[0] or gu.shape[2] != 2 * down.shape[1]:
        raise _refuse(block, f"Llama4TextExperts parameters have shapes {tuple(gu.shape)}, {tuple(down.shape)}; "
                             "expected gate_up_proj [E, H, 2I] and down_proj [E, I, H]")

    def eager(x, idx, w):
        return eager_experts(_LLAMA4.forward, experts, [gu, down], x, idx, w)

    _probe_block(block, _llama4_protocol, eager, _probe_input(gu, (4, int(gu.shape[1]))))
    setattr(experts, _MARK, "llama4")
    _commit(block, _llama4_forward, type(experts), None)


def _prepare_dbrx(block: nn.Module) -> None:
    old = _need(block, "experts", "DbrxExperts")
    mlp = _need(old, "mlp", "DbrxExpertGLU")
    E, I, H = int(old.num_experts), int(old.ffn_hidden_size), int(old.hidden_size)
    params, keys = {}, {}
    for n in ("w1", "v1", "w2"):
        p = getattr(mlp, n, None)
        if not isinstance(p, nn.Parameter) or tuple(p.shape) != (E * I, H):
            raise _refuse(block, f"experts.mlp.{n} is {None if p is None else tuple(p.shape)}; expected [E*I, H] = "
                                 f"{(E * I, H)}")
        # a view of the same storage under the [E, ...] layout the balanced layer slices
        params[n] = nn.Parameter(p.detach().view(E, I, H), requires_grad=p.requires_grad)
        if p.grad is not None:  # a gradient already accumulated stays with its weights
            params[n].grad = p.grad.view(E, I, H)
        keys[f"experts.{n}"] = (f"experts.mlp.{n}", (E * I, H))
    origin = {"module": old, "keys": keys}
    container = StackedExperts("rewrite:DbrxExperts", params, mlp.activation_fn, _dbrx_expert, origin)
    _probe_block(block, _dbrx_protocol, container, _probe_input(params["w1"], (1, 4, H)))
    for n in params:  # the old module keeps no storage alive once wrap frees the container's full tensors
        mlp.register_parameter(n, None)
    _commit(block, _dbrx_forward, StackedExperts, container)


def _prepare_jetmoe(block: nn.Module) -> None:
    lin_in, lin_out = _need(block, "input_linear", "JetMoeParallelExperts"), _need(block, "output_linear",
                                                                                     "JetMoeParallelExperts")
    w_in, w_out = lin_in.weight, lin_out.weight
    if w_in.dim() != 3 or w_out.dim() != 3 or w_in.shape[0] != w_out.shape[0] or w_in.shape[1] != 2 * w_out.shape[2]:
        raise _refuse(block, f"input_linear/output_linear weights are {tuple(w_in.shape)}, {tuple(w_out.shape)}; "
                             "expected [E, 2I, H] and [E, H, I]")
    # F.linear(x, w_in[e]) -> [gate; up] chunks, act(gate) * up, F.linear(., w_out[e]): the interface's
    # default non-transposed concatenated layout, on the very same parameter objects
    params = {"gate_up_proj": w_in, "down_proj": w_out}
    origin = {"module": (lin_in, lin_out), "order": list(block._modules), "keys": {"experts.gate_up_proj": ("input_linear.weight", tuple(w_in.shape)),
                                                    "experts.down_proj": ("output_linear.weight", tuple(w_out.shape))}}
    container = StackedExperts("rewrite:JetMoeParallelExperts", params, block.activation, hf_expert_forward(FLAGS),
                               origin)
    _probe_block(block, _jetmoe_protocol, container, _probe_input(w_in, (1, 4, int(w_in.shape[2]))))
    del block._modules["input_linear"], block._modules["output_linear"]
    lin_in.register_parameter("weight", None)
    lin_out.register_parameter("weight", None)
    _commit(block, _jetmoe_forward, StackedExperts, container)


def _prepare_longcat(block: nn.Module) -> None:
    old = _need(block, "experts", "LongcatFlashExperts")
    _need(block, "router", "LongcatFlashTopkRouter")
    E = getattr(getattr(block, "config", None), "n_routed_experts", None)
    if not isinstance(E, int) or E <= 0:
        raise _refuse(block, f"config.n_routed_experts is {E!r}; expected a positive number of real experts")
    Z = int(getattr(old, "zero_expert_num", 0) or 0)
    gu, down = old.gate_up_proj, old.down_proj
    if not isinstance(gu, nn.Parameter) or not isinstance(down, nn.Parameter) or gu.dim() != 3 or down.dim() != 3 \
            or int(gu.shape[0]) != E + Z or int(down.shape[0]) != E or gu.shape[1] != 2 * down.shape[2] \
            or gu.shape[2] != down.shape[1]:
        shapes = [None if p is None else tuple(p.shape) for p in (gu, down)]
        raise _refuse(block, f"LongcatFlashExperts parameters have shapes {shapes[0]}, {shapes[1]}; expected "
                             f"gate_up_proj [E+Z, 2I, H] and down_proj [E, H, I] with E={E}, Z={Z}")
    # the first E rows under the [E, ...] layout the balanced layer slices: a view, no copy
    head = nn.Parameter(gu.detach()[:E], requires_grad=gu.requires_grad)
    if gu.grad is not None:  # a gradient already accumulated stays with its weights (the Z rows' is zero)
        head.grad = gu.grad[:E]
    params = {"gate_up_proj": head, "down_proj": down}
    origin = {"module": old, "keys": {"experts.gate_up_proj": ("experts.gate_up_proj", tuple(gu.shape))}}
    container = StackedExperts("rewrite:LongcatFlashExperts", params, old.act_fn, hf_expert_forward(FLAGS), origin)
    _probe_block(block, _longcat_protocol, container, _probe_input(head, (1, 4, int(gu.shape[2]))))
    # a copy of the Z dead rows: a view would keep the whole [E + Z] storage alive once wrap frees the masters
    block.register_buffer(_TAIL, gu.detach()[E:].clone(), persistent=False)
    old.register_parameter("gate_up_proj", None)  # the old module keeps no storage alive
    _commit(block, _longcat_forward, StackedExperts, container)


_PREPARE = {"Llama4TextMoe": _prepare_llama4, "DbrxFFN": _prepare_dbrx, "JetMoeMoE": _prepare_jetmoe,
            "LongcatFlashMoE": _prepare_longcat}


def prepare(model: nn.Module) -> list[str]:
    """Rewrite, in place and exactly, every Llama4 / DBRX / JetMoE / Longcat-Flash MoE block of ``model`` into the
    experts-container form (see the module docstring); returns the rewritten blocks' names. Idempotent.
    Raises :class:`~ultraep.models.experts.UnsupportedModelError` (one line) for a block it cannot rewrite exactly."""
    done = []
    for name, block in list(model.named_modules()):
        cls = type(block)
        if getattr(cls, "_ultraep_base", None) is not None:
            continue  # already rewritten
        if cls.__name__ == "JetMoeMoA":  # attention experts: stay replicated (see the module docstring)
            for sub in ("input_linear", "output_linear"):
                if type(getattr(block, sub, None)).__name__ == "JetMoeParallelExperts":
                    setattr(getattr(block, sub), _MARK, "replicated")
            continue
        fn = _PREPARE.get(cls.__name__)
        if fn is not None:
            fn(block)
            done.append(name)
    return done


def restore(model: nn.Module) -> nn.Module:
    """Undo :func:`prepare` on an unwrapped model: every rewritten block gets its original class and expert
    modules back, holding the current weights (views of the same storage, no copy). ``ultraep.unwrap`` leaves
    the rewritten (equivalent) form; call this after it to get the original module tree."""
    for name, block in list(model.named_modules()):
        base = getattr(type(block), "_ultraep_base", None)
        if base is None:
            continue
        experts = block._modules.get("experts")
        if not isinstance(experts, (StackedExperts, type(block)._ultraep_experts_cls)):
            raise UnsupportedModelError(name, f"is still balanced ({type(experts).__name__}): call ultraep.unwrap first")
        if isinstance(experts, StackedExperts) and base.__name__ == "DbrxFFN":
            old = experts.origin["module"]
            for n in experts.param_names:
                p = getattr(experts, n)
                flat = nn.Parameter(p.detach().reshape(-1, p.shape[-1]), requires_grad=p.requires_grad)
                if p.grad is not None:
                    flat.grad = p.grad.reshape(flat.shape)
                old.mlp.register_parameter(n, flat)
            block.experts = old
        elif isinstance(experts, StackedExperts) and base.__name__ == "LongcatFlashMoE":
            old, p, tail = experts.origin["module"], experts.gate_up_proj, block._buffers.pop(_TAIL)
            full = nn.Parameter(torch.cat([p.detach(), tail.to(p.dtype)]), requires_grad=p.requires_grad)
            if p.grad is not None:  # the zero experts' rows get no gradient, as in the original forward
                full.grad = torch.cat([p.grad, p.grad.new_zeros(tail.shape)])
            old.register_parameter("gate_up_proj", full)
            old.down_proj = experts.down_proj
            block.experts = old
        elif isinstance(experts, StackedExperts):  # JetMoE: the same parameter objects go back
            lin_in, lin_out = experts.origin["module"]
            lin_in.weight, lin_out.weight = experts.gate_up_proj, experts.down_proj
            del block._modules["experts"]
            block.input_linear, block.output_linear = lin_in, lin_out
            block._modules = {k: block._modules[k] for k in experts.origin["order"]}  # original key order
        elif getattr(experts, _MARK, None) is not None:
            delattr(experts, _MARK)
        block.__class__ = base
    return model

"""Tiny torchtitan MoE models built from torchtitan's own configs (its model registry's debug flavors), for tests.

* :func:`moe_block` — one family's ``MoE`` layer from the flavor's own layer config (its router, routed experts,
  shared experts), with the expert hidden size cut to :data:`HIDDEN` so CPU tests stay small;
* :func:`decoder` — the whole decoder of the flavor, its first layers only, the same expert cut, and its inner
  attention replaced by :class:`CausalAttention` (the flavors' attention is flex or varlen attention, which has no
  backward on CPU; on a batch of whole sequences — positions ``0..L-1`` — its block-causal mask is the causal
  mask, which :class:`CausalAttention` computes with ``scaled_dot_product_attention``, or flex's math on the
  model's own flex masks where it passes them: GPT-OSS's sinks and sliding windows). ultraep touches only the
  routed experts, so the wrapped and the unwrapped model share whatever attention they have.

qwen3_5's model module imports ``fla`` (flash-linear-attention's Triton ops) at import time; its GatedDeltaNet
(linear-attention) layers call them, and they need a GPU: :func:`decoder` keeps its full-attention layers only, and
no test runs fla's code. Where ``fla`` is not installed (this venv: with it, transformers' own Qwen3-Next layers
would call its GPU kernels on CPU), :func:`_import_qwen3_5` imports the module with placeholders in fla's place
that raise when used, and takes them out of ``sys.modules`` again.

Families (:data:`FAMILIES`): every torchtitan family with routed experts, plus variants that switch on
node-limited routing (``num_expert_groups`` / ``num_limited_groups``) and ``load_balance_coeff`` off.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

#: the largest vocabulary of the tiny decoders (the debug flavors' 2048)
VOCAB = 2048
#: expert hidden size of the tiny models (a multiple of 8: torch._grouped_mm's bf16 strides are 16-byte aligned)
HIDDEN = 32


def _registry(family: str):
    if family == "qwen3":
        from torchtitan.models.qwen3 import model_registry

        return model_registry("debugmodel_moe")
    if family == "deepseek_v3":
        from torchtitan.models.deepseek_v3 import model_registry

        return model_registry("debugmodel")
    if family == "kimi_k2_7":
        from torchtitan.models.kimi_k2_7 import model_registry

        return model_registry("debugmodel")
    if family == "gpt_oss":  # flex: the attention masks are flex BlockMasks the test attention reads
        from torchtitan.models.gpt_oss import model_registry

        return model_registry("debugmodel", attn_backend="flex")
    if family == "qwen3_5":
        return _import_qwen3_5().model_registry("debugmodel_moe")
    raise KeyError(family)


#: the modules of fla that qwen3_5's model module imports from (torchtitan 0.3.0)
_FLA_MODULES = ("fla", "fla.modules", "fla.modules.conv", "fla.modules.conv.triton", "fla.modules.conv.triton.ops",
                "fla.modules.conv.causal_conv1d", "fla.ops", "fla.ops.gated_delta_rule",
                "fla.ops.gated_delta_rule.chunk", "fla.ops.gated_delta_rule.fused_recurrent")


class _FlaPlaceholder:
    """What qwen3_5's module imports from fla, when fla is not installed: any use raises, so a test that reached
    fla's code would fail, never run something else."""

    def __init__(self, name: str):
        self._name = name

    def __call__(self, *args, **kwargs):
        raise RuntimeError(f"{self._name}: flash-linear-attention is not installed (its Triton ops need a GPU)")

    def __getattr__(self, attr):
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _FlaPlaceholder(f"{self._name}.{attr}")


def _import_qwen3_5():
    """torchtitan's qwen3_5 package; without fla installed, imported with :class:`_FlaPlaceholder` modules in fla's
    place, removed from ``sys.modules`` afterwards (so that nothing else, e.g. transformers, finds an ``fla``)."""
    import importlib
    import importlib.util
    import sys
    import types

    if "torchtitan.models.qwen3_5" in sys.modules or importlib.util.find_spec("fla") is not None:
        return importlib.import_module("torchtitan.models.qwen3_5")

    class _Module(types.ModuleType):
        def __getattr__(self, attr):
            if attr.startswith("__"):
                raise AttributeError(attr)
            return _FlaPlaceholder(f"{self.__name__}.{attr}")

    placed = [name for name in _FLA_MODULES if name not in sys.modules]
    for name in placed:
        mod = _Module(name)
        mod.__path__ = []  # a package: its submodules import
        sys.modules[name] = mod
    try:
        return importlib.import_module("torchtitan.models.qwen3_5")
    finally:
        for name in placed:
            sys.modules.pop(name, None)


def _shrink(moe_cfg, node_limited: bool = False, load_balance: bool = True):
    re = moe_cfg.routed_experts
    inner = dataclasses.replace(re.inner_experts, hidden_dim=HIDDEN)
    moe_cfg = dataclasses.replace(moe_cfg, routed_experts=dataclasses.replace(re, inner_experts=inner))
    if node_limited:  # DeepSeek-V3's node-limited routing: 4 groups of experts, each token's top-k from 2
        moe_cfg = dataclasses.replace(moe_cfg, router=dataclasses.replace(
            moe_cfg.router, num_expert_groups=4, num_limited_groups=2))
    if not load_balance:
        moe_cfg = dataclasses.replace(moe_cfg, load_balance_coeff=None)
    if moe_cfg.shared_experts is not None:  # the shared experts' hidden size cut alike (dims of w1/w2/w3)
        se = moe_cfg.shared_experts
        moe_cfg = dataclasses.replace(moe_cfg, shared_experts=dataclasses.replace(
            se, w1=dataclasses.replace(se.w1, out_features=HIDDEN), w2=dataclasses.replace(se.w2, in_features=HIDDEN),
            w3=dataclasses.replace(se.w3, out_features=HIDDEN)))
    return moe_cfg


#: family -> (registry family, variant options)
FAMILIES = {
    "qwen3": ("qwen3", {}),
    "qwen3_5": ("qwen3_5", {}),
    "deepseek_v3": ("deepseek_v3", {}),
    "deepseek_v3-node-limited": ("deepseek_v3", {"node_limited": True}),
    "kimi_k2_7": ("kimi_k2_7", {}),
    "gpt_oss": ("gpt_oss", {}),
    "qwen3-no-load-balance": ("qwen3", {"load_balance": False}),
}


def moe_config(family: str):
    base, opts = FAMILIES[family]
    cfg = _registry(base).model
    moe = next(layer.moe for layer in cfg.layers if getattr(layer, "moe", None) is not None)
    return _shrink(moe, **opts)


def _init(module: nn.Module, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    module.init_states(buffer_device=torch.device("cpu"))
    with torch.no_grad():  # the gpt_oss biases start at zero: give every parameter a non-trivial value
        for n, p in module.named_parameters():
            if "bias" in n and p.abs().sum() == 0:
                p.normal_(0, 0.02)
    return module


def moe_block(family: str, seed: int = 0) -> nn.Module:
    """The family's ``MoE`` layer (fp32 parameters; gpt_oss in bf16: its experts return bf16, which its combine
    adds into the activations' dtype)."""
    block = _init(moe_config(family).build(), seed)
    if FAMILIES[family][0] == "gpt_oss":
        block.to(torch.bfloat16)
    return block


class CausalAttention(nn.Module):
    """The inner attention of a flavor, with a backward on CPU (flex and varlen attention have none there), over
    ``(B, L, N, H)`` q/k/v:

    * called without a mask and without ``out_transform`` (the flavors' block-causal mask on whole sequences is
      the causal mask): causal ``scaled_dot_product_attention``;
    * called with torchtitan's own flex ``BlockMask`` (from the model's ``get_attention_masks``) or an
      ``out_transform`` (GPT-OSS's attention sinks, which rescale by the log-sum-exp): flex attention's math in
      full — scores ``q·kᵀ·scale`` where the mask's ``mask_mod`` allows (evaluated for every position pair,
      ``create_mask``), softmax, the log-sum-exp (natural log, as flex returns it), then ``out_transform(out, lse)``;
      grouped-query heads as flex's ``enable_gqa`` (query head ``n`` reads key/value head ``n // (N / N_kv)``).
      tests/test_torchtitan.py checks it against torchtitan's ``FlexAttention`` itself (forward, which flex runs
      on CPU)."""

    def forward(self, q_BLNH, k_BLNH, v_BLNH, *, attention_masks=None, scale=None, enable_gqa=False,
                out_transform=None, **kwargs):
        q, k, v = (t.transpose(1, 2) for t in (q_BLNH, k_BLNH, v_BLNH))  # (B, N, L, H)
        if attention_masks is None and out_transform is None:
            out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale,
                                                                   enable_gqa=enable_gqa)
            return out.transpose(1, 2)
        from torch.nn.attention.flex_attention import create_mask

        B, N, L, H = q.shape
        if k.shape[1] != N:  # grouped-query attention
            k, v = (t.repeat_interleave(N // t.shape[1], dim=1) for t in (k, v))
        if attention_masks is None:
            allowed = torch.ones(L, L, dtype=torch.bool, device=q.device).tril()
        else:
            allowed = create_mask(attention_masks.mask_mod, B, 1, L, L, device=q.device)  # (B, 1, L, L)
        scores = (q @ k.transpose(-2, -1)).float() * (H ** -0.5 if scale is None else scale)
        scores = scores.masked_fill(~allowed, float("-inf"))
        lse_BNL = torch.logsumexp(scores, dim=-1)
        out = (torch.softmax(scores, dim=-1).to(v.dtype) @ v).transpose(1, 2)  # (B, L, N, Hv)
        if out_transform is None:
            return out
        return out_transform(out, lse_BNL.transpose(1, 2))


def decoder_config(family: str, layers: int = 2):
    base, opts = FAMILIES[family]
    cfg = _registry(base).model
    keep = []
    for layer in cfg.layers:  # the first `layers` MoE layers (and the dense ones before them)
        if getattr(layer, "delta_net", None) is not None:  # qwen3_5's linear attention: fla's Triton kernels only
            continue
        if getattr(layer, "moe", None) is not None:
            layer = dataclasses.replace(layer, moe=_shrink(layer.moe, **opts))
        keep.append(layer)
        if sum(getattr(la, "moe", None) is not None for la in keep) == layers:
            break
    cfg.layers = keep
    if hasattr(cfg, "mtp_layers"):
        cfg.mtp_layers = []
    if getattr(cfg, "vision_encoder", None) is not None and base == "kimi_k2_7":  # text only, as its Moonlight
        cfg.vision_encoder = None                                                  # flavor (qwen3_5 needs one)
    if cfg.vocab_size > VOCAB:  # qwen3_5's debug flavor has the full 248k vocabulary
        cfg.vocab_size = VOCAB
        cfg.tok_embeddings = dataclasses.replace(cfg.tok_embeddings, num_embeddings=VOCAB)
        cfg.lm_head = dataclasses.replace(cfg.lm_head, out_features=VOCAB)
    return cfg


def swap_attention(model: nn.Module) -> nn.Module:
    for module in list(model.modules()):
        if "inner_attention" in module._modules:
            module.inner_attention = CausalAttention()
    return model


def decoder(family: str, layers: int = 2, seed: int = 0) -> nn.Module:
    """The family's decoder (its first ``layers`` MoE layers), attention as :class:`CausalAttention`."""
    return swap_attention(_init(decoder_config(family, layers).build(), seed))


def batch(vocab: int, rows: int, length: int, seed: int, ids: int = 3) -> torch.Tensor:
    """Token ids ``[rows, length]`` from ``ids`` distinct tokens (concentrated routing: replicas get planned)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, ids, (rows, length), generator=g) * (vocab // max(ids, 1))

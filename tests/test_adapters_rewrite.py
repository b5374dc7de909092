"""``prepare`` rewrites Llama4 / DBRX / JetMoE / Longcat-Flash MoE blocks exactly, keeps checkpoints loadable, and refuses what
it cannot rewrite exactly (single process; the 2-rank exactness checks are in test_adapters_conformance.py)."""

from __future__ import annotations

import copy
import os
import sys

import pytest
import torch

from ultraep.models.adapters import UnsupportedModelError, adapter_for
from ultraep.models.rewrite import prepare, restore

sys.path.insert(0, os.path.dirname(__file__))
from numerics import assert_exact  # noqa: E402
from test_adapters import randomized  # noqa: E402

H, I, E = 16, 8, 8


def _block(kind: str):
    import transformers as tf

    if kind == "llama4":
        from transformers.models.llama4.modeling_llama4 import Llama4TextMoe as cls

        cfg = tf.Llama4TextConfig(hidden_size=H, intermediate_size=I, num_local_experts=E, num_experts_per_tok=2)
    elif kind == "dbrx":
        from transformers.models.dbrx.modeling_dbrx import DbrxFFN as cls

        cfg = tf.DbrxConfig(d_model=H, ffn_config=dict(hidden_size=H, ffn_hidden_size=I, moe_num_experts=E, moe_top_k=2))
    elif kind == "jetmoe":
        from transformers.models.jetmoe.modeling_jetmoe import JetMoeMoE as cls

        cfg = tf.JetMoeConfig(hidden_size=H, intermediate_size=I, num_local_experts=E, num_experts_per_tok=2)
    else:  # longcat: 2 zero-computation experts (ids 8, 9) beside the 8 real ones
        from transformers.models.longcat_flash.modeling_longcat_flash import LongcatFlashMoE as cls

        cfg = tf.LongcatFlashConfig(hidden_size=H, expert_ffn_hidden_size=I, n_routed_experts=E, zero_expert_num=2,
                                    moe_topk=3)
    return randomized(cls, cfg)


def _out(block, x):
    out = block(x)
    return out[0] if isinstance(out, tuple) else out


@pytest.mark.parametrize("kind", ["llama4", "dbrx", "jetmoe", "longcat"])
def test_prepare_is_exact_keeps_storage_and_checkpoint_keys_and_restore_undoes_it(kind):
    block = _block(kind)
    orig = copy.deepcopy(block)
    ptrs = {p.data_ptr() for p in block.parameters()}
    x = torch.randn(1, 6, H, generator=torch.Generator().manual_seed(1))
    if kind == "longcat":  # the check below covers zero-computation experts: some slots pick ids >= E
        assert (orig.router(x)[2] >= E).any()
    assert prepare(block) == [""] and prepare(block) == []  # idempotent
    assert {p.data_ptr() for p in block.parameters()} == ptrs  # views / the same parameters: no copy
    experts = block.experts
    assert adapter_for(experts) is not None
    osd, sd = orig.state_dict(), block.state_dict()
    assert {k: v.shape for k, v in sd.items()} == {k: v.shape for k, v in osd.items()}  # original keys, shapes
    assert all(torch.equal(sd[k], osd[k]) for k in osd)
    assert torch.equal(_out(block, x), _out(orig, x))
    # an original checkpoint loads into the prepared block (strict)
    other = _block(kind)
    with torch.no_grad():
        for p in other.parameters():
            p.add_(1.0)
    block.load_state_dict(other.state_dict())
    assert_exact(_out(block, x), _out(other, x), "loaded checkpoint")  # relative to max |out|, fails on NaN
    restore(block)
    assert [type(m) for m in block.modules()] == [type(m) for m in other.modules()]
    assert list(block.state_dict()) == list(other.state_dict())
    assert torch.equal(_out(block, x), _out(other, x))


@pytest.mark.parametrize("kind,attr", [("llama4", "experts"), ("dbrx", "experts"), ("jetmoe", "input_linear"),
                                       ("longcat", "experts")])
def test_container_outside_its_block_is_refused_by_name(kind, attr):
    with pytest.raises(UnsupportedModelError) as info:
        adapter_for(getattr(_block(kind), attr))
    msg = str(info.value)
    assert "\n" not in msg and "refused:" in msg and "outside" in msg, msg


def test_block_whose_router_disagrees_with_the_rewrite_is_refused_and_left_unchanged():
    block = _block("llama4")
    router = block.router

    def three(hidden):  # scores for top-3 experts while the router's top_k is 2: not the rewrite's selection
        logits = torch.nn.functional.linear(hidden, router.weight)
        top, idx = torch.topk(logits, 3, dim=1)
        return torch.full_like(logits, float("-inf")).scatter_(1, idx, top).sigmoid(), logits

    router.forward = three
    with pytest.raises(UnsupportedModelError) as info:
        prepare(block)
    assert "differs from its original forward" in str(info.value) and "\n" not in str(info.value)
    assert type(block).__module__.startswith("transformers.")  # nothing was rewritten


def test_jetmoe_attention_experts_stay_replicated():
    import transformers as tf

    cfg = tf.JetMoeConfig(vocab_size=32, hidden_size=H, num_hidden_layers=1, num_key_value_heads=2, kv_channels=4,
                          intermediate_size=I, num_local_experts=4, num_experts_per_tok=2)
    model = tf.JetMoeForCausalLM(cfg)
    assert prepare(model) == ["model.layers.0.mlp"]
    found = [n for n, m in model.named_modules() if adapter_for(m) is not None]
    assert found == ["model.layers.0.mlp.experts"]  # the mixture-of-attention experts are not balanced

"""Tiny Hugging Face MoE models built from configs (random weights, no download), for tests and the demo.

Each builder returns a transformers v5 causal LM whose MoE layers use the experts interface ultraep wraps.
Sizes are small enough for a 2-core CPU; every builder takes the same knobs.
"""

from __future__ import annotations

import torch

FAMILIES = ("qwen3-moe", "mixtral", "deepseek-v3", "gpt-oss")


def build_model(family: str, *, num_experts: int = 8, top_k: int = 2, hidden: int = 32, expert_hidden: int = 16,
                layers: int = 2, vocab: int = 64, seed: int = 0, dtype: torch.dtype = torch.float32):
    """A small ``family`` model with ``num_experts`` experts per MoE layer (every layer is MoE)."""
    import transformers as tf

    common = dict(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=512)
    if family == "qwen3-moe":
        cfg = tf.Qwen3MoeConfig(**common, intermediate_size=2 * expert_hidden, moe_intermediate_size=expert_hidden,
                                head_dim=hidden // 4, num_experts=num_experts, num_experts_per_tok=top_k,
                                decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True)
        cls = tf.Qwen3MoeForCausalLM
    elif family == "mixtral":
        cfg = tf.MixtralConfig(**common, intermediate_size=expert_hidden, head_dim=hidden // 4,
                               num_local_experts=num_experts, num_experts_per_tok=top_k)
        cls = tf.MixtralForCausalLM
    elif family == "deepseek-v3":
        cfg = tf.DeepseekV3Config(**{**common, "num_key_value_heads": 4}, intermediate_size=2 * expert_hidden,
                                  moe_intermediate_size=expert_hidden, first_k_dense_replace=0,
                                  n_routed_experts=num_experts, n_shared_experts=1, num_experts_per_tok=top_k,
                                  n_group=2, topk_group=1, q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=4,
                                  qk_nope_head_dim=4, v_head_dim=8)
        cls = tf.DeepseekV3ForCausalLM
    elif family == "gpt-oss":
        cfg = tf.GptOssConfig(**common, intermediate_size=expert_hidden, head_dim=hidden // 4,
                              num_local_experts=num_experts, num_experts_per_tok=top_k, sliding_window=16)
        cls = tf.GptOssForCausalLM
    else:
        raise ValueError(f"unknown model family {family!r}; choose from {', '.join(FAMILIES)}")
    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = cls(cfg).to(dtype)
    if family == "deepseek-v3":
        # a non-zero correction bias proves ultraep leaves DeepSeek's routing (and its bias) intact
        for layer in model.model.layers:
            layer.mlp.gate.e_score_correction_bias.copy_(torch.linspace(-0.05, 0.05, num_experts))
    return model


def preload() -> None:
    """Import the model classes now (transformers loads them lazily, which costs seconds per process):
    call before forking ranks so every rank inherits them."""
    import transformers as tf

    for name in ("Qwen3MoeForCausalLM", "MixtralForCausalLM", "DeepseekV3ForCausalLM", "GptOssForCausalLM"):
        getattr(tf, name)
    import ultraep.runtime.layer  # noqa: F401
    import ultraep.kernels.dispatch  # noqa: F401
    import ultraep.kernels.grad_reduce  # noqa: F401
    import ultraep.kernels.rerouting  # noqa: F401
    import ultraep.kernels.tiles  # noqa: F401
    import ultraep.policies  # noqa: F401

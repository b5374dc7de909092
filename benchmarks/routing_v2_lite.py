"""Routing of a DeepSeek-V2-Lite-layout model, written as a trace (the regime of issue 35: nothing pays).

The layout of DeepSeek-V2-Lite's MoE blocks (64 routed experts, top-6 greedy, 2 shared experts, first layer dense) in a
small model built from its transformers config (random weights: no download), one sequence of ``--tokens`` tokens per
rank per step (token ids drawn Zipf-like, as text), 8 ranks; each step's per-rank expert counts are recorded from the
router's top-k ids.

    .venv/bin/python -m benchmarks.routing_v2_lite v2lite.parquet             # about 2 minutes on 2 cores
    .venv/bin/ultraep simulate v2lite.parquet --topology gb200-nvl72 --ranks 8 --slots 2
"""

from __future__ import annotations

import argparse

import numpy as np


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out", help="trace file to write (Parquet)")
    ap.add_argument("--tokens", type=int, default=120, help="tokens per rank per step")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--ranks", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    import torch
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM

    from ultraep.traces import Trace, TraceMeta

    E, K, R, T = 64, 6, args.ranks, args.tokens
    torch.manual_seed(args.seed)
    cfg = DeepseekV2Config(vocab_size=4096, hidden_size=256, intermediate_size=512, moe_intermediate_size=64,
                           num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=E,
                           num_experts_per_tok=K, n_shared_experts=2, first_k_dense_replace=1, topk_method="greedy",
                           q_lora_rank=None, kv_lora_rank=64, qk_rope_head_dim=16, qk_nope_head_dim=32, v_head_dim=32)
    model = DeepseekV2ForCausalLM(cfg).eval()
    moe = [i for i, layer in enumerate(model.model.layers) if hasattr(layer.mlp, "gate")]
    ids_of = {}
    for i in moe:  # the router returns (logits, weights, top-k ids)
        model.model.layers[i].mlp.gate.register_forward_hook(lambda m, a, out, i=i: ids_of.__setitem__(i, out[2]))
    rng = np.random.default_rng(args.seed)
    p = 1.0 / np.arange(1, cfg.vocab_size + 1) ** 1.1
    p /= p.sum()
    counts = np.zeros((args.steps, len(moe), R, E), np.int64)  # [steps, layers, ranks, experts]
    with torch.no_grad():
        for s in range(args.steps):
            model(input_ids=torch.as_tensor(rng.choice(cfg.vocab_size, size=(R, T), p=p)))
            for j, i in enumerate(moe):
                top = ids_of[i].reshape(R, T * K).numpy()
                for r in range(R):
                    counts[s, j, r] = np.bincount(top[r], minlength=E)
    meta = TraceMeta(num_experts=E, num_ranks=R, top_k=K, model="deepseek-v2-lite-layout",
                     description=f"{T} tokens per rank per step, random weights, seed {args.seed}")
    Trace.from_rank_counts(counts, meta, steps=list(range(args.steps)), microbatches=[0] * args.steps,
                           layers=moe).write(args.out)
    print(f"wrote {args.out}: {args.steps} steps x {len(moe)} MoE layers x {R} ranks")


if __name__ == "__main__":
    main()

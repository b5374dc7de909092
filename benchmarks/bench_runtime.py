"""Runtime benchmark: one balanced MoE layer, forward + backward, on 2 local gloo ranks (one thread each).

The layer is a transformers v5 ``Qwen3MoeExperts`` container big enough that expert compute dominates.
Routing is skewed so that the rank-level imbalance without balancing is about 1.6 (hot experts on rank 0);
the same tokens are then run

  * ``none``            no balancing,
  * ``quota``           exact-load real-time balancing (planning, weight streaming, replica gradient
                        reduction and the replica recompute in backward all included in the time),
  * ``force-balanced``  the router forced uniform (the ideal: every rank gets the mean load, no overhead).

Layer time = max over ranks of (forward + backward) wall time per iteration (the all-to-alls make every
rank wait for the slowest). Goals: quota >= 1.25x faster than none, and >= 90 % of force-balanced.

    .venv/bin/python benchmarks/bench_runtime.py [--tokens 2048] [--hidden 1024] [--iters 3]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from benchmarks.common import row, write_rows  # noqa: E402
from ultraep.launch import launch  # noqa: E402


def _routing(rank: int, T: int, K: int, E: int, skew: bool, seed: int) -> torch.Tensor:
    """Top-k ids ``[T, K]``: skewed (hot experts 0..3 on rank 0) or uniform (force-balanced)."""
    g = torch.Generator().manual_seed(seed + rank)
    if skew:
        p = torch.full((E,), 1.0)
        p[: E // 2] = 4.0  # rank 0's masters get 4x the popularity -> rank loads 1.6 : 0.4 of the mean
    else:
        p = torch.ones(E)
    return torch.multinomial(p.expand(T, E), K, replacement=False, generator=g)


def _body(rank, world, args, policy, skew):
    import transformers as tf

    import ultraep

    cfg = tf.Qwen3MoeConfig(hidden_size=args.hidden, moe_intermediate_size=args.ffn, num_experts=args.experts,
                            num_experts_per_tok=args.top_k)
    torch.manual_seed(0)
    experts = tf.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeExperts(cfg)
    with torch.no_grad():
        experts.gate_up_proj.normal_(0, 0.02)
        experts.down_proj.normal_(0, 0.02)
    holder = torch.nn.Module()
    holder.experts = experts
    ultraep.wrap(holder, {"policy": policy, "num_redundant_slots": args.slots})
    layer = holder.experts
    g = torch.Generator().manual_seed(7 + rank)
    x = torch.randn(args.tokens, args.hidden, generator=g).requires_grad_(True)
    idx = _routing(rank, args.tokens, args.top_k, args.experts, skew, args.seed)
    w = torch.softmax(torch.randn(args.tokens, args.top_k, generator=g), -1)
    times = []
    for it in range(args.warmup + args.iters):
        torch.distributed.barrier()
        t0 = time.perf_counter()
        y = layer(x, idx, w)
        y.pow(2).mean().backward()
        t = time.perf_counter() - t0
        layer.zero_grad(set_to_none=True)
        x.grad = None
        if it >= args.warmup:
            times.append(t)
    plan = layer.last_plan
    return {"times": times, "imb_before": plan.imbalance_before, "imb_after": plan.imbalance_after,
            "replicas": plan.num_replicas}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=2048, help="tokens per rank")
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--ffn", type=int, default=1024, help="expert intermediate size")
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--slots", type=int, default=2)
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    from ultraep.models import preload

    preload()
    cases = [("none", "none", True), ("quota", "quota", True), ("force-balanced", "none", False)]
    res = {}
    for name, policy, skew in cases:
        out = launch(_body, 2, args, policy, skew, backend="gloo", threads_per_rank=1)
        per_iter = np.max(np.array([o["times"] for o in out]), axis=0)  # the slowest rank sets the pace
        res[name] = (per_iter, out[0])
    from rich.console import Console
    from rich.table import Table

    t_none = np.median(res["none"][0])
    t_ideal = np.median(res["force-balanced"][0])
    table = Table(title=f"one MoE layer fwd+bwd, 2 ranks x 1 thread, {args.tokens} tokens/rank, H={args.hidden}, "
                        f"I={args.ffn}, E={args.experts}, top-{args.top_k}")
    for c in ["run", "imbalance before", "imbalance after", "replicas", "layer time p50 (s)", "speed-up vs none",
              "% of force-balanced"]:
        table.add_column(c, justify="right")
    rows = []
    for name, (t, info) in res.items():
        p50 = float(np.median(t))
        table.add_row(name, f"{info['imb_before']:.3f}", f"{info['imb_after']:.3f}", str(info["replicas"]),
                      f"{p50:.3f}", f"{t_none / p50:.2f}x", f"{100 * t_ideal / p50:.1f} %")
        rows.append(row("runtime_layer_fwd_bwd", name, "layer_time", "s", f"2x1/{args.tokens}tok", t))
        rows.append(row("runtime_layer_fwd_bwd", name, "speedup_vs_none", "ratio", f"2x1/{args.tokens}tok",
                        t_none / p50))
        rows.append(row("runtime_layer_fwd_bwd", name, "pct_of_force_balanced", "%", f"2x1/{args.tokens}tok",
                        100 * t_ideal / p50))
    Console(width=200).print(table)
    print(f"rows appended to {write_rows('bench_runtime', rows)}")


if __name__ == "__main__":
    main()

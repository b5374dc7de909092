"""Reproduce the papers' tables with the simulator (issue 16): paper vs simulator, row by row.

The papers' numbers are in ``../shared/references/papers.md`` (UltraEP arXiv 2606.04101 Fig. 11; FEPLB arXiv
2604.19654 §2.3; HybridEP arXiv 2510.19470 Table V and the expert-size sweep). Every run replays a synthetic
trace (``ultraep.traces.synthetic``) with the cost model, through the same engine the runtime uses; tokens are
de-duplicated per destination rank/domain with the trace's top-k (DeepEP), and replicas are charged as the
runtime's replica cache moves them (every replica at each training step). Nothing below is fitted per row,
except HybridEP's fixed per-iteration time, one number per cluster, taken from the paper's own smallest point
(see ``fixed_s``): the papers do not give the rest of their iteration otherwise.

    .venv/bin/python -m benchmarks.reproduce_papers              # all rows, ~1-3 min on 2 cores
    .venv/bin/python -m benchmarks.reproduce_papers --only feplb  # one group: ultraep | feplb | hybridep

Prints a Markdown table (the one in ``docs/simulator.md`` §11) and writes long-form rows to
``benchmarks/results/reproduce_papers.csv``.
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("NUMBA_NUM_THREADS", "1")

import numpy as np  # noqa: E402

from benchmarks.common import row, write_rows  # noqa: E402
from ultraep.sim import build_cost_model, sim_params, simulate  # noqa: E402
from ultraep.traces.synthetic import SyntheticSpec, synthetic_trace  # noqa: E402

#: UltraEP Fig. 13 (Qwen3-235B per-layer breakdown): non-MoE time and backward / forward factors
FIG13 = dict(non_moe_fwd_s=2.83e-3, non_moe_bwd_s=4.49e-3, backward_compute_factor=4.32 / 1.89,
             backward_a2a_factor=1.62 / 1.68)

# ---------------------------------------------------------------------------------------------- UltraEP
#: model -> (experts, hidden, expert FFN, initial imbalance of Megatron in Fig. 11, paper % of ideal
#: none / EPLB / EPLB+ / UltraEP = TFLOPS / ideal TFLOPS)
ULTRAEP = {
    "GLM4.5-106B": (128, 4096, 1408, 2.23, (545, 646, 695, 757), 785.4),
    "Qwen3-235B": (128, 4096, 1536, 2.86, (315, 449, 474, 524), 574.7),
    "DeepSeek-V3": (256, 7168, 2048, 1.30, (509, 505, 553, 613), 637.6),
}
ULTRAEP_POLICIES = ("none", "eplb", "eplb+", "quota", "adaptive")


def ultraep_rows(steps: int, layers: int, seed: int, drift: float = 0.05) -> list[dict]:
    out = []
    for model, (E, H, F, imb, tflops, ideal) in ULTRAEP.items():
        tr = synthetic_trace(SyntheticSpec(num_ranks=64, num_experts=E, num_layers=layers, num_steps=steps, top_k=8,
                                           tokens_per_rank=8192, imbalance=(imb, imb), drift=drift, seed=seed))
        cm = build_cost_model("gb200-nvl72", 64, E, 2, params=sim_params(dedup_top_k=8, **FIG13),
                              overrides={"expert": {"hidden_size": H, "ffn_size": F}})
        res = simulate(tr, cm, ULTRAEP_POLICIES, workers=2, max_plans=None)
        s = {x["policy"]: x for x in res.summary()}
        paper = [100.0 * t / ideal for t in tflops]
        sim = [s[p]["pct_of_ideal"] for p in ("none", "eplb", "eplb+", "quota")]
        best = min(s[p]["time_per_layer_ms"] for p in ULTRAEP_POLICIES[:-1])
        out.append({
            "group": "ultraep", "row": f"{model} none / EPLB / EPLB+ / UltraEP % of ideal (gb200, EP64)",
            "paper": " / ".join(f"{x:.0f}" for x in paper), "sim": " / ".join(f"{x:.0f}" for x in sim),
            "within": all(abs(a - b) <= 5.0 for a, b in zip(paper, sim)),
            "delta": " / ".join(f"{b - a:+.0f}" for a, b in zip(paper, sim)),
            "adaptive_vs_best": s["adaptive"]["time_per_layer_ms"] / best,
            "imbalance": f"{s['none']['imbalance_before']:.2f} -> " + " / ".join(
                f"{s[p]['imbalance_after']:.2f}" for p in ("eplb", "eplb+", "quota")),
            "command": f"python -m benchmarks.reproduce_papers --only ultraep  # {model}: E={E}, H={H}, F={F}, "
                       f"imbalance {imb}, top-8, 8192 tokens/rank, {layers} layers x {steps} steps, drift {drift:g}",
        })
    return out


# ---------------------------------------------------------------------------------------------- FEPLB
#: EP -> (paper token straggler reduction %, GEMM straggler reduction %)
FEPLB = {2: (51, 50), 4: (63, 62), 8: (70, 68)}


def feplb_rows(steps: int, seed: int, imbalance: float) -> list[dict]:
    out = []
    for ep, (tok_paper, gemm_paper) in FEPLB.items():
        # GLM-5's MoE layer (128 experts; 72 MiB bf16 experts: H 6144, F 2048), H100 nodes, EP inside a node
        tr = synthetic_trace(SyntheticSpec(num_ranks=ep, num_experts=128, num_layers=2, num_steps=steps, top_k=8,
                                           tokens_per_rank=4096, imbalance=(imbalance, imbalance), drift=0.05,
                                           seed=seed))
        cm = build_cost_model("h100-8x-ib", ep, 128, 4, params=sim_params(dedup_top_k=8),
                              overrides={"expert": {"hidden_size": 6144, "ffn_size": 2048}})
        res = simulate(tr, cm, ("none", "feplb", "adaptive"), workers=2, max_plans=None)
        n, f = res.rows["none"], res.rows["feplb"]
        tok = 100.0 * (1 - f["token_straggler"].mean() / n["token_straggler"].mean())
        gemm = 100.0 * (1 - f["gemm_straggler_s"].mean() / n["gemm_straggler_s"].mean())
        s = {x["policy"]: x for x in res.summary()}
        best = min(s[p]["time_per_layer_ms"] for p in ("none", "feplb"))
        out.append({
            "group": "feplb", "row": f"FEPLB token / GEMM straggler reduction, EP{ep} (h100, 4 dynamic experts)",
            "paper": f"-{tok_paper} / -{gemm_paper} %", "sim": f"-{tok:.0f} / -{gemm:.0f} %",
            "within": abs(tok - tok_paper) <= 8 and abs(gemm - gemm_paper) <= 8,
            "delta": f"{tok_paper - tok:+.0f} / {gemm_paper - gemm:+.0f}",
            "adaptive_vs_best": s["adaptive"]["time_per_layer_ms"] / best,
            "imbalance": f"{s['none']['imbalance_before']:.2f} -> {s['feplb']['imbalance_after']:.2f}",
            "command": f"python -m benchmarks.reproduce_papers --only feplb  # EP{ep}, 128 experts, top-8, 4096 "
                       f"tokens/rank, imbalance {imbalance}, {steps} steps",
        })
    return out


# ---------------------------------------------------------------------------------------------- HybridEP
#: Table V: data traffic per GPU (MB) -> (Tutel s, HybridEP s) per cluster; Cluster-M = 2 DCs, Cluster-L = 4
TABLE_V = {
    2: {6: (2.52, 2.48), 12: (4.26, 2.63), 24: (5.82, 2.74), 48: (7.62, 2.82), 96: (12.65, 3.01), 192: (20.35, 3.78)},
    4: {6: (3.74, 3.49), 12: (7.30, 3.53), 24: (10.69, 3.54), 48: (13.54, 3.85), 96: (18.59, 4.24), 192: (28.46, 5.20)},
}
#: expert-size sweep at 16 MB data (2 DCs): the paper gives the two ends
EXPERT_SWEEP = {2: 2.57, 4: None, 8: None, 16: None, 32: 1.18}
HYB_LAYERS, HYB_E, HYB_K, HYB_H = 12, 32, 2, 1024  # GPT-Medium-like: 12 MoE layers, 32 experts, top-2, H 1024


def _hyb_layer(dcs: int, data_mb: float, expert_mb: float, seed: int, other_s: float):
    """Per-layer time of plain EP (none), HybridEP and adaptive at ``data_mb`` MB of dispatched data per GPU.

    ``other_s``: the rest of the iteration per layer (attention, dense FFN, optimizer and data-parallel work),
    as the layer's non-MoE time, forward : backward = 1 : 2. It is HybridEP's stream model's pre-expert compute
    (Eq. 2, 6-7): the expert all-gather overlaps the forward part, fetched experts' gradients the backward."""
    params = dict(non_moe_fwd_s=other_s / 3, non_moe_bwd_s=2 * other_s / 3)
    R = 8 * dcs
    tokens = max(1, int(round(data_mb * 1e6 / (HYB_H * 2 * HYB_K))))
    ffn = max(1, int(round(expert_mb * 1e6 / (2 * HYB_H * 2))))  # two bf16 H x F matrices of expert_mb MB
    tr = synthetic_trace(SyntheticSpec(num_ranks=R, num_experts=HYB_E, num_layers=1, num_steps=4, top_k=HYB_K,
                                       tokens_per_rank=tokens, imbalance=(1.0, 1.0), seed=seed))
    cm = build_cost_model("hybridep-a800", R, HYB_E, 0, params=sim_params(dedup_top_k=HYB_K, **params),
                          overrides={"expert": {"hidden_size": HYB_H, "ffn_size": ffn, "num_matrices": 2}})
    res = simulate(tr, cm, ("none", "hybridep", "adaptive"), workers=1, max_plans=None)
    return {p: float(res.rows[p]["time_s"].mean()) for p in ("none", "hybridep", "adaptive")}


def _fit_other(dcs: int, data_mb: float, expert_mb: float, iteration_s: float, seed: int) -> float:
    """The rest of the iteration per layer such that HybridEP's simulated iteration is the paper's at one point
    (a fixed point: what the layer exposes depends on the window that time gives)."""
    other = iteration_s / HYB_LAYERS
    for _ in range(4):
        moe = _hyb_layer(dcs, data_mb, expert_mb, seed, other)["hybridep"] - other
        other = max(0.0, iteration_s / HYB_LAYERS - moe)
    return other


def hybridep_rows(seed: int) -> list[dict]:
    out = []
    for dcs, table in TABLE_V.items():
        # the rest of the iteration, one number per cluster: fitted at the paper's smallest data point (the
        # papers do not give it otherwise); every other point is predicted
        d0 = min(table)
        other = _fit_other(dcs, d0, 0.36, table[d0][1], seed)
        fixed_s = other * HYB_LAYERS
        t = {d: _hyb_layer(dcs, d, 0.36, seed, other) for d in table}
        paper, sim, ok, adaptive = [], [], [], []
        for d, (tutel, hyb) in table.items():
            it = {p: HYB_LAYERS * v for p, v in t[d].items()}
            paper.append(tutel / hyb)
            sim.append(it["none"] / it["hybridep"])
            adaptive.append(it["adaptive"] / min(it["none"], it["hybridep"]))
            ok.append(1 / 1.5 <= sim[-1] / paper[-1] <= 1.5)
        out.append({
            "group": "hybridep", "row": f"HybridEP speed-up over EP vs data per GPU {sorted(table)} MB, {dcs} DCs",
            "paper": " / ".join(f"{x:.2f}" for x in paper), "sim": " / ".join(f"{x:.2f}" for x in sim),
            "within": all(ok), "delta": " / ".join(f"{b / a:.2f}" for a, b in zip(paper, sim)) + " (sim/paper)",
            "adaptive_vs_best": max(adaptive), "imbalance": f"fixed {fixed_s:.2f} s/iteration",
            "command": f"python -m benchmarks.reproduce_papers --only hybridep  # hybridep-a800, {8 * dcs} GPUs, "
                       f"32 experts top-2, 0.36 MB experts, 12 layers, fixed {fixed_s:.2f} s from the {d0} MB point",
        })
    # expert size at 16 MB data, 2 DCs (the rest of the iteration as fitted for 2 DCs above)
    other = _fit_other(2, 6, 0.36, TABLE_V[2][6][1], seed)
    fixed_s = other * HYB_LAYERS
    sim, adaptive = {}, []
    for mb in EXPERT_SWEEP:
        t = _hyb_layer(2, 16, mb, seed, other)
        it = {p: HYB_LAYERS * v for p, v in t.items()}
        sim[mb] = it["none"] / it["hybridep"]
        adaptive.append(it["adaptive"] / min(it["none"], it["hybridep"]))
    ends = [(2, EXPERT_SWEEP[2]), (32, EXPERT_SWEEP[32])]
    out.append({
        "group": "hybridep", "row": f"HybridEP speed-up vs expert size {list(EXPERT_SWEEP)} MB at 16 MB data, 2 DCs",
        "paper": "2.57 (2 MB) ... 1.18 (32 MB)", "sim": " / ".join(f"{sim[m]:.2f}" for m in EXPERT_SWEEP),
        "within": all(1 / 1.5 <= sim[m] / p <= 1.5 for m, p in ends),
        "delta": " / ".join(f"{sim[m] / p:.2f}" for m, p in ends) + " (sim/paper at the ends)",
        "adaptive_vs_best": max(adaptive), "imbalance": f"fixed {fixed_s:.2f} s/iteration",
        "command": "python -m benchmarks.reproduce_papers --only hybridep  # as above, 16 MB data, expert 2..32 MB",
    })
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--only", choices=["ultraep", "feplb", "hybridep"], default=None)
    ap.add_argument("--steps", type=int, default=60, help="steps per UltraEP/FEPLB trace (default 60)")
    ap.add_argument("--layers", type=int, default=4, help="layers per UltraEP trace (default 4)")
    ap.add_argument("--feplb-imbalance", type=float, default=1.5, help="initial imbalance of the FEPLB traces")
    ap.add_argument("--drift", type=float, default=0.05, help="ranks per step the UltraEP traces' hot experts move")
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args()
    rows = []
    if args.only in (None, "ultraep"):
        rows += ultraep_rows(args.steps, args.layers, args.seed, args.drift)
    if args.only in (None, "feplb"):
        rows += feplb_rows(args.steps, args.seed, args.feplb_imbalance)
    if args.only in (None, "hybridep"):
        rows += hybridep_rows(args.seed)
    print("| check | paper | simulator | within tolerance | difference | adaptive / best single | notes |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['row']} | {r['paper']} | {r['sim']} | {'yes' if r['within'] else 'no'} | {r['delta']} | "
              f"{r['adaptive_vs_best']:.3f} | {r['imbalance']} |")
    print()
    for r in rows:
        print(f"- {r['row']}: `{r['command']}`")
    write_rows("reproduce_papers", [row("reproduce_papers", r["group"], r["row"], "text", r["sim"],
                                        [r["adaptive_vs_best"]]) for r in rows])


if __name__ == "__main__":
    main()

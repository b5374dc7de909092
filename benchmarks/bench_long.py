"""Long-run benchmark: is the adaptive engine right from its first call to its thousandth (issue 56)?

Two parts, one table each, rows in ``benchmarks/results/bench_long.csv``:

1. **Runtime** (2 local gloo ranks, one thread each): one balanced MoE layer, forward + backward, ``--calls`` layer
   calls per policy, ``adaptive`` and every fixed policy interleaved call by call (call i of every policy runs the
   same tokens and routing; the orders form a Williams design, :func:`benchmarks.common.carryover_orders`), on a
   routing stream with phases (:func:`phase_of`):

   ====================  ==============================================================================
   ``rise``              the popularity skew drifts up from uniform
   ``move``              skewed, the hot experts move every ``MOVE_EVERY`` calls
   ``small``             ``--small-tokens`` per rank: nothing pays (balancing must cost next to nothing)
   ``back``              the first phases' tokens again, skewed, hot experts moving
   ``fall``              the skew drifts back down
   ====================  ==============================================================================

   Per window of ``--window`` calls: adaptive / the best fixed policy of that window (measured, each policy's
   summed layer time), the engine's prediction error, the share of adaptive's calls that were probes, and what deciding
   costs: each policy's mean planning time per call (the engine's decision included, inside the timed call) and
   adaptive's beyond ``none``'s as a share of ``none``'s layer time (``deciding``). The error
   of the window is |sum predicted / sum measured - 1| over adaptive's calls (the runtime's measured layer time,
   slowest rank): what the engine predicted the window to cost. Per call, mean |predicted / measured - 1| is shown
   beside the calls' own noise, the floor no model of the load can go below: mean |log(m_i / m_(i-1))| / sqrt(2) of
   the same calls' measured times, successive calls of a slowly moving load (:func:`noise_floor`). A second arm of
   ``none`` (:data:`TWIN`) runs beside them: its window over ``none``'s is the spread of two arms of the same work,
   what the runtime's noise alone puts between adaptive and the best fixed policy when adaptive runs its very plans.
2. **Engine state** (offline, no ranks): the same :class:`~ultraep.engine.Engine` decides, commits and observes
   ``--decisions`` calls of an 8-rank layer on the same kind of stream, with synthetic measured timings (the cost
   model's prediction times a per-policy factor and noise, every rank's compute for the compute fit). Its state
   (:func:`ultraep.engine.footprint`: items and bytes held) at a tenth of the decisions and at the end, and the
   median time per decision in the first and the last tenth: both must stay flat.

    .venv/bin/python benchmarks/bench_long.py                    # the run of record (about 5 min for the runtime part on 2 quiet cores)
    .venv/bin/python benchmarks/bench_long.py --calls 60 --window 20 --decisions 2000   # a smoke run (minutes)
    .venv/bin/python benchmarks/bench_long.py --part engine      # only the engine's state (10^5 decisions)
    .venv/bin/python benchmarks/bench_long.py --probe-share 0.1  # the adaptive engine's probe budget
    .venv/bin/python benchmarks/bench_long.py --calls-out calls.csv   # and every call's time, planning and decision
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import dataclass

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

import benchmarks.common  # noqa: E402
from benchmarks.common import (adaptive_options, adaptive_provider, carryover_orders, option_text, row,  # noqa: E402
                               write_rows)

BENCH = "bench_long"
FIXED = ("none", "quota", "eplb", "feplb", "hybridep")
#: a second arm of ``none``: the same layer work timed again, interleaved like the others. What it measures over
#: ``none``'s arm in a window is what the runtime's noise alone puts between two arms of one policy, the resolution of
#: "adaptive / best fixed" (adaptive running the best policy's very plans would land that far from it by chance)
TWIN = "twin"
#: the phases of the stream, in order, with their share of the run
PHASES = (("rise", 0.2), ("move", 0.2), ("small", 0.2), ("back", 0.2), ("fall", 0.2))
#: calls between moves of the hot experts (phases move and back)
MOVE_EVERY = 50
#: the largest popularity skew (power law exponent) of the stream
MAX_SKEW = 1.5


@dataclass(frozen=True)
class Shape:
    """The cheap layer of the runtime part: ``tokens`` per rank (``small`` in the small phase), hidden size, expert
    intermediate size, experts, top-k, redundant slots per rank."""

    tokens: int = 256
    small: int = 64
    hidden: int = 256
    ffn: int = 256
    experts: int = 16
    top_k: int = 2
    slots: int = 2


@dataclass(frozen=True)
class Phase:
    name: str
    skew: float  # power-law exponent of the experts' popularity
    hot: int  # the most popular expert
    small: bool  # the small-token phase


def phase_of(i: int, n: int, experts: int) -> Phase:
    """What call ``i`` of ``n`` routes: its phase, skew and hot expert (deterministic)."""
    edges = np.cumsum([share for _, share in PHASES]) * n
    k = int(np.searchsorted(edges, i, side="right"))
    k = min(k, len(PHASES) - 1)
    name = PHASES[k][0]
    lo = 0.0 if k == 0 else edges[k - 1]
    frac = (i - lo) / max(1.0, edges[k] - lo)  # 0 -> 1 through the phase
    moving = (i // MOVE_EVERY) * (experts // 4 + 1) % experts
    skew = {"rise": MAX_SKEW * frac, "move": MAX_SKEW, "small": MAX_SKEW, "back": MAX_SKEW,
            "fall": MAX_SKEW * (1.0 - frac)}[name]
    hot = moving if name in ("move", "back", "small") else 0
    return Phase(name, float(skew), int(hot), name == "small")


def popularity(ph: Phase, experts: int) -> np.ndarray:
    """``[E]`` the experts' popularity in phase ``ph``: a power law ranked from the hot expert."""
    rank = (np.arange(experts) - ph.hot) % experts
    p = (rank + 1.0) ** -ph.skew
    return p / p.sum()


def routing(i: int, n: int, rank: int, shape: Shape, seed: int):
    """Call ``i``'s tokens on ``rank``: ``(top-k ids [T, K], tokens T, phase)``, the same for every policy."""
    ph = phase_of(i, n, shape.experts)
    T = shape.small if ph.small else shape.tokens
    rng = np.random.default_rng([seed, i, rank])
    p = popularity(ph, shape.experts)
    g = rng.gumbel(size=(T, shape.experts)) + np.log(p)[None, :]  # top-k without replacement ~ p (Gumbel top-k)
    return np.argsort(-g, axis=1)[:, :shape.top_k], T, ph


# ------------------------------------------------------------------------------------------ part 1: runtime
def _body(rank, world, shape: Shape, args, policies):
    import torch

    from benchmarks.bench_runtime import Shape as RShape
    from benchmarks.bench_runtime import wrapped_layer

    rshape = RShape("long", tokens=shape.tokens, hidden=shape.hidden, ffn=shape.ffn, experts=shape.experts,
                    top_k=shape.top_k, slots=shape.slots)
    runs = []
    for name in policies:
        config = {"policy": "none" if name == TWIN else name, "num_redundant_slots": shape.slots}
        if name == "adaptive" and args.options:
            config["adaptive"] = dict(args.options)
        layer, rt = wrapped_layer(rshape, config)
        runs.append((name, layer, rt, torch.optim.SGD(layer.parameters(), lr=1e-6)))
    g = torch.Generator().manual_seed(7 + rank)
    xs = {T: torch.randn(T, shape.hidden, generator=g) for T in (shape.tokens, shape.small)}
    out = {name: {"t": [], "measured": [], "predicted": [], "plan": [], "chosen": [], "probe": [], "reason": []}
           for name in policies}
    orders = carryover_orders(len(runs))
    for i in range(args.calls):
        ids, T, _ = routing(i, args.calls, rank, shape, args.seed)
        idx = torch.from_numpy(ids).long()
        w = torch.softmax(torch.randn(T, shape.top_k, generator=g), -1)
        x = xs[T].detach().clone().requires_grad_(True)
        for k in orders[i % len(orders)]:
            name, layer, rt, opt = runs[k]
            torch.distributed.barrier()
            t0 = time.perf_counter()
            layer(x, idx, w).pow(2).mean().backward()
            t = time.perf_counter() - t0
            opt.step()  # training changes the masters every step: replicas are streamed again
            layer.zero_grad(set_to_none=True)
            x.grad = None
            rt.next_step()
            o = out[name]
            tm = layer.last_timings
            choice = getattr(layer.last_plan, "choice", None)
            o["t"].append(t)
            o["measured"].append(float(tm.get("measured_s", float("nan"))))
            o["predicted"].append(float(tm.get("predicted_s", float("nan"))))
            o["plan"].append(float(tm.get("plan_s", float("nan"))))
            o["chosen"].append(layer.last_plan.chosen_policy)
            o["probe"].append(bool(choice is not None and choice.probe))
            o["reason"].append(choice.reason if choice is not None else "")
    return out


def run_runtime(shape: Shape, args) -> dict:
    """``{policy: {"t": [calls] s (slowest rank), "measured", "predicted", "plan": [calls] s, "chosen", "probe"}}``
    (``plan``: the call's planning, the engine's decision included, on its slowest-planning rank)."""
    from ultraep.launch import launch

    policies = (*FIXED, TWIN, "adaptive")
    timeout = 600.0 * max(1.0, args.calls * len(policies) / 200)
    outs = launch(_body, 2, shape, args, policies, backend="gloo", threads_per_rank=1, timeout_s=timeout)
    res = {}
    for name in policies:
        per = [o[name] for o in outs]
        res[name] = {"t": np.max([p["t"] for p in per], axis=0),
                     "measured": np.max([p["measured"] for p in per], axis=0),
                     "predicted": np.asarray(per[0]["predicted"]), "plan": np.max([p["plan"] for p in per], axis=0),
                     "chosen": per[0]["chosen"], "probe": per[0]["probe"], "reason": per[0]["reason"]}
    return res


def write_calls(res: dict, path: str) -> None:
    """Every call of every policy as CSV rows (``policy, call, t_s, measured_s, predicted_s, plan_s, chosen, probe,
    reason``): what a window lost, call by call (which decisions probed, weighed or held a slower policy); a fixed
    policy's calls have no reason (nothing was chosen)."""
    import csv

    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["policy", "call", "t_s", "measured_s", "predicted_s", "plan_s", "chosen", "probe", "reason"])
        for name, r in res.items():
            for i in range(len(r["t"])):
                w.writerow([name, i, f"{r['t'][i]:.6g}", f"{r['measured'][i]:.6g}", f"{r['predicted'][i]:.6g}",
                            f"{r['plan'][i]:.6g}", r["chosen"][i], int(r["probe"][i]), r["reason"][i]])


def windows(res: dict, calls: int, window: int, experts: int) -> list[dict]:
    """Per window of ``window`` calls: its phases, the best fixed policy, adaptive / best (summed layer time), the
    prediction error of adaptive's calls, its probe share, what it chose most, each policy's mean planning time per
    call (``plan``, the engine's decision included: on the critical path) and adaptive's planning beyond ``none``'s as a
    share of ``none``'s layer time (``deciding``: what deciding costs the window, right choices or not); ``twin``: the
    :data:`TWIN` arm's summed time over ``none``'s (NaN without it), never a candidate for the best."""
    out = []
    for lo in range(0, calls, window):
        hi = min(calls, lo + window)
        tot = {n: float(np.sum(r["t"][lo:hi])) for n, r in res.items()}
        best = min(FIXED, key=tot.get)
        a = res["adaptive"]
        m, p = a["measured"][lo:hi], a["predicted"][lo:hi]
        ok = (m > 0) & (p > 0) & np.isfinite(m) & np.isfinite(p)
        err = float(abs(p[ok].sum() / m[ok].sum() - 1)) if ok.any() else float("nan")
        per_call = float(np.mean(np.abs(p[ok] / m[ok] - 1))) if ok.any() else float("nan")
        chosen = a["chosen"][lo:hi]
        plan = {n: float(np.nanmean(r["plan"][lo:hi])) for n, r in res.items()}
        phases = sorted({phase_of(i, calls, experts).name for i in range(lo, hi)},
                        key=[n for n, _ in PHASES].index)
        out.append({"lo": lo, "hi": hi, "phases": "+".join(phases), "best": best,
                    "ratio": tot["adaptive"] / tot[best], "pred_error": err, "per_call_error": per_call,
                    "noise": noise_floor(m[ok]),
                    "probe_share": float(np.mean(a["probe"][lo:hi])),
                    "chose": max(set(chosen), key=chosen.count), "totals": tot, "plan": plan,
                    "deciding": (plan["adaptive"] - plan["none"]) * (hi - lo) / tot["none"],
                    "twin": tot[TWIN] / tot["none"] if TWIN in tot else float("nan")})
    return out


def noise_floor(measured: np.ndarray) -> float:
    """The calls' own noise: mean |log(m_i / m_(i-1))| / sqrt(2) over successive measured times ``measured`` [N]. The
    load moves slowly from call to call, so successive calls differ by their noise alone, each call's twice over:
    for log-normal noise of sigma s this is 0.8 s, what mean |predicted / measured - 1| reaches with a perfect model
    (NaN: fewer than 2 calls)."""
    m = np.asarray(measured, dtype=np.float64)
    if m.size < 2:
        return float("nan")
    return float(np.mean(np.abs(np.diff(np.log(m)))) / np.sqrt(2.0))


# ------------------------------------------------------------------------------------- part 2: engine state
def run_engine(decisions: int, seed: int, options: dict | None = None, at=None, engine=None,
               cycle: int | None = None) -> dict:
    """Drive one adaptive :class:`~ultraep.engine.Engine` (8 ranks, 32 experts, 2 slots; ``options``: its
    AdaptiveOptions) through ``decisions`` calls with synthetic timings. Returns ``marks`` (its footprint after each
    decision count of ``at``, default a tenth and the end), ``first`` and ``last`` (seconds per decision of the first
    and the last tenth) and ``ledger`` (what it spent exploring). ``engine``: called with the engine once built (a
    test's negative control breaks it there). ``cycle``: the stream's phases run once every ``cycle`` decisions (default:
    once over the run), so that a footprint taken after the first cycle has seen every load regime the run will."""
    from ultraep.config import AdaptiveOptions, BalancerConfig
    from ultraep.cost import CostModel
    from ultraep.engine import Engine
    from ultraep.engine import footprint
    from ultraep.presets import get_preset

    R, E, top_k, tokens = 8, 32, 4, 2048
    pre = get_preset("gb200-nvl72")
    cm = CostModel(pre.topology(R, E, 2), pre.hardware, pre.expert)
    eng = Engine(BalancerConfig(policy="adaptive", layers={0: AdaptiveOptions(**(options or {}))}), cm.topology,
                 cost_model=cm)
    if engine is not None:
        engine(eng)
    rng = np.random.default_rng(seed)
    truth = {"none": 1.0, "quota": 0.9, "eplb": 1.05, "feplb": 0.95, "hybridep": 1.1}  # measured / predicted
    tenth = max(1, decisions // 10)
    at = set(at or (tenth, decisions))
    times = np.empty(decisions)
    marks = {}
    for i in range(decisions):
        ph = phase_of(i % (cycle or decisions), cycle or decisions, E)
        load = rng.multinomial((tokens // 16 if ph.small else tokens) * top_k, popularity(ph, E), size=R)
        t0 = time.perf_counter()
        d = eng.decide(i, 0, 0, load)
        eng.commit(d)
        bd = d.predicted
        f = truth.get(d.chosen, 1.0) * float(np.exp(rng.normal(0.0, 0.03)))
        meas = {k: v * f for k, v in bd.as_dict().items() if k in ("compute_fwd_s", "a2a_fwd_s", "compute_bwd_s")}
        ranks = None
        if bd.rank_tokens_R is not None and bd.rank_tokens_R.max() > 0:
            share = bd.rank_tokens_R / bd.rank_tokens_R.max() * np.exp(rng.normal(0.0, 0.03, R))
            ranks = {"compute_fwd_s": bd.compute_fwd_s * f * share, "compute_bwd_s": bd.compute_bwd_s * f * share}
        eng.observe(i, 0, 0, meas, measured_total_s=bd.terms_s * f, rank_compute_s=ranks)
        times[i] = time.perf_counter() - t0
        if i + 1 in at:
            marks[i + 1] = footprint(eng)
    pol = eng.policy_for(0)
    from ultraep.policies.exploration import ledger

    return {"marks": marks, "first": times[:tenth], "last": times[-tenth:], "ledger": ledger(pol.schedule, pol.budget)}


# --------------------------------------------------------------------------------------------------- main
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--part", default="all", choices=["all", "runtime", "engine"])
    ap.add_argument("--calls", type=int, default=1000, help="layer calls per policy (runtime part)")
    ap.add_argument("--window", type=int, default=100, help="calls per window")
    ap.add_argument("--decisions", type=int, default=100_000, help="decisions of the engine-state part")
    ap.add_argument("--tokens", type=int, default=Shape.tokens, help="tokens per rank outside the small phase")
    ap.add_argument("--small-tokens", type=int, default=Shape.small, help="tokens per rank in the small phase")
    ap.add_argument("--probe-share", type=float, default=None,
                    help="the adaptive engine's probe_share (default: its own; negative: no bound)")
    ap.add_argument("--option", action="append", default=[], metavar="KEY=VALUE",
                    help="an adaptive option of the engine (repeatable; VALUE in JSON: explore_share=0.002)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--calls-out", default=None, metavar="CSV",
                    help="also write every call of every policy (time, planning, choice, reason) to this CSV")
    args = ap.parse_args(argv)
    for name in ("calls", "window", "decisions", "tokens", "small_tokens"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')}: must be >= 1, got {getattr(args, name)}")
    try:
        args.options = adaptive_options(args.option)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.probe_share is not None:
        args.options["probe_share"] = None if args.probe_share < 0 else args.probe_share
    who = adaptive_provider(args.options)
    from rich.console import Console
    from rich.table import Table

    console = Console(width=200)
    rows = []
    shape = Shape(tokens=args.tokens, small=args.small_tokens)
    if args.part in ("all", "runtime"):
        benchmarks.common.THREADS = 1
        from ultraep.models import preload

        preload()
        load_at_start = os.getloadavg()[0]
        res = run_runtime(shape, args)
        if args.calls_out:
            write_calls(res, args.calls_out)
        x0 = f"2x1/T{shape.tokens}-{shape.small}/E{shape.experts}"
        named = f", {option_text(args.options)}" if args.options else ""
        tab = Table(title=f"adaptive{named} over {args.calls} interleaved calls per policy, 2 gloo ranks x 1 thread "
                          f"(T={shape.tokens}/{shape.small} H={shape.hidden} I={shape.ffn} E={shape.experts} "
                          f"k={shape.top_k} N={shape.slots}), load avg {load_at_start:.2f} at start")
        for c in ("calls", "phases", "best fixed", "adaptive / best", "prediction error", "per call", "calls' noise",
                  "probes", "deciding", "adaptive ran", "twin / none"):
            tab.add_column(c, justify="right")
        wins = windows(res, args.calls, args.window, shape.experts)
        for w in wins:
            x = f"{x0}/{w['lo']}-{w['hi']}"
            tab.add_row(f"{w['lo']}-{w['hi']}", w["phases"], w["best"], f"{w['ratio']:.3f}",
                        f"{100 * w['pred_error']:.1f} %", f"{100 * w['per_call_error']:.1f} %",
                        f"{100 * w['noise']:.1f} %", f"{100 * w['probe_share']:.0f} %", f"{100 * w['deciding']:+.1f} %",
                        w["chose"], f"{w['twin']:.3f}")
            rows.append(row("long_run", who, "vs_best_fixed", "ratio", x, w["ratio"]))
            rows.append(row("long_run", who, "prediction_error_window", "ratio", x, w["pred_error"]))
            rows.append(row("long_run", who, "prediction_error", "ratio", x, w["per_call_error"]))  # per call
            rows.append(row("long_run", who, "noise_floor", "ratio", x, w["noise"]))
            rows.append(row("long_run", who, "probe_share", "ratio", x, w["probe_share"]))
            rows.append(row("long_run", who, "deciding_share", "ratio", x, w["deciding"]))
            rows.append(row("long_run", TWIN, "vs_none", "ratio", x, w["twin"]))
            for name, tot in w["totals"].items():
                rows.append(row("long_run", name, "layer_time_sum", "s", x, tot))
                rows.append(row("long_run", name, "plan_time", "s", x, w["plan"][name]))
        total = {n: float(np.sum(r["t"])) for n, r in res.items()}
        best = min(FIXED, key=total.get)
        tab.add_section()
        tab.add_row("all", "", best, f"{total['adaptive'] / total[best]:.3f}", "", "", "", "", "", "",
                    f"{total[TWIN] / total['none']:.3f}")
        rows.append(row("long_run", who, "vs_best_fixed", "ratio", f"{x0}/all", total["adaptive"] / total[best]))
        rows.append(row("long_run", TWIN, "vs_none", "ratio", f"{x0}/all", total[TWIN] / total["none"]))
        console.print(tab)
        within = sum(w["ratio"] <= 1.03 for w in wins)
        twin_within = sum(w["twin"] <= 1.03 for w in wins)
        console.print(f"windows within 3 %: adaptive of the best fixed {within} of {len(wins)}; the twin of none "
                      f"{twin_within} of {len(wins)} (the same work: what noise alone leaves)")
    if args.part in ("all", "engine"):
        eng = run_engine(args.decisions, args.seed, args.options)
        tab = Table(title=f"the adaptive engine's state over {args.decisions} decisions (offline, synthetic timings)")
        for c in ("decisions", "items held", "bytes held", "decision time (median)"):
            tab.add_column(c, justify="right")
        n_first = min(eng["marks"])
        for n, (items, size) in sorted(eng["marks"].items()):
            t = eng["first"] if n == n_first else eng["last"]
            tab.add_row(str(n), f"{items:,}", f"{size:,}", f"{1e3 * float(np.median(t)):.3f} ms")
            rows.append(row("engine_state", who, "items", "count", n, items))
            rows.append(row("engine_state", who, "bytes", "By", n, size))
            rows.append(row("engine_state", who, "decision_time", "s", n, t))
        led = eng["ledger"]
        rows.append(row("engine_state", who, "probe_share", "ratio", args.decisions, led["probe_share"]))
        console.print(tab)
        console.print(f"probes: {led['probes']} of {led['decisions']} decisions ({100 * led['probe_share']:.1f} %)")
    print(f"rows appended to {write_rows(BENCH, rows)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Replay bench_long's recorded runtime calls: the adaptive engine of this checkout decides, the recording says what
each decision would have cost.

``benchmarks/bench_long.py --calls-out CSV`` records every call of every policy: call i of each fixed policy ran the
same tokens, interleaved with the others, so the CSV holds what every policy measured on every call. Replayed, the
real :class:`~ultraep.engine.Engine` (the cost model the runtime seeds on 2 CPU ranks, ``local_seed``) decides call
i on bench_long's load of call i; the call costs what its chosen policy measured on call i, plus what deciding that way
cost on the runtime (the recorded adaptive's planning beyond the planning of the policy it ran, on the same call,
averaged per kind of decision: idle, settled, weighing, probe, ...), and that time is what the engine measures. So an
engine change is weighed on the machine's own noise and drift, in seconds, without the 5 minutes of a runtime run.

What it cannot replay: a policy's state that depends on what ran before it (EPLB's placement, a replica cache) is that
of the fixed run, and the engine is fed each call's total time and planning alone (its compute fit sees no phases).

    .venv/bin/python benchmarks/bench_long.py --part runtime --calls-out calls.csv
    .venv/bin/python benchmarks/replay_long.py calls.csv [more.csv ...]   # per recording: replayed and recorded
    .venv/bin/python benchmarks/replay_long.py benchmarks/results_committed/calls/*.csv.gz   # the committed recordings
    .venv/bin/python benchmarks/replay_long.py CSV... --option probe_share=0.01   # a setting weighed on them
"""

from __future__ import annotations

import argparse
import csv
import gzip
import os
import sys
from collections import Counter, defaultdict

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

from benchmarks.bench_long import FIXED, Shape, routing  # noqa: E402
from benchmarks.common import adaptive_options, adaptive_provider, option_text, row, write_rows  # noqa: E402

BENCH = "replay_long"


class RecordingError(ValueError):
    """A calls CSV that cannot be replayed (the message names the file and what is missing)."""


def kind_of(reason: str) -> str:
    """A decision's kind from its reason: its first word (``idle``, ``settled``, ``cheapest``, ``probe``, ...)."""
    return reason.split(":")[0].split(" ")[0] if reason else ""


def read_calls(path: str) -> dict:
    """``{policy: {"t": [N] s, "plan": [N] s, "chosen": [N], "reason": [N]}}`` of a ``--calls-out`` CSV (gzipped where
    its name ends in ``.gz``); every fixed policy and ``adaptive`` must be there with the same calls."""
    by: dict = defaultdict(lambda: {"t": [], "plan": [], "chosen": [], "reason": []})
    try:
        with (gzip.open(path, "rt", newline="") if path.endswith(".gz") else open(path, newline="")) as f:
            for r in csv.DictReader(f):
                d = by[r["policy"]]
                d["t"].append(float(r["t_s"]))
                d["plan"].append(float(r["plan_s"]))
                d["chosen"].append(r["chosen"])
                d["reason"].append(r["reason"])
    except (KeyError, ValueError, EOFError, gzip.BadGzipFile) as e:
        raise RecordingError(f"{path}: not a bench_long --calls-out CSV ({e})") from None
    missing = [p for p in (*FIXED, "adaptive") if p not in by]
    if missing:
        raise RecordingError(f"{path}: no calls of {missing}; bench_long --calls-out records every policy")
    n = {p: len(by[p]["t"]) for p in by}
    if len(set(n.values())) != 1:
        raise RecordingError(f"{path}: policies have different numbers of calls: {n}")
    return {p: {k: np.asarray(v) if k in ("t", "plan") else v for k, v in d.items()} for p, d in by.items()}


def deciding_cost(rec: dict) -> dict[str, float]:
    """Seconds a decision of each kind added on the runtime: the recorded adaptive's planning beyond the planning of
    the policy it ran on the same call, averaged per kind (a replayed decision of a kind never recorded adds the
    mean over all)."""
    a = rec["adaptive"]
    extra: dict = defaultdict(list)
    for i, (ch, why) in enumerate(zip(a["chosen"], a["reason"])):
        if ch in rec:
            extra[kind_of(why)].append(a["plan"][i] - rec[ch]["plan"][i])
    out = {k: float(np.mean(v)) for k, v in extra.items()}
    out[""] = float(np.mean([x for v in extra.values() for x in v])) if extra else 0.0
    return out


def loads(n: int, shape: Shape, seed: int) -> list[np.ndarray]:
    """bench_long's ``[2, E]`` token-expert counts of calls 0..n-1 (:func:`benchmarks.bench_long.routing`)."""
    out = []
    for i in range(n):
        L = np.zeros((2, shape.experts), dtype=np.int64)
        for r in range(2):
            ids, _, _ = routing(i, n, r, shape, seed)
            np.add.at(L[r], ids.ravel(), 1)
        out.append(L)
    return out


def seed_model(shape: Shape):
    """The cost model the runtime seeds for bench_long's layer on 2 CPU ranks of one host (``Runtime.build_engine``)."""
    import torch

    from ultraep.cost import CostModel, CostParams
    from ultraep.presets import local_seed
    from ultraep.topology import Topology

    like = [torch.empty(shape.ffn, shape.hidden)] * 3
    hw, expert, link, copy_s = local_seed(like, cuda=False)
    topo = Topology(num_ranks=2, num_experts=shape.experts, num_redundant_slots=shape.slots, scale_up=link,
                    scale_out=link, expert_bytes=int(3 * shape.hidden * shape.ffn * 4))
    params = CostParams(weight_sync_overlap=True, resend_all_replicas=False, copy_s_per_byte=copy_s,
                        a2a_shared_medium=True)
    return CostModel(topo, hw, expert, params)


def replay(rec: dict, shape: Shape, seed: int, options: dict | None = None, jitter: float = 0.0,
           draw: int = 0) -> dict:
    """The engine deciding over recording ``rec``: ``{"t": [N] s replayed, "chosen": [N], "kinds": Counter, "decide": [N]
    s, "overhead_s": s}`` (``decide``: what deciding added to each call, :func:`deciding_cost` of its kind, included in
    ``t``; ``overhead_s``: the engine's own overhead it calibrated from the calls' planning).
    ``jitter``: each replayed call's time is multiplied by exp(N(0, jitter)) (draw ``draw``): the engine's path through
    a run turns on single calls (one call 1 % slower can send it down another sequence of probes and switches, worth
    +-1 % of the run), so one replay is one sample, and an engine change is judged on the mean of several."""
    from ultraep.config import AdaptiveOptions, BalancerConfig
    from ultraep.engine import Engine

    cost = deciding_cost(rec)
    n = len(rec["none"]["t"])
    cm = seed_model(shape)
    eng = Engine(BalancerConfig(policy="adaptive", num_redundant_slots=shape.slots,
                                layers={0: AdaptiveOptions(**(options or {}))}), cm.topology, cost_model=cm,
                 record_timings=False)
    held = np.zeros((2, shape.experts), dtype=bool)
    t, chosen, kinds, decide = np.empty(n), [], Counter(), np.empty(n)
    shake = np.exp(np.random.default_rng([seed, draw]).normal(0.0, jitter, n)) if jitter > 0 else np.ones(n)
    for i, load in enumerate(loads(n, shape, seed)):
        d = eng.decide(i, 0, 0, load, held)
        eng.commit(d)
        k = kind_of(d.reason)
        decide[i] = cost.get(k, cost[""])
        t[i] = rec[d.chosen]["t"][i] * shake[i] + decide[i]
        bd = d.predicted
        f = t[i] / bd.terms_s if bd.terms_s > 0 else 1.0  # (the terms take the whole measured time)
        meas = {x: v * f for x, v in bd.as_dict().items() if x in ("compute_fwd_s", "a2a_fwd_s", "compute_bwd_s")}
        # the call's planning as the runtime measured it (its policy's plan_s and its decision's kind): the engine's
        # own overhead calibrates from it (``engine_overhead_s``), and so does what the exploration budget charges a
        # weighing; left at the seed's 5 us, the budget paid for a weighing every few calls the runtime could not
        meas["plan_s"] = float(rec[d.chosen]["plan"][i]) + decide[i]
        eng.observe(i, 0, 0, meas, measured_total_s=t[i])
        chosen.append(d.chosen)
        kinds[k] += 1
    return {"t": t, "chosen": chosen, "kinds": kinds, "decide": decide,
            "overhead_s": float(eng.cost_model_for(0).params.engine_overhead_s)}


def ratios(t: np.ndarray, rec: dict, window: int) -> tuple[float, list[float]]:
    """(whole run, per window) of summed times ``t`` over the best fixed policy's of the run, of each window."""
    best = min(FIXED, key=lambda p: rec[p]["t"].sum())
    per = []
    for lo in range(0, len(t), window):
        b = min(FIXED, key=lambda p: rec[p]["t"][lo:lo + window].sum())
        per.append(float(t[lo:lo + window].sum() / rec[b]["t"][lo:lo + window].sum()))
    return float(t.sum() / rec[best]["t"].sum()), per


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("csv", nargs="+", help="bench_long --calls-out recordings")
    ap.add_argument("--window", type=int, default=100, help="calls per window")
    ap.add_argument("--tokens", type=int, default=Shape.tokens, help="as recorded (bench_long's --tokens)")
    ap.add_argument("--small-tokens", type=int, default=Shape.small, help="as recorded")
    ap.add_argument("--seed", type=int, default=0, help="as recorded")
    ap.add_argument("--repeats", type=int, default=5, help="replays per recording, each call's time jittered")
    ap.add_argument("--jitter", type=float, default=0.01, help="the jitter: std of the log of each call's factor")
    ap.add_argument("--option", action="append", default=[], metavar="KEY=VALUE",
                    help="an adaptive option of the replayed engine (repeatable; VALUE in JSON: probe_share=0.01, "
                         "probe_regret=null): a setting weighed on the recorded calls")
    args = ap.parse_args(argv)
    if args.window < 1 or args.tokens < 1 or args.small_tokens < 1 or args.repeats < 1 or args.jitter < 0:
        ap.error(f"--window, --tokens, --small-tokens, --repeats must be >= 1 and --jitter >= 0 (got {args.window}, "
                 f"{args.tokens}, {args.small_tokens}, {args.repeats}, {args.jitter})")
    try:
        options = adaptive_options(args.option)
        recs = [(p, read_calls(p)) for p in args.csv]
    except (OSError, RecordingError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    from rich.console import Console
    from rich.table import Table

    shape = Shape(tokens=args.tokens, small=args.small_tokens)
    provider, named = adaptive_provider(options), f" ({option_text(options)})" if options else ""
    tab = Table(title=f"adaptive / best fixed policy: this checkout's engine{named} on "
                      f"recorded calls, {args.repeats} replay(s) each, calls jittered by {args.jitter:g} (windows of "
                      f"{args.window})")
    for c in ("recording", "calls", "recorded", "replayed (mean, range)", "windows <= 1.03", "worst window",
              "deciding / best fixed", "windows <= 1.03 without it", "replayed ran (first replay)",
              "deciding (ms): idle / settled / weighing"):
        tab.add_column(c, justify="right")
    rows, wholes, shares, windows = [], [], [], []
    for path, rec in recs:
        x, got, per, whole, share, free = os.path.basename(path), None, [], [], [], []
        best_s = min(rec[p]["t"].sum() for p in FIXED)
        for k in range(args.repeats):
            g = replay(rec, shape, args.seed, options, jitter=args.jitter if args.repeats > 1 else 0.0, draw=k)
            w, p = ratios(g["t"], rec, args.window)
            got, whole, per = got or g, whole + [w], per + p
            share.append(float(g["decide"].sum() / best_s))  # what deciding cost the run, and the run without it
            free += ratios(g["t"] - g["decide"], rec, args.window)[1]
            rows.append(row("long_replay", provider, "vs_best_fixed", "ratio", f"{x}/all/replay{k}", w))
        was, _ = ratios(rec["adaptive"]["t"], rec, args.window)
        cost = deciding_cost(rec)
        tab.add_row(x, str(len(got["t"])), f"{was:.3f}", f"{np.mean(whole):.3f} ({min(whole):.3f}-{max(whole):.3f})",
                    f"{sum(r <= 1.03 for r in per)}/{len(per)}", f"{max(per):.3f}", f"{np.mean(share):.2%}",
                    f"{sum(r <= 1.03 for r in free)}/{len(free)}",
                    ", ".join(f"{p} {c}" for p, c in Counter(got["chosen"]).most_common()),
                    " / ".join(f"{1e3 * cost.get(k, float('nan')):.2f}" for k in ("idle", "settled", "cheapest")))
        rows.append(row("long_replay", provider, "vs_best_fixed", "ratio", f"{x}/all", whole))
        rows.append(row("long_replay", "adaptive_recorded", "vs_best_fixed", "ratio", f"{x}/all", was))
        rows.append(row("long_replay", provider, "deciding_share", "ratio", f"{x}/all", share))
        wholes += whole
        shares += share
        windows += per
    Console(width=200).print(tab)
    print(f"mean over {len(recs)} recording(s) x {args.repeats} replay(s): {np.mean(wholes):.4f} "
          f"(standard error {np.std(wholes, ddof=1) / np.sqrt(len(wholes)) if len(wholes) > 1 else float('nan'):.4f}); "
          f"windows within 3 %: {sum(r <= 1.03 for r in windows)} of {len(windows)}, the worst {max(windows):.3f}")
    print(f"deciding (the recorded cost of each decision's kind) took {np.mean(shares):.2%} of the best fixed policy's "
          "time")
    print(f"rows appended to {write_rows(BENCH, rows)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

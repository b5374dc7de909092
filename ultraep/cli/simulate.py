"""``ultraep simulate``: replay a routing trace through every policy with the cost model."""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import sys
from pathlib import Path
from typing import get_args

from ultraep.config import CandidateName
from ultraep.errors import ConfigError


def _csv_ints(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def parse_kv(items: list[str] | None, flag: str) -> dict:
    """``["model=olmoe", "domains=[\\"c4\\"]"]`` → dict (values parsed as JSON when they can be)."""
    out = {}
    for item in items or []:
        if "=" not in item:
            raise ConfigError(flag, f"expected KEY=VALUE, got {item!r}", item)
        k, v = item.split("=", 1)
        try:
            out[k.strip()] = json.loads(v)
        except json.JSONDecodeError:
            out[k.strip()] = v
    return out


def add_trace_args(p: argparse.ArgumentParser) -> None:
    from ultraep.traces.importers import FORMATS

    p.add_argument("--format", default="auto", choices=["auto", *sorted(FORMATS)],
                   help="trace format (default: guessed from the name)")
    p.add_argument("--trace-opt", action="append", metavar="KEY=VALUE",
                   help="importer option, e.g. num_experts=64 num_ranks=8 top_k=8 (plain Parquet/CSV), model=olmoe, "
                   "domains='[\"c4\",\"github\"]', trace_id=..., microbatches_per_step=4 (UltraEP)")


def register(sub: argparse._SubParsersAction) -> None:
    from ultraep.presets import PRESETS
    from ultraep.config import ALL_POLICIES, DEFAULT_MAX_PLANS, DEFAULT_RESAMPLES, MIN_RESAMPLES

    p = sub.add_parser(
        "simulate",
        help="replay a routing trace through every policy with the cost model",
        description="Replay every step of a routing trace through each policy (per layer, in step order) and "
        "predict each layer's time with the cost model on a cluster preset. Prints, per policy, imbalance "
        "before/after (mean, p99), replicas, bytes moved, predicted time per layer, percent of the "
        "force-balanced ideal and speed-up over none.",
    )
    p.add_argument("trace", type=Path, help="trace file or directory (Parquet/CSV, SGLang .pt/.csv, Megatron "
                   "router_trace dir, UltraEP profile dir, TensorRT-LLM dir, OLMoE .pkl/json, recorded run)")
    add_trace_args(p)
    p.add_argument("--topology", default="gb200-nvl72", choices=[*sorted(PRESETS), "from-run"],
                   help="cluster preset, or from-run: the cost model a recorded run's engine learned (the trace must be "
                   "that run); figures are then predictions for the machine that measured the run, printed next to "
                   "what it measured, and on a preset projections")
    p.add_argument("--set", action="append", metavar="KEY=VALUE", dest="overrides",
                   help="override a preset field, e.g. scale_out.bandwidth_GBps=1.25 or expert.hidden_size=2048")
    p.add_argument("--policies", default=",".join(ALL_POLICIES),
                   help=f"comma list (default {','.join(ALL_POLICIES)}); also eplb+ (EPLB fed the exact current load, "
                   "the UltraEP paper's EPLB+ baseline, replayed next to eplb)")
    p.add_argument("--ranks", type=int, default=None, help="EP group size R (default: the trace's source ranks)")
    p.add_argument("--tile-ranks", action="store_true",
                   help="with --ranks a multiple of the trace's source ranks: rank r replays source rank r mod Rs (the "
                   "same tokens per rank: a larger job); default: the trace's tokens are spread over the ranks")
    p.add_argument("--slots", type=int, default=None, help="redundant slots per rank N (default 2; from-run: the run's)")
    p.add_argument("--layers", type=_csv_ints, default=None, help="only these layer ids (comma list)")
    budget = p.add_mutually_exclusive_group()
    budget.add_argument("--max-plans", type=int, default=DEFAULT_MAX_PLANS,
                        help=f"replayed layer-steps per policy at most (default {DEFAULT_MAX_PLANS}); sets the stride")
    budget.add_argument("--stride", type=int, default=None, help="replay every k-th step (overrides --max-plans)")
    p.add_argument("--workers", type=int, default=2, help="processes; layers are split among them (default 2)")
    p.add_argument("--mode", choices=["training", "prefill"], default=None,
                   help="training = fwd + bwd (default training; from-run: the run's)")
    p.add_argument("--non-moe-ms", type=float, nargs=2, metavar=("FWD", "BWD"), default=(0.0, 0.0),
                   help="per-layer time outside the MoE block (attention etc.), ms, forward and backward")
    p.add_argument("--resend-replicas", action="store_true",
                   help="charge every replica's weights each microbatch (a runtime without a replica cache); default: "
                   "as the ultraep runtime, replicas stay valid until their master changes (every training step)")
    p.add_argument("--no-dedup", action="store_true",
                   help="send every token-expert pair in the all-to-all; default: with the trace's top_k, a token goes "
                   "once per destination rank, and once per destination domain across domains (DeepEP)")
    p.add_argument("--step-fixed-ms", type=float, default=0.0, metavar="MS",
                   help="fixed time per step outside the replayed layers (optimizer, data-parallel reduction, layers "
                   "not replayed), ms: the percent of the ideal and the speed-up then weigh the replayed layers against the whole step")
    p.add_argument("--policy-opt", action="append", metavar="POLICY.KEY=VALUE",
                   help="policy option, e.g. eplb.interval=100 or adaptive.margin=0.01")
    p.add_argument("--resamples", type=int, default=None, metavar="B",
                   help=f"from-run: bootstrap resamples of the run's compared steps behind each figure's 90 %% interval "
                   f"(default {DEFAULT_RESAMPLES}; 0 = no interval; otherwise at least {MIN_RESAMPLES})")
    p.add_argument("--interval-seed", type=int, default=0, metavar="S",
                   help="from-run: seed of the interval's resampling (default 0; the same seed gives the same interval)")
    p.add_argument("--json", type=Path, default=None, help="write one JSON object per policy to this file")
    p.add_argument("--out", type=Path, default=None, help="record one telemetry run per policy under RUNS_DIR")
    p.add_argument("--run-name", default=None, help="prefix of the recorded run ids (default sim-<time>-<rand>)")
    p.add_argument("--record-plans", type=int, default=50,
                   help="plans recorded per policy with --out, spread evenly (default 50; 0 = none)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=run)


def _policy_options(items) -> dict:
    from ultraep.sim import SIM_POLICIES as ALL_POLICIES

    out: dict = {}
    for key, value in parse_kv(items, "--policy-opt").items():
        if "." not in key:
            raise ConfigError("--policy-opt", f"expected POLICY.KEY=VALUE, got {key!r}", key)
        pol, opt = key.split(".", 1)
        if pol not in ALL_POLICIES:  # would otherwise be ignored without a word
            raise ConfigError("--policy-opt", f"unknown policy {pol!r} in {key!r}; available: {', '.join(ALL_POLICIES)}",
                              pol)
        out.setdefault(pol, {})[opt] = value
    return out


def read_trace(path: Path, fmt: str, options: dict, layers: list[int] | None):
    """The trace at ``path``; with ``layers``, an ultraep Parquet trace reads only those layers (a row filter in
    the reader, so memory follows the replayed layers, not the whole trace). Other formats are read whole."""
    from ultraep.traces import Trace, load_trace
    from ultraep.traces.importers import detect_format

    if layers is not None and not options and path.is_file():
        kind = detect_format(path) if fmt == "auto" else fmt
        if kind == "parquet":
            import pyarrow.parquet as pq

            from ultraep.traces import META_KEY

            try:
                tagged = META_KEY in (pq.read_schema(str(path)).metadata or {})
            except Exception:  # not readable as Parquet: load_trace says why, in one line
                tagged = False
            if tagged:
                return Trace.read(path, layers=layers)
    return load_trace(path, fmt, **options)


def run(args: argparse.Namespace) -> int:
    import numpy as np
    from rich.console import Console

    from ultraep.presets import parse_overrides
    from ultraep.sim import SIM_POLICIES as ALL_POLICIES
    from ultraep.sim import build_cost_model, check_new_runs, record, sim_params, simulate
    policies = [x.strip() for x in args.policies.split(",") if x.strip()]
    unknown = [x for x in policies if x not in ALL_POLICIES]
    if unknown:
        raise ConfigError("--policies", f"unknown policy {unknown[0]!r}; available: {', '.join(ALL_POLICIES)}",
                          unknown[0])
    trace = read_trace(args.trace, args.format, parse_kv(args.trace_opt, "--trace-opt"), args.layers)
    run_id = trace.meta.extra.get("run_id") if trace.meta.source == "recorded-run" else None
    if args.topology == "from-run" and run_id is None:
        raise ConfigError("--topology", f"from-run needs a recorded ultraep run as the trace; {args.trace} is a "
                          f"{trace.meta.source} trace (use a preset)", "from-run")
    # global-count dumps may still say how large their EP group was (UltraEP's ep_size)
    ranks = args.ranks if args.ranks is not None else (trace.meta.num_ranks or trace.meta.extra.get("ep_size"))
    if ranks is None:
        raise ConfigError("--ranks", "the trace holds global counts only and names no EP size; pass --ranks R", None)
    E = trace.meta.num_experts
    if ranks < 1 or E % ranks:
        raise ConfigError("--ranks", f"({ranks}) must divide the trace's {E} experts", ranks)
    if args.tile_ranks:
        if args.topology == "from-run":
            raise ConfigError("--tile-ranks", "does not apply to --topology from-run (the run's own EP group); "
                              "project the run to a larger job with a preset --topology", True)
        trace = trace.tiled(ranks)  # (ranks <= E: the copies are bounded by the experts)
    if args.workers < 1:
        raise ConfigError("--workers", f"must be >= 1, got {args.workers}", args.workers)
    for flag, value, low in (("--max-plans", args.max_plans, 0), ("--stride", args.stride, 1),
                             ("--record-plans", args.record_plans, 0), ("--step-fixed-ms", args.step_fixed_ms, 0)):
        if value is not None and value < low:
            raise ConfigError(flag, f"must be >= {low}, got {value}", value)
    from ultraep.config import DEFAULT_RESAMPLES
    from ultraep.sim.uncertainty import check_resamples

    if args.topology != "from-run" and (args.resamples is not None or args.interval_seed):
        flag = "--resamples" if args.resamples is not None else "--interval-seed"
        raise ConfigError(flag, "applies to --topology from-run only (a preset's figures rest on no calibration run)",
                          args.resamples if args.resamples is not None else args.interval_seed)
    resamples = DEFAULT_RESAMPLES if args.resamples is None else args.resamples
    check_resamples(resamples, args.interval_seed)
    if args.out is not None:  # fail now, not after the replay, if the runs directory cannot be made
        args.out.mkdir(parents=True, exist_ok=True)
        check_new_runs(args.out, args.run_name, policies)
    shifts = calls = recorded = None
    if args.topology == "from-run":
        cm, shifts, calls, recorded = _from_run_model(args, run_id, ranks, trace)
    else:
        params = sim_params(mode=args.mode or "training", non_moe_fwd_s=args.non_moe_ms[0] * 1e-3,
                            non_moe_bwd_s=args.non_moe_ms[1] * 1e-3, resend_all_replicas=args.resend_replicas,
                            dedup_top_k=None if args.no_dedup else trace.meta.top_k)
        cm = build_cost_model(args.topology, ranks, E, 2 if args.slots is None else args.slots,
                              overrides=parse_overrides(args.overrides), params=params)
    err = Console(stderr=True)
    result = simulate(
        trace, cm, policies, layers=args.layers, max_plans=args.max_plans, stride=args.stride, workers=args.workers,
        policy_options=_policy_options(args.policy_opt), keep_plans=args.record_plans if args.out else 0,
        progress=not args.no_progress and sys.stderr.isatty(), step_fixed_s=args.step_fixed_ms * 1e-3,
    )
    from ultraep.sim.from_run import PREDICTED, PROJECTED, measured_summary

    summary = [s for s in result.summary() if s["policy"] in result.settings["reported"]]
    basis = PREDICTED if args.topology == "from-run" else PROJECTED
    result.settings["basis"] = basis
    if shifts is not None:  # what anchoring on the run's own calls moved, per kind of call (seconds)
        result.settings["anchor"] = {k: dataclasses.asdict(v) for k, v in shifts.items()}
    intervals = None
    if calls is not None:  # the calibration's uncertainty, propagated to every figure (ultraep.sim.uncertainty)
        from ultraep.sim.uncertainty import chooser_ran, resampled_overheads, summary_intervals

        over = resampled_overheads(calls, recorded, resamples, args.interval_seed)
        result.settings["interval"] = {"resamples": resamples, "seed": args.interval_seed,
                                       "steps": int(np.unique(calls.step).size)}
        if over is not None:
            ran = {p: chooser_ran(result.rows[p], d) for p, d in result.decisions.items() if p in result.rows}
            intervals = summary_intervals(result.rows, [s["policy"] for s in summary], over,
                                          step_fixed_s=args.step_fixed_ms * 1e-3, ran=ran)
            # (in the settings, the recorded runs' config carries them with --out; the JSON rows each their own)
            result.settings["interval"]["policies"] = intervals
    measured = measured_summary(args.trace, run_id) if run_id is not None else None
    # (the interval columns need about 30 more)
    console = Console(width=max(120 if intervals is None else 160, shutil.get_terminal_size().columns))
    print_summary(summary, result.settings, console, intervals)
    print_activation(summary, console)
    print_basis(basis, result.settings, measured, console)
    if shifts is not None:
        print_anchor(shifts, console)
        print_intervals(intervals, result.settings["interval"], console)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps([{**s, "basis": basis, "measured": measured, "settings": result.settings,
                                          **({} if calls is None else {"interval": (intervals or {}).get(s["policy"])})}
                                         for s in summary], indent=2))
        err.print(f"wrote {args.json}")
    if args.out is not None:
        ids = record(result, args.out, run_name=args.run_name, trace_path=str(args.trace), model=trace.meta.model,
                     topology=cm.topology)
        err.print(f"recorded {len(ids)} runs under {args.out}: {', '.join(ids)}")
    return 0


def _from_run_model(args, run_id: str, ranks: int, trace):
    """The cost model of ``--topology from-run``: the one the recorded run's engine learned, anchored on the run's own
    measured calls (:func:`~ultraep.sim.from_run.anchored_cost_model`), on the run's EP group (its slots, mode and
    per-layer time outside the MoE block unless given); the anchoring's shifts per kind of call, the calls it compared
    and the recorded model's parameters (what the interval re-anchors, :mod:`ultraep.sim.uncertainty`)."""
    from ultraep.cost import CostModel
    from ultraep.sim.from_run import anchor, anchor_calls, recorded_cost_model

    for flag, given in (("--set", bool(args.overrides)), ("--resend-replicas", args.resend_replicas)):
        if given:
            raise ConfigError(flag, "does not apply to --topology from-run (the run's own calibrated cost model); "
                              "use a preset --topology to change the cluster", flag)
    cm = recorded_cost_model(args.trace, run_id)
    t = cm.topology
    if ranks != t.num_ranks:
        raise ConfigError("--ranks", f"({ranks}) must be the run's {t.num_ranks} ranks with --topology from-run; "
                          "project the run to another size with a preset --topology", ranks)
    if args.slots is not None and args.slots != t.num_redundant_slots:
        t = t.with_slots(args.slots)
    recorded = cm.params
    calls = anchor_calls(args.trace, run_id, cm, trace, workers=args.workers)  # on the run's own group
    cm, shifts = anchor(cm, calls)
    update = {k: v for k, v in (("mode", args.mode), ("non_moe_fwd_s", args.non_moe_ms[0] * 1e-3 or None),
                                ("non_moe_bwd_s", args.non_moe_ms[1] * 1e-3 or None)) if v is not None}
    cm = CostModel(t, cm.hardware, cm.expert, cm.params.model_copy(update=update) if update else cm.params)
    return cm, shifts, calls, recorded


#: a policy the recorded run ran in fewer layer calls than this is flagged as predicted from few calls (from-run):
#: at 64 tokens per rank 1-7 calls of quota in an adaptive run left its predicted speed-up 6.9-25.9 % off, 28 calls
#: of it in a calibration run 1.7-7.9 % (2026-11-27, four recordings, benchmarks/bench_validate.py)
FEW_CALLS = 8


def print_basis(basis: str, settings: dict, measured: dict | None, console) -> None:
    """Say which figures were measured and which are the model's: predictions for the machine that recorded the
    run (``from-run``) or projections to a cluster preset."""
    from ultraep.sim.from_run import PREDICTED

    where = f"{settings['topology']} EP{settings['num_ranks']}"
    if basis == PREDICTED:
        console.print(f"[bold]predicted[/bold]: every figure in the table is the cost model the run's engine learned "
                      f"(calibrated on its measured phases), replaying its routing ({where}); not measured")
    else:
        console.print(f"[bold]projected[/bold]: every figure in the table is the cost model of the {settings['topology']} "
                      f"preset at EP{settings['num_ranks']} (no machine of this kind measured it)")
    if measured is None:
        return
    m, p = measured["measured_layer_ms"], measured["predicted_layer_ms"]
    chose = ", ".join(f"{k} {v}" for k, v in measured["chosen"].items()) or "nothing recorded"
    console.print(f"[bold]measured[/bold]: run {measured['run_id']} ran policy {measured['policy'] or '?'} (chose: "
                  f"{chose}); {measured['calls']} layer calls after warm-up, layer time "
                  + (f"{m:.3f} ms measured, {p:.3f} ms predicted by its engine at the time" if m is not None
                     else "not measured (no timings recorded)"))
    if basis != PREDICTED:
        return
    few = [f"{n} {measured['chosen'].get(n, 0)}" for n in settings.get("reported", ())
           if n in get_args(CandidateName) and measured["chosen"].get(n, 0) < FEW_CALLS]
    if few:
        console.print(f"[bold]few calls[/bold]: the run measured {', '.join(few)} layer calls of these policies; their "
                      "predictions rest on those (the model learns what a policy's calls cost from them). To predict "
                      "every policy, record a calibration run (config: ultraep.calibration_config(); "
                      "docs/simulator.md) and simulate that one")


def print_anchor(shifts: dict, console) -> None:
    """What anchoring the run's model on its own measured calls changed (from-run): per kind of call, how many calls
    were compared, their median of measured minus predicted layer time with its standard error, and what the model's
    call overhead of that kind was moved by (the median shrunk by its noise)."""
    from ultraep.sim.from_run import PLAIN

    if not shifts:
        console.print("[bold]anchored[/bold]: no measured call of a replayable policy to compare; the run's model as "
                      "its engine learned it")
        return
    parts = []
    for kind, s in shifts.items():
        what = "calls moving no expert weights" if kind == PLAIN else "calls moving expert weights"
        se = f" +- {1e3 * s.se_s:.2f}" if s.se_s is not None else ""  # None: too few calls to tell
        parts.append(f"{s.calls} {what}: measured - predicted {1e3 * s.median_s:+.2f}{se} ms (median), "
                     f"overhead moved {1e3 * s.shift_s:+.2f} ms")
    console.print("[bold]anchored[/bold] on the run's own calls (docs/simulator.md): " + "; ".join(parts))


def print_intervals(intervals: dict | None, settings: dict, console) -> None:
    """How sure the from-run figures are: what the 90 % intervals were drawn from and, per policy whose layer time or
    speed-up interval is wider than ±5 %, how wide, and how many more calibration steps would narrow it to ±5 %
    (the width going as 1 / sqrt(steps); :mod:`ultraep.sim.uncertainty`)."""
    from ultraep.sim.uncertainty import TARGET

    n = settings["steps"]
    if intervals is None:
        why = "--resamples 0" if not settings["resamples"] else f"the run compared calls of {n} step(s), 2 needed"
        console.print(f"[bold]interval[/bold]: none ({why}): the figures' uncertainty is not known")
        return
    console.print(f"[bold]interval[/bold] (90 %): a bootstrap of the run's {n} compared steps ({settings['resamples']} "
                  f"resamples, seed {settings['seed']}), each re-anchoring the model (every policy on its own "
                  "calls) and re-predicting every call with a new run's call-to-call noise (docs/simulator.md)")
    for pol, iv in intervals.items():
        parts = [f"{what} ±{100 * w:.1f} %" for what, w in (("ms/layer", iv["time_half_width"]),
                                                             ("speed-up", iv.get("speedup_half_width", 0.0)))
                 if w > TARGET]
        if parts:
            more = iv["steps_for_5pct"] - n
            console.print(f"[bold]wider than ±{100 * TARGET:.0f} %[/bold]: {pol} {', '.join(parts)}; about {more} more "
                          f"calibration steps ({iv['steps_for_5pct']} in all, the width going as 1/sqrt(steps)) would "
                          f"narrow it to ±{100 * TARGET:.0f} %")


def print_activation(summary: list[dict], console) -> None:
    """Activation memory, the third cost of imbalance: the expert activations the busiest rank holds at its peak
    (rows it computes x the expert's activation width x dtype), without and with balancing, against the mean rank."""
    from rich.table import Table

    table = Table(title="expert activations per rank (MB): the busiest rank's peak over the layer calls vs the mean rank")
    for col in ("policy", "busiest peak, no balancing", "busiest peak", "mean rank", "peak / mean"):
        table.add_column(col, justify="left" if col == "policy" else "right", no_wrap=True)
    for r in summary:
        mean = r["activation_mean_MB"]
        table.add_row(r["policy"], f"{r['activation_peak_before_MB']:.2f}", f"{r['activation_peak_after_MB']:.2f}",
                      f"{mean:.2f}", f"{r['activation_peak_after_MB'] / mean:.2f}" if mean > 0 else "-")
    console.print(table)


def print_summary(summary: list[dict], settings: dict, console, intervals: dict | None = None) -> None:
    """The table; with ``intervals`` (from-run, :func:`~ultraep.sim.uncertainty.summary_intervals`) a 90 % interval
    column next to the layer time and next to the speed-up."""
    from rich.table import Table

    s = settings
    table = Table(title=f"ultraep simulate · {s['topology']} EP{s['num_ranks']} · {s['num_experts']} experts · "
                  f"{s['num_redundant_slots']} slots · domain {s['domain_size']} · {s['mode']}")
    cols = ["policy", "imb.before", "p99", "imb.after", "p99 ", "replicas", "MB/layer", "ms/layer", "%ideal", "%own",
            "speedup"]
    if intervals is not None:
        cols.insert(cols.index("ms/layer") + 1, "ms/layer 90%")
        cols.append("speedup 90%")
    for col in cols:
        table.add_column(col, justify="left" if col == "policy" else "right", no_wrap=True)
    for r in summary:
        cells = [r["policy"], f"{r['imbalance_before']:.3f}", f"{r['imbalance_before_p99']:.3f}",
                 f"{r['imbalance_after']:.3f}", f"{r['imbalance_after_p99']:.3f}", f"{r['replicas']:.1f}",
                 f"{r['transfer_bytes_per_layer'] / 1e6:.1f}", f"{r['time_per_layer_ms']:.3f}",
                 f"{r['pct_of_ideal']:.1f}", f"{r['pct_of_scheme_ideal']:.1f}", f"{r['speedup_vs_none']:.3f}"]
        if intervals is not None:
            iv = intervals.get(r["policy"], {})
            t, x = iv.get("time_per_layer_ms"), iv.get("speedup_vs_none")
            cells.insert(cols.index("ms/layer 90%"), f"{t[0]:.3f}-{t[1]:.3f}" if t else "-")
            cells.append(f"{x[0]:.3f}-{x[1]:.3f}" if x else "-")
        table.add_row(*cells)
    console.print(table)
    console.print(f"replayed {s['layer_steps_per_policy']} layer-steps per policy ({len(s['layers'])} layers, stride "
                  f"{s['stride']} over {s['points']} points) in {s['wall_s']:.1f} s with {s['workers']} worker(s); "
                  "MB/layer = expert state moved per layer-step; %ideal = force-balanced plain-EP ideal / predicted; "
                  "%own = the ideal of the policy's own transmission scheme (HybridEP's) / predicted")

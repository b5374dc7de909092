"""``ultraep simulate``: replay a routing trace through every policy with the cost model."""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

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
    from ultraep.config import ALL_POLICIES, DEFAULT_MAX_PLANS

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
    p.add_argument("--topology", default="gb200-nvl72", choices=sorted(PRESETS), help="cluster preset")
    p.add_argument("--set", action="append", metavar="KEY=VALUE", dest="overrides",
                   help="override a preset field, e.g. scale_out.bandwidth_GBps=1.25 or expert.hidden_size=2048")
    p.add_argument("--policies", default=",".join(ALL_POLICIES),
                   help=f"comma list (default {','.join(ALL_POLICIES)}); also eplb+ (EPLB fed the exact current load, "
                   "the UltraEP paper's EPLB+ baseline, replayed next to eplb)")
    p.add_argument("--ranks", type=int, default=None, help="EP group size R (default: the trace's source ranks)")
    p.add_argument("--slots", type=int, default=2, help="redundant slots per rank N (default 2)")
    p.add_argument("--layers", type=_csv_ints, default=None, help="only these layer ids (comma list)")
    budget = p.add_mutually_exclusive_group()
    budget.add_argument("--max-plans", type=int, default=DEFAULT_MAX_PLANS,
                        help=f"replayed layer-steps per policy at most (default {DEFAULT_MAX_PLANS}); sets the stride")
    budget.add_argument("--stride", type=int, default=None, help="replay every k-th step (overrides --max-plans)")
    p.add_argument("--workers", type=int, default=2, help="processes; layers are split among them (default 2)")
    p.add_argument("--mode", choices=["training", "prefill"], default="training", help="training = fwd + bwd")
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
    # global-count dumps may still say how large their EP group was (UltraEP's ep_size)
    ranks = args.ranks if args.ranks is not None else (trace.meta.num_ranks or trace.meta.extra.get("ep_size"))
    if ranks is None:
        raise ConfigError("--ranks", "the trace holds global counts only and names no EP size; pass --ranks R", None)
    E = trace.meta.num_experts
    if ranks < 1 or E % ranks:
        raise ConfigError("--ranks", f"({ranks}) must divide the trace's {E} experts", ranks)
    if args.workers < 1:
        raise ConfigError("--workers", f"must be >= 1, got {args.workers}", args.workers)
    for flag, value, low in (("--max-plans", args.max_plans, 0), ("--stride", args.stride, 1),
                             ("--record-plans", args.record_plans, 0), ("--step-fixed-ms", args.step_fixed_ms, 0)):
        if value is not None and value < low:
            raise ConfigError(flag, f"must be >= {low}, got {value}", value)
    if args.out is not None:  # fail now, not after the replay, if the runs directory cannot be made
        args.out.mkdir(parents=True, exist_ok=True)
        check_new_runs(args.out, args.run_name, policies)
    params = sim_params(mode=args.mode, non_moe_fwd_s=args.non_moe_ms[0] * 1e-3, non_moe_bwd_s=args.non_moe_ms[1] * 1e-3,
                        resend_all_replicas=args.resend_replicas,
                        dedup_top_k=None if args.no_dedup else trace.meta.top_k)
    cm = build_cost_model(args.topology, ranks, E, args.slots, overrides=parse_overrides(args.overrides), params=params)
    err = Console(stderr=True)
    result = simulate(
        trace, cm, policies, layers=args.layers, max_plans=args.max_plans, stride=args.stride, workers=args.workers,
        policy_options=_policy_options(args.policy_opt), keep_plans=args.record_plans if args.out else 0,
        progress=not args.no_progress and sys.stderr.isatty(), step_fixed_s=args.step_fixed_ms * 1e-3,
    )
    summary = [s for s in result.summary() if s["policy"] in result.settings["reported"]]
    print_summary(summary, result.settings, Console(width=max(120, shutil.get_terminal_size().columns)))
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps([{**s, "settings": result.settings} for s in summary], indent=2))
        err.print(f"wrote {args.json}")
    if args.out is not None:
        ids = record(result, args.out, run_name=args.run_name, trace_path=str(args.trace), model=trace.meta.model,
                     topology=cm.topology)
        err.print(f"recorded {len(ids)} runs under {args.out}: {', '.join(ids)}")
    return 0


def print_summary(summary: list[dict], settings: dict, console) -> None:
    from rich.table import Table

    s = settings
    table = Table(title=f"ultraep simulate · {s['topology']} EP{s['num_ranks']} · {s['num_experts']} experts · "
                  f"{s['num_redundant_slots']} slots · domain {s['domain_size']} · {s['mode']}")
    for col in ("policy", "imb.before", "p99", "imb.after", "p99 ", "replicas", "MB/layer", "ms/layer",
                "%ideal", "%own", "speedup"):
        table.add_column(col, justify="left" if col == "policy" else "right", no_wrap=True)
    for r in summary:
        table.add_row(
            r["policy"], f"{r['imbalance_before']:.3f}", f"{r['imbalance_before_p99']:.3f}",
            f"{r['imbalance_after']:.3f}", f"{r['imbalance_after_p99']:.3f}", f"{r['replicas']:.1f}",
            f"{r['transfer_bytes_per_layer'] / 1e6:.1f}", f"{r['time_per_layer_ms']:.3f}", f"{r['pct_of_ideal']:.1f}",
            f"{r['pct_of_scheme_ideal']:.1f}", f"{r['speedup_vs_none']:.3f}",
        )
    console.print(table)
    console.print(f"replayed {s['layer_steps_per_policy']} layer-steps per policy ({len(s['layers'])} layers, stride "
                  f"{s['stride']} over {s['points']} points) in {s['wall_s']:.1f} s with {s['workers']} worker(s); "
                  "MB/layer = expert state moved per layer-step; %ideal = force-balanced plain-EP ideal / predicted; "
                  "%own = the ideal of the policy's own transmission scheme (HybridEP's) / predicted")

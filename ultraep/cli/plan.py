"""``ultraep plan``: plan one layer from a load file (or a generated workload) and show before/after."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

from ultraep.errors import ConfigError, LoadError, UltraEPError


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "plan",
        help="plan one MoE layer from a load matrix and print the rank loads before and after",
        description="Plan one MoE layer for one microbatch. The load is an [R, E] matrix of token-expert "
        "assignments per source rank and expert (.npy, integers), or a generated workload (--synthetic).",
    )
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--load", type=Path, help="[R, E] integer .npy file (no pickles)")
    src.add_argument("--synthetic", action="store_true", help="generate an UltraEP-style skewed load")
    p.add_argument("--ranks", type=int, required=True, help="EP group size R (must match the load's rows)")
    p.add_argument("--experts", type=int, default=None, help="experts E (with --synthetic)")
    p.add_argument("--top-k", type=int, default=8, help="top-k (with --synthetic)")
    p.add_argument("--tokens", type=int, default=8192, help="tokens per rank (with --synthetic)")
    p.add_argument("--imbalance", type=float, default=2.0, help="target initial imbalance (with --synthetic)")
    p.add_argument("--seed", type=int, default=0, help="random seed (with --synthetic)")
    p.add_argument("--slots", type=int, default=2, help="redundant slots per rank N")
    p.add_argument("--domain-size", type=int, default=None, help="ranks per scale-up domain (default: all)")
    p.add_argument("--policy", default="quota", help="none | quota | eplb (default quota)")
    p.add_argument("--compare", action="store_true", help="run every built-in policy and compare")
    p.add_argument("--json", action="store_true", help="print JSON instead of tables")
    p.set_defaults(func=run)


#: CLI flag of each size field, so refusals name what the user typed
_NAMES = {"num_ranks": "--ranks", "num_experts": "--experts", "num_redundant_slots": "--slots", "top_k": "--top-k",
          "tokens_per_rank": "--tokens"}


def _read_load(path: Path, ranks: int, slots: int, policies: int) -> np.ndarray:
    """Read the ``[R, E]`` .npy, checking the size its header declares before reading the data."""
    from ultraep import limits

    if not path.exists():
        raise LoadError(str(path), "no such file", str(path))
    try:  # a memory map reads only the header: the shape is known before any data is loaded
        arr = np.load(path, allow_pickle=False, mmap_mode="r")
    except ValueError as exc:  # object arrays need pickles: refused
        raise LoadError(str(path), f"is not a plain numeric .npy array ({exc})") from None
    except Exception as exc:
        raise LoadError(str(path), f"cannot be read as .npy ({type(exc).__name__}: {exc})") from None
    if not isinstance(arr, np.ndarray):
        raise LoadError(str(path), "holds several arrays (.npz); pass a single [R, E] .npy")
    if arr.ndim == 2 and arr.shape[0] == ranks and arr.shape[1] >= 1:
        names = {**_NAMES, "num_experts": f"{path} (columns)"}
        limits.check_plan(ranks, int(arr.shape[1]), slots, policies=policies, names=names)
    return np.array(arr)  # read it (validate_load refuses other shapes with their own message)


def _check_expert_totals(load: np.ndarray, args: argparse.Namespace) -> None:
    """Name ``--tokens`` when the sampled load is beyond what the planners split exactly (the load check would
    only name a cell). Sampling costs the same for any token count, so this is known within a second."""
    from ultraep.load import MAX_EXPERT_LOAD

    col = load.sum(axis=0)
    e = int(np.argmax(col))
    if col[e] > MAX_EXPERT_LOAD:
        fit = max(1, int(args.tokens * MAX_EXPERT_LOAD // int(col[e])))
        raise ConfigError("--tokens", f"({args.tokens:,}) gives expert {e} {int(col[e]):,} token-expert assignments over "
                          f"{args.ranks} ranks; the planners split at most {MAX_EXPERT_LOAD:,} (2^31 - 1) exactly, "
                          f"about --tokens {fit:,} here", args.tokens)


def run(args: argparse.Namespace) -> int:
    from ultraep import limits
    from ultraep.load import validate_load
    from ultraep.planning import plan_layer, warm_up
    from ultraep.policies import POLICIES
    from ultraep.topology import Topology

    if args.ranks < 1:
        raise ConfigError("--ranks", f"must be >= 1, got {args.ranks}", args.ranks)
    policies = list(POLICIES) if args.compare else [args.policy]
    if args.synthetic:
        from ultraep.sim.workload import synthetic_load

        if args.experts is None:
            raise ConfigError("--experts", "is required with --synthetic")
        if args.experts >= 1 and args.slots >= 0:  # sizes before anything is allocated; bad values: below
            limits.check_plan(args.ranks, args.experts, args.slots, policies=len(policies), names=_NAMES)
        try:
            load = synthetic_load(args.ranks, args.experts, top_k=args.top_k, tokens_per_rank=args.tokens,
                                  target_imbalance=args.imbalance, seed=args.seed, names=_NAMES)
        except UltraEPError:
            raise
        except ValueError as exc:
            raise ConfigError("--synthetic", str(exc)) from None
        _check_expert_totals(load, args)
        source = f"synthetic (target imbalance {args.imbalance}, top-{args.top_k}, {args.tokens} tokens/rank)"
    else:
        load = validate_load(_read_load(args.load, args.ranks, max(args.slots, 0), len(policies)),
                             num_ranks=args.ranks, path=str(args.load))
        source = str(args.load)
    topo = Topology(num_ranks=args.ranks, num_experts=load.shape[1], num_redundant_slots=args.slots,
                    domain_size=args.domain_size)
    # compile the planners (or load numba's cache) only now: refusals above must not wait ~20 s for a cold
    # compile, and the solve times printed below must not include it
    warm_up()
    plans = [plan_layer(load, name, topology=topo) for name in policies]
    if args.json:
        out = [p.summary() | {"transfers": p.transfers.rows()} for p in plans]
        json.dump(out if args.compare else out[0], sys.stdout, indent=1)
        print()
        return 0
    _print_tables(plans, source)
    return 0


def _print_tables(plans, source: str) -> None:
    from rich.console import Console
    from rich.table import Table

    con = Console()
    t0 = plans[0].topology
    con.print(f"[bold]load[/bold]: {source}; R={t0.num_ranks} ranks, E={t0.num_experts} experts, "
              f"M={t0.num_masters} masters + N={t0.num_redundant_slots} redundant slots per rank, "
              f"domain size {t0.D}")
    ranks = Table(title="rank load (tokens received) before → after")
    ranks.add_column("rank", justify="right")
    ranks.add_column("before", justify="right")
    for p in plans:
        ranks.add_column(f"after ({p.policy})", justify="right")
    for r in range(t0.num_ranks):
        ranks.add_row(str(r), str(plans[0].rank_load_before_R[r]), *[str(p.rank_load_after_R[r]) for p in plans])
    con.print(ranks)
    head = Table(title="summary")
    for col in ["policy", "imbalance before", "imbalance after", "replicas", "max instances/expert",
                "transfers", "solve µs"]:
        head.add_column(col, justify="right")
    for p in plans:
        s = p.summary()
        head.add_row(p.policy, f"{s['imbalance_before']:.3f}", f"{s['imbalance_after']:.3f}", str(s["num_replicas"]),
                     str(s["max_instances_per_expert"]), str(s["num_transfers"]), f"{p.solve_time_s * 1e6:.0f}")
    con.print(head)


__all__ = ["register", "run", "UltraEPError"]

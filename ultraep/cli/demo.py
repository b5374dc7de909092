"""``ultraep demo``: the main job (see :mod:`ultraep.cli.demo_job`)."""

from __future__ import annotations

import argparse
import os


def default_ranks() -> int:
    """One rank per CPU core (a straggler only costs time when every rank owns its core), 2 to 8, a power
    of two so it divides the demo's 8 experts. Kept here so that building the CLI does not import torch."""
    cores = min(os.cpu_count() or 2, 8)
    return max(2, 1 << (cores.bit_length() - 1))


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("demo", help="balance a small Hugging Face MoE model on local ranks and compare with none",
                       description="Run a real MoE model on local gloo ranks without balancing and with the chosen "
                       "policy (or every --compare policy), all in one launch, interleaved step by step, record every "
                       "run, and print first the measured step time and speed-up (the verdict is read off that "
                       "table), then what balancing changed and what it cost. One-time costs (start-up, compiles, "
                       "warm-up steps) are shown apart, charged to no run.")
    p.add_argument("--ranks", type=int, default=default_ranks(), help="local ranks, one thread each (default: cores)")
    p.add_argument("--steps", type=int, default=None, help="steps per run (default: sized to the machine, at most 30; "
                   "16 with --quick)")
    p.add_argument("--tokens", type=int, default=None, help="tokens per rank per step, a multiple of the sequence "
                   "length (default: sized to the machine by a 1 s probe, at most 1024; 256 with --quick)")
    p.add_argument("--mode", default="train", help="train (forward, backward, optimizer) or prefill (forward)")
    p.add_argument("--policy", default="adaptive", help="policy of the balanced run (default adaptive)")
    p.add_argument("--model", default="qwen3-moe", help="qwen3-moe | mixtral | deepseek-v3 | gpt-oss")
    p.add_argument("--slots", type=int, default=2, help="redundant slots per rank")
    p.add_argument("--out", default="runs", help="telemetry runs directory")
    p.add_argument("--quick", action="store_true", help="smaller model and fewer steps (CI)")
    p.add_argument("--compare", default=None, metavar="P1,P2,...",
                   help="run each policy on the same token stream, interleaved step by step with none in one launch, "
                   "and print one table, e.g. none,quota,eplb,feplb,adaptive")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ultraep.cli.demo_job import DemoSettings, run_demo
    from ultraep.cli.demo_size import resize
    from ultraep.errors import ConfigError
    from ultraep.policies import BASELINE, available_policies

    if args.policy not in available_policies() or args.policy == BASELINE:  # the baseline runs anyway
        raise ConfigError("--policy", f"unknown or trivial policy {args.policy!r}; choose from "
                          + ", ".join(p for p in available_policies() if p != BASELINE), args.policy)
    compare = tuple(p.strip() for p in args.compare.split(",") if p.strip()) if args.compare else ()
    settings = DemoSettings(model=args.model, policy=args.policy, mode=args.mode, ranks=args.ranks, compare=compare,
                            out=args.out, quick=args.quick, seed=args.seed, slots=args.slots, tokens=args.tokens,
                            steps=args.steps if args.steps is not None else 30)
    # tokens and steps the flags leave open are sized to the machine, once the flags are checked
    return run_demo(settings, resize=lambda s: resize(s, tokens=args.tokens, steps=args.steps))

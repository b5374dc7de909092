"""``ultraep trace``: generate synthetic traces, import peers' dumps, describe a trace."""

from __future__ import annotations

import argparse
import json
import sys
import time
from contextlib import contextmanager
from pathlib import Path

from ultraep.errors import ConfigError


def _range(text: str) -> tuple[float, float]:
    try:
        parts = [float(x) for x in text.split(":")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected X or LOW:HIGH, got {text!r}") from None
    if len(parts) == 1:
        return parts[0], parts[0]
    if len(parts) == 2:
        return parts[0], parts[1]
    raise argparse.ArgumentTypeError(f"expected X or LOW:HIGH, got {text!r}")


def register(sub: argparse._SubParsersAction) -> None:
    from ultraep.cli.simulate import add_trace_args

    p = sub.add_parser("trace", help="generate, import or describe routing traces",
                       description="Routing traces in ultraep's canonical Parquet table "
                       "(step, microbatch, layer, src_rank, expert, tokens).")
    tsub = p.add_subparsers(dest="trace_command", required=True, parser_class=type(p))

    g = tsub.add_parser("synth", help="write a synthetic trace (imbalance targets, drift, bursts, domain shifts)")
    g.add_argument("out", type=Path, help="output .parquet")
    g.add_argument("--ranks", type=int, required=True, help="source ranks R")
    g.add_argument("--experts", type=int, required=True, help="experts E (a multiple of R)")
    g.add_argument("--layers", type=int, default=1, help="MoE layers")
    g.add_argument("--steps", type=int, default=100, help="steps")
    g.add_argument("--microbatches", type=int, default=1, help="microbatches per step")
    g.add_argument("--top-k", type=int, default=8, help="experts per token")
    g.add_argument("--tokens", type=int, default=8192, help="tokens per rank per microbatch")
    g.add_argument("--imbalance", type=_range, default=(2.0, 2.0), help="target imbalance X or LOW:HIGH over layers")
    g.add_argument("--drift", type=float, default=0.0, help="ranks the hot pattern moves per step")
    g.add_argument("--burst-prob", type=float, default=0.0, help="chance of a burst per step and layer")
    g.add_argument("--burst-factor", type=float, default=8.0, help="weight multiplier of a bursting expert")
    g.add_argument("--burst-len", type=int, default=5, help="steps a burst lasts")
    g.add_argument("--domain-shift", type=int, default=0, help="steps between domain shifts (0 = never)")
    g.add_argument("--per-source", action="store_true", help="per-source-rank counts (default: global counts)")
    g.add_argument("--seed", type=int, default=0, help="random seed")
    g.add_argument("--no-progress", action="store_true", help="no progress bar")
    g.set_defaults(func=run_synth)

    i = tsub.add_parser("import", help="convert a peer's dump into a canonical trace")
    i.add_argument("src", type=Path, help="dump file or directory")
    i.add_argument("out", type=Path, help="output .parquet")
    add_trace_args(i)
    i.add_argument("--no-progress", action="store_true", help="no progress bar")
    i.set_defaults(func=run_import)

    d = tsub.add_parser("info", help="describe a trace")
    d.add_argument("src", type=Path, help="trace file or directory")
    add_trace_args(d)
    d.set_defaults(func=run_info)


#: CLI flag of each synthetic-spec field, so size refusals name what the user typed
_SYNTH_NAMES = {"num_ranks": "--ranks", "num_experts": "--experts", "num_layers": "--layers", "num_steps": "--steps",
                "microbatches": "--microbatches", "top_k": "--top-k", "tokens_per_rank": "--tokens",
                "burst_len": "--burst-len"}


@contextmanager
def _bar(label: str, show: bool):
    """Yield ``advance(done, total)`` driving a rich bar on stderr (``done=None``: start the indeterminate stage
    ``total``, a description), or a no-op when ``show`` is false."""
    if not show:
        yield lambda done, total: None
        return
    from rich.progress import BarColumn, Progress, TaskProgressColumn, TextColumn, TimeElapsedColumn, TimeRemainingColumn

    with Progress(TextColumn("{task.description}"), BarColumn(), TaskProgressColumn(), TimeElapsedColumn(),
                  TimeRemainingColumn(), transient=True) as bar:
        task = bar.add_task(label, total=None)

        def advance(done, total):
            if done is None:
                bar.reset(task, total=None, description=total)
            else:
                bar.update(task, completed=done, total=total)
        yield advance


def run_synth(args: argparse.Namespace) -> int:
    from ultraep.traces.synthetic import SyntheticSpec, synthetic_trace

    spec = SyntheticSpec.model_validate(dict(
        num_ranks=args.ranks, num_experts=args.experts, num_layers=args.layers, num_steps=args.steps,
        microbatches=args.microbatches, top_k=args.top_k, tokens_per_rank=args.tokens, imbalance=args.imbalance,
        drift=args.drift, burst_prob=args.burst_prob, burst_factor=args.burst_factor, burst_len=args.burst_len,
        domain_shift_every=args.domain_shift, per_source=args.per_source, seed=args.seed,
    ), context={"names": _SYNTH_NAMES})
    t0 = time.perf_counter()
    with _bar("sampling (step x layer)", not args.no_progress and sys.stderr.isatty()) as advance:
        trace = synthetic_trace(spec, progress=advance, names=_SYNTH_NAMES)
        advance(None, "writing")
        trace.write(args.out)  # under a temporary name, renamed when complete (Ctrl-C leaves no trace file)
    print(f"wrote {args.out}: {trace.num_rows:,} rows in {time.perf_counter() - t0:.1f} s")
    return 0


def run_import(args: argparse.Namespace) -> int:
    from ultraep.cli.simulate import parse_kv
    from ultraep.traces import load_trace

    if args.out.suffix != ".parquet":
        raise ConfigError("out", f"must end in .parquet, got {args.out.name!r}", str(args.out))
    with _bar(f"reading {args.src.name}", not args.no_progress and sys.stderr.isatty()) as advance:
        trace = load_trace(args.src, args.format, **parse_kv(args.trace_opt, "--trace-opt"))
        advance(None, "writing")
        trace.write(args.out)  # under a temporary name, renamed when complete
    print(f"wrote {args.out}: {trace.num_rows:,} rows ({trace.meta.source})")
    return 0


def run_info(args: argparse.Namespace) -> int:
    from ultraep.cli.simulate import parse_kv
    from ultraep.traces import load_trace

    trace = load_trace(args.src, args.format, **parse_kv(args.trace_opt, "--trace-opt"))
    print(json.dumps(trace.summary(), indent=2))
    return 0

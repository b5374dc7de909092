"""The demo sized to the machine: a short probe of the expert GEMM, then tokens per rank and steps.

``make demo`` must finish in about two minutes on a 2-core machine of any speed, in the regime the README
describes: a step's time grows with its tokens (expert compute the largest part), so that balancing the
experts pays as it does at the default size. A machine several times slower at
GEMMs would otherwise take several times longer (issue 31: 4 min 17 s on an AVX2 EPYC).

Step 1 (:func:`probe_gflops`): time the demo's expert GEMM (``[tokens, H] @ [H, 2I]``, fp32) on one
        thread, as each rank runs it, for about a second: GFLOP/s.
Step 2 (:func:`choose_size`, a pure function of that figure): predict a step of the unbalanced run as
        expert compute (the busiest rank's forward and backward GEMMs at the probe's speed, divided by the
        efficiency the demo's layer reaches) plus the rest of the step (attention, embeddings, loss, Adam,
        collectives: a share of the expert compute plus a fixed part), and the whole demo as start-up plus
        every run's steps. Then take the largest tokens per rank (a multiple of the sequence length, at most
        the default, and never a size whose step is < 60 % work that grows with the tokens: fixed per-step
        costs <= 40 %) whose demo fits the budget: with every run full length; else with the fp32 band's run
        (training: a third, unrecorded run that only shows how two equivalent runs drift apart) cut to
        :data:`BAND_MIN_STEPS`; else with that and fewer steps (at least :data:`MIN_STEPS`). A machine too slow
        for even the smallest such size gets it with the fewest steps, and the prediction says so.

The constants are fitted to runs of the demo (docs/benchmarks.md, "Demo sizing"); the prediction is printed
next to the choice, and ``--tokens`` / ``--steps`` override it.

Legend: T tokens per rank per step, H hidden size, I expert intermediate size, k top-k, L MoE layers.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

#: seconds the whole demo may take after set-up (the README's promise)
BUDGET_S = 120.0
#: the smallest share of a step that must grow with the tokens (expert compute and the rest that scales):
#: below it the fixed per-step costs change the regime (balancing saves expert time, not fixed time). With the
#: fixed costs scaled to the machine (below), 256 tokens per rank on a CPU held to a third of a core is 0.66 of its
#: step and balancing still paid 1.28x there (docs/benchmarks.md, 2026-11-25 night)
MIN_SCALING_SHARE = 0.6
#: the fewest steps a run may take (5 warm-up steps, then 11 timed ones)
MIN_STEPS = 16
#: the fewest steps of the fp32 band's run: steps 0-3, which the equality line compares ("steps 1-3")
BAND_MIN_STEPS = 4
#: busiest rank's load over the mean under ``none`` (the demo's skew: 1.83-1.85 measured at 2 ranks)
IMBALANCE = 1.85
#: the speed of the demo's expert forward + backward as a multiple of the probe's GFLOP/s, and the rest of a
#: step that grows with the tokens (attention, embeddings, loss) as a fraction of the expert compute.
#: (1 + OTHER_RATIO) / EFFICIENCY = 1.44 is fitted to issue 31's machine, whose GEMM ran at 34 GFLOP/s on one
#: thread and whose unbalanced step took 3.07 s at 1024 tokens per rank (71.5 GFLOP of busiest-rank expert
#: work); OTHER_RATIO to the demo's own timers, which put the busiest rank's expert compute at 58-59 % of
#: none's step on this project's machine at 1024 and at 512 tokens (docs/benchmarks.md, "Demo sizing").
EFFICIENCY = 1.125
OTHER_RATIO = 0.62
#: the probe's figure on the machine where the fixed costs below were measured (this project's AMD EPYC: 96.6-102
#: GFLOP/s). A slower probe scales them up in proportion: on a CPU that is slower throughout (not only at GEMMs),
#: Python, imports and collectives are slower too. A faster one keeps them (the prediction errs on the long side).
REF_GFLOPS = 100.0
#: the rest of a step that does not grow with the tokens (Python, collectives' latency, Adam), at REF_GFLOPS:
#: none's step measured 1.13-1.21 s at 1024 tokens there, of which the tokens' part predicts 1.03 s; with every
#: process held to a third of a core (probe 34.8 GFLOP/s) none's step at 256 tokens measured 1.14 s, which this
#: scaling predicts as 1.11 s (0.05 s unscaled predicted 0.79 s, and the demo took 128 s, not the predicted 82 s)
FIXED_STEP_S = 0.13
#: start-up: imports and preload (3 s measured), then per run the ranks' fork, model build and first step
#: (1.3 s measured): both rounded up, so that the prediction errs on the long side; at REF_GFLOPS, scaled as above
STARTUP_S = 5.0
RUN_START_S = 2.0


def probe_gflops(hidden: int, expert_hidden: int, seconds: float = 1.0, rows: int = 512, bursts: int = 5) -> float:
    """GFLOP/s of the expert GEMM ``[rows, H] @ [H, 2I]`` (fp32) on one thread: the best of ``bursts`` timings
    of about ``seconds / bursts`` each (the best is the least disturbed by whatever else the machine runs)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # each rank runs on one thread
    try:
        g = torch.Generator().manual_seed(0)
        x = torch.randn(rows, hidden, generator=g)
        w = torch.randn(hidden, 2 * expert_hidden, generator=g)
        x @ w  # first call: allocation and kernel selection
        best = 0.0
        for _ in range(bursts):
            calls, t0 = 0, time.perf_counter()
            while True:
                x @ w
                calls += 1
                dt = time.perf_counter() - t0
                if dt >= seconds / bursts:
                    break
            best = max(best, calls / dt)
    finally:
        torch.set_num_threads(threads)
    return best * 2.0 * rows * hidden * 2 * expert_hidden / 1e9


@dataclass(frozen=True)
class DemoSize:
    """What :func:`choose_size` chose, and what it predicts."""

    tokens: int  #: tokens per rank per step
    steps: int  #: steps per run
    band_steps: int | None  #: steps of the fp32 band's run (None: no band run; ``steps`` when it runs full length)
    step_s: float  #: predicted step time of the unbalanced run
    expert_share: float  #: predicted share of that step spent in expert compute (busiest rank)
    scaling_share: float  #: predicted share of that step that grows with the tokens
    total_s: float  #: predicted seconds of the whole demo (start-up and every run)


def _slower(gflops: float) -> float:
    """How much longer the fixed costs, measured at REF_GFLOPS, take on a machine whose probe reads ``gflops``."""
    return max(1.0, REF_GFLOPS / gflops)


def predict(gflops: float, tokens: int, steps: int, *, runs: int, hidden: int, expert_hidden: int, layers: int,
            top_k: int = 2, train: bool = True, band_steps: int | None = None) -> DemoSize:
    """The model of Step 2 for one size. ``runs``: runs of ``steps`` steps each (balanced runs are counted as long
    as the unbalanced one: the prediction errs on the long side); ``band_steps``: one more run (the fp32 band's) of
    that many steps."""
    if gflops <= 0:
        raise ValueError(f"probe figure must be > 0 GFLOP/s, got {gflops}")
    flops = layers * IMBALANCE * top_k * tokens * 6.0 * hidden * expert_hidden * (3.0 if train else 1.0)
    expert_s = flops / (gflops * 1e9 * EFFICIENCY)
    slower = _slower(gflops)
    fixed_s = FIXED_STEP_S * slower
    step_s = expert_s * (1.0 + OTHER_RATIO) + fixed_s
    total = slower * STARTUP_S + runs * (slower * RUN_START_S + steps * step_s)
    if band_steps is not None:
        total += slower * RUN_START_S + band_steps * step_s
    return DemoSize(tokens=tokens, steps=steps, band_steps=band_steps, step_s=step_s, expert_share=expert_s / step_s,
                    scaling_share=1.0 - fixed_s / step_s, total_s=total)


def choose_size(gflops: float, *, runs: int, seq: int, max_tokens: int, default_steps: int, hidden: int,
                expert_hidden: int, layers: int, top_k: int = 2, train: bool = True,
                budget_s: float = BUDGET_S, min_steps: int = MIN_STEPS, band: bool = False) -> DemoSize:
    """Tokens per rank (a multiple of ``seq``, at most ``max_tokens``) and steps (at most ``default_steps``, at
    least :data:`MIN_STEPS`) for a machine whose expert GEMM runs at ``gflops`` on one thread (Step 2).

    Among the sizes whose step is still >= :data:`MIN_SCALING_SHARE` work that grows with the tokens, largest
    first: the first whose demo fits ``budget_s`` at ``default_steps``; with ``band``, else with the band's run cut
    to :data:`BAND_MIN_STEPS`, else with that and the most steps that fit (never below ``min_steps``). A machine too
    slow for even the smallest such size gets it with the fewest steps, and the prediction says so.
    ``min_steps = default_steps`` holds the steps (``--steps`` given) and sizes the tokens only. ``band``: the last
    of the ``runs`` is the fp32 band's run, which may be cut to :data:`BAND_MIN_STEPS` before anything else is."""
    if seq <= 0 or max_tokens < seq or default_steps < 1:
        raise ValueError(f"need seq > 0, max_tokens >= seq and steps >= 1, got {seq}, {max_tokens}, {default_steps}")
    kw = dict(hidden=hidden, expert_hidden=expert_hidden, layers=layers, top_k=top_k, train=train)
    timed = runs - 1 if band else runs  # runs of the full steps; the band's run apart
    fewest = min(min_steps, default_steps)

    def size(tokens: int, steps: int, band_steps: int | None) -> DemoSize:
        return predict(gflops, tokens, steps, runs=timed, band_steps=band_steps if band else None, **kw)

    sizes = [size(t, default_steps, default_steps) for t in range(max_tokens, seq - 1, -seq)]
    kept = [s for s in sizes if s.scaling_share >= MIN_SCALING_SHARE] or sizes[:1]
    short = min(BAND_MIN_STEPS, default_steps)
    for s in kept:  # largest first: every run full length, else the band's run short, else fewer steps too
        if s.total_s <= budget_s:
            return s
        if not band:
            continue
        cut = size(s.tokens, default_steps, short)
        if cut.total_s <= budget_s:
            return cut
        steps = _steps_that_fit(size(s.tokens, 0, short), cut, default_steps, budget_s)
        if steps >= fewest:
            return size(s.tokens, steps, short)
    floor = kept[-1]  # the smallest size that keeps the regime: fewer steps instead of fewer tokens
    base = size(floor.tokens, 0, short if band else None)
    steps = _steps_that_fit(base, size(floor.tokens, default_steps, short if band else None), default_steps, budget_s)
    return size(floor.tokens, max(fewest, steps), short if band else None)


def _steps_that_fit(zero: DemoSize, full: DemoSize, steps: int, budget_s: float) -> int:
    """The most steps (at most ``steps``) whose demo fits ``budget_s``, from the prediction at 0 steps and at
    ``steps`` (the total is linear in the steps)."""
    per_step = (full.total_s - zero.total_s) / steps
    return min(steps, int((budget_s - zero.total_s) / per_step)) if per_step > 0 else steps


def size_line(gflops: float | None, size: DemoSize | None, tokens: int, steps: int, probe_s: float) -> str:
    """The one line the demo prints: the probe figure and the size it chose (or that the flags chose)."""
    if size is None:
        return f"size: {tokens} tokens/rank x {steps} steps per run, from --tokens and --steps (no probe)"
    band = (f", the fp32 band's run {size.band_steps} steps" if size.band_steps is not None and size.band_steps < steps
            else "")
    return (f"size: machine probe {gflops:.1f} GFLOP/s (expert GEMM, 1 thread, {probe_s:.1f} s) -> {tokens} tokens/rank "
            f"x {steps} steps per run{band} (predicted: none's step {size.step_s:.2f} s, {100 * size.scaling_share:.0f} % of it growing "
            f"with the tokens, expert compute {100 * size.expert_share:.0f} %; whole demo ~{size.total_s:.0f} s; "
            f"--tokens / --steps override)")


def resize(settings, *, tokens: int | None, steps: int | None):
    """``(settings with tokens and steps, the line to print)`` for a checked ``DemoSettings``: ``--tokens`` and
    ``--steps`` (``None`` when not given) win; what they leave open comes from the probe."""
    import dataclasses

    sh = settings.shape if settings.tokens is None else dataclasses.replace(settings, tokens=None).shape
    default_steps = 16 if settings.quick else 30
    if tokens is not None and steps is not None:
        return settings, size_line(None, None, tokens, steps, 0.0)
    train = settings.mode == "train"
    kw = dict(hidden=sh["hidden"], expert_hidden=sh["expert_hidden"], layers=sh["layers"], train=train)
    t0 = time.perf_counter()
    gflops = probe_gflops(sh["hidden"], sh["expert_hidden"])
    probe_s = time.perf_counter() - t0
    if tokens is not None:  # tokens given: the default steps, predicted (every run full length)
        size = predict(gflops, tokens, default_steps, runs=len(settings.runs),
                       band_steps=default_steps if train else None, **kw)
    else:  # the band's run is the last of the runs (training)
        size = choose_size(gflops, runs=len(settings.runs) + (1 if train else 0), seq=sh["seq"],
                           max_tokens=sh["batch"] * sh["seq"], default_steps=steps or default_steps,
                           min_steps=steps or MIN_STEPS, band=train, **kw)
    line = size_line(gflops, size, size.tokens, size.steps, probe_s)
    band = size.band_steps if size.band_steps is not None and size.band_steps < size.steps else None
    return dataclasses.replace(settings, tokens=size.tokens, steps=size.steps, band_steps=band), line

"""``ultraep demo``: a real Hugging Face MoE model, balanced across local ranks, measured against none.

What it does:

    Step 1: build a small transformers v5 MoE model from a config (random weights, no download) on every
            rank, and give it *structure*: the vocabulary is split into one domain per rank; each domain's
            token embeddings share a direction, and each MoE router is tilted so that rank d's experts
            prefer domain d. The token stream shifts between domains over time (70 % of the tokens from the
            current domain), so the model's own router sends most tokens to one rank's experts, and the hot
            rank moves. The counts always come from the router; nothing is overwritten.
    Step 2: run the same steps under policy ``none`` and the chosen policy (or every ``--compare`` policy) in
            ONE launch: every run is built (and the planners compiled) before any step is timed, then step i
            runs each run once, interleaved in a carry-over balanced order, so a busy machine slows all runs
            alike and no run is charged for another's compile. Every run is recorded to the telemetry store,
            the balanced ones naming the none run as their baseline. Training runs forward, backward and an
            Adam step, with the non-expert gradients averaged over ranks (data parallel) and the masters'
            gradients summed by the balanced layer.
    Step 3: print the measured step time of every run and its speed-up over none first, then per-layer
            imbalance before → after, the policy decisions, planning and transfer overhead
            (:mod:`ultraep.cli.demo_report`: the verdict is read off the printed numbers), check that the
            losses match, and print the commands that open the dashboard and the report on the runs.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch

from ultraep.cli.demo_check import is_match, step0_difference, step0_gradients
from ultraep.errors import ConfigError
from ultraep.policies.registry import BASELINE

#: the baseline run fed each batch's sequences in reverse order (see :func:`_rank_main`)
REORDERED = f"{BASELINE}-reordered"


@dataclass(frozen=True)
class DemoSettings:
    model: str = "qwen3-moe"
    policy: str = "adaptive"
    mode: str = "train"
    ranks: int = 2
    steps: int = 30
    out: str = "runs"
    quick: bool = False
    seed: int = 0
    slots: int = 2
    #: policies run on the same token stream, in order (``none`` first); default: none, then ``policy``
    compare: tuple[str, ...] = ()
    #: tokens per rank per step (a multiple of the sequence length); None: the shape's default batch
    tokens: int | None = None
    #: steps of the fp32 reordering band's run (training); None: ``steps``. A machine too slow for three full runs
    #: in the budget runs it shorter (:mod:`ultraep.cli.demo_size`): only step 0 decides equality, the band shows
    #: how two equivalent runs drift apart
    band_steps: int | None = None

    @property
    def runs(self) -> tuple[str, ...]:
        pols = self.compare or (self.policy,)
        return (BASELINE,) + tuple(p for p in pols if p != BASELINE)

    @property
    def shape(self) -> dict:
        """Model and batch size: 1024 tokens per rank by default (top-2, H 512, I 1024: the busiest rank's expert
        compute is 58-59 % of an unbalanced step by the demo's own timers on this project's machine, the largest
        part); ``tokens`` (sized to the machine by :mod:`ultraep.cli.demo_size`, or ``--tokens``) sets the batch."""
        if self.quick:
            sh = dict(num_experts=8, hidden=256, expert_hidden=512, layers=2, vocab=256, batch=2, seq=128)
        else:
            sh = dict(num_experts=8, hidden=512, expert_hidden=1024, layers=2, vocab=512, batch=4, seq=256)
        if self.tokens is not None:  # sized to the machine (ultraep.cli.demo_size) or --tokens
            sh["batch"] = self.tokens // sh["seq"]
        return sh


def _structure(model, family: str, num_domains: int, vocab: int, strength: float, seed: int) -> None:
    """Tilt embeddings and routers so that routing follows the token domain (Step 1)."""
    g = torch.Generator().manual_seed(seed + 99)
    emb = model.get_input_embeddings().weight
    H = emb.shape[1]
    dirs = torch.nn.functional.normalize(torch.randn(num_domains, H, generator=g), dim=-1)
    per = vocab // num_domains
    with torch.no_grad():
        for d in range(num_domains):
            emb[d * per:(d + 1) * per] = 0.3 * emb[d * per:(d + 1) * per] + dirs[d]
        from ultraep.models.adapters import adapter_for

        for name, mod in model.named_modules():
            if adapter_for(mod) is None:
                continue
            parent = model.get_submodule(name.rpartition(".")[0])
            E = adapter_for(mod).num_experts(mod)
            router = next(m for m in parent.children() if getattr(m, "weight", None) is not None
                          and tuple(m.weight.shape) == (E, H))
            M = E // num_domains
            for e in range(E):
                router.weight[e] += strength * dirs[e // M] * (1.0 - 0.15 * (e % M))


def _tokens(step: int, rank: int, settings: DemoSettings, num_domains: int) -> torch.Tensor:
    """The token stream: the current domain shifts every few steps; 70 % of tokens come from it."""
    sh = settings.shape
    period = max(2, settings.steps // (2 * num_domains))
    domain = (step // period) % num_domains
    per = sh["vocab"] // num_domains
    g = torch.Generator().manual_seed(settings.seed * 7919 + step * 131 + rank)
    n = sh["batch"] * sh["seq"]
    ids = torch.randint(0, sh["vocab"], (n,), generator=g)
    hot = torch.rand(n, generator=g) < 0.7
    ids[hot] = domain * per + torch.randint(0, per, (int(hot.sum()),), generator=g)
    return ids.view(sh["batch"], sh["seq"])


def warmup_steps(settings: DemoSettings) -> int:
    """Steps left out of every timed figure (the table, the verdict and the store's ``steps.warmup``): the first
    plans, allocations and the adaptive engine's exploration. One definition, so the report and the dashboard
    print the same step time p50 as the demo."""
    return min(10, settings.steps // 3)


class _DemoRun:
    """One run of the demo on this rank: its model, runtime, optimizer and what it measured (Step 2)."""

    def __init__(self, rank: int, world: int, settings: DemoSettings, policy: str, run_name: str | None,
                 baseline: str | None) -> None:
        """``policy="none-reordered"``: the unbalanced model fed each batch's sequences in reverse order (the
        same loss and gradients, summed in another order) — the fp32 reordering band the balanced run is judged
        against. ``baseline``: the run id of this stream's unbalanced run, stored in the run's ``extra`` so that
        ``ultraep report`` and the dashboard measure the speed-up against it."""
        import ultraep
        from ultraep.config import BalancerConfig
        from ultraep.models import build_model
        from ultraep.telemetry import NullRecorder, Recorder

        sh = settings.shape
        self.policy, self.settings, self.world = policy, settings, world
        self.model = build_model(settings.model, num_experts=sh["num_experts"], hidden=sh["hidden"],
                                 expert_hidden=sh["expert_hidden"], layers=sh["layers"], vocab=sh["vocab"],
                                 seed=settings.seed)
        _structure(self.model, settings.model, world, sh["vocab"], strength=2.0, seed=settings.seed)
        self.reordered = policy == REORDERED
        config = BalancerConfig(policy=BASELINE if self.reordered else policy, num_redundant_slots=settings.slots)
        self.recorder = NullRecorder()
        if run_name is not None:
            extra = {"demo": True, "policy": policy}
            if baseline is not None and baseline != run_name:
                extra["baseline"] = baseline
            try:
                self.recorder = Recorder.open(settings.out, run_name, kind=settings.mode, config=config,
                                              model=settings.model, world_size=world, rank=rank, extra=extra)
            except Exception as exc:  # telemetry never stops the demo
                print(f"ultraep demo: recording disabled ({exc})")
        ultraep.wrap(self.model, config, recorder=self.recorder)
        self.rt = ultraep.runtime_of(self.model)
        self.train = settings.mode == "train"
        # trains as users train: DistributedDataParallel around the wrapped model (the masters stay ultraep's)
        self.trained = torch.nn.parallel.DistributedDataParallel(self.model) if self.train else self.model
        self.opt = torch.optim.Adam(self.trained.parameters(), lr=1e-3) if self.train else None
        self.losses: list[float] = []
        self.times: list[float] = []
        self.calls: list = []
        self.grads0 = None

    def step(self, step: int, rank: int, warm: int) -> None:
        """One timed step (barrier first: every rank starts together, so the time is the step's, not a wait)."""
        import torch.distributed as dist

        ids = _tokens(step, rank, self.settings, self.world)
        if self.reordered:
            ids = ids.flip(0)
        model = self.trained
        dist.barrier(group=self.rt.group)
        t0 = time.perf_counter()
        if self.train:
            self.opt.zero_grad(set_to_none=True)
            logits = model(input_ids=ids).logits
            loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]),
                                                     ids[:, 1:].reshape(-1))
            loss.backward()  # DDP averages every gradient but the masters', which ultraep averages alike
            dt = time.perf_counter() - t0
            if step == 0:  # untimed: the step-0 gradients the equality check compares (collective)
                self.grads0 = step0_gradients(self.model, self.rt, rank)
            t1 = time.perf_counter()
            self.opt.step()
            dt += time.perf_counter() - t1
        else:
            with torch.no_grad():
                logits = model(input_ids=ids).logits
                loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]),
                                                         ids[:, 1:].reshape(-1))
            dt = time.perf_counter() - t0
        self.losses.append(float(loss.detach()))
        self.times.append(dt)
        self.rt.next_step(loss=self.losses[-1], step_time_s=dt, warmup=step < warm)
        self.calls.extend((step, layer.layer, dict(layer.last_timings)) for layer in self.rt.layers)

    def result(self) -> dict:
        self.recorder.close()
        return {"losses": self.losses, "times": self.times, "history": self.rt.recording.history,
                "run_id": getattr(self.recorder, "run_id", None), "calls": self.calls, "grads0": self.grads0,
                "recording_errors": self.rt.recording.errors + int(getattr(self.recorder, "errors", 0) or 0)}


def _rank_main(rank: int, world: int, settings: DemoSettings, specs: list[tuple[str, str | None]]) -> dict:
    """Every run of the demo on this rank, in one process, interleaved step by step (Step 2).

    ``specs``: ``(policy, run name or None)``; the first is the baseline (none). Every run is built (and the
    planners compiled, by ``ultraep.wrap``) before any step is timed; step ``i`` then runs each run once, in
    the ``i``-th carry-over balanced order (:func:`~ultraep.cli.paired.carryover_orders`), so a busy machine
    slows every run alike and no run is charged for another's compile. Returns ``{policy: result}`` and
    ``"setup_s"``: the seconds spent before the first step (imports, model builds, compiles)."""
    from ultraep.cli.paired import carryover_orders

    t0 = time.perf_counter()
    base = specs[0][1]
    runs = [_DemoRun(rank, world, settings, policy, name, base) for policy, name in specs]
    setup_s = time.perf_counter() - t0
    warm = warmup_steps(settings)
    orders = carryover_orders(len(runs))
    band_steps = settings.steps if settings.band_steps is None else min(settings.steps, settings.band_steps)
    progress = None
    if rank == 0:
        from rich.progress import Progress

        progress = Progress(transient=True)
        progress.start()
        total = sum(band_steps if r.reordered else settings.steps for r in runs)
        task = progress.add_task(f"{len(runs)} runs interleaved ({settings.mode})", total=total)
    try:
        for step in range(settings.steps):
            for k in orders[step % len(orders)]:
                if runs[k].reordered and step >= band_steps:  # the band's run ends early (a slow machine)
                    continue
                runs[k].step(step, rank, warm)
                if progress is not None:
                    progress.advance(task)
    finally:
        if progress is not None:
            progress.stop()
        out = {r.policy: r.result() for r in runs}
    out["setup_s"] = setup_s
    return out


def run_demo(settings: DemoSettings, resize=None) -> int:
    """``resize(settings) -> (settings, line)``: sizes tokens and steps after the settings are checked
    (:func:`ultraep.cli.demo_size.resize`); the line is printed."""
    from rich.console import Console

    from ultraep.launch import launch
    from ultraep.models import FAMILIES, preload
    from ultraep.policies import available_policies

    if settings.model not in FAMILIES:
        raise ConfigError("--model", f"unknown model {settings.model!r}; choose from {', '.join(FAMILIES)}",
                          settings.model)
    if settings.mode not in ("train", "prefill"):
        raise ConfigError("--mode", f"must be train or prefill, got {settings.mode!r}", settings.mode)
    if settings.ranks < 2 or settings.shape["num_experts"] % settings.ranks:
        raise ConfigError("--ranks", f"must be >= 2 and divide {settings.shape['num_experts']} experts, "
                          f"got {settings.ranks}", settings.ranks)
    seq = settings.shape["seq"]
    if settings.tokens is not None and (settings.tokens < seq or settings.tokens % seq):
        raise ConfigError("--tokens", f"must be a positive multiple of the sequence length {seq}, got {settings.tokens}",
                          settings.tokens)
    if settings.steps < 4:
        raise ConfigError("--steps", f"must be >= 4, got {settings.steps}", settings.steps)
    unknown = [p for p in settings.runs if p not in available_policies()]
    if unknown:
        raise ConfigError("--compare", f"unknown policy {unknown[0]!r}; choose from {', '.join(available_policies())}",
                          unknown[0])
    con = Console()
    if not con.is_terminal:  # logs and pipes: wide enough that tables and commands are not wrapped
        con = Console(width=140)
    if resize is not None:
        settings, line = resize(settings)
        con.print(line, soft_wrap=True)
    preload()
    stamp = time.strftime("%Y%m%d-%H%M%S")
    runs = list(settings.runs)
    band = settings.mode == "train"  # the fp32 reordering band: a third, unrecorded run of none
    con.print(f"[bold]ultraep demo[/bold]: {settings.model}, {settings.ranks} ranks x 1 thread (gloo), "
              f"{settings.shape['batch'] * settings.shape['seq']} tokens/rank/step, {settings.steps} {settings.mode} "
              f"steps, policies {', '.join(runs)}{_band_note(settings) if band else ''}; "
              f"runs in {settings.out}/", soft_wrap=True)
    specs = [(policy, f"demo-{stamp}-{policy}") for policy in runs] + ([(REORDERED, None)] if band else [])
    t0 = time.perf_counter()
    per_rank = launch(_rank_main, settings.ranks, settings, specs, threads_per_rank=1)
    wall = time.perf_counter() - t0
    results = {policy: (name, [o[policy] for o in per_rank]) for policy, name in specs}
    from ultraep.cli.demo_report import DemoTiming, summary

    timing = DemoTiming(wall_s=wall, setup_s=max(o["setup_s"] for o in per_rank), warmup=warmup_steps(settings))
    paid = summary(con, settings, {k: v for k, v in results.items() if k != REORDERED}, timing)
    ok = _equality(con, settings, results)
    _activation_memory(con, settings, [v[0] for k, v in results.items() if k != REORDERED])
    con.print(paid, soft_wrap=True)
    con.print(f"open the dashboard on these runs:  [bold]ultraep dashboard {settings.out}[/bold]"
              f"   (or: make dashboard); the measured answer again:  [bold]ultraep report {settings.out}[/bold]",
              soft_wrap=True)
    return 0 if ok else 1


def _band_note(settings: DemoSettings) -> str:
    short = settings.band_steps is not None and settings.band_steps < settings.steps
    return f" (+ none reordered, for the fp32 band{f', {settings.band_steps} steps' if short else ''})"


def _activation_memory(con, settings: DemoSettings, run_ids: list) -> None:
    """One line per run: the expert activations the busiest rank holds at its peak, without -> with balancing,
    against the mean rank (the canned query telemetry.queries.ACTIVATION_MEMORY, summed over the layers)."""
    from ultraep.telemetry import open_run, queries

    cols, rows = queries.run(open_run(settings.out), queries.ACTIVATION_MEMORY)
    parts = []
    for run_id in run_ids:
        mine = [dict(zip(cols, r)) for r in rows if r[0] == run_id]
        if not mine:
            continue
        before, after, mean = (sum(r[k] or 0.0 for r in mine) for k in (
            "peak_busiest_before_MB", "peak_busiest_after_MB", "mean_rank_MB"))
        parts.append(f"{run_id.rsplit('-', 1)[-1]} {before:.1f} -> {after:.1f} MB"
                     + (f" ({after / mean:.2f}x the mean rank's {mean:.1f} MB)" if mean > 0 else ""))
    if parts:
        con.print("expert activations the busiest rank holds at its peak (all layers, without -> with balancing): "
                  + "; ".join(parts), soft_wrap=True)


def _rel(a, b) -> np.ndarray:
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return np.abs(a - b) / np.maximum(np.maximum(np.abs(a), np.abs(b)), 1e-12)


def _equality(con, settings: DemoSettings, results: dict) -> bool:
    """The honest equality verdict. The math is the same iff step 0 — before any optimizer step could amplify
    a rounding difference — gives the same loss and the same gradients, expert row by expert row
    (:mod:`ultraep.cli.demo_check`). Later steps are compared with the band two equivalent unbalanced runs
    (``none`` and ``none`` with its gradient average rounded in another order) drift apart by in the same run."""
    base = results[BASELINE][1][0]
    ok = True
    band = None
    if REORDERED in results:
        short = results[REORDERED][1][0]["losses"]  # the band's run may have ended early
        band = _rel(base["losses"][:len(short)], short)
    for policy, (_, out) in results.items():
        if policy in (BASELINE, REORDERED):
            continue
        r = out[0]
        step0, worst = step0_difference(results[BASELINE][1], out)
        rel = _rel(base["losses"], r["losses"])
        same = is_match(step0)
        ok &= same
        early = slice(1, min(4, len(rel)))
        where = ""
        if band is not None:
            end = "by the end" if len(band) == len(rel) else f"by step {len(band) - 1}"
            where = (f"; two equivalent unbalanced runs (batch order reversed) differ by {band[early].max():.1e} in "
                     f"steps 1-3 and {band.max():.1e} {end}: Adam amplifies last-bit fp32 differences step "
                     "after step, so only step 0 can decide equality")
        verdict = ("match: balancing does not change the math" if same else
                   "MISMATCH: step 0 differs beyond fp32 summation order")
        con.print(f"{policy}: step 0 loss and gradients (per expert row) vs none: max relative difference {step0:.1e} "
                  f"({worst}); losses in "
                  f"steps 1-3: {rel[early].max() if len(rel) > 1 else 0.0:.1e}, by step {len(rel) - 1}: "
                  f"{rel.max():.1e}{where} -> {verdict}", soft_wrap=True)
    return ok

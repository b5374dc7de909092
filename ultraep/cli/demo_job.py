"""``ultraep demo``: a real Hugging Face MoE model, balanced across local ranks, measured against none.

What it does:

    Step 1: build a small transformers v5 MoE model from a config (random weights, no download) on every
            rank, and give it *structure*: the vocabulary is split into one domain per rank; each domain's
            token embeddings share a direction, and each MoE router is tilted so that rank d's experts
            prefer domain d. The token stream shifts between domains over time (70 % of the tokens from the
            current domain), so the model's own router sends most tokens to one rank's experts, and the hot
            rank moves. The counts always come from the router; nothing is overwritten.
    Step 2: run the same steps twice on fresh ranks: policy ``none``, then the chosen policy; record both
            runs to the telemetry store. Training runs forward, backward and an Adam step, with the
            non-expert gradients averaged over ranks (data parallel) and the masters' gradients summed
            by the balanced layer.
    Step 3: print per-layer imbalance before → after, the policy decisions, planning and transfer
            overhead, the measured step time of both runs and the speed-up, check that the losses match,
            and print the command that opens the dashboard on the runs.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch

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

    @property
    def runs(self) -> tuple[str, ...]:
        pols = self.compare or (self.policy,)
        return (BASELINE,) + tuple(p for p in pols if p != BASELINE)

    @property
    def shape(self) -> dict:
        """Model and batch size: big enough that expert compute dominates a step (1024 tokens per rank, top-2,
        H 512, I 1024: ~80 % of a step is expert compute), small enough for two runs in 3 minutes on 2 cores."""
        if self.quick:
            return dict(num_experts=8, hidden=256, expert_hidden=512, layers=2, vocab=256, batch=2, seq=128)
        return dict(num_experts=8, hidden=512, expert_hidden=1024, layers=2, vocab=512, batch=4, seq=256)


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


def _rank_main(rank: int, world: int, settings: DemoSettings, policy: str, run_name: str | None) -> dict:
    """One run. ``policy="none-reordered"``: the unbalanced model fed each batch's sequences in reverse order
    (the same loss and gradients, summed in another order) — the fp32 reordering band the balanced run is
    judged against."""
    import torch.distributed as dist

    import ultraep
    from ultraep.config import BalancerConfig
    from ultraep.models import build_model
    from ultraep.telemetry import NullRecorder, Recorder

    sh = settings.shape
    model = build_model(settings.model, num_experts=sh["num_experts"], hidden=sh["hidden"],
                        expert_hidden=sh["expert_hidden"], layers=sh["layers"], vocab=sh["vocab"], seed=settings.seed)
    _structure(model, settings.model, world, sh["vocab"], strength=2.0, seed=settings.seed)
    reordered = policy == REORDERED
    config = BalancerConfig(policy=BASELINE if reordered else policy, num_redundant_slots=settings.slots)
    recorder = NullRecorder()
    if run_name is not None:
        try:
            recorder = Recorder.open(settings.out, run_name, kind=settings.mode, config=config, model=settings.model,
                                     world_size=world, rank=rank, extra={"demo": True, "policy": policy})
        except Exception as exc:  # telemetry never stops the demo
            print(f"ultraep demo: recording disabled ({exc})")
    ultraep.wrap(model, config, recorder=recorder)
    rt = ultraep.runtime_of(model)
    train = settings.mode == "train"
    opt = torch.optim.Adam(model.parameters(), lr=1e-3) if train else None
    masters = {id(p) for layer in rt.layers for p in layer.master_params()}
    losses, times, calls = [], [], []
    grad_sum = None
    progress = None
    if rank == 0:
        from rich.progress import Progress

        progress = Progress(transient=True)
        progress.start()
        task = progress.add_task(f"{policy:>8} ({settings.mode})", total=settings.steps)
    try:
        for step in range(settings.steps):
            ids = _tokens(step, rank, settings, world)
            if reordered:
                ids = ids.flip(0)
            dist.barrier(group=rt.group)
            t0 = time.perf_counter()
            if train:
                opt.zero_grad(set_to_none=True)
                logits = model(input_ids=ids).logits
                loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]),
                                                         ids[:, 1:].reshape(-1))
                loss.backward()
                for p in model.parameters():  # data parallel for everything but the masters (shared expert
                    if p.grad is not None and id(p) not in masters:  # submodules, e.g. a post-norm, included)
                        dist.all_reduce(p.grad)
                        p.grad /= world
                if step == 0:
                    grad_sum = _grad_checksum(model, rt, world)
                opt.step()
            else:
                with torch.no_grad():
                    logits = model(input_ids=ids).logits
                    loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]),
                                                             ids[:, 1:].reshape(-1))
            dt = time.perf_counter() - t0
            losses.append(float(loss.detach()))
            times.append(dt)
            rt.next_step(loss=losses[-1], step_time_s=dt)
            calls.extend((step, layer.layer, dict(layer.last_timings)) for layer in rt.layers)
            if progress is not None:
                progress.advance(task)
    finally:
        if progress is not None:
            progress.stop()
        recorder.close()
    return {"losses": losses, "times": times, "history": rt.history, "run_id": getattr(recorder, "run_id", None),
            "calls": calls, "grad_sum": grad_sum,
            "recording_errors": rt.recording_errors + int(getattr(recorder, "errors", 0) or 0)}


def _grad_checksum(model, rt, world: int) -> list[float]:
    """Step 0's gradients, summed per expert parameter over every rank's masters (the unbalanced model's
    full expert gradient) and per other parameter: what must be equal when the math is equal."""
    import torch.distributed as dist

    out = []
    for name, p in model.named_parameters():
        g = p.grad.detach().double() if p.grad is not None else torch.zeros_like(p, dtype=torch.float64)
        t = torch.stack([g.abs().sum(), g.pow(2).sum()])  # positive: a relative difference means something
        if ".experts." in name:  # masters: the group sums them into the full parameter's figure
            dist.all_reduce(t, group=rt.group)
        out.extend(t.tolist())
    return out


def run_demo(settings: DemoSettings) -> int:
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
    if settings.steps < 4:
        raise ConfigError("--steps", f"must be >= 4, got {settings.steps}", settings.steps)
    unknown = [p for p in settings.runs if p not in available_policies()]
    if unknown:
        raise ConfigError("--compare", f"unknown policy {unknown[0]!r}; choose from {', '.join(available_policies())}",
                          unknown[0])
    con = Console()
    if not con.is_terminal:  # logs and pipes: wide enough that tables and commands are not wrapped
        con = Console(width=140)
    preload()
    stamp = time.strftime("%Y%m%d-%H%M%S")
    runs = list(settings.runs)
    band = settings.mode == "train"  # the fp32 reordering band: a third, unrecorded run of none
    con.print(f"[bold]ultraep demo[/bold]: {settings.model}, {settings.ranks} ranks x 1 thread (gloo), "
              f"{settings.shape['batch'] * settings.shape['seq']} tokens/rank/step, {settings.steps} {settings.mode} "
              f"steps, policies {', '.join(runs)}{' (+ none reordered, for the fp32 band)' if band else ''}; "
              f"runs in {settings.out}/", soft_wrap=True)
    results = {}
    for policy in runs + ([REORDERED] if band else []):
        name = f"demo-{stamp}-{policy}" if policy != REORDERED else None
        t0 = time.perf_counter()
        out = launch(_rank_main, settings.ranks, settings, policy, name, threads_per_rank=1)
        results[policy] = (name, out, time.perf_counter() - t0)
    paid = _summary(con, settings, {k: v for k, v in results.items() if k != REORDERED})
    ok = _equality(con, settings, results)
    _activation_memory(con, settings, [v[0] for k, v in results.items() if k != REORDERED])
    con.print(paid, soft_wrap=True)
    con.print(f"open the dashboard on these runs:  [bold]ultraep dashboard {settings.out}[/bold]"
              f"   (or: make dashboard)", soft_wrap=True)
    return 0 if ok else 1


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
    a rounding difference — gives the same loss and the same gradients (relative <= 1e-6, fp32 summation
    order). Later steps are compared with the band two equivalent unbalanced runs (``none`` and ``none``
    with its gradient average rounded in another order) drift apart by in the same run."""
    base = results[BASELINE][1][0]
    ok = True
    band = None
    if REORDERED in results:
        band = _rel(base["losses"], results[REORDERED][1][0]["losses"])
    for policy, (_, out, _) in results.items():
        if policy in (BASELINE, REORDERED):
            continue
        r = out[0]
        step0 = max(float(_rel(base["losses"][:1], r["losses"][:1]).max()),
                    float(_rel(base["grad_sum"], r["grad_sum"]).max()) if base["grad_sum"] and r["grad_sum"] else 0.0)
        rel = _rel(base["losses"], r["losses"])
        same = step0 <= 1e-6
        ok &= same
        early = slice(1, min(4, len(rel)))
        where = ""
        if band is not None:
            where = (f"; two equivalent unbalanced runs (batch order reversed) differ by {band[early].max():.1e} in "
                     f"steps 1-3 and {band.max():.1e} by the end: Adam amplifies last-bit fp32 differences step "
                     "after step, so only step 0 can decide equality")
        verdict = ("match: balancing does not change the math" if same else
                   "MISMATCH: step 0 differs beyond fp32 summation order")
        con.print(f"{policy}: step 0 loss and gradients vs none: max relative difference {step0:.1e}; losses in "
                  f"steps 1-3: {rel[early].max() if len(rel) > 1 else 0.0:.1e}, by step {len(rel) - 1}: "
                  f"{rel.max():.1e}{where} -> {verdict}", soft_wrap=True)
    return ok


_PHASES = [  # (label, timing keys summed): exposed overheads of balancing, per layer call
    ("planning", ("plan_s",)),
    ("weight sync", ("weight_post_s", "relay_s", "weight_wait_s")),
    ("gradient reduction", ("grad_post_s", "grad_wait_s", "grad_reduce_s", "restore_s", "recompute_s")),
]


def _per_call(out: list, warm: int) -> dict:
    """``{(step, layer): [timings of each rank]}`` after the warm-up steps."""
    calls: dict = {}
    for o in out:
        for step, layer, t in o["calls"]:
            if step >= warm:
                calls.setdefault((step, layer), []).append(t)
    return calls


def _summary(con, settings: DemoSettings, results: dict) -> str:
    """Tables; returns the closing lines (whether balancing paid and why)."""
    from rich.table import Table

    warm = min(10, settings.steps // 3)
    none_calls = _per_call(results[BASELINE][1], warm)
    train = settings.mode == "train"

    def expert_s(ts):  # the busiest rank's expert compute of one layer call (forward and backward)
        return max(t.get("experts_s", 0.0) + (t.get("backward_compute_s", 0.0) if train else 0.0) for t in ts)

    none_expert = np.mean([expert_s(ts) for ts in none_calls.values()]) if none_calls else 0.0
    table = Table(title=f"per MoE layer (rank 0's plans; steps {warm}..{settings.steps - 1})")
    for c in ["run", "layer", "imbalance before -> after", "decisions", "replicas", "expert compute ms "
              "(busiest rank)", "exposed overhead ms: plan / weight sync / grad reduction", "predicted / measured "
              "layer ms (median |error|)"]:
        table.add_column(c, justify="right")
    steps = Table(title="measured step time (max over ranks, after warm-up)")
    for c in ["run", "run id", "step time p50 (s)", "speed-up vs none", "wall time (s)", "recording errors"]:
        steps.add_column(c, justify="right")
    t_none, best, lines = None, None, []
    for policy, (name, out, wall) in results.items():
        hist = [h for h in out[0]["history"] if h[0] >= warm]
        calls = _per_call(out, warm)
        for layer in sorted({h[1] for h in hist}):
            rows = [h for h in hist if h[1] == layer]
            shares: dict[str, int] = {}
            for h in rows:
                shares[h[2]] = shares.get(h[2], 0) + 1
            dec = ", ".join(f"{k} {100 * v / len(rows):.0f}%" for k, v in sorted(shares.items(), key=lambda kv: -kv[1]))
            lc = [ts for (s, la), ts in calls.items() if la == layer]
            exp_ms = 1e3 * np.mean([expert_s(ts) for ts in lc])
            over = [1e3 * np.mean([max(sum(t.get(k, 0.0) for k in keys) for t in ts) for ts in lc]) for _, keys in _PHASES]
            pred = np.array([ts[0].get("predicted_s", np.nan) for ts in lc])
            meas = np.array([max(t.get("measured_s", 0.0) for t in ts) for ts in lc])  # forward + backward
            err = np.nanmedian(np.abs(pred - meas) / meas) if len(meas) else np.nan
            table.add_row(policy if layer == 0 else "", str(layer),
                          f"{np.mean([h[3] for h in rows]):.2f} -> {np.mean([h[4] for h in rows]):.2f}", dec,
                          f"{np.mean([h[5] for h in rows]):.1f}", f"{exp_ms:.0f}", " / ".join(f"{v:.1f}" for v in over),
                          f"{1e3 * np.nanmedian(pred):.0f} / {1e3 * np.median(meas):.0f} ({100 * err:.0f} %)")
        table.add_section()
        per_step = np.max(np.array([o["times"] for o in out]), axis=0)[warm:]
        p50 = float(np.median(per_step))
        t_none = p50 if policy == BASELINE else t_none
        steps.add_row(policy, name, f"{p50:.3f}", f"{t_none / p50:.2f}x", f"{wall:.0f}",
                      str(sum(o["recording_errors"] for o in out)))
        if policy != BASELINE:
            saved = 1e3 * (none_expert - np.mean([expert_s(ts) for ts in calls.values()])) if calls else 0.0
            cost = sum(1e3 * np.mean([max(sum(t.get(k, 0.0) for k in keys) for t in ts) for ts in calls.values()])
                       for _, keys in _PHASES) if calls else 0.0
            speed = t_none / p50
            lines.append((speed, policy, saved, cost))
    con.print(table)
    con.print(steps)
    out_lines = []
    for speed, policy, saved, cost in lines:
        if speed >= 1.02 and saved <= 0:
            out_lines.append(f"{policy} ran {speed:.2f}x of none but saved no expert compute ({saved:.0f} ms per layer "
                             f"call): the difference is run-to-run noise, not balancing.")
        elif speed >= 1.02:
            out_lines.append(f"balancing paid: {policy} ran {speed:.2f}x faster than none: it saved {saved:.0f} ms of "
                             f"busiest-rank expert compute per layer call for {cost:.0f} ms of exposed overhead.")
        elif speed > 0.98:
            out_lines.append(f"balancing broke even: {policy} ran at {speed:.2f}x of none (saved {saved:.0f} ms of "
                             f"expert compute per layer call, paid {cost:.0f} ms of exposed overhead).")
        else:
            out_lines.append(f"balancing did not pay: {policy} ran at {speed:.2f}x of none: {cost:.0f} ms of exposed "
                             f"overhead per layer call outweighed the {saved:.0f} ms of expert compute it saved.")
    return "\n".join(out_lines)

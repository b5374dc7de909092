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


@dataclass(frozen=True)
class DemoSettings:
    model: str = "qwen3-moe"
    policy: str = "adaptive"
    mode: str = "train"
    ranks: int = 2
    steps: int = 60
    out: str = "runs"
    quick: bool = False
    seed: int = 0
    slots: int = 2

    @property
    def shape(self) -> dict:
        """Model and batch size: big enough that expert compute dominates a step, small enough for 2 cores."""
        if self.quick:
            return dict(num_experts=8, hidden=256, expert_hidden=512, layers=2, vocab=256, batch=2, seq=128)
        return dict(num_experts=8, hidden=384, expert_hidden=768, layers=3, vocab=512, batch=2, seq=128)


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
        from ultraep.adapters import adapter_for

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


def _rank_main(rank: int, world: int, settings: DemoSettings, policy: str, run_name: str) -> dict:
    import torch.distributed as dist

    import ultraep
    from ultraep.config import BalancerConfig
    from ultraep.models import build_model
    from ultraep.telemetry import NullRecorder, Recorder

    sh = settings.shape
    model = build_model(settings.model, num_experts=sh["num_experts"], hidden=sh["hidden"],
                        expert_hidden=sh["expert_hidden"], layers=sh["layers"], vocab=sh["vocab"], seed=settings.seed)
    _structure(model, settings.model, world, sh["vocab"], strength=2.0, seed=settings.seed)
    config = BalancerConfig(policy=policy, num_redundant_slots=settings.slots)
    try:
        recorder = Recorder.open(settings.out, run_name, kind=settings.mode, config=config, model=settings.model,
                                 world_size=world, rank=rank, extra={"demo": True, "policy": policy})
    except Exception as exc:  # telemetry never stops the demo
        print(f"ultraep demo: recording disabled ({exc})")
        recorder = NullRecorder()
    ultraep.wrap(model, config, recorder=recorder)
    rt = ultraep.runtime_of(model)
    train = settings.mode == "train"
    opt = torch.optim.Adam(model.parameters(), lr=1e-3) if train else None
    losses, times = [], []
    progress = None
    if rank == 0:
        from rich.progress import Progress

        progress = Progress(transient=True)
        progress.start()
        task = progress.add_task(f"{policy:>8} ({settings.mode})", total=settings.steps)
    try:
        for step in range(settings.steps):
            ids = _tokens(step, rank, settings, world)
            dist.barrier(group=rt.group)
            t0 = time.perf_counter()
            if train:
                opt.zero_grad(set_to_none=True)
                logits = model(input_ids=ids).logits
                loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]),
                                                         ids[:, 1:].reshape(-1))
                loss.backward()
                for name, p in model.named_parameters():  # data parallel for everything but the masters
                    if p.grad is not None and ".experts." not in name:
                        dist.all_reduce(p.grad)
                        p.grad /= world
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
            if progress is not None:
                progress.advance(task)
    finally:
        if progress is not None:
            progress.stop()
        recorder.close()
    return {"losses": losses, "times": times, "history": rt.history, "run_id": getattr(recorder, "run_id", None),
            "recording_errors": rt.recording_errors + int(getattr(recorder, "errors", 0) or 0)}


def run_demo(settings: DemoSettings) -> int:
    from rich.console import Console
    from rich.table import Table

    from ultraep.launch import launch
    from ultraep.models import FAMILIES, preload

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
    con = Console()
    if not con.is_terminal:  # logs and pipes: wide enough that tables and commands are not wrapped
        con = Console(width=140)
    preload()
    stamp = time.strftime("%Y%m%d-%H%M%S")
    con.print(f"[bold]ultraep demo[/bold]: {settings.model}, {settings.ranks} ranks x 1 thread (gloo), "
              f"{settings.steps} {settings.mode} steps, policy none then {settings.policy}; runs in {settings.out}/")
    results = {}
    for policy in ("none", settings.policy):
        name = f"demo-{stamp}-{policy}"
        t0 = time.perf_counter()
        out = launch(_rank_main, settings.ranks, settings, policy, name, threads_per_rank=1)
        results[policy] = (name, out, time.perf_counter() - t0)
    _summary(con, settings, results)
    a, b = results["none"][1][0]["losses"], results[settings.policy][1][0]["losses"]
    a, b = np.array(a), np.array(b)
    rel = np.abs(a - b) / np.maximum(np.abs(a), 1e-12)
    ok = float(rel.max()) <= 1e-3
    first = int(np.argmax(rel > 1e-5)) if (rel > 1e-5).any() else None
    con.print(f"losses of the two runs: max relative difference {rel.max():.1e}"
              + (f" (first above 1e-5 at step {first}: fp32 summation order, amplified by training)" if first is not None
                 else "") + f" -> {'match: balancing does not change the math' if ok else 'MISMATCH'}", soft_wrap=True)
    con.print(f"open the dashboard on these runs:  [bold]ultraep dashboard {settings.out}[/bold]"
              f"   (or: make dashboard)", soft_wrap=True)
    return 0 if ok else 1


def _summary(con, settings: DemoSettings, results: dict) -> None:
    from rich.table import Table

    warm = min(3, settings.steps // 4)
    none_hist = np.array([h[:2] + h[3:] for h in results["none"][1][0]["history"]], dtype=object)
    pol = settings.policy
    hist = results[pol][1][0]["history"]
    layers = sorted({h[1] for h in hist})
    table = Table(title=f"per MoE layer, rank 0's view, mean over {settings.steps} steps")
    for c in ["layer", "imbalance without balancing", f"imbalance after ({pol})", "decisions",
              "replicas / step", "planning ms", "transfer ms"]:
        table.add_column(c, justify="right")
    for layer in layers:
        rows = [h for h in hist if h[1] == layer]
        before = np.mean([h[3] for h in rows])
        after = np.mean([h[4] for h in rows])
        shares: dict[str, int] = {}
        for h in rows:
            shares[h[2]] = shares.get(h[2], 0) + 1
        dec = ", ".join(f"{k} {100 * v / len(rows):.0f}%" for k, v in sorted(shares.items(), key=lambda kv: -kv[1]))
        table.add_row(str(layer), f"{before:.2f}", f"{after:.2f}", dec, f"{np.mean([h[5] for h in rows]):.1f}",
                      f"{1e3 * np.mean([h[6] for h in rows]):.2f}", f"{1e3 * np.mean([h[7] for h in rows]):.2f}")
    con.print(table)
    del none_hist
    steps = Table(title="measured step time (max over ranks, after warm-up)")
    for c in ["run", "run id", "step time p50 (s)", "speed-up vs none", "wall time (s)", "recording errors"]:
        steps.add_column(c, justify="right")
    t_none = None
    for policy, (name, out, wall) in results.items():
        per_step = np.max(np.array([o["times"] for o in out]), axis=0)[warm:]
        p50 = float(np.median(per_step))
        t_none = p50 if policy == "none" else t_none
        steps.add_row(policy, name, f"{p50:.3f}", f"{t_none / p50:.2f}x", f"{wall:.0f}",
                      str(sum(o["recording_errors"] for o in out)))
    con.print(steps)


"""Synthetic routing traces: target initial imbalance, drift, bursts and domain shifts, vectorised.

Popularity follows :func:`ultraep.sim.workload.power_law_popularity` (UltraEP's recipe: a power law over a
random order of home ranks and over each rank's local experts). Each token includes expert ``e`` with
probability ``π_e = 1 − exp(−c·w_e)``, with ``c`` solved so that ``Σ_e π_e = k`` (top-k without
replacement, the inclusion approximation of the UltraEP generator); counts are binomial draws, so a
1000-step, 60-layer EP256 trace takes seconds. The exponent of every layer is found by bisection on the
*expected* rank-level imbalance, so layer ``l`` starts near its target.

Non-stationarity, per layer and step ``t`` (all deterministic given ``seed``):

* **drift**: the popularity pattern moves by ``drift`` ranks per step (in whole-rank jumps at
  ``floor(drift · t)``, which keeps every step's imbalance at the layer's target), so the hot experts
  wander from rank to rank and a placement made from past load goes stale;
* **bursts**: with probability ``burst_prob`` per step a random expert's weight is multiplied by
  ``burst_factor`` for ``burst_len`` steps;
* **domain shifts**: every ``domain_shift_every`` steps the popularity of the ranks' expert blocks is
  re-dealt by a new random permutation of the ranks (a new data domain with other hot experts, as
  OLMoE's per-domain counts show), again keeping the imbalance level.

Microbatches of a step share the popularity and differ by sampling noise.

Legend: T steps, B microbatches, L layers, R source ranks, E experts, k top-k.
"""

from __future__ import annotations

from typing import Callable

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, model_validator

from ultraep.errors import ConfigError
from ultraep.limits import check_bound, check_memory, check_synthetic_trace, check_work, limit
from ultraep.sim.workload import fit_popularity, solve_inclusion

from .trace import Trace, TraceMeta


class SyntheticSpec(BaseModel):
    """Settings of a synthetic trace."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    num_ranks: int = Field(ge=1, description="Source ranks (R).")
    num_experts: int = Field(ge=1, description="Logical experts per layer (E); a multiple of num_ranks.")
    num_layers: int = Field(default=1, ge=1, description="MoE layers (L).")
    num_steps: int = Field(default=100, ge=1, description="Steps (T).")
    microbatches: int = Field(default=1, ge=1, description="Microbatches per step (B).")
    top_k: int = Field(default=8, ge=1, description="Experts per token (k).")
    tokens_per_rank: int = Field(default=8192, ge=1, description="Tokens each source rank routes per microbatch.")
    imbalance: tuple[float, float] = Field(
        default=(2.0, 2.0), description="Initial rank-level imbalance targets (max/mean), spread over the layers."
    )
    drift: float = Field(default=0.0, ge=0.0, description="Ranks the popularity pattern moves per step.")
    burst_prob: float = Field(default=0.0, ge=0.0, le=1.0, description="Chance per step and layer of a burst.")
    burst_factor: float = Field(default=8.0, ge=1.0, description="Weight multiplier of a bursting expert.")
    burst_len: int = Field(default=5, ge=1, description="Steps a burst lasts.")
    domain_shift_every: int = Field(default=0, ge=0, description="Steps between domain shifts (0 = never).")
    per_source: bool = Field(default=False, description="Record per-source-rank counts (else global counts).")
    seed: int = Field(default=0, ge=0, description="Random seed.")

    @model_validator(mode="after")
    def _check(self, info: ValidationInfo) -> "SyntheticSpec":
        # Sane bounds first (machine independent); memory and work are checked by synthetic_trace, on the machine
        # that generates. ``model_validate(..., context={"names": {"num_ranks": "--ranks", ...}})`` renames fields.
        names = (info.context or {}).get("names") if info is not None else None
        for field, low, cap, why in (("num_ranks", 1, "MAX_RANKS", "source ranks"),
                                     ("num_experts", 1, "MAX_EXPERTS", "experts per layer"),
                                     ("num_layers", 1, "MAX_LAYERS", "MoE layers"),
                                     ("num_steps", 1, "MAX_STEPS", "trace step ids are int32"),
                                     ("microbatches", 1, "MAX_MICROBATCHES", "trace microbatch ids have 20 bits"),
                                     ("tokens_per_rank", 1, "MAX_TOTAL_TOKENS", "tokens per rank"),
                                     ("burst_len", 1, "MAX_STEPS", "steps")):
            check_bound((names or {}).get(field, f"synthetic.{field}"), getattr(self, field), low, cap, why)
        if self.tokens_per_rank * self.num_ranks > limit("MAX_TOTAL_TOKENS"):
            raise ConfigError((names or {}).get("tokens_per_rank", "synthetic.tokens_per_rank"),
                              f"({self.tokens_per_rank:,}) x {self.num_ranks:,} ranks exceeds limits.MAX_TOTAL_TOKENS "
                              f"({int(limit('MAX_TOTAL_TOKENS')):,}, exact in float64)", self.tokens_per_rank)
        if self.num_experts % self.num_ranks:
            raise ConfigError("synthetic.num_experts", f"num_experts ({self.num_experts}) must be a multiple of "
                              f"num_ranks ({self.num_ranks})", self.num_experts)
        if self.top_k > self.num_experts:
            raise ConfigError("synthetic.top_k", f"top_k ({self.top_k}) must be <= num_experts ({self.num_experts})",
                              self.top_k)
        lo, hi = self.imbalance
        if not 1.0 <= lo <= hi:
            raise ConfigError("synthetic.imbalance", f"needs 1.0 <= low <= high, got {self.imbalance}", self.imbalance)
        return self


def layer_weights(spec: SyntheticSpec, layer: int, target: float) -> np.ndarray:
    """``[T, E]`` popularity of one layer over the steps (drift, bursts, domain shifts applied)."""
    T, E, R = spec.num_steps, spec.num_experts, spec.num_ranks
    M = E // R
    rng = np.random.default_rng([spec.seed, layer, 1])
    base = fit_popularity(R, E, spec.top_k, target, seed=int(rng.integers(2**31)))
    t = np.arange(T)
    # Rank block each step reads its experts' weights from: domain shift permutation, then drift.
    if spec.domain_shift_every > 0:
        seg = t // spec.domain_shift_every
        perms = np.stack([np.arange(R)] + [rng.permutation(R) for _ in range(int(seg.max()))])[seg]  # [T, R]
    else:
        perms = np.broadcast_to(np.arange(R), (T, R))
    shift = np.floor(spec.drift * t).astype(np.int64) if spec.drift > 0 else np.zeros(T, dtype=np.int64)
    src_rank = np.take_along_axis(perms, (np.arange(R)[None, :] - shift[:, None]) % R, axis=1)  # [T, R]
    idx = (src_rank[:, :, None] * M + np.arange(M)[None, None, :]).reshape(T, E)
    w = base[idx]
    # Bursts.
    if spec.burst_prob > 0:
        starts = np.flatnonzero(rng.random(T) < spec.burst_prob)
        experts = rng.integers(E, size=starts.size)
        boost = np.ones((T, E))
        for t0, e in zip(starts, experts):
            boost[t0:t0 + spec.burst_len, e] *= spec.burst_factor
        w = w * boost
    return w / w.sum(axis=1, keepdims=True)


def layer_targets(spec: SyntheticSpec) -> np.ndarray:
    """``[L]`` initial imbalance target of every layer: evenly spaced in the range, shuffled by seed."""
    lo, hi = spec.imbalance
    targets = np.linspace(lo, hi, spec.num_layers)
    return np.random.default_rng([spec.seed, 7]).permutation(targets)


def synthetic_trace(spec: SyntheticSpec, *, progress: Callable[[int, int], None] | None = None,
                    names: dict[str, str] | None = None) -> Trace:
    """Generate the trace described by ``spec``.

    Memory and work are checked first (:func:`ultraep.limits.check_synthetic_trace`; ``names`` renames the
    fields in its messages). ``progress(done, total)`` is called as (point, layer) cells are sampled, in
    blocks of steps, so a bar can advance and Ctrl-C is honoured between blocks; sampling row by row in
    step order draws the same numbers as one call, so the result does not depend on the blocks.
    """
    check_synthetic_trace(spec, names=names)
    T, B, L, R, E, k = (spec.num_steps, spec.microbatches, spec.num_layers, spec.num_ranks, spec.num_experts,
                        spec.top_k)
    targets = layer_targets(spec)
    P = T * B
    if spec.per_source:
        counts = np.empty((P, L, R, E), dtype=np.int64)
    else:
        counts = np.empty((P, L, E), dtype=np.int64)
    # steps per block: about 2^22 sampled cells, at least one step
    block = max(1, (1 << 22) // max(1, B * E * (R if spec.per_source else 1)))
    for layer in range(L):
        w = layer_weights(spec, layer, float(targets[layer]))  # [T, E]
        rng = np.random.default_rng([spec.seed, layer, 2])
        for t0 in range(0, T, block):
            t1 = min(T, t0 + block)
            pi_P = np.repeat(solve_inclusion(w[t0:t1], k), B, axis=0)  # [(t1 - t0) * B, E]
            p0, p1 = t0 * B, t1 * B
            if spec.per_source:
                counts[p0:p1, layer] = rng.binomial(spec.tokens_per_rank,
                                                    np.broadcast_to(pi_P[:, None, :], (p1 - p0, R, E)))
            else:
                counts[p0:p1, layer] = rng.binomial(spec.tokens_per_rank * R, pi_P)
            if progress is not None:
                progress(layer * P + p1, L * P)
    meta = TraceMeta(
        num_experts=E, num_ranks=R if spec.per_source else None, top_k=k, source="synthetic",
        description="synthetic: " + spec.model_dump_json(),
        # the EP size it was made for, also with global counts: `simulate` replays it on R ranks without --ranks
        extra={"layer_targets": targets.tolist(), "ep_size": R},
    )
    steps = np.repeat(np.arange(T), B)
    mbs = np.tile(np.arange(B), T)
    if spec.per_source:
        return Trace.from_rank_counts(counts, meta, steps=steps, microbatches=mbs)
    return Trace.from_global_counts(counts, meta, steps=steps, microbatches=mbs)


def resampled_trace(source: Trace, *, num_ranks: int, tokens_per_rank: int, num_steps: int,
                    steps_per_source_point: int = 1, seed: int = 0) -> Trace:
    """Per-rank routing drawn from a recorded trace's popularity, at a token count of your choosing.

    Real routing dumps often hold counts summed over many tokens (OLMoE's routing analysis: about 200 000 tokens per
    domain) where a question needs a few tokens per rank per step (one sequence of ~120 tokens per rank: where
    balancing cannot pay). Step ``t`` takes the popularity of the source's point ``t // steps_per_source_point``
    (cycling through the source's points in order: a domain shift each time), and every token of every rank draws
    its ``top_k`` distinct experts from it without replacement (Gumbel top-k: exactly sequential sampling
    proportional to popularity), so the counts carry the sampling noise of ``tokens_per_rank`` real tokens.

    ``source``: a trace with ``top_k`` set; all its layers are kept. Returns a trace with per-source counts
    ``[num_steps, L, num_ranks, E]``. Shapes: popularity ``[E]`` per layer and source point."""
    k, E = source.meta.top_k, source.meta.num_experts
    if k is None:
        raise ConfigError("top_k", "the source trace does not say its top_k; pass it to the importer (top_k=...)", None)
    if k > E:
        raise ConfigError("top_k", f"({k}) must be <= the trace's {E} experts", k)
    for name, v in (("num_ranks", num_ranks), ("tokens_per_rank", tokens_per_rank), ("num_steps", num_steps),
                    ("steps_per_source_point", steps_per_source_point)):
        if v < 1:
            raise ConfigError(name, f"must be >= 1, got {v}", v)
    layers = [int(x) for x in source.layers]
    L = len(layers)
    value = f"{num_steps:,} x {L:,} x {num_ranks:,} x {tokens_per_rank:,} x {E:,}"
    field = "num_steps x layers x num_ranks x tokens_per_rank x experts"
    # the counts [T, L, R, E] int64 and one rank's Gumbel keys [tokens, E] float64 at a time (with argpartition's)
    check_memory(field, value, 8.0 * num_steps * L * num_ranks * E + 3 * 8.0 * tokens_per_rank * E,
                 "the resampled counts and one rank's sampling keys")
    check_work(field, value, 30.0 * num_steps * L * num_ranks * tokens_per_rank * E, "the resampled trace")
    # popularity [points, L, E] of the source: every source rank's counts summed
    pop = np.stack([np.stack([load.sum(axis=0) for _, _, load in source.layer_loads(l, 1)]) for l in layers], axis=1)
    pop = pop.astype(np.float64)
    if (pop.sum(axis=2) <= 0).any():
        raise ConfigError("source", "a layer of the source trace routes no tokens at some point", None)
    rng = np.random.default_rng(seed)
    if ((pop > 0).sum(axis=2) < k).any():
        raise ConfigError("source", f"a layer of the source trace routes to fewer than top_k = {k} experts at some "
                          "point: no token could pick k distinct experts from it", k)
    counts = np.zeros((num_steps, L, num_ranks, E), dtype=np.int64)
    for t in range(num_steps):
        p = pop[(t // steps_per_source_point) % len(pop)]  # [L, E]
        with np.errstate(divide="ignore"):
            logp = np.log(p / p.sum(axis=1, keepdims=True))  # -inf: never chosen
        for j in range(L):
            for r in range(num_ranks):
                keys = logp[j] + rng.gumbel(size=(tokens_per_rank, E))  # [tokens, E]
                top = np.argpartition(-keys, k - 1, axis=1)[:, :k]  # [tokens, k] distinct experts per token
                counts[t, j, r] = np.bincount(top.reshape(-1), minlength=E)
    meta = TraceMeta(num_experts=E, num_ranks=num_ranks, top_k=k, model=source.meta.model, source="resampled",
                     description=f"resampled from {source.meta.source or 'a trace'}: {tokens_per_rank} tokens per "
                     f"rank per step, {steps_per_source_point} step(s) per source point, seed {seed}")
    return Trace.from_rank_counts(counts, meta, steps=np.arange(num_steps), microbatches=np.zeros(num_steps, np.int64),
                                  layers=layers)

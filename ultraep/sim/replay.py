"""The simulator: replay a routing trace through every policy with the cost model.

One code path plans online and offline: the simulator calls the same policy classes (``plan`` then
``commit``, per layer, in step order) and the same :class:`~ultraep.cost.CostModel` the engine uses, and
writes the same telemetry records (one run per policy, ``kind="simulation"``).

Per (step, microbatch, layer) and policy it keeps: imbalance before/after (max/mean of rank load; after =
what the cost model sees the ranks compute), replicas in use, bytes of expert state moved, the predicted
layer time and its terms, and the force-balanced ideal of the same step (:meth:`CostModel.ideal`).
Summaries per policy (:func:`summarise`): mean and p99 imbalance, replicas, transfer bytes, predicted time
per layer, % of the ideal (Σ ideal / Σ time, i.e. a throughput ratio) and speed-up over ``none``
(Σ time of none / Σ time).

**Plan budget.** Planning dominates the cost (the quota planner takes ~0.1-1 ms per plan at EP64-256 on
this CPU; every policy plans every replayed layer-step, ``adaptive`` reuses the other policies' plans).
``max_plans`` (default :data:`DEFAULT_MAX_PLANS`) caps the replayed layer-steps per policy by replaying
every ``k``-th (step, microbatch) point of each layer. Historical EPLB's ``interval`` and ``window`` are
counted in replayed points, so they are divided by ``k`` to keep covering the same stretch of the trace.

**Parallelism.** Layers are independent (every policy keeps per-layer history), so layers are split over
``workers`` forked processes; the progress bar counts replayed layer-steps.

Legend: R ranks, E experts, S slots per rank, P replayed points per layer.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import operator
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from ultraep.config import ALL_POLICIES, DEFAULT_MAX_PLANS, BalancerConfig  # noqa: F401 - re-exported
from ultraep.cost import CostBreakdown, CostModel, CostParams
from ultraep.engine import Engine
from ultraep.errors import ConfigError
from ultraep.plan import Plan
from ultraep.policies import BASELINE, get_policy_class, is_chooser, make_policy, option_default
from ultraep.presets import get_preset
from ultraep.traces import Trace

#: the cost model's predicted terms kept per row, under the CostBreakdown's own names (the names the engine
#: records as ``predicted.<term>`` and the runtime measures): no translation between vocabularies
TERM_FIELDS = tuple(f.name for f in dataclasses.fields(CostBreakdown)
                    if f.name.endswith("_s") and f.name != "total_s") + ("token_straggler",)
#: act_*: bytes of expert activations a rank holds for the call (rows it computes x the expert's activation width
#: x dtype): the busiest rank's without (before) and with (after) the plan, and the mean rank's
ROW_FIELDS = ("step", "microbatch", "layer", "imbalance_before", "imbalance_after", "replicas", "transfer_bytes",
              "time_s", "ideal_s", "scheme_ideal_s", *TERM_FIELDS, "act_busiest_before", "act_busiest_after", "act_mean")
#: simulator-only names of a policy with fixed options, replayed as their own run next to the base policy:
#: ``<name>+`` is the policy with its one-shot options (``one_shot_options``: what it plans with when it has no
#: history); ``eplb+`` is the UltraEP paper's EPLB+ baseline (DeepSeek EPLB fed the exact current load)
VARIANTS: dict[str, tuple[str, dict]] = {
    f"{n}+": (n, dict(get_policy_class(n).one_shot_options)) for n in ALL_POLICIES
    if getattr(get_policy_class(n), "one_shot_options", None)}
#: every policy the simulator replays, each variant right after its base policy
SIM_POLICIES = tuple(x for n in ALL_POLICIES for x in (n, *(v for v, (b, _) in VARIANTS.items() if b == n)))


def sim_params(**fields) -> CostParams:
    """The simulator's cost-model parameters (``fields`` over the defaults).

    Replica weights are charged as the ultraep runtime moves them (its replica cache, ``docs/design.md``): a
    replica stays valid on its rank until its master changes, and the replay hands the engine which replicas
    are resident (:func:`replay_layer`), so a plan pays for exactly its non-resident replicas. In training the
    optimizer changes the masters every step, so every replica is sent again at the first microbatch of a
    step, historical ``eplb`` included; in prefill a placement that does not change moves nothing.
    ``resend_all_replicas=True`` charges every replica each microbatch instead (a runtime without a cache)."""
    return CostParams(**fields)


def build_cost_model(preset: str, num_ranks: int, num_experts: int, num_redundant_slots: int = 2, *,
                     overrides: dict | None = None, params: CostParams | None = None) -> CostModel:
    """Preset (with overrides) → topology for the EP group → cost model (``params`` default: :func:`sim_params`)."""
    pre = get_preset(preset, overrides)
    topo = pre.topology(num_ranks, num_experts, num_redundant_slots)
    params = params if params is not None else sim_params()
    if pre.scale_out_shared and not params.scale_out_shared:  # the preset's link is one per domain
        params = params.model_copy(update={"scale_out_shared": True})
    return CostModel(topo, pre.hardware, pre.expert, params)


@dataclass
class SimulationResult:
    """Rows per policy (``{policy: {field: [n] array}}``), adaptive decisions, summaries, settings."""

    policies: list[str]
    rows: dict[str, dict[str, np.ndarray]]
    decisions: dict[str, list] = field(default_factory=dict)
    plans: dict[str, list] = field(default_factory=dict)
    settings: dict[str, Any] = field(default_factory=dict)

    def summary(self) -> list[dict[str, Any]]:
        return summarise(self.rows, self.policies, step_fixed_s=self.settings.get("step_fixed_s", 0.0))

    def per_layer(self, metric: str = "time_s") -> dict[str, dict[int, float]]:
        """``{policy: {layer: Σ metric}}``."""
        out = {}
        for pol in self.policies:
            r = self.rows[pol]
            layers = np.unique(r["layer"])
            out[pol] = {int(l): float(r[metric][r["layer"] == l].sum()) for l in layers}
        return out


def summarise(rows: dict[str, dict[str, np.ndarray]], policies, step_fixed_s: float = 0.0) -> list[dict[str, Any]]:
    """One dict per policy with the headline figures (see the module docstring). ``step_fixed_s``: a fixed cost per
    replayed step (the rest of an iteration: layers not replayed, optimizer, data-parallel reduction) added to the
    time and the ideals of ``pct_of_ideal``, ``pct_of_scheme_ideal`` and ``speedup_vs_none``, so that a gain in the
    replayed layers is weighed against the whole iteration."""
    fixed = {p: step_fixed_s * np.unique(rows[p]["step"]).size for p in policies} if step_fixed_s else {}
    base = rows.get(BASELINE)
    base_t = float(base["time_s"].sum()) + fixed.get(BASELINE, 0.0) if base is not None else 0.0
    out = []
    for pol in policies:
        r = rows[pol]
        n = len(r["time_s"])
        f = fixed.get(pol, 0.0)
        t = float(r["time_s"].sum()) + f
        out.append({
            "policy": pol,
            "layer_steps": n,
            "imbalance_before": float(r["imbalance_before"].mean()) if n else 1.0,
            "imbalance_before_p99": float(np.percentile(r["imbalance_before"], 99)) if n else 1.0,
            "imbalance_after": float(r["imbalance_after"].mean()) if n else 1.0,
            "imbalance_after_p99": float(np.percentile(r["imbalance_after"], 99)) if n else 1.0,
            "replicas": float(r["replicas"].mean()) if n else 0.0,
            "transfer_bytes": float(r["transfer_bytes"].sum()),
            "transfer_bytes_per_layer": float(r["transfer_bytes"].mean()) if n else 0.0,
            "time_per_layer_ms": (t - f) / n * 1e3 if n else 0.0,
            "ideal_per_layer_ms": float(r["ideal_s"].sum()) / n * 1e3 if n else 0.0,
            "pct_of_ideal": 100.0 * (float(r["ideal_s"].sum()) + f) / t if t > 0 else 100.0,
            "pct_of_scheme_ideal": 100.0 * (float(r["scheme_ideal_s"].sum()) + f) / t if t > 0 else 100.0,
            "speedup_vs_none": base_t / t if (base is not None and t > 0) else float("nan"),
            "gemm_straggler_ms": float(r["gemm_straggler_s"].mean()) * 1e3 if n else 0.0,
            "token_straggler": float(r["token_straggler"].mean()) if n else 0.0,
            # expert activations per rank: the busiest rank's peak over the calls, without and with balancing, and
            # the mean rank's mean (what a rank must reserve vs what it holds on average)
            "activation_peak_before_MB": float(r["act_busiest_before"].max()) / 1e6 if n else 0.0,
            "activation_peak_after_MB": float(r["act_busiest_after"].max()) / 1e6 if n else 0.0,
            "activation_mean_MB": float(r["act_mean"].mean()) / 1e6 if n else 0.0,
        })
    return out


# ---------------------------------------------------------------------------------------------- replay
class _Shared:
    """One policy instance shared by the engines of a replayed layer. The standalone engine of a policy and the
    adaptive engine weighing it as a candidate see one history, and a plan for one load is made once:
    ``plan`` returns the plan already made for this very load array and topology (policies plan purely; history
    advances only in ``commit``), and ``commit`` of the plan committed last (or a copy of it) is a no-op."""

    def __init__(self, policy) -> None:
        object.__setattr__(self, "_inner", policy)
        object.__setattr__(self, "_made", (None, None, None, None))  # (load, topology, resident, plan)
        object.__setattr__(self, "_committed", None)
        object.__setattr__(self, "_advanced", None)  # the load advance() folded last

    def plan(self, load_RE, topology, **kw):
        resident = kw.pop("resident_RE", None)
        if kw:  # anything else beyond (load, topology): no sharing
            return self._inner.plan(load_RE, topology, resident_RE=resident, **kw)
        load, topo, res, plan = self._made
        if load is not load_RE or topo is not topology or res is not resident:
            plan = (self._inner.plan(load_RE, topology) if resident is None
                    else self._inner.plan(load_RE, topology, resident_RE=resident))
            object.__setattr__(self, "_made", (load_RE, topology, resident, plan))
        return plan

    def commit(self, plan) -> None:
        last = self._committed
        # a copy of one plan (the engine hands a plan over with its residency's transfers) commits once
        if last is None or plan.quota_RS is not last.quota_RS or plan.info is not last.info:
            object.__setattr__(self, "_committed", plan)
            self._inner.commit(plan)

    def advance(self, load_RE) -> None:
        """A load the chooser did not plan this policy for: its history advances once, unless its own engine
        already committed a plan of this very load (engines commit before the choosers do)."""
        last = self._committed
        if (last is None or last.load_RE is not load_RE) and self._advanced is not load_RE:
            object.__setattr__(self, "_advanced", load_RE)
            self._inner.advance(load_RE)

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def __setattr__(self, name, value) -> None:
        setattr(self._inner, name, value)


class _PointCostModel(CostModel):
    """The cost model, with predictions memoised per plan object and the ideal per load array for the replayed
    point at hand (:meth:`next_point` forgets them): the adaptive engine weighs plans the standalone engines
    have just predicted. Plans and loads are immutable, so a hit is the same prediction."""

    def _cache(self) -> None:
        super()._cache()
        self._memo: dict = {}

    def next_point(self) -> None:
        self._memo.clear()

    def _once(self, key, obj, fn):
        hit = self._memo.get(key)
        if hit is None or hit[0] is not obj:  # keyed by id(): the object itself confirms the hit
            hit = self._memo[key] = (obj, fn())
        return hit[1]

    def predict(self, plan: Plan, **kw) -> CostBreakdown:
        if set(kw) - {"sync_s"}:
            return super().predict(plan, **kw)
        # keyed by the arrays and info a plan shares with its copies (the engine hands each policy's plan over
        # with the transfers of its own residency: a copy, equal when the residency is)
        key = (id(plan.quota_RS), id(plan.info), kw.get("sync_s"), plan.engine_s, plan.planner_s, plan.sync_s)
        hit = self._memo.get(key)
        if hit is None or not _same_plan(hit[0], plan):
            hit = self._memo[key] = (plan, super().predict(plan, **kw))
        return hit[1]

    def ideal(self, load_RE: np.ndarray) -> CostBreakdown:
        return self._once(("ideal", id(load_RE)), load_RE, lambda: super(_PointCostModel, self).ideal(load_RE))

    def full_sync_time(self, plan: Plan) -> float:
        return self._once(("full_sync", id(plan)), plan, lambda: super(_PointCostModel, self).full_sync_time(plan))

    def weight_sync_time(self, plan: Plan) -> float:
        return self._once(("sync", id(plan)), plan, lambda: super(_PointCostModel, self).weight_sync_time(plan))


def _same_plan(a: Plan, b: Plan) -> bool:
    if a is b:
        return True
    if a.quota_RS is not b.quota_RS or a.info is not b.info or a.phy2log_RS is not b.phy2log_RS:
        return False
    ta, tb = a.transfers, b.transfers
    return ta is tb or (len(ta) == len(tb) and all(np.array_equal(getattr(ta, f), getattr(tb, f))
                                                   for f in ("expert", "src", "dst", "bytes", "stage")))


def resident_of(plan: Plan) -> np.ndarray | None:
    """``[R, E]`` bool: the ranks holding weights of an expert after ``plan`` ran (its replicas; None if none)."""
    rep = plan.replicas
    if not len(rep.rank):
        return None
    t = plan.topology
    out = np.zeros((t.num_ranks, t.num_experts), dtype=bool)
    out[rep.rank, np.repeat(np.arange(t.num_experts), np.diff(rep.ptr))] = True
    return out


class _Sink:
    """The recorder an engine records into during a replay (workers are forked processes; :func:`record` writes
    the telemetry runs afterwards): every ``keep_every``-th plan, and the decisions of a choosing policy."""

    def __init__(self, keep_every: int, decisions: bool) -> None:
        self.keep_every = keep_every
        self.keep_decisions = decisions
        self.count = 0
        self.plans: list = []
        self.decisions: list = []

    def record_plan(self, step: int, microbatch: int, layer: int, plan: Plan) -> None:
        if self.keep_every and self.count % self.keep_every == 0:  # a fresh copy: lazy derived arrays stay behind
            self.plans.append((step, microbatch, layer, dataclasses.replace(plan)))
        self.count += 1

    def record_decision(self, step: int, microbatch: int, layer: int, *, policy: str, reason: str,
                        predictions: dict, chosen_predicted_s: float) -> None:
        if self.keep_decisions:
            self.decisions.append((step, microbatch, layer, policy, reason, predictions, chosen_predicted_s))


def _kind(name: str) -> str:
    """The registered policy a simulated name runs (a variant's base policy)."""
    return VARIANTS.get(name, (name, {}))[0]


def _engines(names, cm: CostModel, layer: int, stride: int, policy_options: dict | None, keep_every: int):
    """One :class:`~ultraep.engine.Engine` per simulated policy for ``layer`` (choosers last: a policy that
    chooses among others, :func:`~ultraep.policies.is_chooser`), over shared policy instances (:class:`_Shared`),
    each recording into its own :class:`_Sink`."""
    from ultraep.config import _DEFAULTS

    t = cm.topology
    opts = {k: dict(v) for k, v in (policy_options or {}).items()}
    choosers = [n for n in names if is_chooser(_kind(n))]
    chooser_opts = {n: opts.pop(n, {}) for n in choosers}
    candidates = {n: tuple(o.pop("candidates", option_default(_kind(n), "candidates"))) for n, o in chooser_opts.items()}
    shared: dict[str, _Shared] = {}
    for n in dict.fromkeys([*names, *(c for cs in candidates.values() for c in cs)]):
        if n in choosers:
            continue
        kind, fixed = VARIANTS.get(n, (n, {}))
        o = {**fixed, **opts.get(n, {})}
        cls = get_policy_class(kind)
        if stride > 1:  # options counted in replayed points: keep their stretch in steps
            for k in getattr(cls, "step_count_options", ()):
                o[k] = max(1, round(o.get(k, option_default(kind, k)) / stride))
        if getattr(cls, "needs_cost_model", False):
            o.setdefault("cost_model", cm)
        shared[n] = _Shared(make_policy(kind, **o))
    M = t.num_masters
    engines, sinks = {}, {}
    for n in sorted(names, key=lambda x: x in choosers):
        kind = _kind(n)
        if n in choosers:
            c_opts = chooser_opts[n]
            # replayed layers are predicted, not measured: a probe could only lose (the model is the outcome
            # here); screened candidates are still re-planned every probe_every decisions
            if "probe_max_loss" in inspect.signature(get_policy_class(kind).__init__).parameters:
                c_opts.setdefault("probe_max_loss", 0.0)
            pol = make_policy(kind, policies={c: shared[c] for c in candidates[n]}, cost_model=cm, **c_opts)
        else:
            pol = shared[n]
        # the config gives the engine its configured name and is validated against the group; the replayed
        # topology itself is handed over as is (slots beyond what a config allows still replay, as planned)
        # (the layer's options given explicitly: the engine then looks them up instead of building defaults)
        cfg = BalancerConfig(policy=kind, num_redundant_slots=min(t.num_redundant_slots, (t.D - 1) * M),
                             domain_size=t.D, layers={layer: _DEFAULTS[kind]()})
        sinks[n] = _Sink(keep_every, decisions=n in choosers)
        engines[n] = Engine(cfg, t, cost_model=cm, recorder=sinks[n], record_timings=False,
                            layer_topologies={layer: t}, policy_factory=lambda _layer, p=pol: p)
    return engines, sinks


_TERMS = operator.attrgetter(*TERM_FIELDS)


def _row(plan: Plan, bd: CostBreakdown, ideal: CostBreakdown, scheme: CostBreakdown, transfer_bytes: float,
         step: int, mb: int, layer: int, row_bytes: float) -> tuple:
    # rows each rank computes under the plan: the cost model's (HybridEP computes some tokens elsewhere), else quotas
    after = bd.rank_tokens_R if bd.rank_tokens_R is not None else plan.rank_load_after_R
    return (step, mb, layer, plan.imbalance_before, bd.imbalance, plan.num_replicas, transfer_bytes, bd.total_s,
            ideal.total_s, scheme.total_s, *_TERMS(bd), row_bytes * float(plan.rank_load_before_R.max()),
            row_bytes * float(after.max()), row_bytes * float(after.mean()))


def _scheme_ideal(plan: Plan, cm: "_PointCostModel", load: np.ndarray, ideal: CostBreakdown) -> CostBreakdown:
    """The force-balanced ideal of the plan's transmission scheme: plain EP's, or that of its expert-domain overlay
    (:meth:`~ultraep.cost.CostModel.scheme_ideal`) when the plan moves expert weights across domains."""
    dom = plan.expert_domains
    if dom is None:
        return ideal
    return cm._once(("scheme", id(load), dom), load, lambda: cm.scheme_ideal(load, dom))


def _transfer_bytes(plan: Plan, cm: CostModel) -> float:
    dom = plan.expert_domains
    if dom is not None:
        return float(cm.allgather_bytes_R(dom.size, dom.compression, dom.fetched).sum())
    if plan.sync_s is not None or (cm.params.resend_all_replicas and plan.num_replicas):  # every replica moves
        return float(cm.replica_tree(plan).bytes.sum())
    return float(plan.transfers.bytes.sum()) if len(plan.transfers) else 0.0


def replay_layer(trace: Trace, layer: int, cm: CostModel, names, *, stride: int = 1, policy_options=None,
                 keep_plan_every: int = 0, tick: Callable[[int], None] | None = None) -> dict[str, Any]:
    """Replay one layer of ``trace`` through ``names``, one engine each (decide, then commit, per point in step
    order); return its rows, decisions and kept plans."""
    cm = _PointCostModel(cm.topology, cm.hardware, cm.expert, cm.params)
    t = cm.topology
    engines, sinks = _engines(names, cm, layer, stride, policy_options, keep_plan_every)
    rows = {n: [] for n in names}
    count = pending = 0
    # Residency as the runtime's replica cache keeps it: a replica stays valid until its master changes. The
    # optimizer changes the masters once per training step, so only the replicas of the previous microbatch of
    # the same step are resident then; prefill never changes them. (One array for "nothing resident", shared by
    # every engine, so that policies shared between engines plan it once.)
    nothing = np.zeros((t.num_ranks, t.num_experts), dtype=bool)
    row_bytes = float(cm.expert.activation_row_bytes)
    held: dict[str, tuple[int, np.ndarray | None]] = {}
    keep = cm.params.mode == "prefill"
    for step, mb, load in trace.layer_loads(layer, t.num_ranks, point_stride=stride):
        cm.next_point()
        ideal = cm.ideal(load)
        decided = []
        for n, eng in engines.items():
            s0, res = held.get(n, (None, None))
            d = eng.decide(step, mb, layer, load, res if res is not None and (keep or s0 == step) else nothing)
            decided.append((n, eng, d))
            rows[n].append(_row(d.plan, d.predicted, ideal, _scheme_ideal(d.plan, cm, load, ideal),
                                _transfer_bytes(d.plan, cm), step, mb, layer, row_bytes))
        for n, eng, d in decided:
            eng.commit(d)
            held[n] = (step, resident_of(d.plan))
        count += 1
        pending += 1
        if tick is not None and pending >= 8:
            tick(pending)
            pending = 0
    if tick is not None and pending:
        tick(pending)
    out_rows = {}
    for n in names:
        arr = np.asarray(rows[n], dtype=np.float64).reshape(-1, len(ROW_FIELDS))
        out_rows[n] = {f: arr[:, j] for j, f in enumerate(ROW_FIELDS)}
        for f in ("step", "microbatch", "layer", "replicas"):
            out_rows[n][f] = out_rows[n][f].astype(np.int64)
    decisions = {n: sink.decisions for n, sink in sinks.items() if sink.keep_decisions}  # the choosers'

    return {"layer": layer, "rows": out_rows, "decisions": decisions, "plans": {n: sinks[n].plans for n in names},
            "count": count}


# ---------------------------------------------------------------------------------------------- driver
_WORK: dict[str, Any] = {}


def _worker(layer: int) -> dict[str, Any]:
    w = _WORK
    q = w.get("queue")
    return replay_layer(w["trace"], layer, w["cm"], w["names"], stride=w["stride"], policy_options=w["options"],
                        keep_plan_every=w["keep"], tick=(lambda n: q.put(n)) if q is not None else None)


def plan_stride(num_points: int, num_layers: int, max_plans: int | None) -> int:
    """Smallest point stride that keeps ``points / stride * layers <= max_plans``."""
    if not max_plans or num_points * num_layers <= max_plans:
        return 1
    return int(math.ceil(num_points * num_layers / max_plans))


def _replayed_names(policies) -> tuple[list[str], list[str]]:
    """``(replayed, reported)`` simulator names: the baseline is replayed first when not asked for (the speed-up
    figures are measured against it) but reported only when asked for."""
    names = list(dict.fromkeys(policies))
    unknown = [n for n in names if n not in SIM_POLICIES]
    if unknown:
        raise ConfigError("policies", f"unknown policy {unknown[0]!r}; available: {', '.join(SIM_POLICIES)}", unknown[0])
    if BASELINE in names:
        return names, names
    return [BASELINE, *names], names


def simulate(trace: Trace, cm: CostModel, policies=ALL_POLICIES, *, layers=None, max_plans: int | None = DEFAULT_MAX_PLANS,
             stride: int | None = None, workers: int = 1, policy_options: dict | None = None,
             keep_plans: int = 0, progress: bool | Callable = False, step_fixed_s: float = 0.0) -> SimulationResult:
    """Replay ``trace`` through ``policies`` on the cluster of ``cm``.

    Args:
        layers: layer ids to replay (default all).
        max_plans: replayed layer-steps per policy at most (sets the point stride; ignored with ``stride``).
        stride: replay every ``stride``-th (step, microbatch) point.
        workers: forked processes (layers are split among them).
        policy_options: ``{policy: {option: value}}`` (``adaptive`` accepts ``candidates`` and its options).
        keep_plans: keep about this many plans per policy (evenly spread) for recording (0 = none).
        progress: ``True`` for a rich progress bar, or a callable ``f(done, total)``.
        step_fixed_s: fixed seconds per replayed step outside the replayed layers (see :func:`summarise`).
    """
    names, report = _replayed_names(policies)
    t = cm.topology
    if trace.meta.num_experts != t.num_experts:
        raise ConfigError("experts", f"the trace has {trace.meta.num_experts} experts but the topology "
                          f"{t.num_experts}", t.num_experts)
    # every replayed point densifies a [R, E] load and plans it with each policy: refuse what cannot fit now,
    # not in a worker after the pool started
    from ultraep.limits import check_plan, check_trace_densify

    check_trace_densify(t.num_ranks, trace.meta.num_ranks, t.num_experts)
    check_plan(t.num_ranks, t.num_experts, t.num_redundant_slots, policies=len(names),
               names={"num_ranks": "ranks", "num_experts": "experts", "num_redundant_slots": "slots"})
    all_layers = [int(x) for x in trace.layers]
    if layers is not None:
        missing = sorted(set(int(x) for x in layers) - set(all_layers))
        if missing:
            raise ConfigError("layers", f"layer {missing[0]} is not in the trace (layers: {all_layers[:10]}...)",
                              missing[0])
        all_layers = [int(x) for x in layers]
    n_points = len(trace.points())
    if stride is None:
        stride = plan_stride(n_points, len(all_layers), max_plans)
    stride = max(1, int(stride))
    per_layer = len(range(0, n_points, stride))
    total = per_layer * len(all_layers)
    keep_every = max(1, math.ceil(total / keep_plans)) if keep_plans else 0
    # compile the planners (or load numba's cache) now, after every size check and before anything is
    # timed: a refusal never waits for a cold compile, and no replayed plan carries one (issue 15 item 3)
    from ultraep.planning import warm_up

    warm_up()
    t0 = time.perf_counter()
    results = []
    bar, advance = _progress(progress, total)
    try:
        workers = max(1, min(int(workers), len(all_layers)))
        if workers == 1:
            for layer in all_layers:
                results.append(replay_layer(trace, layer, cm, names, stride=stride, policy_options=policy_options,
                                            keep_plan_every=keep_every, tick=advance))
        else:
            results = _run_pool(trace, cm, names, stride, policy_options, keep_every, all_layers, workers, advance)
    finally:
        if bar is not None:
            bar.stop()
    results.sort(key=lambda r: r["layer"])
    rows = {n: {f: np.concatenate([r["rows"][n][f] for r in results]) for f in ROW_FIELDS} for n in names}
    decisions = {k: [d for r in results for d in r["decisions"][k]] for k in dict.fromkeys(
        k for r in results for k in r["decisions"])}  # the choosers' (every layer's result lists each)
    plans = {n: [p for r in results for p in r["plans"][n]] for n in names}
    settings = {
        "topology": t.name, "num_ranks": t.num_ranks, "num_experts": t.num_experts,
        "num_redundant_slots": t.num_redundant_slots, "domain_size": t.D, "layers": all_layers,
        "points": n_points, "stride": stride, "layer_steps_per_policy": total, "workers": workers,
        "wall_s": time.perf_counter() - t0, "mode": cm.params.mode, "max_plans": max_plans,
        "dedup_top_k": cm.params.dedup_top_k, "step_fixed_s": float(step_fixed_s), "resend_all_replicas": cm.params.resend_all_replicas,
        "reported": report,
    }
    return SimulationResult(names, rows, decisions, plans, settings)


def _progress(progress, total):
    if callable(progress):
        done = [0]

        def adv(n):
            done[0] += n
            progress(done[0], total)
        return None, adv
    if not progress:
        return None, None
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

    bar = Progress(TextColumn("simulating"), BarColumn(), MofNCompleteColumn(), TextColumn("layer-steps"),
                   TimeElapsedColumn(), TimeRemainingColumn(), transient=False)
    task = bar.add_task("sim", total=total)
    bar.start()
    return bar, (lambda n: bar.advance(task, n))


def _run_pool(trace, cm, names, stride, options, keep_every, layers, workers, advance):
    import multiprocessing as mp
    import queue as _queue

    ctx = mp.get_context("fork")
    q = ctx.Queue() if advance is not None else None
    _WORK.update(trace=trace, cm=cm, names=names, stride=stride, options=options, keep=keep_every, queue=q)
    try:
        with ctx.Pool(workers) as pool:
            pending = pool.map_async(_worker, layers, chunksize=1)
            while not pending.ready():
                if q is not None:
                    try:
                        advance(q.get(timeout=0.2))
                    except _queue.Empty:
                        pass
                else:
                    pending.wait(0.2)
            results = pending.get()
            if q is not None:
                while True:
                    try:
                        advance(q.get_nowait())
                    except _queue.Empty:
                        break
    finally:
        _WORK.clear()
    return results

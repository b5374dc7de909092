"""The policy engine: one policy per MoE layer, every decision recorded with its predictions.

The runtime (and anything else that balances online) asks the engine, per layer and microbatch:

    decision = engine.decide(step, microbatch, layer, load_RE)   # plan + prediction + reason, recorded
    ... run the layer with decision.plan ...
    engine.commit(decision)                                       # policy history advances
    engine.observe(step, microbatch, layer, {"compute_fwd_s": ..., "a2a_fwd_s": ...})  # calibration

Recording has one path, :meth:`Engine.record` (plan, decision, timings, transfer times): ``decide`` calls it at
once by default (the simulator, tests); the runtime builds its engine with ``record_on_decide=False`` and calls
it when a call is measured (after its backward), with the plan whose transfers really moved.

Each layer gets its own policy instance from :class:`~ultraep.config.BalancerConfig` (history is per
layer), on the topology with that layer's redundant-slot count. ``adaptive`` layers choose among their
candidates with the cost model (:mod:`ultraep.policies.adaptive`); fixed layers report their own
prediction. ``observe`` folds measured timings into the cost model (:class:`~ultraep.cost.Calibrator`,
EWMA of log ratios) and records each prediction next to the measurement.
"""

from __future__ import annotations

import sys
import types
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from pydantic import BaseModel

from ultraep.config import BalancerConfig
from ultraep.cost import Calibrator, CostBreakdown, CostModel, excess_of, with_excess
from ultraep.load import validate_load
from ultraep.plan import Plan
from ultraep.policies import get_policy_class, make_policy, plan_resident
from ultraep.topology import Topology


@dataclass(frozen=True)
class Decision:
    """What the engine decided for one layer and microbatch."""

    step: int
    microbatch: int
    layer: int
    configured: str
    chosen: str
    reason: str
    predictions: dict[str, float]
    predicted: CostBreakdown
    plan: Plan = field(repr=False)


class Engine:
    """Per-layer policies, predictions, recording and calibration: the one decide → commit → observe loop,
    used by the runtime's balanced layers and by anything else that balances online.

    Args:
        config: the validated balancer config (checked against the topology here).
        topology: the EP group; per-layer slot overrides derive from it.
        cost_model: the cost model (default: built from the topology's preset). Its scales are calibrated
            from every layer's measurements (one hardware, one set of scales); each layer predicts with its
            own topology and expert geometry.
        recorder: a telemetry recorder (``Recorder`` / ``NullRecorder``) or ``None``.
        calibration_alpha: EWMA weight of the calibrator (the first observations weigh 1/n, a running mean).
        layer_topologies, layer_experts: per-layer topology / :class:`~ultraep.presets.ExpertSpec` (the
            runtime's layers may differ); layers not listed derive from ``topology`` and the cost model.
        record_timings: record predictions (and calibration rows) as timing rows; the runtime turns this off
            and puts them into its own per-call timing row.
        record_on_decide: :meth:`decide` records the plan and decision right away (tests, the simulator); False:
            the caller records each call with :meth:`record` once it measured it (the runtime, after the call's
            backward, with the plan whose transfers really moved and the call's timings).
        record_plans: record plans and decisions (False: only timings; the runtime's ranks other than 0, since
            plans are identical on every rank).
        policy_factory: ``layer -> policy`` used instead of building the layer's policy from ``config`` (the
            simulator replays several engines side by side and shares policy instances between them, so a
            plan the adaptive engine also weighs is made once); ``config`` still gives slots and the name.
    """

    def __init__(self, config: BalancerConfig, topology: Topology, *, cost_model: CostModel | None = None,
                 recorder=None, calibration_alpha: float = 0.2, layer_topologies: dict[int, Topology] | None = None,
                 layer_experts: dict | None = None, record_timings: bool = True,
                 policy_factory: Callable[[int], Any] | None = None, record_on_decide: bool = True,
                 record_plans: bool = True) -> None:
        config.validate_for(topology.num_ranks, topology.num_masters)
        self.config = config
        self.topology = topology
        self.calibrator = Calibrator(cost_model or CostModel(topology), calibration_alpha,
                                     recorder if record_timings else None)
        self.recorder = recorder
        self.record_timings = record_timings
        self.record_on_decide = record_on_decide
        self.record_plans = record_plans
        self._policies: dict[int, Any] = {}
        self._topologies: dict[int, Topology] = dict(layer_topologies or {})
        self._experts: dict[int, Any] = dict(layer_experts or {})
        self._models: dict[int, CostModel] = {}
        self._pending: dict[tuple[int, int, int], tuple[CostBreakdown, str]] = {}
        self._factory = policy_factory

    @property
    def cost_model(self) -> CostModel:
        return self.calibrator.model

    def cost_model_for(self, layer: int) -> CostModel:
        """The calibrated cost model of ``layer`` (its topology and expert geometry, the shared scales)."""
        cm = self._models.get(layer)
        if cm is None:
            base = self.cost_model
            topo = self.topology_for(layer)
            expert = self._experts.get(layer, base.expert)
            cm = base if (base.topology == topo and expert is base.expert) else CostModel(
                topo, base.hardware, expert, base.params)
            self._models[layer] = cm
        return cm

    def topology_for(self, layer: int) -> Topology:
        t = self._topologies.get(layer)
        if t is None:
            n = self.config.slots_for(layer)
            t = self.topology if n == self.topology.num_redundant_slots else self.topology.with_slots(n)
            self._topologies[layer] = t
        return t

    def policy_for(self, layer: int):
        pol = self._policies.get(layer)
        if pol is None and self._factory is not None:
            pol = self._policies[layer] = self._factory(layer)
        if pol is None:
            opts = self.config.layer_options(layer)
            kwargs = opts.policy_options()
            if getattr(get_policy_class(opts.kind), "needs_cost_model", False):  # the policy says what it needs
                kwargs["cost_model"] = self.cost_model_for(layer)
            if "candidates" in kwargs:  # a policy choosing among others plans them with the configured options
                kwargs["candidates"] = tuple(kwargs["candidates"])
                kwargs["candidate_options"] = {c: getattr(self.config, c).policy_options()
                                               for c in kwargs["candidates"] if isinstance(getattr(
                                                   self.config, c, None), BaseModel)}
            pol = self._policies[layer] = make_policy(opts.kind, **kwargs)
        return pol

    def decide(self, step: int, microbatch: int, layer: int, load_RE, resident_RE=None) -> Decision:
        """Plan ``layer`` for this microbatch, predict it, record plan, decision and prediction.

        ``resident_RE`` (bool ``[R, E]``, optional): which ranks already hold valid weights of which experts
        (the runtime's replica cache). The plan's transfers are then exactly the replicas that are not
        resident, and policies that can prefer resident replicas see it
        (:func:`~ultraep.policies.plan_resident`); without it a plan lists the transfers its policy chose."""
        topo = self.topology_for(layer)
        load = validate_load(load_RE, topo.num_ranks, topo.num_experts, path=f"layers.{layer}.load")
        pol = self.policy_for(layer)
        plan = plan_resident(pol, load, topo, resident_RE)
        cm = self.cost_model_for(layer)
        known = getattr(pol, "breakdown_of", None)  # a policy that predicted exactly this plan hands it over
        bd = known(plan, cm) if known is not None else None
        if bd is None:
            bd = cm.predict(plan)
        # the time the call stands for: the terms, and the calls' mean over them (the same for every candidate, so
        # added after the choice; :func:`~ultraep.cost.with_excess`)
        excess = cm.params.excess_s
        bd = with_excess(bd, excess)
        kind = self.config.layer_options(layer).kind
        d = plan.decision
        if d is not None:
            chosen, reason, preds = d.chosen, d.reason, {k: v + excess_of(v, excess) for k, v in d.predictions.items()}
        else:
            chosen, reason, preds = kind, f"configured policy {kind}", {kind: bd.total_s}
        self._pending[(step, microbatch, layer)] = (bd, chosen)
        if len(self._pending) > 4096:  # bounded: forget the oldest unobserved predictions
            self._pending.pop(next(iter(self._pending)))
        decision = Decision(step, microbatch, layer, kind, chosen, reason, preds, bd, plan)
        if self.record_on_decide and self.recorder is not None:
            self.record(decision, timings={"predicted_s": bd.total_s, **{
                f"predicted.{k}": v for k, v in bd.as_dict().items() if k.endswith("_s")}} if self.record_timings
                else None)
        return decision

    def record(self, decision: Decision, *, plan: Plan | None = None, timings: dict[str, float] | None = None,
               transfer_seconds=None) -> None:
        """The one recording path of a layer call (the runtime's layers and the simulator's replays alike): its
        plan (``plan``: the one that ran, default the decision's) and decision where this engine records plans,
        its ``timings`` row, and the measured seconds of its transfers (aligned with ``plan.transfers``)."""
        rec = self.recorder
        if rec is None:
            return
        step, mb, layer = decision.step, decision.microbatch, decision.layer
        plan = decision.plan if plan is None else plan
        if self.record_plans:
            rec.record_plan(step, mb, layer, plan)
            rec.record_decision(step, mb, layer, policy=decision.chosen, reason=decision.reason,
                                predictions=decision.predictions, chosen_predicted_s=decision.predicted.total_s)
        if timings is not None:
            rec.record_timings(step, mb, layer, timings)
        if transfer_seconds is not None and len(plan.transfers):
            rec.record_transfer_times(step, mb, layer, transfer_seconds)

    def commit(self, decision: Decision) -> None:
        """Accept the decision: the layer's policy history advances."""
        self.policy_for(decision.layer).commit(decision.plan)

    def observe(self, step: int, microbatch: int, layer: int, measured: dict[str, float],
                measured_total_s: float | None = None, *, rank_compute_s: dict | None = None) -> list[dict]:
        """Fold measured timings (keys like ``compute_fwd_s``, ``a2a_fwd_s``, ``weight_sync_s``) into the
        cost model; return (and record) the prediction next to each measurement. ``measured_total_s``: the
        whole layer's measured time, which a policy that chooses among candidates keeps per candidate.
        ``rank_compute_s``: every rank's measured compute (``{"compute_fwd_s": [R], "compute_bwd_s": [R]}``), which
        the compute parameters are fitted over (:meth:`~ultraep.cost.Calibrator.observe`)."""
        pending = self._pending.pop((step, microbatch, layer), None)
        if pending is None:
            return []
        bd, chosen = pending
        rows = self.calibrator.observe(bd, measured, step=step, microbatch=microbatch, layer=layer,
                                       total_s=measured_total_s, rank_compute_s=rank_compute_s, policy=chosen)
        self._models.clear()
        for lay, pol in self._policies.items():  # policies that predict use the calibrated model
            _refresh(pol, self.cost_model_for(lay))
        if measured_total_s is not None and bd.terms_s > 0:  # (the terms: an excess never hides a measurement)
            rows.append({"term": "total_s", "predicted_s": bd.total_s, "measured_s": float(measured_total_s),
                         "ratio": float(measured_total_s / bd.total_s)})
            outcome = getattr(self.policy_for(layer), "observe_outcome", None)
            if outcome is not None:
                outcome(chosen, bd.terms_s, float(measured_total_s))  # (as the candidates are compared)
        return rows


def _refresh(pol, cm: CostModel) -> None:
    if getattr(pol, "cost_model", None) is not None:
        pol.cost_model = cm
    for sub in getattr(pol, "policies", {}).values():
        _refresh(sub, cm)


# ------------------------------------------------------------------------------------------- what it holds
# The engine decides every layer call of a run (10^4-10^5 steps times the layers); anything it kept per call would grow
# without end (issue 56, item 6). :func:`footprint` counts what an object holds, so that tests/test_engine_state.py
# and benchmarks/bench_long.py can check the engine's state after N decisions and after 10 N.
_LEAVES = (str, bytes, int, float, complex, bool, type(None), np.generic)
_SKIP = (types.ModuleType, types.FunctionType, types.BuiltinFunctionType, types.MethodType, type)


def footprint(obj) -> tuple[int, int]:
    """``(items, bytes)`` held by ``obj`` and everything reachable from it (each object counted once)."""
    seen: set[int] = set()
    items = size = 0
    todo = [obj]
    while todo:
        o = todo.pop()
        if isinstance(o, _LEAVES) or isinstance(o, _SKIP) or id(o) in seen:
            continue
        seen.add(id(o))
        if isinstance(o, np.ndarray):
            items += int(o.size)
            size += int(o.nbytes)
            continue
        size += sys.getsizeof(o, 0)
        if isinstance(o, dict):
            items += len(o)
            todo.extend(o.keys())
            todo.extend(o.values())
        elif isinstance(o, (list, tuple, set, frozenset, deque)):
            items += len(o)
            todo.extend(o)
        else:
            if hasattr(o, "__dict__"):
                todo.append(vars(o))
            for cls in type(o).__mro__:
                for name in getattr(cls, "__slots__", ()):
                    if isinstance(name, str) and hasattr(o, name):
                        todo.append(getattr(o, name))
    return items, size

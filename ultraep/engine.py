"""The policy engine: one policy per MoE layer, every decision recorded with its predictions.

The runtime (and anything else that balances online) asks the engine, per layer and microbatch:

    decision = engine.decide(step, microbatch, layer, load_RE)   # plan + prediction + reason, recorded
    ... run the layer with decision.plan ...
    engine.commit(decision)                                       # policy history advances
    engine.observe(step, microbatch, layer, {"compute_fwd_s": ..., "a2a_fwd_s": ...})  # calibration

Each layer gets its own policy instance from :class:`~ultraep.config.BalancerConfig` (history is per
layer), on the topology with that layer's redundant-slot count. ``adaptive`` layers choose among their
candidates with the cost model (:mod:`ultraep.policies.adaptive`); fixed layers report their own
prediction. ``observe`` folds measured timings into the cost model (:class:`~ultraep.cost.Calibrator`,
EWMA of log ratios) and records each prediction next to the measurement.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ultraep.config import BalancerConfig
from ultraep.cost import Calibrator, CostBreakdown, CostModel
from ultraep.load import validate_load
from ultraep.plan import Plan
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
    """Per-layer policies, predictions, recording and calibration.

    Args:
        config: the validated balancer config (checked against the topology here).
        topology: the EP group; per-layer slot overrides derive from it.
        cost_model: the cost model (default: built from the topology's preset).
        recorder: a telemetry recorder (``Recorder`` / ``NullRecorder``) or ``None``.
        calibration_alpha: EWMA weight of the calibrator.
    """

    def __init__(self, config: BalancerConfig, topology: Topology, *, cost_model: CostModel | None = None,
                 recorder=None, calibration_alpha: float = 0.2) -> None:
        config.validate_for(topology.num_ranks, topology.num_masters)
        self.config = config
        self.topology = topology
        self.calibrator = Calibrator(cost_model or CostModel(topology), calibration_alpha, recorder)
        self.recorder = recorder
        self._policies: dict[int, Any] = {}
        self._topologies: dict[int, Topology] = {}
        self._pending: dict[tuple[int, int, int], CostBreakdown] = {}

    @property
    def cost_model(self) -> CostModel:
        return self.calibrator.model

    def _model_for(self, topo: Topology) -> CostModel:
        cm = self.cost_model
        return cm if cm.topology == topo else cm.__class__(topo, cm.hardware, cm.expert, cm.params)

    def topology_for(self, layer: int) -> Topology:
        t = self._topologies.get(layer)
        if t is None:
            n = self.config.slots_for(layer)
            t = self.topology if n == self.topology.num_redundant_slots else self.topology.with_slots(n)
            self._topologies[layer] = t
        return t

    def policy_for(self, layer: int):
        pol = self._policies.get(layer)
        if pol is None:
            from ultraep.policies import make_policy

            opts = self.config.layer_options(layer)
            kwargs = opts.policy_options()
            cm = self._model_for(self.topology_for(layer))
            if opts.kind == "hybridep":
                kwargs["cost_model"] = cm
            elif opts.kind == "adaptive":
                kwargs["cost_model"] = cm
                kwargs["candidates"] = tuple(kwargs["candidates"])
                kwargs["candidate_options"] = {
                    c: getattr(self.config, c).policy_options() for c in ("quota", "eplb") if c in kwargs["candidates"]
                }
            pol = self._policies[layer] = make_policy(opts.kind, **kwargs)
        return pol

    def decide(self, step: int, microbatch: int, layer: int, load_RE) -> Decision:
        """Plan ``layer`` for this microbatch, predict it, record plan, decision and prediction."""
        topo = self.topology_for(layer)
        load = validate_load(load_RE, topo.num_ranks, topo.num_experts, path=f"layers.{layer}.load")
        pol = self.policy_for(layer)
        plan = pol.plan(load, topo)
        cm = self._model_for(topo)
        bd = cm.predict(plan)
        kind = self.config.layer_options(layer).kind
        a = plan.info.get("adaptive")
        if a is not None:
            chosen, reason, preds = a["chosen"], a["reason"], dict(a["predictions"])
        else:
            chosen, reason, preds = kind, f"configured policy {kind}", {kind: bd.total_s}
        self._pending[(step, microbatch, layer)] = bd
        if len(self._pending) > 4096:  # bounded: forget the oldest unobserved predictions
            self._pending.pop(next(iter(self._pending)))
        rec = self.recorder
        if rec is not None:
            rec.record_plan(step, microbatch, layer, plan)
            rec.record_decision(step, microbatch, layer, policy=chosen, reason=reason, predictions=preds,
                                chosen_predicted_s=bd.total_s)
            rec.record_timings(step, microbatch, layer, {"predicted_s": bd.total_s, **{
                f"predicted.{k}": v for k, v in bd.as_dict().items() if k.endswith("_s")}})
        return Decision(step, microbatch, layer, kind, chosen, reason, preds, bd, plan)

    def commit(self, decision: Decision) -> None:
        """Accept the decision: the layer's policy history advances."""
        self.policy_for(decision.layer).commit(decision.plan)

    def observe(self, step: int, microbatch: int, layer: int, measured: dict[str, float]) -> list[dict]:
        """Fold measured timings (keys like ``compute_fwd_s``, ``a2a_fwd_s``, ``weight_sync_s``) into the
        cost model; return (and record) the prediction next to each measurement."""
        bd = self._pending.pop((step, microbatch, layer), None)
        if bd is None:
            return []
        rows = self.calibrator.observe(bd, measured, step=step, microbatch=microbatch, layer=layer)
        cm = self.cost_model
        for pol in self._policies.values():  # policies that predict use the calibrated model
            _refresh(pol, cm)
        return rows


def _refresh(pol, cm: CostModel) -> None:
    if getattr(pol, "cost_model", None) is not None:
        old = pol.cost_model
        pol.cost_model = cm if cm.topology == old.topology else CostModel(old.topology, cm.hardware, cm.expert, cm.params)
        if hasattr(pol, "_models"):
            pol._models.clear()
    for sub in getattr(pol, "policies", {}).values():
        _refresh(sub, cm)


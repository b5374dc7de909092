"""The adaptive engine's candidates and what each declares about itself.

A chooser never compares policy names (``tests/test_policy_names.py``): it asks each candidate's class. The
one that declares ``fallback`` (``none``: does nothing, always on time) is always planned; a ``screenable``
one (a stateless planner on the critical path: ``quota``) may be skipped when it cannot pay for its planner;
one with a ``placement_interval`` (a historical placement: ``eplb``) sends all its replicas when switched to;
``planner_exposed = False`` (FEPLB's CPU thread) hides its planning behind compute.
"""

from __future__ import annotations

from ultraep.errors import ConfigError
from ultraep.plan import Plan

from .base import plan_with_residency
from .registry import BASELINE, get_policy_class, make_policy


class Candidates:
    """Named candidate policy instances (``policies``, in order) and the facts they declare.

    Args:
        policies: name -> instance (ready instances shared with a caller, or built by :meth:`build`).
    """

    def __init__(self, policies: dict) -> None:
        self.policies = dict(policies)
        found = [n for n, p in self.policies.items() if getattr(p, "fallback", False)]
        if not found:
            names = list(self.policies)
            raise ConfigError("adaptive.candidates", f"must include {BASELINE!r} (the fallback), got {names}", names)
        self.fallback = found[0]
        self._made: dict = {}  # this decision's plans and predictions (:meth:`begin`, :meth:`plan`, :meth:`predict`)

    @classmethod
    def build(cls, candidates, candidate_options: dict | None, cost_model) -> "Candidates":
        """The candidate instances from their names and options (a candidate that needs a cost model gets it)."""
        names = list(candidates)
        choosers = [n for n in names if getattr(get_policy_class(n), "chooses_among_policies", False)]
        if choosers:
            raise ConfigError("adaptive.candidates", f"cannot include a policy that chooses among others "
                              f"({choosers[0]!r})", names)
        opts = candidate_options or {}
        unknown = sorted(set(opts) - set(names))
        if unknown:
            raise ConfigError(f"adaptive.candidate_options.{unknown[0]}", f"is not a candidate ({names})", unknown[0])
        policies = {}
        for n in names:
            o = dict(opts.get(n, {}))
            if cost_model is not None and getattr(get_policy_class(n), "needs_cost_model", False):
                o.setdefault("cost_model", cost_model)
            policies[n] = make_policy(n, **o)
        return cls(policies)

    def declares(self, name: str, attr: str, default=False):
        return getattr(self.policies.get(name), attr, default)

    def screenable(self, name: str) -> bool:
        return bool(self.declares(name, "screenable"))

    def can_rest(self, name: str) -> bool:
        """Whether ``name``'s history can advance without a plan (it has ``advance``): only then may it go unplanned."""
        return callable(getattr(self.policies[name], "advance", None))

    def switches(self, name: str, current: str | None) -> bool:
        """Whether running ``name`` while ``current`` is in force switches to a historical placement (``name``
        declares a ``placement_interval``): all its replicas are then sent once."""
        return self.declares(name, "placement_interval", None) is not None and current != name

    def exposed_planner_s(self, cm, name: str) -> float:
        """Planner latency on the critical path (0 for a candidate whose policy says its planner is not on it,
        like FEPLB, which plans on a CPU thread under static compute)."""
        if not self.declares(name, "planner_exposed", True):
            return 0.0
        return cm.params.planner_s.get(name, self.declares(name, "planner_s", 0.0)) * cm.params.plan_scale

    def begin(self) -> None:
        """A new decision: forget the last one's plans and predictions (:meth:`plan`, :meth:`predict`)."""
        self._made = {}

    def plan(self, name: str, load_RE, topology, resident_RE) -> Plan:
        """``name``'s plan of this decision's load (:func:`~.base.plan_with_residency`; planning is pure until
        ``commit``), made once per decision. Why: a rest (Step 0, 0b) plans the policy in force to see whether the
        decision may rest; where it may not, the weighing takes that plan, and its predictions, as they are."""
        got = self._made.get(name)
        if got is None or got[0] is not load_RE or got[1] is not resident_RE:
            got = self._made[name] = (load_RE, resident_RE,
                                      plan_with_residency(self.policies[name], load_RE, topology, resident_RE))
        return got[2]

    def ideal_s(self, cm, load_RE) -> float:
        """The force-balanced ideal's predicted time of this decision's load on ``cm`` (:meth:`~ultraep.cost.CostModel.
        ideal`), made once per decision: an idle decision that does not rest weighs on the same load."""
        key = ("ideal", id(cm))
        got = self._made.get(key)
        if got is None or got[0] is not cm or got[1] is not load_RE:
            got = self._made[key] = (cm, load_RE, cm.ideal(load_RE).total_s)
        return got[2]

    def predict(self, cm, name: str, plan: Plan, resident: bool, current: str | None):
        """The cost model's breakdown of ``name``'s plan: a historical placement that is not resident pays for
        sending all its replicas once; it then stays resident until its next re-placement, so that one-time cost
        is spread over the placement's ``placement_interval`` decisions (charging it to one decision would make a
        switch never pay). With ``resident`` the plan's transfers already are exactly what moves (the caller
        knows which replicas are resident): no switch cost is added. Kept for the decision (:meth:`begin`): the same
        plan on the same model is predicted once."""
        key = ("predict", name, id(cm), bool(resident), current)
        got = self._made.get(key)
        if got is not None and got[0] is cm and got[1] is plan:
            return got[2]
        if not self.switches(name, current) or resident or cm.params.resend_all_replicas:  # (resending all too)
            bd = cm.predict(plan)
        else:
            interval = max(1, int(self.declares(name, "placement_interval", 1)))
            bd = cm.predict(plan, sync_s=cm.weight_sync_time(plan) + cm.full_sync_time(plan) / interval)
        self._made[key] = (cm, plan, bd)
        return bd

"""``none``: no balancing. Every expert's tokens go to its master; no replicas, no transfers."""

from __future__ import annotations

import time

import numpy as np

from ultraep.plan import Plan
from ultraep.topology import Topology

from .base import Stateless, identity_plan


class NonePolicy(Stateless):
    """The identity plan (the baseline every other policy is measured against)."""

    name = "none"
    planner_s = 0.0  # nothing to plan

    def plan(self, load_RE: np.ndarray, topology: Topology) -> Plan:
        t0 = time.perf_counter()
        plan = identity_plan(self.name, topology, load_RE, planner_s=self.planner_s)
        object.__setattr__(plan, "solve_time_s", time.perf_counter() - t0)
        return plan

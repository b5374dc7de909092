"""``none``: no balancing. Every expert's tokens go to its master; no replicas, no transfers."""

from __future__ import annotations

import numpy as np

from ultraep.plan import Plan
from ultraep.topology import Topology

from .base import Stateless, identity_plan


class NonePolicy(Stateless):
    """The identity plan (the baseline every other policy is measured against)."""

    name = "none"
    planner_s = 0.0  # nothing to plan
    #: does nothing and is always on time: a chooser's fallback and the baseline (registry.BASELINE)
    fallback = True

    def plan(self, load_RE: np.ndarray, topology: Topology) -> Plan:
        return identity_plan(self.name, topology, load_RE, planner_s=self.planner_s)

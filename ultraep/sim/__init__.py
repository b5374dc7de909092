"""The simulator: replay recorded or imported routing traces through the policies with the cost model.

* :mod:`.replay` — ``simulate(trace, cost_model, policies)``: every policy decides and commits through the
  engine (:class:`~ultraep.engine.Engine`), each replayed point predicted by the cost model;
* :mod:`.record` — a simulation's results written as telemetry runs;
* :mod:`.workload` — synthetic loads (UltraEP's power-law recipe) and the fits behind the trace importers.
"""

from ultraep.sim.record import check_new_runs, record
from ultraep.sim.replay import (SIM_POLICIES, SimulationResult, build_cost_model, plan_stride, replay_layer, sim_params,
                                simulate)

__all__ = ["SIM_POLICIES", "SimulationResult", "build_cost_model", "check_new_runs", "plan_stride", "record",
           "replay_layer", "sim_params", "simulate"]

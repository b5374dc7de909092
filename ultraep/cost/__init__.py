"""The cost model: the predicted time of one MoE layer under a plan, and its calibration from measured timings.

One module per job, each importing only the ones listed before it (``tests/test_import_graph.py`` checks it):

- :mod:`ultraep.cost.params`: :class:`CostParams`, the coefficients (calibrated scales, modelling choices);
- :mod:`ultraep.cost.model`: :class:`CostModel` and its :class:`CostBreakdown` (the terms, ``docs/simulator.md``
  §3), the busiest rank under co-run slowdown and noise, the record a run keeps of its model;
- :mod:`ultraep.cost.fit`: :class:`ComputeFit`, every rank's measured compute fitted over the calls;
- :mod:`ultraep.cost.calibrator`: :class:`Calibrator`, which folds measured timings into the parameters.

The names below are re-exported here; a module's tunables (``FIT_UNEVEN``, ``FIT_SOLVE_EVERY``, ``HISTORY_ROWS``,
...) are read from, and set on, their own module.
"""

from ultraep.cost.params import CostParams
from ultraep.cost.model import (CostBreakdown, CostModel, corun_finish, cost_model_from_record, cost_record,
                                excess_of, expected_max, model_for, moves_weights, with_excess)
from ultraep.cost.fit import (FIT_MIN_CALLS, FIT_SLOWDOWNS, HALF_TOKENS_MIN_SPREAD, MAX_HALF_TOKENS, ComputeFit,
                              FittedCompute, corun_matrices, half_tokens_from_spread)
from ultraep.cost.calibrator import SUMMED_TERMS, Calibrator, call_residual

__all__ = [
    "CostParams",
    "CostBreakdown", "CostModel", "corun_finish", "cost_model_from_record", "cost_record", "expected_max", "model_for",
    "moves_weights", "excess_of", "with_excess",
    "FIT_MIN_CALLS", "FIT_SLOWDOWNS", "HALF_TOKENS_MIN_SPREAD", "MAX_HALF_TOKENS", "ComputeFit", "FittedCompute",
    "corun_matrices", "half_tokens_from_spread",
    "SUMMED_TERMS", "Calibrator", "call_residual",
]

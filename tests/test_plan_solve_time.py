"""A plan is frozen: the planning time is measured once, where the policy is called (issue 33, item 7).

``plan_resident`` (the engine's and ``plan_layer``'s way to call a policy) times the call and returns a copy
with ``solve_time_s`` set (:meth:`Plan.with_solve_time`); no policy writes into its plan, and no code outside
``ultraep/plan/`` sets a field of a ``Plan`` with ``object.__setattr__``."""

import ast
import dataclasses

import import_graph as ig
import numpy as np

from ultraep import plan_layer
from ultraep.plan import Plan
from ultraep.policies import make_policy, plan_resident
from ultraep.topology import Topology

PLAN_FIELDS = {f.name for f in dataclasses.fields(Plan)}


def setattr_on_plans(tree: ast.AST) -> list[int]:
    """Lines of ``object.__setattr__(x, name, ...)`` where ``x`` reads as a plan (its name says so) or ``name`` is
    one of :class:`Plan`'s fields."""
    lines = []
    for node in ast.walk(tree):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "__setattr__"
                and isinstance(node.func.value, ast.Name) and node.func.value.id == "object" and node.args):
            target = ast.unparse(node.args[0]).lower()
            field = node.args[1].value if len(node.args) > 1 and isinstance(node.args[1], ast.Constant) else None
            if "plan" in target or field in PLAN_FIELDS:
                lines.append(node.lineno)
    return lines


def test_no_setattr_on_a_plan_outside_the_plan_package():
    hits = []
    for mod, path in ig.project_modules().items():
        if mod == "ultraep.plan" or mod.startswith("ultraep.plan."):
            continue
        rel = path.relative_to(ig.ROOT).as_posix()
        hits += [f"{rel}:{line}" for line in setattr_on_plans(ast.parse(path.read_text(), filename=str(path)))]
    assert not hits, "object.__setattr__ on a frozen Plan (use Plan.with_solve_time / dataclasses.replace):\n" + \
        "\n".join(hits)


def test_the_scan_finds_a_write_into_a_plan():
    src = 'object.__setattr__(plan, "x", 1)\nobject.__setattr__(p, "solve_time_s", 2)\nobject.__setattr__(self, "_a", 3)\n'
    assert setattr_on_plans(ast.parse(src)) == [1, 2]


def _load(R=4, E=8):
    rng = np.random.default_rng(0)
    return rng.integers(0, 100, size=(R, E)).astype(np.int64) * np.arange(1, E + 1)


def test_plan_resident_times_the_call_and_the_policy_does_not():
    topo = Topology(num_ranks=4, num_experts=8, num_redundant_slots=1)
    load = _load()
    for name in ("none", "quota", "eplb", "feplb"):
        pol = make_policy(name)
        own = pol.plan(load, topo)
        assert own.solve_time_s == 0.0, name  # the policy measures nothing itself
        timed = plan_resident(pol, load, topo, None)
        assert timed.solve_time_s > 0.0, name
        assert timed.phy2log_RS is not None and timed.policy == name
    copy = own.with_solve_time(1.5)
    assert copy.solve_time_s == 1.5 and own.solve_time_s == 0.0 and copy.quota_RS is own.quota_RS


def test_plan_layer_reports_the_planning_time():
    assert plan_layer(_load(), "quota", num_redundant_slots=1).solve_time_s > 0.0

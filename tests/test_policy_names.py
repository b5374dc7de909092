"""Policies own their knowledge (issue 19): no code outside ``policies/`` branches on a policy's name.

The scan reads every module of the installed packages except ``ultraep.policies`` with ``ast`` and fails on a
comparison (``==``, ``!=``, ``in``, ``not in``, ``match`` cases) against a string constant that is a registered
policy name, alone or inside a tuple, list or set literal. What code outside ``policies/`` needs to know about a
policy it asks the policy class (``needs_cost_model``, ``one_shot_options``, ``step_count_options``,
``uses_residency``, ...) or the registry (``BASELINE``, ``is_chooser``, ``option_default``).
"""

from __future__ import annotations

import ast
import textwrap

import import_graph as ig

from ultraep.policies import available_policies


def name_comparisons(tree: ast.AST, names: set[str]) -> list[tuple[int, str]]:
    """``(line, name)`` for every comparison of the tree against a string constant in ``names``."""

    def consts(node: ast.AST) -> list[str]:
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            return [node.value]
        if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
            return [c.value for c in node.elts if isinstance(c, ast.Constant) and isinstance(c.value, str)]
        return []

    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            for side in (node.left, *node.comparators):
                found += [(node.lineno, v) for v in consts(side) if v in names]
        elif isinstance(node, ast.MatchValue):
            found += [(node.lineno, v) for v in consts(node.value) if v in names]
    return found


#: (file, name) pairs where the string is not a policy name, with the reason
NOT_A_POLICY = {
    ("telemetry/otel.py", "none"): "OTEL_<SIGNAL>_EXPORTER=none is the OpenTelemetry specification's 'no exporter'",
}


def test_no_policy_name_comparison_outside_policies():
    names = set(available_policies())
    assert {"none", "adaptive"} <= names
    hits = []
    for mod, path in ig.project_modules().items():
        if mod == "ultraep.policies" or mod.startswith("ultraep.policies."):
            continue
        tree = ast.parse(path.read_text(), filename=str(path))
        rel = path.relative_to(ig.ROOT).as_posix()
        hits += [f"{rel}:{line}: compares with policy name {v!r}" for line, v in name_comparisons(tree, names)
                 if (rel, v) not in NOT_A_POLICY]
    assert not hits, "branch on a policy name outside policies/ (ask the policy class or the registry):\n" + "\n".join(hits)


def test_the_scan_finds_each_form_of_comparison():
    src = textwrap.dedent('''
        if n == "adaptive": pass
        if "eplb" != kind: pass
        ok = kind in ("none", "other")
        ok = kind not in ["quota"]
        match kind:
            case "feplb": pass
        d = {"quota": 1}            # a key, not a comparison
        x = f(policy="hybridep")    # an argument, not a comparison
        y = kind == "other"
    ''')
    got = name_comparisons(ast.parse(src), {"none", "quota", "eplb", "feplb", "hybridep", "adaptive"})
    assert got == [(2, "adaptive"), (3, "eplb"), (4, "none"), (5, "quota"), (7, "feplb")]


#: the adaptive engine and its parts: what they need to know about a candidate they ask its class (``fallback``,
#: ``screenable``, ``placement_interval``, ``planner_exposed``), never its name (issue 33, item 7)
ADAPTIVE_PARTS = ("policies/adaptive.py", "policies/candidates.py", "policies/outcomes.py", "policies/probes.py",
                  "policies/hysteresis.py", "policies/screening.py", "policies/exploration.py")


def test_no_policy_name_comparison_in_the_adaptive_engine():
    names = set(available_policies())
    hits = []
    for rel in ADAPTIVE_PARTS:
        path = ig.ROOT / rel
        hits += [f"{rel}:{line}: compares with policy name {v!r}"
                 for line, v in name_comparisons(ast.parse(path.read_text(), filename=str(path)), names)]
        # a module-level tuple of names compared indirectly (``n in SCREENABLE``) is the same branch by another way
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.Assign) and isinstance(node.value, (ast.Tuple, ast.List, ast.Set)):
                target = ast.unparse(node.targets[0])
                if target != "DEFAULT_CANDIDATES" and any(isinstance(c, ast.Constant) and c.value in names
                                                          for c in node.value.elts):
                    hits.append(f"{rel}:{node.lineno}: {target} lists policy names")
    assert not hits, "branch on a policy name in the adaptive engine (ask the candidate's class):\n" + "\n".join(hits)

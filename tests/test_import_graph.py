"""Import direction (issue 19; docs/design.md, Dependency direction): the vocabulary never imports upward, not even inside a
function, and no import cycle appears between the project's modules.

The graph comes from ``tests/import_graph.py`` (``ast`` only; function-level imports count like module-level
ones; imports under ``if TYPE_CHECKING:`` never run and are left out). ``python tests/import_graph.py``
prints every remaining cycle with the statements that close it.

Cycles that existed when this test was written were listed in :data:`KNOWN_CYCLE_EDGES` (and upward imports
in :data:`KNOWN_UPWARD`) while they were being removed; both are empty now, so any cycle or upward import
fails. The mechanism stays (the test fails on any cycle that uses an unlisted edge; the stale-entry test
makes the lists shrink only).
"""

from __future__ import annotations

import shutil
import textwrap

import pytest

import import_graph as ig

# The vocabulary (docs/design.md: the plan and its parts in ultraep/plan/, load, topology, config, cost, and the
# small modules they are made of). A vocabulary module imports only vocabulary modules.
VOCABULARY = {
    "ultraep.plan", "ultraep.plan.metrics", "ultraep.plan.routes", "ultraep.plan.transfers", "ultraep.plan.traffic",
    "ultraep.load", "ultraep.topology", "ultraep.config", "ultraep.errors", "ultraep.presets",
    "ultraep.limits", "ultraep.timings",
    "ultraep.cost", "ultraep.cost.params", "ultraep.cost.model", "ultraep.cost.fit", "ultraep.cost.calibrator",
}
# Issue 56, item 7: the cost model's rooms, bottom first. Each imports only the rooms before it; the package's
# ``__init__`` (which re-exports them) is the top, so no room imports ``ultraep.cost`` itself.
COST_ROOMS = ("ultraep.cost.params", "ultraep.cost.model", "ultraep.cost.fit", "ultraep.cost.calibrator",
              "ultraep.cost")
# Upward imports of the vocabulary, and edges of import cycles, tolerated while other work is in progress
# (``(src, dst)`` module pairs; a cycle's edges listed in both directions). Empty since issue 19 removed the
# last ones (the cost model prices HybridEP's typed overlay itself; the models' shared types sit in
# ``ultraep.models.experts``): any upward import or cycle fails. Only entries may be removed.
KNOWN_UPWARD: set[tuple[str, str]] = set()
KNOWN_CYCLE_EDGES: set[tuple[str, str]] = set()


@pytest.fixture(scope="module")
def edges():
    return ig.build_graph()


def test_the_graph_covers_every_package_and_both_kinds_of_import(edges):
    mods = ig.project_modules()
    for pkg in ("ultraep", "ultraep.policies", "ultraep.kernels", "ultraep.telemetry", "ultraep.dashboard",
                "ultraep.traces", "ultraep.plan"):
        assert pkg in mods, pkg
    assert "ultraep.dashboard.pages.sql" not in mods  # Streamlit page scripts are not modules
    kinds = {e.kind for e in edges}
    assert kinds == {"top", "function", "type_checking"}
    # a known function-level import (numba stays out of `import ultraep.plan`) is in the graph
    assert any(e.src == "ultraep.plan" and e.dst == "ultraep.plan.routes" and e.kind == "function" for e in edges)


def test_the_top_of_ultraep_stays_small():
    """Issue 19: at most 12 modules directly in ``ultraep/``, every other concern in a sub-package (docs/design.md
    says why each module sits at the top)."""
    mods = ig.project_modules()
    top = sorted(m for m, path in mods.items() if m.count(".") == 1 and path.name != "__init__.py")
    packages = sorted(m for m, path in mods.items() if m.count(".") == 1 and path.name == "__init__.py"
                      and path.parent.parent == ig.package_dirs()["ultraep"])
    assert len(top) + 1 <= 12, f"{len(top) + 1} modules in ultraep/ (with __init__): {top}"
    assert len(packages) >= 3 and "ultraep.plan" in packages, packages


def test_the_vocabulary_imports_only_the_vocabulary(edges):
    """Counting imports inside functions: nothing in the vocabulary imports policies, the runtime, the
    simulator, telemetry or the CLI."""
    upward = {(e.src, e.dst): e for e in edges if e.kind != "type_checking" and e.src in VOCABULARY
              and e.dst not in VOCABULARY and e.dst != "ultraep"}
    new = sorted(str(e) for pair, e in upward.items() if pair not in KNOWN_UPWARD)
    assert not new, "the vocabulary imports upward:\n" + "\n".join(new)


def test_no_import_cycle_beyond_the_known_ones(edges):
    found = ig.cycles(edges)
    new = [c for c in found if any((e.src, e.dst) not in KNOWN_CYCLE_EDGES for e in c)]
    assert not new, "import cycles:\n" + "\n".join(ig.format_cycle(c) for c in new)


def test_no_import_cycle_even_for_type_checking(edges):
    """Issue 54, item 7: not even an import under ``if TYPE_CHECKING:`` closes a cycle (the balanced layer once
    named the runtime that builds it for its recording helpers; they live in ``runtime.recording`` now). Such an
    import never runs, but it is still a dependency of the code's meaning: the lower module knows the higher."""
    found = ig.cycles(edges, ig.KINDS)
    assert not found, "import cycles (type-checking imports counted):\n" + "\n".join(ig.format_cycle(c) for c in found)


def test_the_layer_never_imports_the_runtime_that_builds_it(edges):
    """Issue 54, item 7: ``runtime.layer`` (and the token path it runs) reach the runtime's recorder through
    ``runtime.recording``, never through ``runtime.wrap``: no edge of any kind, so a second builder of the layer
    (an adapter that wraps another engine's model) imports the layer without the runtime."""
    layer_side = {"ultraep.runtime.layer", "ultraep.runtime.token_path", "ultraep.runtime.recording",
                  "ultraep.runtime.guard", "ultraep.runtime.checkpoint_replay"}
    assert layer_side <= set(ig.project_modules())
    up = [str(e) for e in edges if e.src in layer_side and e.dst == "ultraep.runtime.wrap"]
    assert up == [], "the layer's side imports the runtime:\n" + "\n".join(up)


def test_the_known_lists_hold_no_stale_entries(edges):
    """When a listed cycle or upward import is fixed, its entry must go (so the lists only shrink)."""
    on_cycles = {(e.src, e.dst) for c in ig.cycles(edges) for e in c}
    pairs = {(e.src, e.dst) for e in edges if e.kind != "type_checking"}
    assert KNOWN_CYCLE_EDGES <= on_cycles, f"fixed, remove from KNOWN_CYCLE_EDGES: {KNOWN_CYCLE_EDGES - on_cycles}"
    assert KNOWN_UPWARD <= pairs, f"fixed, remove from KNOWN_UPWARD: {KNOWN_UPWARD - pairs}"


def test_the_builder_finds_cycles_through_function_level_imports_and_skips_type_checking(tmp_path):
    (tmp_path / "pyproject.toml").write_text(textwrap.dedent("""
        [tool.setuptools]
        package-dir = { "pkg" = "pkg", "pkg.sub" = "sub" }
    """))
    (tmp_path / "pkg").mkdir()
    (tmp_path / "sub").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "a.py").write_text("from pkg import b\n")
    (tmp_path / "pkg" / "b.py").write_text(textwrap.dedent("""
        from typing import TYPE_CHECKING
        if TYPE_CHECKING:
            from pkg.sub import c
        def f():
            from .a import x  # relative, inside a function: still an edge
    """))
    (tmp_path / "sub" / "__init__.py").write_text("")
    (tmp_path / "sub" / "c.py").write_text("import pkg.b\n")
    edges = ig.build_graph(tmp_path)
    got = {(e.src, e.dst, e.kind) for e in edges}
    assert got == {("pkg.a", "pkg.b", "top"), ("pkg.b", "pkg.a", "function"),
                   ("pkg.b", "pkg.sub.c", "type_checking"), ("pkg.sub.c", "pkg.b", "top")}
    assert ig.strongly_connected(ig.adjacency(edges)) == [["pkg.a", "pkg.b"]]
    (cycle,) = ig.cycles(edges)
    assert [(e.src, e.dst) for e in cycle] == [("pkg.a", "pkg.b"), ("pkg.b", "pkg.a")]
    assert cycle[1].path == "pkg/b.py" and cycle[1].line == 6
    # counted with TYPE_CHECKING imports, c joins the cycle
    assert ig.strongly_connected(ig.adjacency(edges, ig.KINDS)) == [["pkg.a", "pkg.b", "pkg.sub.c"]]


def test_the_transport_rooms_import_nothing_above_them(edges):
    """Issue 34 (and 33's "transport as its own room"): the point-to-point batches, the direct / tiled
    transports and the clock know nothing of the job, the layer or the runtime, not even for type checking."""
    low = {"ultraep.runtime.transport", "ultraep.runtime.replica_transport", "ultraep.runtime.clock"}
    high = {"ultraep.runtime.replicas", "ultraep.runtime.layer", "ultraep.runtime.wrap"}
    assert low <= set(ig.project_modules())
    assert [(e.src, e.dst, e.kind) for e in edges if e.src in low and e.dst in high] == []


#: issue 33: the modules that do replica work and hold replica memory (the job, its transports and point-to-point
#: batches, the per-layer store and its residency table, the clock) ...
REPLICA_ROOMS = {"ultraep.runtime.replicas", "ultraep.runtime.replica_transport", "ultraep.runtime.transport",
                 "ultraep.runtime.replica_store", "ultraep.runtime.replica_cache", "ultraep.runtime.clock"}
#: ... and the modules that build them: the balanced layer and the runtime
REPLICA_BUILDERS = {"ultraep.runtime.layer", "ultraep.runtime.wrap"}


def test_replica_work_never_imports_the_layer_or_the_runtime(edges):
    """Issue 33, item 1: a replica job gets a narrow ``ReplicaContext`` from its layer, so nothing that does replica
    work or owns replica memory imports ``BalancedExperts`` (``runtime.layer``) or ``EPRuntime`` (``runtime.wrap``):
    no edge of any kind, at module level, inside a function or under ``if TYPE_CHECKING:``."""
    assert REPLICA_ROOMS | REPLICA_BUILDERS <= set(ig.project_modules())
    up = [str(e) for e in edges if e.src in REPLICA_ROOMS and e.dst in REPLICA_BUILDERS]
    assert up == [], "replica work imports the layer or the runtime:\n" + "\n".join(up)


def test_the_cost_models_rooms_import_downward_only(edges):
    """Issue 56, item 7: ``ultraep/cost/`` is params <- model <- fit <- calibrator (<- its ``__init__``), every
    module of the package is ranked, and no edge of any kind (inside a function or for type checking too) points up."""
    rooms = {m for m in ig.project_modules() if m == "ultraep.cost" or m.startswith("ultraep.cost.")}
    assert rooms == set(COST_ROOMS), f"rank every module of ultraep.cost in COST_ROOMS: {sorted(rooms)}"
    up = [str(e) for e in ig.upward(edges, COST_ROOMS)]
    assert up == [], "the cost model's rooms import upward:\n" + "\n".join(up)
    # the rooms do use the ones below them (the order is not vacuous)
    pairs = {(e.src, e.dst) for e in edges}
    assert {("ultraep.cost.model", "ultraep.cost.params"), ("ultraep.cost.calibrator", "ultraep.cost.model"),
            ("ultraep.cost.calibrator", "ultraep.cost.fit")} <= pairs


@pytest.mark.parametrize("room, line, kind", [
    ("params.py", "from ultraep.cost.model import CostModel", "top"),
    ("model.py", "def _f():\n    from ultraep.cost import Calibrator", "function"),
    ("fit.py", "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from . import calibrator", "type_checking"),
])
def test_negative_control_an_upward_import_in_a_cost_room_fails(tmp_path, room, line, kind):
    """The same check on a copy of ``ultraep/cost/``: clean, nothing; one upward import added (at module level, inside
    a function, for type checking), that edge."""
    (tmp_path / "pyproject.toml").write_text('[tool.setuptools]\npackage-dir = { "ultraep" = "ultraep" }\n')
    (tmp_path / "ultraep").mkdir()
    (tmp_path / "ultraep" / "__init__.py").write_text("")
    shutil.copytree(ig.package_dirs()["ultraep"] / "cost", tmp_path / "ultraep" / "cost",
                    ignore=shutil.ignore_patterns("__pycache__"))
    assert ig.upward(ig.build_graph(tmp_path), COST_ROOMS) == []
    path = tmp_path / "ultraep" / "cost" / room
    path.write_text(path.read_text() + "\n" + line + "\n")
    (e,) = ig.upward(ig.build_graph(tmp_path), COST_ROOMS)
    assert (e.src, e.kind) == ("ultraep.cost." + room[:-3], kind)

"""Issue 15, item 3: the planners compile before anything is timed.

``ultraep.planning.warm_up()`` plans tiny loads through every built-in policy so that numba compiles (or
loads from its cache) every signature real planning uses; ``ultraep.wrap`` and the planning CLI commands
call it. Checked here without paying a cold compile: after ``warm_up()``, planning realistic loads
(writeable and read-only, one and two scale-up domains) compiles no new numba signature anywhere.
On a cold cache the measured difference is ~18 s of warm-up, then sub-millisecond first plans (before:
3 s for the first quota plan inside the timed call, ~20 s over all planners).
"""

from __future__ import annotations

import importlib
import pkgutil

import numpy as np

import ultraep.planning
from dist_utils import run_ranks
from ultraep import Topology
from ultraep.cli import main
from ultraep.policies import POLICIES, make_policy


def _signatures() -> set:
    """Every compiled signature of every numba dispatcher in the planners and the cost model."""
    import ultraep.cost
    import ultraep.policies as pkg

    mods = [ultraep.cost] + [importlib.import_module(f"{pkg.__name__}.{m.name}") for m in pkgutil.iter_modules(pkg.__path__)]
    out = set()
    for mod in mods:
        for name, obj in vars(mod).items():
            for sig in getattr(obj, "signatures", None) or ():
                if hasattr(obj, "py_func"):
                    out.add((mod.__name__, name, str(sig)))
    return out


def test_after_warm_up_real_planning_compiles_nothing():
    ultraep.planning.warm_up()
    before = _signatures()
    assert before, "warm_up compiled the planners"
    rng = np.random.default_rng(7)
    for domain_size in (None, 4):
        topo = Topology(num_ranks=8, num_experts=64, num_redundant_slots=3, domain_size=domain_size,
                        expert_bytes=3 << 20)
        for name in POLICIES:
            pol = make_policy(name)
            for step in range(4):
                load = rng.integers(0, 5000, size=(8, 64), dtype=np.int64)
                load[:, step] *= 40  # a hot expert that moves
                load.setflags(write=bool(step % 2))
                pol.commit(pol.plan(load, topo))
    assert _signatures() - before == set()


def test_planning_cli_commands_warm_up(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(ultraep.planning, "_WARM", {})
    assert main(["plan", "--synthetic", "--ranks", "4", "--experts", "8", "--tokens", "64", "--json"]) == 0
    assert "s" in ultraep.planning._WARM


def _wrap_warms_up(rank, world):
    import ultraep
    from ultraep.models import build_model

    ultraep.planning._WARM.clear()  # as in a fresh process: nothing compiled yet
    ultraep.wrap(build_model("qwen3-moe", layers=1), {"policy": "quota", "num_redundant_slots": 0})
    return "s" in ultraep.planning._WARM


def test_wrap_warms_up():
    assert run_ranks(_wrap_warms_up, 1) == [True]


def test_warm_up_is_idempotent():
    ultraep.planning.warm_up()
    assert ultraep.planning.warm_up() == 0.0

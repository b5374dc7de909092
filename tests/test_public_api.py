"""The public API the README shows does not move (issue 19, item 7).

Every name of the README's API section resolves from where the README takes it, with the arguments the
README passes; the telemetry round trip and a policy plugged in through the ``ultraep.policies``
entry-point group work end to end; the ``ultraep`` console script resolves to the CLI's ``main``.
The runtime's collective behaviour (``wrap`` / ``unwrap`` on real ranks) is tested in the runtime's own
tests; here only that the names and their documented parameters stay.
"""

from __future__ import annotations

import inspect
import textwrap
from importlib.metadata import entry_points

import numpy as np
import pytest

import ultraep

# Names the README's API section and its prose use, as `ultraep.<name>`.
README_NAMES = ("plan_layer", "wrap", "unwrap", "runtime_of", "register_experts", "BalancerConfig", "telemetry",
                "Topology", "Plan")


def test_every_lazy_name_of_the_package_resolves():
    assert set(README_NAMES) <= set(ultraep.__all__)
    for name in ultraep.__all__:
        assert getattr(ultraep, name) is not None, name
    assert ultraep.__version__


def test_plan_layer_returns_the_plan_the_readme_reads():
    load = np.random.default_rng(0).integers(0, 100, (4, 8))
    load[:, 0] += 900
    plan = ultraep.plan_layer(load, "quota", num_redundant_slots=2)
    assert plan.phy2log_RS.shape == plan.quota_RS.shape == (4, 4)
    assert plan.routes_RRS.shape == (4, 4, 4)
    assert isinstance(plan.transfers.rows(), list)
    assert plan.imbalance_after < plan.imbalance_before and plan.num_replicas > 0


def test_balancer_config_accepts_the_readme_forms():
    cfg = ultraep.BalancerConfig(policy="adaptive", num_redundant_slots=2)
    assert getattr(cfg.policy, "kind", cfg.policy) == "adaptive"
    per_layer = ultraep.BalancerConfig(policy="quota", layers={3: {"kind": "eplb", "interval": 20}})
    assert 3 in per_layer.layers


def test_runtime_names_keep_their_documented_parameters():
    pytest.importorskip("torch")
    import torch

    assert list(inspect.signature(ultraep.wrap).parameters)[:2] == ["model", "config"]
    assert "recorder" in inspect.signature(ultraep.wrap).parameters
    assert list(inspect.signature(ultraep.unwrap).parameters) == ["model"]
    assert list(inspect.signature(ultraep.register_experts).parameters)[:3] == ["cls", "param_names", "forward"]
    with pytest.raises(ultraep.UltraEPError, match="ultraep.wrap"):
        ultraep.runtime_of(torch.nn.Linear(2, 2))  # not wrapped: the documented one-line error
    from ultraep.models.rewrite import restore
    from ultraep.launch import launch

    assert callable(restore) and callable(launch)


def test_telemetry_round_trip_as_the_readme_shows(tmp_path):
    from ultraep.telemetry import NullRecorder, Recorder, open_run

    assert ultraep.telemetry.Recorder is Recorder and ultraep.telemetry.open_run is open_run
    plan = ultraep.plan_layer(np.full((2, 4), 10), "quota", num_redundant_slots=1)
    with ultraep.telemetry.Recorder.open(tmp_path, "api", world_size=1, rank=0, flush_interval_s=None,
                                         otel=False) as rec:
        rec.record_plan(0, 0, 0, plan)
        rec.record_step(0, loss=1.0)
    con = ultraep.telemetry.open_run(tmp_path / "api")
    rows = con.execute("SELECT layer, avg(imbalance_before), avg(imbalance_after) FROM layer_balance "
                       "GROUP BY layer").fetchall()
    assert rows == [(0, 1.0, 1.0)]
    NullRecorder().record_plan(0, 0, 0, plan)  # telemetry off: same interface, does nothing


def test_the_console_script_is_the_cli_main(capsys):
    from ultraep.cli import main

    (ep,) = entry_points(group="console_scripts", name="ultraep")
    assert ep.value == "ultraep.cli:main" and ep.load() is main
    with pytest.raises(SystemExit) as exc:
        main(["--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    for command in ("demo", "plan", "simulate", "trace", "sql", "report", "export", "dashboard"):
        assert command in out, command


def test_a_policy_registered_through_the_entry_point_group_plans(tmp_path, monkeypatch):
    """A third-party package registers ``name = "module:Class"`` under ``ultraep.policies``; here a
    dist-info folder on ``sys.path`` stands in for the installed package."""
    from ultraep.policies import ENTRY_POINT_GROUP, available_policies, get_policy_class

    assert ENTRY_POINT_GROUP == "ultraep.policies"
    (tmp_path / "my_ultraep_policy.py").write_text(textwrap.dedent("""
        from ultraep.policies import identity_plan

        class MyPolicy:
            name = "mine"

            def plan(self, load_RE, topology):
                return identity_plan(self.name, topology, load_RE, 0.0)

            def commit(self, plan):
                return None
    """))
    info = tmp_path / "my_ultraep_policy-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: my-ultraep-policy\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[ultraep.policies]\nmine = my_ultraep_policy:MyPolicy\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert "mine" in available_policies()
    assert get_policy_class("mine").__name__ == "MyPolicy"
    plan = ultraep.plan_layer(np.full((2, 4), 5), "mine", num_redundant_slots=1)
    assert plan.policy == "mine" and plan.num_replicas == 0

"""A torchtitan-wrapped training run is recorded like any run (issue 54, item 4): `ultraep report`, the dashboard
(Streamlit AppTest, every page) and `ultraep simulate RUN --topology from-run` read it.

The run: a qwen3 decoder built from torchtitan's config, wrapped with a recorder, parallelized by its own
``parallelize_fn`` through ``ultraep.integrations.torchtitan`` (FSDP2), 4 steps on 2 gloo ranks.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("torchtitan")

import titan_models as tm  # noqa: E402
from dist_utils import run_ranks  # noqa: E402
from test_dashboard import PAGES, app, assert_ok, select_run  # noqa: E402
from test_torchtitan_train import _ce_sum, _ids, _parallelize_kwargs, _sum_reduction  # noqa: E402

from ultraep.cli import main  # noqa: E402

tm._registry("qwen3")
STEPS = 4


def _recorded(rank, world, runs):
    import ultraep
    from ultraep.integrations import torchtitan as integration

    spec = tm._registry("qwen3")
    model = tm.decoder("qwen3")
    with ultraep.telemetry.Recorder.open(runs, "titan", world_size=world, rank=rank, flush_interval_s=None,
                                         model="torchtitan:qwen3", config={"policy": "quota"}) as rec:
        ultraep.wrap(model, {"policy": "quota", "num_redundant_slots": 2}, recorder=rec)
        rt = ultraep.runtime_of(model)
        integration.parallelize(spec.parallelize_fn, model, **_parallelize_kwargs(world, "fsdp"))
        _sum_reduction(model)
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        vocab = int(model.lm_head.weight.shape[0])
        for step in range(STEPS):
            opt.zero_grad(set_to_none=True)
            ids = _ids(vocab, rank, step)
            loss = _ce_sum(model(ids), ids) / (world * ids[:, 1:].numel())
            loss.backward()
            opt.step()
            rt.next_step(loss=float(loss))
    return sum(int(h[5]) for h in rt.recording.history), len(rt.layers)  # replicas planned per call


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("runs")
    results = run_ranks(_recorded, 2, str(root))
    assert sum(r[0] for r in results) > 0, "no replica was planned"
    return root, results[0][1]


def test_report_reads_the_run(runs, capsys):
    root, layers = runs
    assert main(["report", str(root / "titan")]) == 0
    text = capsys.readouterr().out
    assert "quota" in text and "titan" in text, text


def test_simulate_from_run_replays_it(runs, tmp_path, capsys):
    root, layers = runs
    assert main(["simulate", str(root / "titan"), "--topology", "from-run", "--policies", "none,quota",
                 "--json", str(tmp_path / "sim.json"), "--no-progress", "--workers", "1"]) == 0
    text = capsys.readouterr().out
    assert "measured: run titan ran policy quota" in text, text


def test_every_dashboard_page_shows_it(runs):
    root, _ = runs
    for page in PAGES:
        at = select_run(app(root, page), "titan")
        assert_ok(at)

"""The Policies page's prediction error per cost-model term (issue 13 item 5) equals SQL on the store.

Two ranks record ``predicted.<term>`` / ``measured.<term>`` timing keys (what the runtime writes once a
layer's backward ran); the dashboard's mirror lifts them out of the ``other`` map and takes the slowest
rank's measurement per layer-microbatch; the page's series is the median |measured / predicted − 1| per
step bin and term. The canned report query reduces ranks as the engine does (all-to-alls from the fastest
rank), so it is checked separately on the same run.
"""

import numpy as np
from ultraep.dashboard import data
from ultraep.dashboard.mirror import RunMirror
from ultraep.telemetry import Recorder, open_run, queries
from ultraep.telemetry import semconv as sc


def _record(root):
    recs = [Recorder.open(root, "terms", kind="train", world_size=2, rank=r, flush_interval_s=None) for r in (0, 1)]
    for step in range(6):
        for layer in range(2):
            for rec in recs:
                t = {"measured_s": 0.01, "predicted_s": 0.01}
                for i, term in enumerate(sc.PREDICTED_TERMS):
                    pred = 1e-3 * (i + 1)
                    t[f"predicted.{term}"] = pred
                    # rank 1 is slower; the error grows with the step
                    t[f"measured.{term}"] = pred * (1 + 0.1 * step + 0.05 * rec.rank + 0.01 * layer)
                rec.record_timings(step, 0, layer, t)
        for rec in recs:
            rec.record_step(step, loss=1.0)
    for rec in recs:
        rec.close()


def test_phase_errors_per_term_equal_sql(tmp_path):
    _record(tmp_path)
    m = RunMirror(tmp_path / "terms")
    bins = data.step_bins(0, 5, max_bins=3)  # bins of 2 steps
    got = data.phase_errors_over_steps(m, bins)
    assert set(got["policy"]) == set(sc.PREDICTED_TERMS)
    con = open_run(tmp_path / "terms")
    for term in sc.PREDICTED_TERMS:
        rows = con.execute(
            f"""SELECT 2 * (step // 2) AS b, median(abs(meas / pred - 1)) FROM (
                    SELECT step, layer, max(other['predicted.{term}']) AS pred, max(other['measured.{term}']) AS meas
                    FROM timings GROUP BY step, layer) GROUP BY b ORDER BY b""").fetchall()
        sub = got[got["policy"] == term].sort_values("step")
        assert list(sub["step"]) == [r[0] for r in rows]
        np.testing.assert_allclose(sub["rel_error"], [r[1] for r in rows], rtol=1e-9)
    # the canned report: one row per term; the all-to-all terms take the fastest rank
    cols, rep = queries.run(con, queries.PHASE_PREDICTION_ERRORS)
    by = {r[cols.index("term")]: r for r in rep}
    assert set(by) == set(sc.PREDICTED_TERMS)
    assert by["total_s"][cols.index("samples")] == 6 * 2  # no warm-up step marked here: every call counts
    err = cols.index("median_abs_rel_error")
    fastest = np.median([0.1 * s + 0.01 * la for s in range(6) for la in range(2)])  # rank 0
    slowest = np.median([0.1 * s + 0.05 + 0.01 * la for s in range(6) for la in range(2)])  # rank 1
    assert abs(by["a2a_fwd_s"][err] - fastest) < 1e-9
    assert abs(by["compute_fwd_s"][err] - slowest) < 1e-9

"""``ultraep report`` for a person: the measured answer first, then grouped sections, as wide as the terminal.

Sections, in order (each a :class:`Section` of :data:`SECTIONS`; add one by appending a function that turns
:class:`ReportData` into lines and tables):

1. **Did it pay?** measured step time p50 and the speed-up over the baseline run with its 90 % interval over
   the paired steps (or a labelled estimate), warm-up steps as a one-time cost (:mod:`.answer`).
2. **Balance (plan quality)**: imbalance before → after per layer, policy shares. What the plans achieve
   on paper; never a measured time.
3. **Overhead**: planning and transfers per layer call, the replica cache (with the reason when a layer's
   hit rate is 0 %).
4. **Prediction quality**: the cost model's predicted vs measured layer time, with a sentence when the
   error is large; per term, the predicted and measured times beside the error, terms too small to compare
   marked.
5. **Exploration**: an adaptive engine's probes: their share of its calls and their measured cost.
6. **Transfers**: per layer, bytes moved, relay share, measured bandwidth.
7. **Runs**: status, size, recording errors.

Numbers are rounded and in human units (ms, MiB); runs are labelled by what tells them apart (the full id
is printed once above the tables). Width: ``COLUMNS``, else the terminal's (stdout's, or stderr's when stdout
is piped), else :data:`WIDTH`. A cell is never broken across lines: a table wider than that is printed in
parts, each repeating the key columns (:class:`FitTable`); headers break between words only. The figures come
from the canned queries (:data:`queries.REPORT`) and :mod:`.answer`; nothing is computed here that those do not
hold.
"""

from __future__ import annotations

import math
import os
import sys
import textwrap
from dataclasses import dataclass, field
from typing import Any, Callable

from ultraep.telemetry.answer import Answer, headline
from ultraep.telemetry.units import fmt_bytes as f_bytes
from ultraep.telemetry.units import fmt_s, short_labels

#: the width when neither COLUMNS nor a terminal tells (output to a file, CI logs)
WIDTH = 120
#: narrower than this, the tables could not show one figure beside its key
MIN_WIDTH = 40
#: a prediction error above this (median |measured / predicted - 1|) gets a sentence
LARGE_ERROR = 0.25
#: a cost-model term below this share of the layer call's measured time is too small to compare: a few µs off
#: make a large relative error that says nothing about the layer's time
SMALL_TERM = 0.02


def terminal_width(fallback: int = WIDTH) -> int:
    """Columns to print in: ``COLUMNS`` when set, else the terminal's (stdout's; when stdout is piped, as in
    ``ultraep report RUN | less``, stderr's or stdin's), else ``fallback``."""
    cols = os.environ.get("COLUMNS", "").strip()
    if cols.isdigit() and int(cols) > 0:
        return max(MIN_WIDTH, int(cols))
    for stream in (sys.stdout, sys.stderr, sys.stdin):
        try:
            if stream is not None and stream.isatty():
                return max(MIN_WIDTH, os.get_terminal_size(stream.fileno()).columns)
        except (AttributeError, OSError, ValueError):
            continue
    return fallback


@dataclass
class ReportData:
    """What the sections read: run ids in order, their short labels, answers, and each canned query's rows
    (``rows[query name]`` = list of dicts)."""

    run_ids: list[str]
    labels: dict[str, str]
    answers: dict[str, Answer]
    rows: dict[str, list[dict]] = field(default_factory=dict)

    def label(self, run_id: str) -> str:
        return self.labels.get(run_id, run_id)


@dataclass(frozen=True)
class Section:
    title: str
    render: Callable[[ReportData], list]


# --------------------------------------------------------------------------- formatting
def _bad(v) -> bool:
    return v is None or (isinstance(v, float) and math.isnan(v))


def f_ratio(v, digits: int = 2) -> str:
    return "—" if _bad(v) else f"{float(v):.{digits}f}"


def f_pct(v) -> str:
    return "—" if _bad(v) else f"{100 * float(v):.0f} %"


def f_int(v) -> str:
    return "—" if _bad(v) else f"{int(v):,}"


class FitTable:
    """A table that never breaks a cell: each column is as wide as its widest cell (or its header's longest
    word: headers break between words only); when the columns do not fit the console's width, the table is
    printed in parts, each with the first ``keys`` columns (what a row is about) and as many of the others as
    fit; narrower still, row by row as ``header: value`` lines. The first ``text`` columns are words
    (left-aligned), the others figures (right-aligned)."""

    def __init__(self, cols: list[str], rows: list[list[str]], text: int = 1, keys: int = 1) -> None:
        self.cols, self.rows, self.text, self.keys = cols, [[str(c) for c in r] for r in rows], text, keys
        self.widths = [max([max(len(w) for w in c.split()), *(len(r[i]) for r in self.rows)])
                       for i, c in enumerate(cols)]

    @staticmethod
    def span(widths: list[int]) -> int:
        """Characters a rich table of these column widths takes (no outer edge: one space of padding either side
        of each inner separator)."""
        return sum(widths) + 3 * (len(widths) - 1)

    def parts(self, width: int) -> list[list[int]]:
        """Column indices of each part."""
        keys = list(range(min(self.keys, len(self.cols) - 1)))
        if self.span(self.widths) <= width:
            return [list(range(len(self.cols)))]
        parts, cur = [], list(keys)
        for i in range(len(keys), len(self.cols)):
            if len(cur) > len(keys) and self.span([self.widths[j] for j in cur + [i]]) > width:
                parts.append(cur)
                cur = list(keys)
            cur.append(i)
        return parts + [cur]

    def render(self, idx: list[int], width: int):
        """One part as a rich table; room left within ``width`` goes to the headers that would wrap."""
        from rich.table import Table

        widths = {i: self.widths[i] for i in idx}
        room = width - self.span(list(widths.values()))
        for i in idx:
            more = max(0, min(room, len(self.cols[i]) - widths[i]))
            widths[i] += more
            room -= more
        t = Table(show_edge=False, pad_edge=False)
        for i in idx:
            w = widths[i]
            t.add_column(textwrap.fill(self.cols[i], w, break_long_words=False, break_on_hyphens=False),
                         justify="left" if i < self.text else "right", width=w, no_wrap=True, overflow="crop")
        for r in self.rows:
            t.add_row(*(r[i] for i in idx))
        return t

    def records(self) -> list:
        """Each row as lines ``key · key`` then ``  header: value``: for a console too narrow for the key columns
        and one figure beside them."""
        from rich.text import Text

        k = min(self.keys, len(self.cols) - 1)
        out = []
        for r in self.rows:
            out.append(Text(" · ".join(r[:k]), no_wrap=True, overflow="ignore"))
            out += [Text(f"  {' '.join(self.cols[i].split())}: {r[i]}", no_wrap=True, overflow="ignore")
                    for i in range(k, len(self.cols))]
        return out

    def __rich_console__(self, console, options):
        width = options.max_width
        parts = self.parts(width)
        if any(self.span([self.widths[i] for i in idx]) > width for idx in parts):
            yield from self.records()
            return
        for idx in parts:
            yield self.render(idx, width)


def table(cols: list[str], rows: list[list[str]], text: int = 1, keys: int = 1) -> FitTable:
    """A :class:`FitTable` (kept as the sections' one way to make a table)."""
    return FitTable(cols, rows, text, keys)


# --------------------------------------------------------------------------- sections
def _did_it_pay(d: ReportData) -> list:
    rows, lines = [], []
    for rid in d.run_ids:
        a = d.answers.get(rid)
        if a is None:
            continue
        st = a.steps
        if a.basis == "measured":
            vs = f"{a.speedup:.2f}x vs {d.label(a.baseline_id) if a.baseline_id in d.labels else a.baseline_id}"
            vs += " (simulated)" if a.simulated else ""
        elif a.basis == "estimate":
            vs = f"~{a.speedup:.2f}x (estimate)"
        elif a.basis == "baseline":
            vs = "baseline"
        else:
            vs = "unknown"
        iv = f"{a.interval[0]:.2f}x – {a.interval[1]:.2f}x" if a.interval is not None else "—"
        rows.append([d.label(rid), a.policy or "?", f_int(st.timed_steps), fmt_s(st.p50_s),
                     f"{fmt_s(st.p20_s)} – {fmt_s(st.p80_s)}" if st.p20_s is not None else "—", vs, iv,
                     f"{st.warmup_steps} ({fmt_s(st.warmup_time_s)})"])
        lines.append(f"{d.label(rid)}: {headline(a, d.label)}")
    if not rows:
        return ["no run recorded a step"]
    sims = any(a.simulated for a in d.answers.values())
    note = ("Measured step time: per step the slowest rank's, median over the steps not marked warm-up; speed-up "
            "= the baseline run's (same stream, no balancing) / this run's; its 90 % interval comes from the steps "
            "both runs timed, resampled in pairs (the demo prints the same)." + (
                " A simulation's step times are the cost model's predictions for the replayed layers, not "
                "measurements." if sims else ""))
    return [note, table(["run", "policy", "timed steps", "step time p50", "p20 – p80", "speed-up",
                         "90 % interval", "warm-up steps (one-time)"], rows, text=2), *lines]


def _balance(d: ReportData) -> list:
    out = ["Plan quality: what the plans do to the rank loads on paper (max / mean rank load, 1.00 = perfect); "
           "not a measured time."]
    rows = [[d.label(r["run_id"]), str(r["layer"]), f_ratio(r["mean_before"]) + " → " + f_ratio(r["mean_after"]),
             f_ratio(r["max_before"]) + " → " + f_ratio(r["max_after"]), f_int(r["mean_straggler_after_tokens"]),
             f_int(r["plans"])]
            for r in d.rows.get("layer_summary", [])]
    if rows:
        out.append(table(["run", "layer", "mean imbalance before → after", "worst before → after",
                          "straggler after (tokens)", "plans"], rows, keys=2))
    shares = d.rows.get("policy_shares", [])
    if shares:
        per_run: dict[str, list[str]] = {}
        for r in shares:
            per_run.setdefault(r["run_id"], []).append(f"{r['policy']} {f_pct(r['share'])}")
        out.append(table(["run", "policies chosen (share of layer calls)"],
                         [[d.label(k), ", ".join(v)] for k, v in per_run.items()], text=2))
    return out


def _overhead(d: ReportData) -> list:
    plans = {r["run_id"]: r for r in d.rows.get("overview", [])}
    moved: dict[str, dict[str, float]] = {}
    for r in d.rows.get("transfer_summary", []):
        m = moved.setdefault(r["run_id"], {"s": 0.0, "n": 0})
        m["s"] += float(r["measured_s"] or 0.0)
        m["n"] += int(r["transfers"] or 0)
    rows = []
    for rid in d.run_ids:
        ov = plans.get(rid)
        if ov is None:
            continue
        n = max(1, int(ov["plans"] or 0))
        rows.append([d.label(rid), f_int(ov["plans"]), f_int(ov["transfers"]), f_bytes(ov["transfer_bytes"]),
                     f_bytes((ov["transfer_bytes"] or 0) / n), fmt_s(moved.get(rid, {}).get("s"))])
    out = [table(["run", "layer calls", "transfers", "moved", "moved per layer call", "transfer time (measured)"],
                 rows)] if rows else []
    cache = [r for r in d.rows.get("replica_cache", []) if (r["hits"] or 0) + (r["misses"] or 0) > 0]
    if cache:
        out.append(table(["run", "layer", "replica cache hits", "misses", "hit rate", "bytes saved"],
                         [[d.label(r["run_id"]), str(r["layer"]), f_int(r["hits"]), f_int(r["misses"]),
                           f_pct(r["hit_rate"]), f_bytes(r["bytes_saved"])] for r in cache], keys=2))
        out += _no_hits(d, cache)
    return out or ["no layer call recorded"]


def _no_hits(d: ReportData, cache: list[dict]) -> list[str]:
    """Why a layer's replica cache never hit (one line per run and reason): the cache keeps a replica while its
    master is unchanged, so it pays between the microbatches of one optimizer step and in serving."""
    why: dict[tuple[str, str], list[str]] = {}
    for r in cache:
        if r["hits"]:
            continue
        share = r.get("repeat_share")
        if r.get("kind") == "train" and (r.get("microbatches_per_step") or 1) <= 1:
            reason = ("every layer call follows an optimizer step, which changes the masters, so no kept replica is "
                      "still valid; the cache pays between the microbatches of one step (gradient accumulation) "
                      "and in serving")
        elif _bad(share) or not share:
            reason = ("no replica was placed on the same rank as in the layer's previous call"
                      + (" of the same step" if r.get("kind") == "train" else "") + ": the plans moved every "
                      "replica, so none could be reused")
        else:
            reason = (f"{f_pct(share)} of the replicas repeated the previous call's placement, but their masters "
                      "had changed in between (a write to the master weights)")
        why.setdefault((r["run_id"], reason), []).append(str(r["layer"]))
    return [f"Hit rate 0 % ({d.label(rid)}, layer{'s' if len(ls) > 1 else ''} {', '.join(ls)}): {reason}."
            for (rid, reason), ls in why.items()]


def _prediction(d: ReportData) -> list:
    rows, large, short = [], [], []
    for r in d.rows.get("prediction_summary", []):
        rows.append([d.label(r["run_id"]), r["policy"], f_int(r["samples"]), fmt_s(r["mean_predicted_s"]),
                     fmt_s(r["mean_measured_s"]), f_pct(r["mean_abs_rel_error"]), f_ratio(r["measured_over_predicted"])])
        err = r["mean_abs_rel_error"]
        if not _bad(err) and err > LARGE_ERROR:
            large.append(f"{d.label(r['run_id'])}/{r['policy']} {f_pct(err)}")
            a = d.answers.get(r["run_id"])
            if a is not None and a.steps.timed_steps < 50:
                short.append(a.steps.timed_steps)
    out = ["The cost model's prediction of each layer call against its measurement (slowest rank)."]
    if rows:
        out.append(table(["run", "chosen policy", "layer calls", "predicted (mean)", "measured (mean)",
                          "mean |error|", "measured / predicted"], rows, text=2))
    terms = d.rows.get("phase_prediction_errors", [])
    if terms:
        out.append("Per cost-model term: the mean predicted and measured time per layer call; median |error| = "
                   "the median over layer calls of |measured / predicted − 1|; * = the term is under "
                   f"{100 * SMALL_TERM:.0f} % of the layer call's measured time, too small to compare (a few µs "
                   "off make a large error).")
        out.append(table(["run", "term", "layer calls", "predicted (mean)", "measured (mean)", "median |error|",
                          "measured / predicted"], [_term_row(d, r, terms) for r in terms], text=2, keys=2))
    if large:
        out.append(f"Large prediction errors ({', '.join(large)}): the cost model calibrates itself from each "
                   "measured call, so its first predictions in a run are rough"
                   + (f" (these runs timed only {max(short)} steps)" if short else "")
                   + "; the per-term table shows which phase it misjudges. The decisions and the speed-up above "
                   "do not depend on these predictions being right: the speed-up is measured.")
    return out if len(out) > 1 else ["no prediction recorded"]


def _term_row(d: ReportData, r: dict, terms: list[dict]) -> list[str]:
    """One row of the per-term table; the error marked ``*`` when the term is too small to compare."""
    total = next((t["mean_measured_s"] for t in terms if t["run_id"] == r["run_id"] and t["term"] == "total_s"),
                 None)
    if _bad(total) or not total:  # no total recorded: the terms' measured times add up to the layer call
        total = sum(t["mean_measured_s"] or 0.0 for t in terms if t["run_id"] == r["run_id"] and t["term"] != "total_s")
    size = max(r.get("mean_predicted_s") or 0.0, r.get("mean_measured_s") or 0.0)
    small = bool(total) and size < SMALL_TERM * total
    return [d.label(r["run_id"]), r["term"], f_int(r["samples"]), fmt_s(r.get("mean_predicted_s")),
            fmt_s(r.get("mean_measured_s")), f_pct(r["median_abs_rel_error"]) + (" *" if small else ""),
            f_ratio(r["measured_over_predicted"])]


def _exploration(d: ReportData) -> list:
    """What an adaptive engine's probes took (issue 56): share of its chosen calls, measured cost."""
    rows = [[d.label(r["run_id"]), f_int(r["chosen_calls"]), f_int(r["probe_calls"]), f_pct(r["probe_share"]),
             fmt_s(r["probe_cost_s"]), f_pct(r["probe_cost_share"])] for r in d.rows.get("exploration", [])]
    if not rows:
        return ["no engine chose a policy (every layer ran its configured one)"]
    return ["Probes: calls that ran a candidate other than the policy in force to measure it; their cost is each "
            "one's layer time less that of the policy in force's calls beside it.",
            table(["run", "chosen calls", "probes", "share", "cost (measured)", "of the chosen calls' time"], rows)]


def _transfers(d: ReportData) -> list:
    rows = []
    for r in d.rows.get("transfer_summary", []):
        relay = (r["relay_bytes"] or 0) / r["bytes"] if r["bytes"] else None
        bw = r["bandwidth_Bps"]
        rows.append([d.label(r["run_id"]), str(r["layer"]), f_int(r["transfers"]), f_bytes(r["bytes"]),
                     f_pct(relay), f_int(r["measured"]), "—" if _bad(bw) else f"{bw / (1 << 20):,.0f} MiB/s"])
    if not rows:
        return ["no expert weights moved"]
    return [table(["run", "layer", "transfers", "moved", "via relay", "timed", "bandwidth (measured)"], rows, keys=2)]


def _memory(d: ReportData) -> list:
    rows = []
    for r in d.rows.get("activation_memory", []):
        if _bad(r["peak_busiest_after_MB"]):
            continue
        rows.append([d.label(r["run_id"]), str(r["layer"]), f"{r['peak_busiest_before_MB']:,.2f} MB",
                     f"{r['peak_busiest_after_MB']:,.2f} MB", f"{r['mean_rank_MB']:,.2f} MB",
                     f_ratio(r["peak_over_mean_before"]), f_ratio(r["peak_over_mean_after"])])
    if not rows:
        return ["no activation memory recorded (runs recorded before it, or no layer call settled)"]
    return [table(["run", "layer", "busiest rank, unbalanced", "busiest rank, balanced", "mean rank",
                   "peak / mean before", "peak / mean after"], rows, text=1, keys=2)]


def _runs(d: ReportData) -> list:
    rows = []
    for r in d.rows.get("overview", []):
        rows.append([d.label(r["run_id"]), r["kind"] or "", r["model"] or "", f_int(r["world_size"]), r["status"],
                     str(r["started_at"])[:19] if r["started_at"] else "—", f_int(r["steps"]),
                     f_int(r["warmup_steps"]), f_int(r["errors"])])
    return [table(["run", "kind", "model", "EP ranks", "status", "started (UTC)", "steps", "warm-up steps",
                   "recording errors"], rows, text=3)] if rows else []


SECTIONS: list[Section] = [
    Section("Did balancing pay?", _did_it_pay),
    Section("Balance (plan quality, warm-up excluded)", _balance),
    Section("Overhead", _overhead),
    Section("Prediction quality (warm-up excluded)", _prediction),
    Section("Exploration (warm-up excluded)", _exploration),
    Section("Transfers", _transfers),
    Section("Expert activation memory (peak per rank, warm-up excluded)", _memory),
    Section("Runs", _runs),
]


def render(console, data: ReportData, prefix: str | None) -> None:
    """Print every section of :data:`SECTIONS` on ``console``."""
    if prefix:
        console.print(f"runs {prefix}<run>: " + ", ".join(data.label(r) for r in data.run_ids), soft_wrap=False)
    for s in SECTIONS:
        console.print()
        console.rule(f"[bold]{s.title}[/bold]", align="left")
        for item in s.render(data):
            console.print(item)


def answers_json(answers: dict[str, Answer]) -> list[dict[str, Any]]:
    """The answers as JSON rows (``ultraep report --json``'s ``answer`` section)."""
    out = []
    for rid, a in answers.items():
        st = a.steps
        out.append({"run_id": rid, "policy": a.policy, "basis": a.basis, "timed_steps": st.timed_steps,
                    "warmup_steps": st.warmup_steps, "step_time_p50_s": st.p50_s, "step_time_p20_s": st.p20_s,
                    "step_time_p80_s": st.p80_s, "warmup_time_s": st.warmup_time_s, "baseline_id": a.baseline_id,
                    "baseline_p50_s": a.baseline_p50_s, "estimated_none_s": a.estimated_none_s,
                    "estimate_source": a.estimate_source, "speedup": a.speedup,
                    "speedup_interval_90": list(a.interval) if a.interval is not None else None,
                    "paired_steps": a.paired_steps, "headline": headline(a)})
    return out

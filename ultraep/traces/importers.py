"""Importers: peers' routing dumps → the canonical :class:`~ultraep.traces.Trace`.

Every importer follows its writer's real file layout (each module's docstring names the writer's repository,
file and commit, and says how records map to rows; ``docs/simulator.md`` has the table). Rules they share:

* **Directories are recognised by their contents** (:func:`detect_format`): Megatron's
  ``router_trace_rank*.jsonl``, UltraEP's ``*.manifest.json``, SGLang's recorder ``.pt`` files or per-rank
  CSVs, TensorRT-LLM's ``rank*.safetensors``, OLMoE's ``.pkl`` files, otherwise a recorded ultraep run.
* **Per-rank files of one run merge** into one trace with ``src_rank`` filled in (ranks renumbered
  ``0..n-1``; the original ids are kept in ``TraceMeta.extra['source_ranks']``).
* **Exact or refused**: a key, record kind or tensor the writer does not write is refused with one line
  naming the file, line or key and the value; nothing is merged on a guess. Counts are conserved: the
  builder checks the total it read against the total it wrote (:class:`~ultraep.traces._build.RowBuilder`).
* **No pickled code runs**: ``.pt`` files load with ``torch.load(weights_only=True)``, ``.npz`` with
  ``allow_pickle=False``, OLMoE pickles with an unpickler that admits only ``collections.Counter`` and numpy
  integer scalars.
* What a dump does not say (``num_experts``, ranks, top-k) comes from ``--trace-opt`` or is inferred and
  listed in ``TraceMeta.inferred`` (shown by ``ultraep trace info``). Widths are checked against
  :mod:`ultraep.limits` before anything that wide is allocated.

``parquet`` / ``csv`` (:mod:`.canonical`), ``sglang-pt`` / ``sglang-csv`` (:mod:`.sglang`),
``megatron-jsonl`` (:mod:`.megatron`), ``ultraep-npz`` (:mod:`.ultraep_profile`), ``trtllm``
(:mod:`.trtllm`), ``olmoe`` (:mod:`.olmoe`), and ``recorded-run``: our own runs, the telemetry store's
``layer_loads`` (exact ``[R, E]`` load of every recorded plan) of a run directory, a directory of runs
(``run_id=``) or an exported ``.duckdb`` file.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ultraep.errors import TraceError, UltraEPError, format_pydantic_error

from .trace import Trace, TraceMeta
from ._build import first_line as _first_line
from .canonical import import_csv, import_parquet, is_canonical_csv
from .megatron import import_megatron_jsonl, is_megatron_dir
from .olmoe import import_olmoe, is_olmoe_dir
from .sglang import CSV_FILE as _SGLANG_CSV
from .sglang import PT_FILE as _SGLANG_PT
from .sglang import import_sglang_csv, import_sglang_pt, is_sglang_dir
from .trtllm import RANK_FILE as _TRT_FILE
from .trtllm import import_trtllm, is_trtllm_dir, read_safetensors, write_safetensors  # noqa: F401 (re-exported)
from .ultraep_profile import CHUNK as _ULTRAEP_CHUNK
from .ultraep_profile import MANIFEST as _ULTRAEP_MANIFEST
from .ultraep_profile import import_ultraep_npz, is_ultraep_dir


# ---------------------------------------------------------------------------------------------- recorded runs
def import_recorded_run(path, run_id: str | None = None, **_) -> Trace:
    """Loads recorded by ultraep's telemetry (``layer_loads``: the exact ``[R, E]`` load of every recorded
    plan) from a run directory, a directory of runs (pick one with ``run_id``) or an exported ``.duckdb``.
    When several ranks recorded the same layer, the lowest rank's copy is used."""
    from ultraep.telemetry import open_run

    p = str(path)
    try:
        con = open_run(path)
    except Exception as exc:
        raise TraceError(p, f"is not a readable ultraep run ({exc})") from None
    runs = [r[0] for r in con.execute("SELECT DISTINCT run_id FROM layer_loads ORDER BY 1").fetchall()]
    if not runs:
        raise TraceError(p, "holds no recorded loads (layer_loads is empty; record plans with record_plan)")
    if run_id is None:
        if len(runs) > 1:
            raise TraceError(p, f"holds {len(runs)} runs; pick one with run_id= (CLI: --trace-opt run_id=RUN) "
                             f"({', '.join(runs[:5])}{', ...' if len(runs) > 5 else ''})", runs)
        run_id = runs[0]
    elif run_id not in runs:
        raise TraceError(f"{p}:run_id", f"{run_id!r} has no recorded loads; runs: {', '.join(runs[:5])}", run_id)
    rows = con.execute(
        "SELECT step, microbatch, layer, num_experts, num_ranks, load FROM layer_loads WHERE run_id = ? "
        "QUALIFY row_number() OVER (PARTITION BY step, microbatch, layer ORDER BY rank) = 1 "
        "ORDER BY layer, step, microbatch", [run_id]).fetchall()
    E, R = int(rows[0][3]), int(rows[0][4])
    cols = {c: [] for c in ("step", "microbatch", "layer", "src_rank", "expert", "tokens")}
    for step, mb, layer, e_, r_, load in rows:
        a = np.asarray(load, dtype=np.int64)
        if a.shape != (R, E):
            raise TraceError(f"{p}:layer_loads", f"step {step} layer {layer} has a load of shape {a.shape}, "
                             f"expected {(R, E)}", a.shape)
        r, e = np.nonzero(a)
        for c, v in (("step", step), ("microbatch", mb), ("layer", layer)):
            cols[c].append(np.full(r.size, v))
        cols["src_rank"].append(r)
        cols["expert"].append(e)
        cols["tokens"].append(a[r, e])
    meta = TraceMeta(num_experts=E, num_ranks=R, source="recorded-run", extra={"run_id": run_id})
    return Trace.from_columns(meta, p, **{c: np.concatenate(v) for c, v in cols.items()})


# ---------------------------------------------------------------------------------------------- dispatch
FORMATS = {
    "parquet": import_parquet,
    "csv": import_csv,
    "sglang-pt": import_sglang_pt,
    "sglang-csv": import_sglang_csv,
    "megatron-jsonl": import_megatron_jsonl,
    "ultraep-npz": import_ultraep_npz,
    "trtllm": import_trtllm,
    "olmoe": import_olmoe,
    "recorded-run": import_recorded_run,
}


def _detect_dir(p: Path) -> str:
    """A directory's format from the files in it (the first writer whose files are there)."""
    for fmt, test in (("megatron-jsonl", is_megatron_dir), ("ultraep-npz", is_ultraep_dir),
                      ("trtllm", is_trtllm_dir), ("olmoe", is_olmoe_dir)):
        if test(p):
            return fmt
    if is_sglang_dir(p):
        pts = any(_SGLANG_PT.match(f.name) for f in p.iterdir())
        csvs = any(_SGLANG_CSV.match(f.name) for f in p.iterdir())
        if pts and csvs:
            raise TraceError(str(p), "holds both SGLang .pt dumps and per-rank CSVs; pass --format sglang-pt or "
                             "sglang-csv")
        return "sglang-pt" if pts else "sglang-csv"
    return "recorded-run"


def detect_format(path) -> str:
    """The format of a file or directory, from its contents' names (a CSV from its header)."""
    p = Path(path)
    name = p.name
    if p.is_dir():
        return _detect_dir(p)
    if p.suffix == ".duckdb":
        return "recorded-run"
    if name.endswith(_ULTRAEP_MANIFEST) or _ULTRAEP_CHUNK.match(name):
        return "ultraep-npz"
    if _TRT_FILE.match(name):
        return "trtllm"
    if p.suffix == ".csv":
        return "csv" if is_canonical_csv(p) else "sglang-csv"
    by_suffix = {".parquet": "parquet", ".pt": "sglang-pt", ".pth": "sglang-pt", ".jsonl": "megatron-jsonl",
                 ".json": "olmoe", ".pkl": "olmoe"}
    if p.suffix in by_suffix:
        return by_suffix[p.suffix]
    raise TraceError(str(p), f"cannot tell the trace format from the name; pass format= (CLI: --format) one of "
                     f"{', '.join(sorted(FORMATS))}", name)


def _importer_options(fn) -> list[str]:
    """Options an importer takes by name (everything after ``path``; ``**_`` catch-alls excluded)."""
    import inspect

    named = [n for n, p in inspect.signature(fn).parameters.items()
             if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    return named[1:]


def load_trace(path, format: str = "auto", **options) -> Trace:
    """Read any supported trace (``format="auto"`` guesses from the name).

    A file is user input: whatever is wrong with it (truncated, binary where text belongs, a JSON value of the
    wrong kind, ...) raises :class:`TraceError` naming the file, never another exception. An option the
    format does not take raises too (it would otherwise be ignored without a word).
    """
    if not Path(path).exists():
        raise TraceError(str(path), "does not exist")
    fmt = detect_format(path) if format == "auto" else format
    if fmt not in FORMATS:
        raise TraceError("format", f"unknown trace format {fmt!r}; available: {', '.join(sorted(FORMATS))}", fmt)
    importer = FORMATS[fmt]
    accepted = _importer_options(importer)
    unknown = sorted(set(options) - set(accepted))
    if unknown:
        raise TraceError(f"{fmt}.{unknown[0]}", f"unknown option for trace format {fmt!r}; accepted: "
                         f"{', '.join(accepted) or '(none)'}", unknown[0])
    try:
        return importer(path, **options)
    except (TraceError, MemoryError):
        raise
    except UltraEPError:
        raise
    except Exception as exc:  # malformed content the importer did not anticipate: still one line naming the file
        from pydantic import ValidationError

        detail = (format_pydantic_error(exc).replace("\n", "; ") if isinstance(exc, ValidationError)
                  else f"{type(exc).__name__}: {_first_line(exc)}")
        raise TraceError(str(path), f"is not a readable {fmt} trace ({detail})", fmt) from None

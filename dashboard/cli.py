"""``ultraep dashboard [RUN_OR_DIR] [--port P] [--host H]``: the live Streamlit dashboard.

Runs ``python -m streamlit run dashboard/app.py`` bound to 127.0.0.1 by default (only this machine can
connect; pass ``--host 0.0.0.0`` to share it, knowing the dashboard has no authentication). Importing
this module is cheap: Streamlit loads in the child process only.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import threading
from importlib.util import find_spec
from pathlib import Path

DEFAULT_PORT = 8501
DEFAULT_HOST = "127.0.0.1"


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "dashboard",
        help="live dashboard (Streamlit) over recorded runs",
        description="Serve the ultraep dashboard: Overview, Layers, Experts, Policies, Transfers, Compare and "
        "SQL pages over a run directory or a directory of runs. Pages refresh themselves while a run is "
        "being written. Needs the 'dashboard' extra (pip install 'ultraep[dashboard]').",
    )
    p.add_argument("run", nargs="?", type=Path, default=Path("runs"),
                   help="a run directory (RUNS_DIR/RUN_ID) or a directory of runs (default: ./runs)")
    p.add_argument("--port", type=int, default=DEFAULT_PORT, help=f"port to serve on (default {DEFAULT_PORT})")
    p.add_argument("--host", default=DEFAULT_HOST,
                   help=f"address to bind (default {DEFAULT_HOST}: this machine only)")
    p.add_argument("--refresh", type=float, default=2.0,
                   help="seconds between refreshes of pages showing a live run (default 2)")
    p.add_argument("--dry-run", action="store_true", help="print the streamlit command instead of running it")
    p.set_defaults(func=run_dashboard)


def app_path() -> Path:
    return Path(__file__).resolve().with_name("app.py")


def streamlit_command(run: Path, *, port: int = DEFAULT_PORT, host: str = DEFAULT_HOST,
                      refresh: float = 2.0) -> list[str]:
    """The command line that serves the dashboard (the same one the tests and the benchmark start)."""
    return [
        sys.executable, "-m", "streamlit", "run", str(app_path()),
        "--server.address", host, "--server.port", str(int(port)), "--server.headless", "true",
        "--server.fileWatcherType", "none", "--server.runOnSave", "false",
        "--browser.gatherUsageStats", "false", "--global.developmentMode", "false",
        "--client.toolbarMode", "viewer", "--client.showSidebarNavigation", "false",
        "--", "--root", str(run), "--refresh", f"{float(refresh):g}",
    ]


def run_dashboard(args: argparse.Namespace) -> int:
    from ultraep.errors import UltraEPError

    run = Path(args.run).expanduser()
    if not run.exists():
        raise UltraEPError(str(run), "no such run directory or runs directory (record a run into it first, "
                                     "e.g. Recorder.open('runs', ...), or pass the directory that holds your runs)")
    if not run.is_dir():
        raise UltraEPError(str(run), "is a file; the dashboard reads a run directory or a directory of runs "
                                     "(query exported .duckdb files with `ultraep sql`)")
    if not 0 < int(args.port) < 65536:
        raise UltraEPError("--port", f"must be in 1..65535, got {args.port}", args.port)
    if not args.refresh > 0:
        raise UltraEPError("--refresh", f"must be > 0 seconds, got {args.refresh}", args.refresh)
    cmd = streamlit_command(run.resolve(), port=args.port, host=args.host, refresh=args.refresh)
    if args.dry_run:
        print(" ".join(cmd))
        return 0
    if find_spec("streamlit") is None or find_spec("plotly") is None:
        raise UltraEPError("dashboard", "needs streamlit and plotly: pip install 'ultraep[dashboard]'")
    print(f"ultraep dashboard: http://{args.host}:{args.port}  (runs: {run.resolve()}; Ctrl+C to stop)",
          file=sys.stderr)
    return serve(cmd)


# Signals that end the dashboard. The Streamlit server is a child process: left alone it would keep serving
# after its parent is gone (SIGTERM from a process manager, SIGHUP from a closed terminal, SIGINT sent to
# the parent's pid only), so each is passed on to it and the parent waits for it to exit.
_FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


def serve(cmd: list[str]) -> int:
    """Run ``cmd`` (the Streamlit server) until it exits, passing SIGTERM/SIGINT/SIGHUP on to it. On Linux
    the child also gets SIGTERM if this process dies without running any handler (SIGKILL).
    Returns 0 after an interrupt (Ctrl+C), else the child's exit status (128 + n if killed by signal n)."""
    child = subprocess.Popen(cmd, preexec_fn=_die_with_parent(os.getpid()) if sys.platform == "linux" else None)
    received: list[int] = []

    def forward(signum, _frame):
        received.append(signum)
        if child.poll() is None:
            child.send_signal(signum)

    main_thread = threading.current_thread() is threading.main_thread()  # handlers only install there
    previous = {s: signal.signal(s, forward) for s in _FORWARDED} if main_thread else {}
    try:
        rc = child.wait()
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        if child.poll() is None:  # an exception while waiting: never leave the server behind
            child.terminate()
            try:
                child.wait(timeout=10)
            except subprocess.TimeoutExpired:
                child.kill()
                child.wait()
    if signal.SIGINT in received:
        return 0
    return 128 - rc if rc < 0 else rc


def _die_with_parent(parent: int):
    """``preexec_fn`` for the child: ask Linux to send it SIGTERM when the parent dies (prctl
    PR_SET_PDEATHSIG), and exit at once if the parent is already gone (the race before the prctl)."""
    def setup() -> None:
        import ctypes

        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(1, int(signal.SIGTERM), 0, 0, 0)  # 1 = PR_SET_PDEATHSIG
        except (OSError, AttributeError):  # no prctl (unusual libc): signal forwarding still applies
            return
        if os.getppid() != parent:
            os._exit(0)
    return setup

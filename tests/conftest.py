"""Shared test set-up.

TRITON_INTERPRET must be set before any kernel module imports triton, so it is set here, at collection
start. Tests must not depend on the environment otherwise.
"""

import os
import signal

os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")

# A shell starts a background job (`make test &`, a script under nohup) with SIGINT ignored, and an ignored signal
# stays ignored across exec: the CLIs the tests start would never see the Ctrl-C the tests send them (measured: a
# `trace synth` ran its 31 CPU seconds to the end after SIGINT). A handled signal is reset to its default at exec,
# so handling it here gives every child the default again, whatever started pytest.
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


# The suite leaves the tree as it found it (tests/tree_guard.py): `git status` is taken when the run starts and
# compared when it ends; anything a test wrote into the checkout fails the run, named.
def pytest_sessionstart(session):
    import tree_guard

    session.config._tree_before = tree_guard.snapshot(session.config.rootpath)


def pytest_sessionfinish(session, exitstatus):
    import tree_guard

    before = getattr(session.config, "_tree_before", None)
    if before is None or hasattr(session.config, "workerinput"):
        return
    changed = tree_guard.changes(before, tree_guard.snapshot(session.config.rootpath) or {})
    if changed:
        session.config._tree_changed = changed
        session.exitstatus = 1


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    changed = getattr(config, "_tree_changed", None)
    if changed:
        terminalreporter.write_line(
            "FAILED the suite left the working tree changed (tests write to temporary directories only; a file "
            "you edited yourself while the suite ran shows here too): " + "; ".join(changed), red=True)

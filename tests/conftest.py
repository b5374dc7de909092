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

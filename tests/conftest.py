"""Shared test set-up.

TRITON_INTERPRET must be set before any kernel module imports triton, so it is set here, at collection
start. Tests must not depend on the environment otherwise.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")

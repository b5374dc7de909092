"""What an object holds: the items of every container and array reachable from it (issue 56, item 6).

The adaptive engine decides every layer call of a run (10^4-10^5 steps times the layers); anything it keeps per call
grows without end. :func:`footprint` counts what an object holds — every element of a list, tuple, set, dict (keys and
values) or deque, every element of a numpy array — and the bytes of those containers (``sys.getsizeof``, an array's
``nbytes``), walking instance attributes, each object once. The engine's state after N decisions and after 10 N must
then be the same (tests/test_engine_state.py; benchmarks/bench_long.py writes both in its rows).
"""

from __future__ import annotations

import sys
import types
from collections import deque

import numpy as np

_LEAVES = (str, bytes, int, float, complex, bool, type(None), np.generic)
_SKIP = (types.ModuleType, types.FunctionType, types.BuiltinFunctionType, types.MethodType, type)


def footprint(obj) -> tuple[int, int]:
    """``(items, bytes)`` held by ``obj`` and everything reachable from it (each object counted once)."""
    seen: set[int] = set()
    items = size = 0
    todo = [obj]
    while todo:
        o = todo.pop()
        if isinstance(o, _LEAVES) or isinstance(o, _SKIP) or id(o) in seen:
            continue
        seen.add(id(o))
        if isinstance(o, np.ndarray):
            items += int(o.size)
            size += int(o.nbytes)
            continue
        size += sys.getsizeof(o, 0)
        if isinstance(o, dict):
            items += len(o)
            todo.extend(o.keys())
            todo.extend(o.values())
        elif isinstance(o, (list, tuple, set, frozenset, deque)):
            items += len(o)
            todo.extend(o)
        else:
            if hasattr(o, "__dict__"):
                todo.append(vars(o))
            for cls in type(o).__mro__:
                for name in getattr(cls, "__slots__", ()):
                    if isinstance(name, str) and hasattr(o, name):
                        todo.append(getattr(o, name))
    return items, size

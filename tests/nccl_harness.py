"""NCCL's point-to-point rules, enforced on gloo: run the real runtime on gloo ranks, record every operation
it issues, and check the record against the rules NCCL would run it under.

Gloo matches a receive to a send by (peer, tag) and progresses every posted operation at once, so an order
that hangs on NCCL runs fine on gloo. NCCL does neither (issue 34):

* per (pair, process group), operations *start in issue order*, and each one holds the pair until it
  completes (a receive blocks the pair until the peer's matching send runs);
* tags are ignored: the j-th send from A to B on a group meets the j-th receive on B from A;
* the operations of one ``dist.batch_isend_irecv`` are one group: they start together and progress
  concurrently; the group holds the pair until all of its operations with that peer completed, and a host
  ``wait()`` on any of its requests returns only when the whole group completed (NCCL returns one work
  for a coalesced group).

Collectives are host barriers of their group (as on gloo). ``scope="communicator"`` checks the stricter
rule of one stream per communicator (every peer's operations of a rank and group in one queue), which is
what NCCL does for coalesced groups.

:func:`record` patches ``torch.distributed`` inside a rank; :func:`check` replays the ranks' records in
that model and raises :class:`NcclOrderingError` naming the pending operations when no rank can make
progress (a deadlock found by the model, not a timeout), when a send and the receive it would meet differ
in size, or when an operation never completes. :func:`run_ranks_nccl` does both around ``run_ranks``.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import sys
import threading
from collections import defaultdict

import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d


class NcclOrderingError(AssertionError):
    """The recorded point-to-point order would deadlock (or mismatch) under NCCL's rules."""


# ---------------------------------------------------------------------------------------------- recording
_P2P = ("isend", "irecv", "send", "recv", "batch_isend_irecv")
_COLLECTIVES = ("all_to_all_single", "all_to_all", "all_gather_into_tensor", "all_gather_single", "all_gather",
                "all_reduce", "broadcast", "barrier", "all_gather_object", "gather", "reduce_scatter_tensor",
                "reduce", "scatter", "broadcast_object_list")
_HERE = os.path.abspath(__file__)
_TRANSPORT_FILES = ("runtime/transport.py", "runtime/comm.py")


def _label() -> str:
    """Who issued the operation: the first frame of ``ultraep`` outside the transport (else of the test)."""
    f = sys._getframe(2)
    fallback = None
    while f is not None:
        fn = f.f_code.co_filename
        if "torch/" not in fn and os.path.abspath(fn) != _HERE:
            where = f"{f.f_code.co_qualname} ({os.path.basename(fn)}:{f.f_lineno})"
            if "ultraep/" in fn and not fn.endswith(_TRANSPORT_FILES):
                return where
            fallback = fallback or where
        f = f.f_back
    return fallback or "?"


def _group_key(group) -> str:
    g = group if group is not None else c10d._get_default_group()
    return g.group_name


class _Work:
    """A request whose ``wait()`` is recorded (``uids``: the operations it waits for)."""

    def __init__(self, work, trace: list, uids: tuple[int, ...]) -> None:
        self._work, self._trace, self._uids = work, trace, uids

    def wait(self, *args, **kwargs):
        self._trace.append(("wait", self._uids))
        return self._work.wait(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._work, name)


class Recorder:
    """The operations of one rank, in issue order (see the module docstring for the event tuples)."""

    def __init__(self) -> None:
        self.events: list[tuple] = []
        self._uid = itertools.count()
        self._batch = itertools.count()
        self._local = threading.local()

    def _inside(self) -> bool:
        return getattr(self._local, "depth", 0) > 0

    @contextlib.contextmanager
    def _nested(self):
        self._local.depth = getattr(self._local, "depth", 0) + 1
        try:
            yield
        finally:
            self._local.depth -= 1

    def _op(self, kind: str, tensor, peer: int, group, batch: int) -> int:
        uid = next(self._uid)
        nbytes = int(tensor.numel() * tensor.element_size())
        self.events.append(("op", uid, kind, int(peer), _group_key(group), nbytes, batch, _label()))
        return uid

    def patch(self, orig: dict):
        rec = self

        def p2p(name):
            fn = orig[name]
            kind = "send" if name in ("isend", "send") else "recv"

            def wrapper(tensor, *args, **kwargs):
                if rec._inside():
                    return fn(tensor, *args, **kwargs)
                bound = dict(zip(("peer", "group", "tag"), args))
                bound.update(kwargs)
                group = bound.get("group")
                peer = bound.get("dst", bound.get("src", bound.get("peer")))
                gpeer = bound.get("group_dst", bound.get("group_src"))
                if peer is None and gpeer is not None:
                    peer = dist.get_global_rank(group, gpeer) if group is not None else gpeer
                uid = rec._op(kind, tensor, peer, group, -1)
                with rec._nested():
                    out = fn(tensor, *args, **kwargs)
                if name in ("send", "recv"):  # blocking: issued and waited at once
                    rec.events.append(("wait", (uid,)))
                    return out
                return _Work(out, rec.events, (uid,))

            return wrapper

        def batch(ops):
            b = next(rec._batch)
            uids = tuple(rec._op("send" if o.op is c10d.isend else "recv", o.tensor, o.peer, o.group, b)
                         for o in ops)
            with rec._nested():
                works = orig["batch_isend_irecv"](ops)
            return [_Work(w, rec.events, uids) for w in works]

        def collective(name):
            fn = orig[name]

            def wrapper(*args, **kwargs):
                if rec._inside():
                    return fn(*args, **kwargs)
                group = kwargs.get("group")
                if group is None:  # positional group: the argument of type ProcessGroup, if any
                    group = next((a for a in args if isinstance(a, dist.ProcessGroup)), None)
                g = group if group is not None else c10d._get_default_group()
                rec.events.append(("coll", _group_key(g), name, tuple(dist.get_process_group_ranks(g))))
                with rec._nested():
                    return fn(*args, **kwargs)

            return wrapper

        new = {n: p2p(n) for n in ("isend", "irecv", "send", "recv")}
        new["batch_isend_irecv"] = batch
        new.update({n: collective(n) for n in _COLLECTIVES if n in orig})
        return new


@contextlib.contextmanager
def record():
    """Inside a rank: record every point-to-point operation, wait and collective until the block exits."""
    import ultraep.runtime.comm as comm

    rec = Recorder()
    orig = {n: getattr(c10d, n) for n in _P2P + _COLLECTIVES if hasattr(c10d, n)}
    new = rec.patch(orig)
    saved_alias = comm._all_gather
    alias = next((n for n in ("all_gather_single", "all_gather_into_tensor") if orig.get(n) is saved_alias), None)
    for mod in (c10d, dist):
        for n, fn in new.items():
            setattr(mod, n, fn)
    if alias is not None:
        comm._all_gather = new[alias]
    try:
        yield rec
    finally:
        for mod in (c10d, dist):
            for n, fn in orig.items():
                setattr(mod, n, fn)
        comm._all_gather = saved_alias


# ---------------------------------------------------------------------------------------------- checking
def _describe(traces, key) -> str:
    r, uid = key
    ev = traces[r][_index(traces, r)[uid]]
    _, _, kind, peer, g, nbytes, batch, label = ev
    where = "to" if kind == "send" else "from"
    grp = f", batch {batch}" if batch >= 0 else ""
    return f"rank {r}: {kind} {where} rank {peer} ({nbytes} B, group {g[:8]}{grp}) issued by {label}"


_INDEX_CACHE: dict[int, dict] = {}


def _index(traces, r) -> dict[int, int]:
    key = id(traces[r])
    if key not in _INDEX_CACHE:
        _INDEX_CACHE[key] = {ev[1]: i for i, ev in enumerate(traces[r]) if ev[0] == "op"}
    return _INDEX_CACHE[key]


def check(traces: list[list[tuple]], scope: str = "pair") -> None:
    """Replay every rank's record (``traces[r]``: :class:`Recorder` events) under NCCL's rules; raise
    :class:`NcclOrderingError` on a deadlock, a size mismatch or an operation that never completes."""
    if scope not in ("pair", "communicator"):
        raise ValueError(f"scope must be 'pair' or 'communicator', got {scope!r}")
    _INDEX_CACHE.clear()
    queues: dict[tuple, list[list]] = defaultdict(list)  # (rank, group[, peer]) -> units of op keys, issue order
    where: dict[tuple, tuple] = {}  # op key -> (queue key, unit index)
    channel: dict[tuple, dict[str, list]] = defaultdict(lambda: {"send": [], "recv": []})  # (src, dst, group)
    for r, tr in enumerate(traces):
        last_unit: dict[tuple, tuple] = {}
        for ev in tr:
            if ev[0] != "op":
                continue
            _, uid, kind, peer, g, _, batch, _ = ev
            key = (r, uid)
            qk = (r, g, peer) if scope == "pair" else (r, g)
            unit = ("batch", batch) if batch >= 0 else ("op", uid)
            if last_unit.get(qk) != unit:
                queues[qk].append([])
                last_unit[qk] = unit
            queues[qk][-1].append(key)
            where[key] = (qk, len(queues[qk]) - 1)
            channel[(r, peer, g) if kind == "send" else (peer, r, g)][kind].append(key)
    problems, match = [], {}
    for (src, dst, g), ch in channel.items():
        for j, (s, v) in enumerate(zip(ch["send"], ch["recv"])):
            match[s], match[v] = v, s
            bs = traces[s[0]][_index(traces, s[0])[s[1]]][5]
            bv = traces[v[0]][_index(traces, v[0])[v[1]]][5]
            if bs != bv:
                problems.append(f"message {j} from rank {src} to rank {dst}: NCCL ignores tags, so\n    "
                                f"{_describe(traces, s)}\n    meets {_describe(traces, v)} (sizes differ)")
    done: set[tuple] = set()
    issued: set[tuple] = set()
    head = {qk: 0 for qk in queues}
    pc = [0] * len(traces)
    arrived: dict[tuple, set] = defaultdict(set)
    coll_seq = [defaultdict(int) for _ in traces]

    def active(key) -> bool:
        qk, u = where[key]
        return key in issued and u <= head[qk]

    progress = True
    while progress:
        progress = False
        for r, tr in enumerate(traces):
            while pc[r] < len(tr):
                ev = tr[pc[r]]
                if ev[0] == "op":
                    issued.add((r, ev[1]))
                elif ev[0] == "wait":
                    if not all((r, u) in done for u in ev[1]):
                        break
                else:  # a collective: a barrier of its group
                    cid = (ev[1], coll_seq[r][ev[1]])
                    arrived[cid].add(r)
                    if not set(ev[3]) <= arrived[cid]:
                        break
                    coll_seq[r][ev[1]] += 1
                pc[r] += 1
                progress = True
        for key in list(issued - done):
            other = match.get(key)
            if other is not None and other not in done and active(key) and active(other):
                done.update((key, other))
                progress = True
        for qk, units in queues.items():
            while head[qk] < len(units) and all(k in done for k in units[head[qk]]):
                head[qk] += 1
                progress = True
    finished = all(pc[r] == len(tr) for r, tr in enumerate(traces))
    pending = [k for k in where if k not in done]
    unmatched = [k for k in pending if k not in match]
    if not finished or len(unmatched) < len(pending):  # a host or a matched operation is stuck
        lines = [f"NCCL point-to-point deadlock ({scope} scope): no rank can make progress."]
        for r, tr in enumerate(traces):
            if pc[r] < len(tr):
                ev = tr[pc[r]]
                if ev[0] == "wait":
                    lines.append(f"  rank {r} blocks in wait() for: " + "; ".join(
                        _describe(traces, (r, u))[len(f'rank {r}: '):] for u in ev[1] if (r, u) not in done))
                else:
                    lines.append(f"  rank {r} blocks in {ev[2]} on group {ev[1][:8]}")
        lines.append("  operations holding their pair (first pending on each):")
        for qk, units in sorted(queues.items()):
            if head[qk] < len(units):
                k = next(k for k in units[head[qk]] if k not in done)
                lines.append("    " + _describe(traces, k) + ("" if k in issued else " [not yet issued]"))
        problems.insert(0, "\n".join(lines))
    if unmatched:
        problems.append("operations that never complete (no matching operation on the peer):\n" + "\n".join(
            "    " + _describe(traces, k) for k in unmatched[:20]))
    if problems:
        raise NcclOrderingError("\n".join(problems))


# ---------------------------------------------------------------------------------------------- running
def _traced(rank, world, fn, args):
    with record() as rec:
        out = fn(rank, world, *args)
    return out, rec.events


def run_ranks_nccl(fn, world_size: int, *args, scope: str = "pair", timeout: float = 300.0):
    """``run_ranks(fn, world_size, *args)`` with every rank's operations checked under NCCL's rules."""
    from dist_utils import run_ranks_unchecked

    got = run_ranks_unchecked(_traced, world_size, fn, args, timeout=timeout)
    check([events for _, events in got], scope=scope)
    return [out for out, _ in got]

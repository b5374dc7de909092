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
  for a coalesced group);
* a collective joins its group's queue (issue 53): on every rank it starts only after every operation issued
  before it on that group completed (a collective issued while a batch is still pending waits behind it), and
  it completes once every rank of the group reached it; the host blocks on it (a barrier, as on gloo). In
  ``"pair"`` scope it queues behind the rank's operations with every peer of the group, in
  ``"communicator"`` scope in the group's one queue;
* a batch that *opens* a group — the group's first operation on a rank that is a batch or a collective (single
  ``isend``/``irecv`` use NCCL's pair communicators and open nothing) — must be a batch on every rank of the
  group: NCCL creates the group's communicator with that first call and every rank must join it
  (``torch.distributed.batch_isend_irecv``'s documentation).

``scope="communicator"`` checks the stricter rule of one stream per communicator (every peer's operations of a
rank and group in one queue), which is what NCCL does for coalesced groups.

:func:`record` patches ``torch.distributed`` inside a rank; :func:`check` replays the ranks' records in
that model and raises :class:`NcclOrderingError` naming the pending operations when no rank can make
progress (a deadlock found by the model, not a timeout), when a send and the receive it would meet differ
in size, when an operation never completes, or when a batch opens a group without every rank.
:func:`run_ranks_nccl` does both around ``run_ranks`` and then checks that the record holds the
point-to-point operations the test expects (``p2p=``: by default at least one matched send and receive, so
a run that moved nothing between ranks — an empty record — fails).

What is recorded, and what is not. Recorded: every point-to-point call and collective made from Python through
``torch.distributed`` (including FSDP2's all-gathers and reduce-scatters, which it issues from Python), every
collective method called from Python straight on a ``ProcessGroup`` object (``pg.allreduce(...)``,
``pg.alltoall_base(...)``: the class's methods are patched), and ``dist._broadcast_coalesced`` (DDP's
parameter and buffer broadcast at construction). Not recorded — the harness cannot see these, because they are
issued from C++ without passing through Python: DDP's bucket all-reduces during the backward (its ``Reducer``
calls the process group in C++), functional collectives (``torch.ops._c10d_functional.*``, e.g. DTensor's
``full_tensor()``) and anything a C++ extension issues. Those run on the group they were given — DDP on the
default group and FSDP2 on its mesh, never on the runtime's token or transfer groups — so they cannot queue
behind the runtime's batches in this model; a test that adds such a collective on a group that carries the
runtime's batches is outside what the harness checks (docs/design.md, "Guards that can fail").
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
                "reduce_scatter_single", "reduce", "scatter", "broadcast_object_list", "_broadcast_coalesced")
#: collective methods of ``ProcessGroup`` (what ``torch.distributed``'s functions call, and what code may call
#: directly on a group object): patched on the class, so a direct call is recorded too
_PG_COLLECTIVES = ("allreduce", "allreduce_coalesced", "allgather", "_allgather_base", "allgather_coalesced",
                   "allgather_into_tensor_coalesced", "all_gather_single", "alltoall", "alltoall_base", "broadcast",
                   "barrier", "reduce", "reduce_scatter", "_reduce_scatter_base", "reduce_scatter_single",
                   "reduce_scatter_tensor_coalesced", "gather", "scatter")
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
        self._groups: set[str] = set()

    def _inside(self) -> bool:
        return getattr(self._local, "depth", 0) > 0

    @contextlib.contextmanager
    def _nested(self):
        self._local.depth = getattr(self._local, "depth", 0) + 1
        try:
            yield
        finally:
            self._local.depth -= 1

    def _group(self, group) -> str:
        """The group's key; its ranks are recorded (a ``("group", key, ranks)`` event) the first time it is seen."""
        g = group if group is not None else c10d._get_default_group()
        key = g.group_name
        if key not in self._groups:
            self._groups.add(key)
            self.events.append(("group", key, tuple(dist.get_process_group_ranks(g))))
        return key

    def _op(self, kind: str, tensor, peer: int, group, batch: int) -> int:
        uid = next(self._uid)
        nbytes = int(tensor.numel() * tensor.element_size())
        g = self._group(group)
        self.events.append(("op", uid, kind, int(peer), g, nbytes, batch, _label()))
        return uid

    def _coll(self, group, name: str) -> None:
        g = group if group is not None else c10d._get_default_group()
        key = self._group(g)
        self.events.append(("coll", key, name, tuple(dist.get_process_group_ranks(g))))

    def patch(self, orig: dict, orig_pg: dict):
        """The replacements of ``orig`` (``torch.distributed`` functions) and of ``orig_pg`` (``ProcessGroup``
        methods): ``(functions, methods)``."""
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
                group = kwargs.get("group", kwargs.get("process_group"))
                if group is None:  # positional group: the argument of type ProcessGroup, if any
                    group = next((a for a in args if isinstance(a, dist.ProcessGroup)), None)
                rec._coll(group, name)
                with rec._nested():
                    return fn(*args, **kwargs)

            return wrapper

        def method(name):  # a collective called on a ProcessGroup object (self: the group)
            fn = orig_pg[name]

            def wrapper(self, *args, **kwargs):
                if rec._inside():
                    return fn(self, *args, **kwargs)
                rec._coll(self, f"ProcessGroup.{name}")
                with rec._nested():
                    return fn(self, *args, **kwargs)

            return wrapper

        new = {n: p2p(n) for n in ("isend", "irecv", "send", "recv")}
        new["batch_isend_irecv"] = batch
        new.update({n: collective(n) for n in _COLLECTIVES if n in orig})
        return new, {n: method(n) for n in orig_pg}


@contextlib.contextmanager
def record():
    """Inside a rank: record every point-to-point operation, wait and collective until the block exits."""
    import ultraep.runtime.comm as comm

    rec = Recorder()
    orig = {n: getattr(c10d, n, None) or getattr(dist, n) for n in _P2P + _COLLECTIVES
            if hasattr(c10d, n) or hasattr(dist, n)}
    orig_pg = {n: getattr(dist.ProcessGroup, n) for n in _PG_COLLECTIVES if hasattr(dist.ProcessGroup, n)}
    new, new_pg = rec.patch(orig, orig_pg)
    saved_alias = comm._all_gather
    alias = next((n for n in ("all_gather_single", "all_gather_into_tensor") if orig.get(n) is saved_alias), None)
    for mod in (c10d, dist):
        for n, fn in new.items():
            if hasattr(mod, n):
                setattr(mod, n, fn)
    for n, fn in new_pg.items():
        setattr(dist.ProcessGroup, n, fn)
    if alias is not None:
        comm._all_gather = new[alias]
    try:
        yield rec
    finally:
        for mod in (c10d, dist):
            for n, fn in orig.items():
                if hasattr(mod, n):
                    setattr(mod, n, fn)
        for n, fn in orig_pg.items():
            setattr(dist.ProcessGroup, n, fn)
        comm._all_gather = saved_alias


# ---------------------------------------------------------------------------------------------- checking
def _describe(traces, key) -> str:
    r, uid = key
    if isinstance(uid, tuple):  # a collective: ("coll", group, sequence number, name)
        _, g, seq, name = uid
        return f"rank {r}: {name} on group {g[:8]} (its collective {seq} there)"
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


def _opening_problems(traces) -> list[str]:
    """NCCL creates a group's communicator with its first batch or collective, and every rank must join that
    call: where some rank opens a group with a batch, every rank of the group must open it with a batch."""
    members: dict[str, tuple] = {}
    opener: dict[str, dict[int, tuple]] = defaultdict(dict)  # group -> {rank: its first batch or collective}
    for r, tr in enumerate(traces):
        for ev in tr:
            if ev[0] == "group":
                members.setdefault(ev[1], tuple(ev[2]))
            elif ev[0] == "coll" and r not in opener[ev[1]]:
                opener[ev[1]][r] = ev
            elif ev[0] == "op" and ev[6] >= 0 and r not in opener[ev[4]]:
                opener[ev[4]][r] = ev
    problems = []
    for g, first in opener.items():
        batches = {r: ev for r, ev in first.items() if ev[0] == "op"}
        if not batches:
            continue
        ranks = members.get(g, tuple(sorted(first)))
        missing = [r for r in ranks if r < len(traces) and r not in batches]
        if missing:
            r, ev = next(iter(sorted(batches.items())))
            how = "; ".join(f"rank {m} " + (f"opens it with {first[m][2]}" if m in first else "never opens it")
                            for m in missing)
            problems.append(
                f"group {g[:8]} (ranks {list(ranks)}) is opened by a batch that does not include every rank: "
                f"rank {r}'s batch {ev[6]} (issued by {ev[7]}) is its first operation there, but {how}. NCCL "
                "creates the group's communicator with that first call and every rank must join it "
                "(torch.distributed.batch_isend_irecv): open the group with a collective every rank joins first")
    return problems


def check(traces: list[list[tuple]], scope: str = "pair") -> None:
    """Replay every rank's record (``traces[r]``: :class:`Recorder` events) under NCCL's rules; raise
    :class:`NcclOrderingError` on a deadlock, a size mismatch, an operation that never completes or a batch that
    opens a group without every rank."""
    if scope not in ("pair", "communicator"):
        raise ValueError(f"scope must be 'pair' or 'communicator', got {scope!r}")
    _INDEX_CACHE.clear()
    queues: dict[tuple, list[list]] = defaultdict(list)  # (rank, group[, peer]) -> units of keys, issue order
    where: dict[tuple, list[tuple]] = defaultdict(list)  # key -> [(queue key, unit index)]
    channel: dict[tuple, dict[str, list]] = defaultdict(lambda: {"send": [], "recv": []})  # (src, dst, group)
    coll_at: dict[tuple, tuple] = {}  # (rank, event index) -> the collective's key on that rank
    coll_ranks: dict[tuple, tuple] = {}  # collective id (group, seq, name) -> its group's ranks
    for r, tr in enumerate(traces):
        last_unit: dict[tuple, tuple] = {}
        seq: dict[str, int] = defaultdict(int)
        for i, ev in enumerate(tr):
            if ev[0] == "coll":
                g, ranks = ev[1], tuple(ev[3])
                cid = ("coll", g, seq[g], ev[2])
                seq[g] += 1
                key = coll_at[(r, i)] = (r, cid)
                coll_ranks.setdefault(cid[:3], ranks)
                qks = [(r, g)] if scope == "communicator" else [(r, g, p) for p in ranks if p != r] or [(r, g, None)]
                for qk in qks:  # it waits behind everything issued before it on the group, and holds what follows
                    queues[qk].append([key])
                    last_unit[qk] = cid
                    where[key].append((qk, len(queues[qk]) - 1))
                continue
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
            where[key].append((qk, len(queues[qk]) - 1))
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
    problems += _opening_problems(traces)
    done: set[tuple] = set()
    issued: set[tuple] = set()
    head = {qk: 0 for qk in queues}
    pc = [0] * len(traces)

    def at_head(key) -> bool:
        return key in issued and all(u <= head[qk] for qk, u in where[key])

    def coll_members(cid) -> list[tuple]:
        return [(m, cid) for m in coll_ranks[cid[:3]]]

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
                elif ev[0] == "coll":  # issued into the group's queue; the host waits until it completed
                    key = coll_at[(r, pc[r])]
                    if key not in issued:
                        issued.add(key)
                        progress = True
                    if key not in done:
                        break
                pc[r] += 1
                progress = True
        for key in list(issued - done):
            if isinstance(key[1], tuple):  # a collective: every rank of the group reached it in its queue
                keys = coll_members(key[1])
                if all(k in where and at_head(k) for k in keys):
                    done.update(keys)
                    progress = True
                continue
            other = match.get(key)
            if other is not None and other not in done and at_head(key) and at_head(other):
                done.update((key, other))
                progress = True
        for qk, units in queues.items():
            while head[qk] < len(units) and all(k in done for k in units[head[qk]]):
                head[qk] += 1
                progress = True
    finished = all(pc[r] == len(tr) for r, tr in enumerate(traces))
    pending = [k for k in where if k not in done and not isinstance(k[1], tuple)]
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
        lines.append("  operations holding their queue (first pending on each):")
        for qk, units in sorted(queues.items(), key=lambda kv: str(kv[0])):
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
class P2PRecord:
    """What the ranks' records say moved between ranks: per (source, destination), the point-to-point messages
    and bytes (sends; on a checked record every send met its receive), and the collectives issued."""

    def __init__(self, traces: list[list[tuple]]) -> None:
        self.traces = traces
        self.messages: dict[tuple[int, int], int] = defaultdict(int)
        self.bytes: dict[tuple[int, int], int] = defaultdict(int)
        self.receives = 0
        self.collectives: list[tuple[int, str, str]] = []  # (rank, group, name)
        for r, tr in enumerate(traces):
            for ev in tr:
                if ev[0] == "op" and ev[2] == "send":
                    self.messages[(r, ev[3])] += 1
                    self.bytes[(r, ev[3])] += ev[5]
                elif ev[0] == "op":
                    self.receives += 1
                elif ev[0] == "coll":
                    self.collectives.append((r, ev[1], ev[2]))

    @property
    def sends(self) -> int:
        return sum(self.messages.values())

    def both_ways(self) -> list[tuple[int, int]]:
        """The pairs ``(a, b)``, ``a < b``, with bytes sent from a to b and from b to a."""
        return sorted((a, b) for (a, b) in self.bytes if a < b and self.bytes.get((b, a), 0) > 0
                      and self.bytes[(a, b)] > 0)

    def __repr__(self) -> str:
        return (f"P2PRecord({self.sends} sends, {self.receives} receives, bytes {dict(self.bytes)}, "
                f"{len(self.collectives)} collectives)")


def expect_p2p(record: P2PRecord, p2p) -> None:
    """The record holds the point-to-point operations the test expects: ``p2p=True`` at least one send and one
    receive (an empty record fails: the run moved nothing between ranks), ``False`` none at all, a callable
    ``p2p(record)`` whatever it asserts."""
    if callable(p2p):
        p2p(record)
    elif p2p:
        if not (record.sends and record.receives):
            raise NcclOrderingError(f"the record holds no point-to-point operation ({record}): the run moved nothing "
                                    "between ranks, so its ordering checked nothing (pass p2p=False where "
                                    "nothing is to move)")
    elif record.sends or record.receives:
        raise NcclOrderingError(f"the test expects no point-to-point operation, the record holds some: {record}")


def _traced(rank, world, fn, args):
    with record() as rec:
        out = fn(rank, world, *args)
    return out, rec.events


def run_ranks_nccl(fn, world_size: int, *args, scope: str = "pair", timeout: float = 300.0, p2p=True):
    """``run_ranks(fn, world_size, *args)`` with every rank's operations checked under NCCL's rules, and the record
    checked to hold the point-to-point operations the test expects (``p2p``: see :func:`expect_p2p`)."""
    from dist_utils import run_ranks_unchecked

    got = run_ranks_unchecked(_traced, world_size, fn, args, timeout=timeout)
    traces = [events for _, events in got]
    check(traces, scope=scope)
    expect_p2p(P2PRecord(traces), p2p)
    return [out for out, _ in got]

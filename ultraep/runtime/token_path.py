"""Steps 4-7 of a balanced layer's call: the token path of one plan (docs/design.md, How data flows).

Legend: T tokens of this rank, K top-k, H hidden, R ranks, M master slots, S = M + N slots, Nr rows received.

    Step 4: reroute logical top-k ids to physical instances (rank, slot) by the plan's quotas; order the (token, k)
            rows by destination slot.
    Step 5: dispatch all-to-all (split sizes straight from the plan's routes); relays forward replica weights.
    Step 6: :func:`run_slots` — the masters' experts over their rows, then the replica slots
            (:class:`~ultraep.runtime.replicas.ReplicaExperts`, which wait for their weights only now).
    Step 7: combine all-to-all (the reverse exchange), then the weighted sum per token.

Every rank issues the two all-to-alls in this order (their backward: combine's, then dispatch's); the replica
job's relay posts sit between them, where every rank derives them from the same plan.
"""

from __future__ import annotations

import numpy as np
import torch

from ultraep.kernels import upload
from ultraep.runtime.comm import AllToAll
from ultraep.runtime.recompute import RecomputeAnchor
from ultraep.runtime.replicas import GradSink, ReplicaExperts


def route_tokens(layer, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor, plan,
                 job, needs_backward: bool, marks: dict, clk, replay=None):
    """Steps 4-7 of ``plan``: reroute, dispatch, experts (masters, then replicas), combine. ``replay``: the
    call is an activation-checkpoint recompute whose original graph runs the backward (only the tensors it
    saves are recomputed: no relay, no gradient sink, replicas computed from the weights already here).
    Returns (output ``[T, H]``, the dispatched rows, (t4, t5, t6, t7), the masters' seconds)."""
    from ultraep.kernels import dispatch_layout, permute, reroute, reroute_table, unpermute

    rt = layer.runtime
    R, S, me = layer.topology.num_ranks, layer.topology.num_slots, rt.rank
    phys = reroute(top_k_index, reroute_table(plan, me, device=top_k_index.device))
    lay = dispatch_layout(phys, R, S, num_rows=int(plan.routes_RRS[me].sum()))
    send = permute(hidden_states, lay)
    in_splits = [int(c) for c in plan.routes_RRS[me].sum(axis=1)]  # = the layout's, without a host sync
    C = plan.routes_RRS[:, me, :]  # [R, S] rows each source sends to each of my slots
    out_splits = [int(c) for c in C.sum(axis=1)]
    t4 = clk.now()
    # Step 5: dispatch; relays forward the weights they received.
    with layer.collective("token dispatch (all-to-all)"):
        recv = AllToAll.apply(send, out_splits, in_splits, rt.group, lambda: layer.collective.timed(
            clk, marks, "dispatch_bwd_s", "token dispatch gradient (all-to-all)"))
    layer.recording.event("dispatched", layer.layer)
    t5 = clk.now()
    # per-expert views of the masters (one stacking backward instead of a full-size zero fill per slot)
    unbound = [p.unbind(0) for p in layer.master_params()]
    if job is not None and replay is None:
        job.relay()
        if needs_backward:
            first = layer.first_expert
            recv = GradSink.apply(recv, job, *[u[e - first] for e in job.contributing() for u in unbound])
    # Step 6: experts on masters, then replicas.
    y_recv, master_s = layer._experts(recv, C, plan, job, unbound, clk, replay)
    t6 = clk.now()
    # Step 7: return rows and combine.
    with layer.collective("token combine (all-to-all)"):
        y_send = AllToAll.apply(y_recv, in_splits, out_splits, rt.group, lambda: layer.collective.timed(
            clk, marks, "combine_bwd_s", "token combine gradient (all-to-all)"))
    out = unpermute(y_send, top_k_weights.to(y_send.dtype), lay)
    if needs_backward and out.requires_grad:  # a checkpoint's recompute starts here on every rank
        out = RecomputeAnchor.apply(out, out.new_empty(0))
    layer.recording.event("combined", layer.layer)
    if job is not None and replay is None:
        job.finish_sends()
    return out, send, (t4, t5, t6, clk.now()), master_s


def run_slots(layer, recv: torch.Tensor, C: np.ndarray, plan, job, unbound: list, clk,
              replay=None) -> tuple[torch.Tensor, float]:
    """``recv`` ``[Nr, H]`` → outputs ``[Nr, H]`` of ``layer`` (a ``BalancedExperts``), and the masters' seconds.

    ``C``: ``[R, S]`` rows each source sent to each slot; ``unbound``: per master tensor, its ``M`` per-expert views;
    ``job``: the call's replica job (None without replicas); ``replay``: an activation-checkpoint recompute (the
    replicas compute from the weights ``job`` holds)."""
    t = plan.topology
    M, S = t.num_masters, t.num_slots
    counts_S = C.sum(axis=0)
    # rows arrive source-major, slot-minor: sort them by slot (stable) to run each slot on one chunk
    slot_of_row = np.repeat(np.tile(np.arange(S), C.shape[0]), C.ravel())
    order_np = np.argsort(slot_of_row, kind="stable")
    inv_np = np.empty_like(order_np)
    inv_np[order_np] = np.arange(order_np.size)
    order, inv = upload([order_np, inv_np], recv.device)  # one copy that does not block the host
    x = recv.index_select(0, order)
    t0 = clk.now()
    outs, at = [], 0
    params = layer.master_params()
    for s in range(M):
        c = int(counts_S[s])
        if c:
            outs.append(layer.adapter.forward(layer.container, x[at:at + c], [u[s] for u in unbound]))
        at += c
    layer.recording.event("master_compute", layer.layer)
    master_s = clk.now() - t0
    if job is not None:
        job.counts = [int(c) for c in counts_S[M:]]  # rows per replica slot, in slot order
        if replay is not None:
            outs.append(job.recompute(x[at:]))
        else:  # shared parameters ride along: the replica rows' gradient of e.g. a post-expert norm reaches them
            outs.append(ReplicaExperts.apply(x[at:], job, *params, *layer.shared_params()))
    y_sorted = torch.cat(outs) if outs else x[:0]
    if not counts_S[:M].any() and torch.is_grad_enabled():
        # No row reached this rank's masters: tie them into the graph with a zero term so they still get a
        # (zero) gradient, as the unbalanced model's full parameters do, and optimizers treat them alike.
        y_sorted = y_sorted + sum((p.reshape(-1)[:1] * 0).sum()
                                  for p in params + layer.shared_params()).to(y_sorted.dtype)
    return y_sorted.index_select(0, inv), master_s

"""Train a tiny transformers MoE model with ultraep under torchrun, recording the run.

    torchrun --standalone --nproc-per-node 2 examples/train_torchrun.py --steps 8 --runs-dir runs
    ultraep report runs/<run_id>          # or: ultraep dashboard runs

Every rank builds the same Qwen3-MoE model from its config (random weights, nothing downloaded), wraps
it with ``ultraep.wrap`` (expert parallelism over all ranks: each rank holds the masters of
``num_experts / world_size`` experts, plus ``--slots`` redundant slots for replicas of hot experts), hands it
to ``DistributedDataParallel`` and trains it on its own shard of a synthetic token stream. The backend is NCCL when every
local rank has a GPU of its own, gloo on CPU otherwise.

What a training loop adds for ultraep, and why:

* ``Recorder.open(runs_dir, run_name, world_size=..., rank=...)`` on every rank, handed to ``wrap``:
  every plan, decision, transfer and timing is recorded per rank into ``runs_dir/run_name``.
* ``DistributedDataParallel(ultraep.wrap(model))``, in that order: ``wrap`` keeps the expert masters out of
  DDP (each rank holds different experts; their gradients already gather every rank's tokens) and averages
  their gradients as DDP averages the rest, so each rank's ``loss.backward()`` gives the gradients of the
  mean loss over the global batch, exactly as the unwrapped model trained on it. Nothing is all-reduced by
  hand.
* ``ultraep.runtime_of(model).next_step(loss=...)`` once per optimizer step closes the step in the
  record; the runtime marks its step 0 (allocations, first plans) as warm-up, and summaries leave it out.

Rank 0 prints a short summary read back from the recorded run (``ultraep.telemetry.open_run``).

``examples/train_ddp.py`` is the same loop at its shortest (the README shows it whole), with activation
checkpointing; this script adds options (policy, slots, sizes, run name) and the summary.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

import ultraep
from ultraep import BalancerConfig
from ultraep.models import build_model
from ultraep.telemetry import Recorder, open_run, queries

VOCAB = 64


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=8, help="optimizer steps (default 8)")
    p.add_argument("--runs-dir", default="runs", help="where the run is recorded (default runs/)")
    p.add_argument("--run-name", default=None, help="run id (default: a fresh timestamped id from rank 0)")
    p.add_argument("--policy", default="quota", help="balancing policy (default quota)")
    p.add_argument("--slots", type=int, default=1, help="redundant expert slots per rank (default 1)")
    p.add_argument("--experts", type=int, default=8, help="experts per MoE layer (default 8)")
    p.add_argument("--layers", type=int, default=2, help="decoder layers, all MoE (default 2)")
    p.add_argument("--batch", type=int, default=4, help="sequences per rank and step (default 4)")
    p.add_argument("--seq", type=int, default=32, help="tokens per sequence (default 32)")
    p.add_argument("--lr", type=float, default=1e-2)
    return p.parse_args(argv)


def batch(step: int, rank: int, args, device) -> torch.Tensor:
    """Token ids [batch, seq] for this rank and step: arithmetic sequences modulo the vocabulary, so the
    next token is predictable and the loss falls within a few steps; each rank gets its own shard."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    start = torch.randint(0, VOCAB, (args.batch, 1), generator=g)
    stride = torch.randint(1, 4, (args.batch, 1), generator=g)
    return ((start + stride * torch.arange(args.seq)) % VOCAB).to(device)


def train(args, rank: int, world: int, device) -> tuple[str, list[float], list[float]]:
    """Run the training loop on this rank; returns (run id, losses, step times in s)."""
    config = BalancerConfig(policy=args.policy, num_redundant_slots=args.slots)
    model = build_model("qwen3-moe", num_experts=args.experts, layers=args.layers, vocab=VOCAB, seed=0).to(device)
    rec = Recorder.open(args.runs_dir, args.run_name, config=config, model="qwen3-moe", world_size=world, rank=rank,
                        extra={"example": "train_torchrun"})
    losses, times = [], []
    try:
        model = DistributedDataParallel(ultraep.wrap(model, config, recorder=rec))
        runtime = ultraep.runtime_of(model)
        opt = torch.optim.Adam(model.parameters(), lr=args.lr)
        for step in range(args.steps):
            ids = batch(step, rank, args, device)
            t0 = time.perf_counter()
            opt.zero_grad(set_to_none=True)
            logits = model(input_ids=ids).logits
            loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), ids[:, 1:].reshape(-1))
            loss.backward()
            opt.step()
            times.append(time.perf_counter() - t0)
            losses.append(float(loss.detach()))
            runtime.next_step(loss=losses[-1], step_time_s=times[-1])
    finally:
        rec.close()
    return rec.run_id, losses, times


def summary(run_dir: str, losses: list[float], times: list[float]) -> str:
    """A few lines about the recorded run, read back from the store."""
    con = open_run(run_dir)
    try:
        cols, rows = queries.run(con, queries.OVERVIEW)
        ov = dict(zip(cols, rows[0]))
    finally:
        con.close()
    settled = times[1:] or times
    return "\n".join([
        f"run {ov['run_id']}: {ov['steps']} steps ({ov['warmup_steps']} warm-up), {ov['ranks_recording']} ranks "
        f"recording, {ov['plans']} layer plans, {ov['transfers']} expert transfers, {ov['errors']} recording errors",
        f"loss {losses[0]:.3f} -> {losses[-1]:.3f}; step time {1e3 * sum(settled) / len(settled):.1f} ms "
        f"(warm-up excluded; step 0 took {1e3 * times[0]:.1f} ms)",
        f"mean imbalance (max/mean rank load) {ov['mean_imbalance_before']:.3f} unbalanced -> "
        f"{ov['mean_imbalance_after']:.3f} balanced (warm-up excluded)",
        f"recorded in {run_dir}: ultraep report {run_dir}",
    ])


def main(argv=None) -> int:
    args = parse_args(argv)
    if "RANK" not in os.environ:
        print("run me under torchrun: torchrun --standalone --nproc-per-node 2 " + sys.argv[0], file=sys.stderr)
        return 2
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank, local_world = int(os.environ["LOCAL_RANK"]), int(os.environ["LOCAL_WORLD_SIZE"])
    if args.experts % world:
        print(f"--experts ({args.experts}) must be divisible by the number of ranks ({world})", file=sys.stderr)
        return 2
    # NCCL needs a GPU per rank; two ranks on one GPU (or none) train on CPU over gloo
    if torch.cuda.is_available() and torch.cuda.device_count() >= local_world:
        torch.cuda.set_device(local_rank)
        backend, device = "nccl", torch.device("cuda", local_rank)
    else:
        backend, device = "gloo", torch.device("cpu")  # threads: torchrun sets OMP_NUM_THREADS
    dist.init_process_group(backend)
    try:
        run_id, losses, times = train(args, rank, world, device)
        dist.barrier()  # every rank closed its recorder: the run is complete on disk
        if rank == 0:
            print(f"ultraep example: {world} ranks on {backend} ({device.type}), policy {args.policy}")
            print(summary(os.path.join(args.runs_dir, run_id), losses, times))
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())

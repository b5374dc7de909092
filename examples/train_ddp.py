"""Train a small MoE model with ultraep under DDP and activation checkpointing, recording the run.

    torchrun --standalone --nproc-per-node 2 examples/train_ddp.py     # gloo on CPU; NCCL with a GPU per rank
"""
import os
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

import ultraep
from ultraep.models import build_model  # a small Qwen3-MoE built from its config; any transformers v5 MoE works
from ultraep.telemetry import Recorder, open_run

STEPS, VOCAB, RUNS = 8, 64, os.environ.get("RUNS_DIR", "runs")
local = int(os.environ["LOCAL_RANK"])  # torchrun sets it, with RANK, WORLD_SIZE and MASTER_ADDR/PORT
gpu = torch.cuda.is_available() and torch.cuda.device_count() > local
device = torch.device("cuda", local) if gpu else torch.device("cpu")
if gpu:
    torch.cuda.set_device(device)
dist.init_process_group("nccl" if gpu else "gloo")
rank, world = dist.get_rank(), dist.get_world_size()

model = build_model("qwen3-moe", num_experts=8, vocab=VOCAB, seed=0).to(device)  # the same model on every rank
model.activation_checkpointing_enable()  # transformers: each decoder layer recomputes its forward in the backward
config = ultraep.BalancerConfig(policy="quota", num_redundant_slots=1)
rec = Recorder.open(RUNS, config=config, model="qwen3-moe", world_size=world, rank=rank)  # a fresh run id
model = DistributedDataParallel(ultraep.wrap(model, config, recorder=rec))  # wrap first, then DDP
runtime = ultraep.runtime_of(model)
opt = torch.optim.AdamW(model.parameters(), lr=1e-2)

for step in range(STEPS):
    g = torch.Generator().manual_seed(1000 * step + rank)  # this rank's batch: 4 arithmetic sequences mod VOCAB
    ids = (torch.randint(0, VOCAB, (4, 1), generator=g) + torch.randint(1, 4, (4, 1), generator=g)
           * torch.arange(32)) % VOCAB
    t0 = time.perf_counter()
    logits = model(input_ids=ids.to(device), use_cache=False).logits  # the model returns a ModelOutput
    loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten().to(device))
    loss.backward()
    opt.step()
    opt.zero_grad()
    runtime.next_step(loss=loss.item(), step_time_s=time.perf_counter() - t0)  # once per optimizer step
rec.close()
dist.barrier()  # every rank closed its recorder: the run is complete on disk

if rank == 0:  # read the run back: the tables `ultraep report` and `ultraep sql` read
    run_dir = os.path.join(RUNS, rec.run_id)
    con = open_run(run_dir)
    first, last = con.execute("SELECT arg_min(loss, step), arg_max(loss, step) FROM steps WHERE rank = 0").fetchone()
    before, after = con.execute("SELECT avg(imbalance_before), avg(imbalance_after) FROM layer_balance").fetchone()
    (replicas,) = con.execute("SELECT sum(num_replicas) FROM plans WHERE rank = 0").fetchone()
    print(f"{world} ranks, {STEPS} steps: loss {first:.3f} -> {last:.3f}; imbalance {before:.2f} -> {after:.2f} "
          f"with {replicas} replicas\nultraep report {run_dir}")
    con.close()
dist.destroy_process_group()

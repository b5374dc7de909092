"""The distributed runtime: ``wrap`` a model's experts containers into balanced expert-parallel layers.

Modules, each with one job (dependencies point down the list):

* :mod:`.wrap` — ``wrap`` / ``unwrap`` / ``runtime_of`` and :class:`EPRuntime`, the per-model state the layers
  share (process groups, config, the engine, replica buffers);
* :mod:`.layer` — :class:`~ultraep.runtime.layer.BalancedExperts`, what runs in place of an experts container:
  one call's collectives in order (load all-gather, plan, replica posts, token path), nothing else;
* :mod:`.recording` — :class:`~ultraep.runtime.recording.Recording`, what the layers record through (the recorder,
  the per-call history, the event trace; a failing record is counted, never raised);
* :mod:`.token_path` — Steps 4-7 of a call: reroute, dispatch all-to-all, the slots' experts, combine all-to-all;
* :mod:`.checkpoint_replay` — the forward of an activation-checkpoint recompute (the original call replayed);
* :mod:`.call_record` — a call between its forward and its record (backward hooks, flush, the next observation);
* :mod:`.call_timings` — :class:`~ultraep.runtime.call_timings.CallTimings`, one call's typed phases and their record;
* :mod:`.load_header` — :class:`~ultraep.runtime.load_header.LoadHeader`, what rides with the load all-gather;
* :mod:`.phases` — a call's phases as the cost model's terms, reduced over the ranks;
* :mod:`.guard` — a collective's failure named (layer, phase, peers) as ``CollectiveFailedError``;
* :mod:`.masters` — a layer's topology and this rank's master slices of the experts container (``[M, ...]`` meta
  tensors for a model on the meta device), and the expert bytes a rank holds;
* :mod:`.master_rows` — a rank's masters as rows of the ``[E, ...]`` checkpoint tensors: read for a model built
  on the meta device (safetensors, DCP, or an init: ``load_masters``);
* :mod:`.master_checkpoint` — the masters in the model's and the optimizers' state dicts as ``Shard(0)`` DTensors of
  the ``[E, ...]`` tensors, so any DCP save writes every rank's experts and any load gives each rank its rows;
* :mod:`.replicas` — replica weights posted early and waited late, gradients reduced back without a barrier;
* :mod:`.replica_cache` — replicas kept valid until their master changes;
* :mod:`.replica_transport` — what a job's weights and gradients become as messages (direct or tiled);
* :mod:`.transport` — point-to-point batches NCCL cannot deadlock on (one group, a canonical order);
* :mod:`.comm` — the collectives (load all-gather, token all-to-alls);
* :mod:`.clock` — phase timings: ``perf_counter`` on CPU, CUDA events read at record time on CUDA;
* :mod:`.data_parallel` — living inside DDP / FSDP2: the masters kept out of them, ``no_sync``, the
  replicated-parameter check;
* :mod:`.recompute` — which call an activation-checkpoint recompute replays.
"""

from ultraep.runtime.data_parallel import ParameterDivergenceError
from ultraep.runtime.master_rows import DCPMasters, InitMasters, SafetensorsMasters
from ultraep.runtime.wrap import (EPRuntime, WrapReport, expert_params, load_masters, no_sync,
                                  replica_budget_bytes, runtime_of, unwrap, wrap)

__all__ = ["DCPMasters", "EPRuntime", "InitMasters", "ParameterDivergenceError", "SafetensorsMasters", "WrapReport",
           "expert_params", "load_masters", "no_sync", "replica_budget_bytes", "runtime_of", "unwrap", "wrap"]

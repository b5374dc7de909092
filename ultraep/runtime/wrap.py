"""``ultraep.wrap`` / ``ultraep.unwrap``: turn an MoE model into a balanced expert-parallel one and back.

Every rank builds the same model, then calls ``wrap`` under an initialised process group (the EP group).
Each experts container the adapters recognise is replaced by a :class:`~ultraep.runtime.layer.BalancedExperts` that
keeps only this rank's masters; ``wrap`` returns the model and reports which layers it balanced. A model
with no recognised experts raises with the list of supported ones (never a silent no-op).
"""

from __future__ import annotations

import logging
import weakref
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from ultraep.models.adapters import UnsupportedModelError, adapter_for, prepare, supported
from ultraep.config import BalancerConfig
from ultraep.runtime import data_parallel
from ultraep.runtime import master_checkpoint, master_rows
from ultraep.runtime.layer import BalancedExperts
from ultraep.runtime.master_rows import MasterSource
from ultraep.runtime.recording import Recording
from ultraep.errors import UltraEPError
from ultraep.runtime.replica_store import SharedSlots, split_budget
from ultraep.runtime.transport import open_transfer_group

log = logging.getLogger("ultraep")

_ATTR = "_ultraep_runtime"


@dataclass
class WrapReport:
    """What ``wrap`` did: balanced layers (index, module path, policy, adapter)."""

    layers: list[tuple[int, str, str, str]] = field(default_factory=list)

    def __str__(self) -> str:
        rows = [f"  layer {i}: {path} ({adapter}) -> {policy}" for i, path, policy, adapter in self.layers]
        return f"ultraep balanced {len(self.layers)} MoE layer(s):\n" + "\n".join(rows)


class EPRuntime:
    """Per-model runtime state shared by the balanced layers: group, config, shared replica buffers, counters,
    and their :class:`~ultraep.runtime.recording.Recording` (recorder, history, event trace)."""

    def __init__(self, config: BalancerConfig, group, recorder=None, device=None) -> None:
        self.config = config
        #: where the masters live (or will, for a model on the meta device): seeds the cost model, sizes the budget
        self.device = torch.device("cpu") if device is None else torch.device(device)
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        ranks = dist.get_process_group_ranks(group if group is not None else dist.group.WORLD)
        backend = dist.get_backend(group)
        # The layers' collectives (load all-gathers, token all-to-alls) run on a communicator of their own, never
        # on the user's group: DistributedDataParallel all-reduces its gradient buckets on that group from
        # autograd hooks while the layers' backward (and an activation-checkpoint recompute) exchange tokens, and
        # the two orders of issue need not agree across ranks — on a shared communicator they would pair one
        # rank's all-to-all with another's all-reduce.
        timeout = _timeout_of(group)  # a peer that stops answering fails the layers as it fails the user's group
        self.group = dist.new_group(ranks, backend=backend, timeout=timeout, use_local_synchronization=True)
        # Replica weights and gradients travel point-to-point on a group of their own, so they never queue
        # behind the token all-to-alls (NCCL serialises one communicator's operations on one stream).
        self.transfer_group = open_transfer_group(ranks, backend, timeout)
        #: the replica buffers the ``restore`` layers share (each layer's own are in its ``store``)
        self.shared_slots = SharedSlots()
        #: what the layers record through (recorder, failed recordings, per-call history, event trace)
        self.recording = Recording(recorder)
        self.layers: list = []
        self.report = WrapReport()
        self.step = 0
        self.microbatch = -1
        #: False inside :meth:`no_sync`: replica gradients wait on their ranks for the next backward outside it
        self.grad_sync = True
        #: the wrapped model (for the replicated-parameter check and FSDP detection); set by ``wrap``
        self.model_ref = lambda: None
        #: what the masters' gradients are multiplied by in backward: 1 / R where the data-parallel wrapper
        #: averages (``config.master_grads``), set at every forward
        self.master_grad_scale = 1.0
        #: (step it was looked up at, whether FSDP manages the model, whether it averages the gradients it reduces)
        self._fsdp: tuple[int, bool, bool] = (-1, False, False)

    @contextmanager
    def no_sync(self):
        """Gradient accumulation without reducing replica gradients every microbatch (like DDP's ``no_sync``):
        the layers' forwards inside the block (and their backwards) keep each replica's weight gradient on its
        rank, summed; the next forward + backward outside the block reduces them to the masters with its own.
        The masters' ``.grad`` is complete — equal to the unbalanced model's — only after that backward, so run
        the last microbatch of every step outside the block; an optimizer step before it raises
        :class:`~ultraep.errors.PendingGradientsError` at the next forward rather than lose gradients. With the
        replica cache, the replicas' weights too move once per step instead of once per microbatch.

        A layer reduces early (and correctly) when the replicas it would hold pending exceed ``2 N`` on a rank."""
        before, self.grad_sync = self.grad_sync, False
        try:
            yield self
        finally:
            self.grad_sync = before

    def invalidate_replicas(self) -> None:
        """Drop every cached replica at the next call: needed only after writing master weights through
        ``p.data`` (which PyTorch's version counter does not see); optimizer steps, ``load_state_dict`` and
        in-place writes to the parameters are detected."""
        for layer in self.layers:
            layer.epoch.invalidate()

    # ------------------------------------------------------------------ step bookkeeping
    def next_step(self, loss: float | None = None, step_time_s: float | None = None,
                  warmup: bool | None = None) -> None:
        """Close the current training step (call once per optimizer step, after it); records the step if
        recording. At the first step and every ``config.sync_check_every`` steps it checks that the parameters
        outside the experts are the same on every rank (one small all-gather).

        ``warmup``: whether summaries should leave this step out (compiles, first allocations, first plans);
        default: step 0 only. A caller that times its own warm-up (the demo) marks every step it leaves out."""
        self.flush_records()
        for layer in self.layers:
            layer.replays.clear()  # every backward of the step ran: no recompute can still need a call's plan
        every = self.config.sync_check_every
        if every and self.step % every == 0:
            self.check_replicated()
        if self.recording.recorder is not None:
            self.recording.safe(self._record_step, loss, step_time_s,
                                self.step == 0 if warmup is None else bool(warmup))
        self.step += 1
        self.microbatch = -1

    def _record_step(self, loss, step_time_s, warmup: bool) -> None:
        # rank 0 keeps the engine's calibrated cost model with every step (the same on every rank): a recorded run
        # then replays on the machine it measured (`ultraep simulate RUN --topology from-run`)
        from ultraep.cost import cost_record

        extra = None
        if self.rank == 0 and self.layers and getattr(self, "engine", None) is not None:
            extra = {"cost_model": cost_record(self.engine.cost_model_for(self.layers[0].layer))}
        self.recording.recorder.record_step(self.step, loss=loss, step_time_s=step_time_s, warmup=warmup, extra=extra)

    def flush_records(self) -> None:
        """Record every layer call still waiting for its backward (at a step's end, or on a failure)."""
        for layer in self.layers:
            self.recording.safe(layer.flush_record)

    def enter_layer(self, layer: int) -> None:
        if layer == 0:
            self.microbatch += 1
        self.check_fsdp()
        if data_parallel.in_ddp_forward():
            data_parallel.check_ddp_ignores_masters(self.layers)
        self.master_grad_scale = 1.0 / self.world_size if self._master_grads_mean() else 1.0

    def _master_grads_mean(self) -> bool:
        """Whether the masters' gradients are averaged over the group (``config.master_grads``; 'auto': inside a
        DDP forward, or on a model FSDP manages and averages — looked up once per step; torchtitan's FSDP sums)."""
        mode = self.config.master_grads
        if mode != "auto":
            return mode == "mean"
        return data_parallel.in_ddp_forward() or (self._fsdp[1] and self._fsdp[2])

    def check_fsdp(self) -> None:
        """Look up once per step whether FSDP manages the model, and refuse FSDP2 managing a master."""
        if self._fsdp[0] == self.step:
            return
        model = self.model_ref()
        found = model is not None and data_parallel.has_fsdp(model)
        if found:
            data_parallel.refuse_sharded_masters(model, self.layers)
        self._fsdp = (self.step, found, found and data_parallel.fsdp_averages(model))

    def check_replicated(self) -> None:
        """Raise :class:`~ultraep.runtime.data_parallel.ParameterDivergenceError` (on every rank) when a parameter
        outside the experts differs across ranks (``config.sync_check_every``). Collective."""
        model = self.model_ref()
        if model is None:
            return
        masters = {id(p) for layer in self.layers for p in layer.master_params()}
        data_parallel.check_replicated(model, masters, self.group, self.step)

    def build_engine(self) -> None:
        """The one decision loop of this model's layers: their policies, a cost model seeded with this
        machine's figures (:func:`~ultraep.presets.local_seed`) and calibrated from every rank's measured phases."""
        from ultraep.cost import CostModel, CostParams
        from ultraep.engine import Engine
        from ultraep.presets import local_seed

        first = self.layers[0]
        like = [p[0].detach() for p in first.master_params()]
        cuda = self.device.type == "cuda"
        hw, _, _, copy_s = local_seed(like, cuda)
        # the layers plan with their replica residency, so a plan's transfers are exactly what moves
        # CPU ranks on one host (ultraep.launch, or torchrun with LOCAL_WORLD_SIZE = WORLD_SIZE) exchange tokens over
        # its one loopback; how much their computing at the same time slows each other is learned (corun_slowdown)
        params = CostParams(weight_sync_overlap=True, resend_all_replicas=False, copy_s_per_byte=copy_s,
                            restore_in_backward=any(la.store.mode == "restore" for la in self.layers),
                            a2a_shared_medium=not cuda and _one_host())
        cm = CostModel(first.topology, hw, first.expert_spec, params)
        # A layer call is recorded once it is measured (after its backward), through the engine's one recording
        # path: the plan with the transfers that really moved, the decision, the call's timings. Plans are
        # identical on every rank: rank 0 records one copy.
        self.engine = Engine(self.config, first.topology, cost_model=cm, recorder=self.recording.recorder,
                             layer_topologies={la.layer: la.topology for la in self.layers},
                             layer_experts={la.layer: la.expert_spec for la in self.layers}, record_timings=False,
                             record_on_decide=False, record_plans=self.rank == 0)
        self.recording.engine = self.engine


def _one_host() -> bool:
    """Whether every rank runs on this host: torchrun's LOCAL_WORLD_SIZE equals WORLD_SIZE, or neither is set
    (ranks forked or spawned on one machine, as ``ultraep.launch`` starts them)."""
    import os

    local, world = os.environ.get("LOCAL_WORLD_SIZE"), os.environ.get("WORLD_SIZE")
    return local is None or world is None or local == world


def _timeout_of(group):
    """The collective timeout of ``group`` (None: the backend's default), for the groups the runtime opens beside it."""
    import torch

    pg = group if group is not None else dist.group.WORLD
    for device in ("cpu", "cuda"):
        try:
            return pg._get_backend(torch.device(device)).options._timeout
        except (AttributeError, RuntimeError, ValueError):
            continue
    return None


def _available_bytes(device) -> int:
    """Memory free for new tensors on ``device`` (CUDA: the driver's free bytes; CPU: MemAvailable)."""
    import torch

    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    import os

    return int(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))


def replica_budget_bytes(budget, sizes: list[tuple[int, int, int]], device) -> int:
    """Bytes of ``BalancerConfig.replica_memory_budget`` for this rank's layers (``sizes``: per layer N, expert
    bytes and masters per rank; ``device``: where the masters live)."""
    if budget == "auto":
        if not sizes:
            return 0
        # read before the layers copy their masters (wrap sizes every layer first): take those bytes off, so the
        # budget is never above what it was when free memory was read after the copies
        return max(0, _available_bytes(device) - sum(m * b for _, b, m in sizes)) // 4
    if isinstance(budget, float):
        return int(budget * sum(m * b for _, b, m in sizes))
    return int(budget)


def replica_memory(config: BalancerConfig, found: list, world_size: int, device=None) -> list:
    """Each layer's :class:`~ultraep.runtime.replica_store.ReplicaMemory`, decided before any layer is built (so
    each is built in its final mode): ``config.replica_memory_budget`` split in layer order over the experts
    containers ``found`` (``(name, module)``), from their sizes alone. ``device``: where the masters will live
    (default: where the first container's tensors are)."""
    sizes = []
    for layer, (_, mod) in enumerate(found):
        adapter = adapter_for(mod)
        like = [getattr(mod, n)[0] for n in adapter.param_names]
        device = like[0].device if device is None else device
        expert_bytes = int(sum(t.numel() * t.element_size() for t in like))
        sizes.append((config.slots_for(layer), expert_bytes, adapter.num_experts(mod) // world_size))
    budget = replica_budget_bytes(config.replica_memory_budget, sizes, device)
    return split_budget(budget, [(n, b) for n, b, _ in sizes], config.replica_cache)


def wrap(model: nn.Module, config: BalancerConfig | dict | None = None, group=None, *, recorder=None,
         device=None) -> nn.Module:
    """Balance every MoE layer of ``model`` across the ranks of ``group`` (default: WORLD).

    Args:
        model: the same model on every rank (same weights), or the same model built on the meta device (see below).
        config: :class:`~ultraep.BalancerConfig` (or a dict validated into one).
        group: the EP process group.
        recorder: an ``ultraep.telemetry`` recorder for this rank (optional).
        device: where the masters will live when the experts are on the meta device (default: the current CUDA
            device if there is one, else the CPU); it seeds the cost model and sizes ``replica_memory_budget``.

    A model on the meta device (too large to build whole on one rank) is wrapped without allocating anything: each
    layer keeps ``[M, ...]`` meta masters. Then ``model.to_empty(device=...)`` allocates every parameter (the
    masters at ``M`` of ``E`` rows), the user fills the non-expert ones (their own init or checkpoint), and
    :func:`load_masters` reads this rank's expert rows from a checkpoint (or runs an init); a forward before that
    is refused. docs/guide/large-models.md.

    Returns the model (modified in place); ``runtime_of(model).report`` lists the balanced layers.
    """
    if not dist.is_available() or not dist.is_initialized():
        raise UltraEPError("torch.distributed", "wrap() needs an initialised process group "
                           "(torch.distributed.init_process_group or ultraep.launch)")
    if config is None:
        config = BalancerConfig()
    elif isinstance(config, dict):
        config = BalancerConfig.model_validate(config)
    if getattr(data_parallel.model_of(model), _ATTR, None) is not None:
        raise UltraEPError("model", "is already wrapped by ultraep")
    data_parallel.refuse_wrapped(model)
    prepare(model)  # MoE blocks whose experts need an exact rewrite into the experts-container form
    found = [(name, mod) for name, mod in model.named_modules() if adapter_for(mod) is not None]
    if not found:
        raise UnsupportedModelError(
            "model", f"{type(model).__name__} has no experts container ultraep can balance; supported: "
            + "; ".join(supported()))
    config.validate_layers(len(found))  # a `layers` override for a layer that does not exist is refused
    __import__("ultraep.planning").planning.warm_up()  # compile the planners now, not inside step 0's timing
    runtime = EPRuntime(config, group, recorder, _masters_device(found, device))
    R = runtime.world_size
    for layer, (name, mod) in enumerate(found):
        E = adapter_for(mod).num_experts(mod)
        if E % R:
            raise UltraEPError(f"{name}.num_experts", f"{E} experts cannot be split over {R} ranks "
                               f"(experts must be divisible by the EP group size)", E)
        config.validate_for(R, E // R)
    memory = replica_memory(config, found, R, runtime.device)  # every layer's share, before any is built
    for layer, (name, mod) in enumerate(found):
        adapter = adapter_for(mod)
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        balanced = BalancedExperts(mod, adapter, layer, name, runtime, memory[layer])
        setattr(parent, attr, balanced)
        runtime.layers.append(balanced)
        runtime.report.layers.append((layer, name, balanced.policy_name, adapter.name))
    runtime.build_engine()
    master_checkpoint.attach(runtime)  # state dicts hold the masters as rows of the [E, ...] tensors (DTensors)
    object.__setattr__(model, _ATTR, runtime)
    runtime.model_ref = weakref.ref(model)
    # DistributedDataParallel(model) leaves the masters alone: no broadcast from rank 0, no gradient averaging
    data_parallel.ignore_masters_in_ddp(model, runtime.layers)
    if runtime.rank == 0:
        log.info("%s", runtime.report)
    return model


def _masters_device(found: list, device) -> "torch.device":
    """Where the masters live: their container's device, or for a container on the meta device ``device`` (default:
    the current CUDA device if there is one, else the CPU)."""
    name, mod = found[0]
    where = getattr(mod, adapter_for(mod).param_names[0]).device
    if where.type != "meta":
        if device is not None and torch.device(device) != where:
            raise UltraEPError("device", f"{device} is not where the experts are ({name}: {where}); device= is for "
                               "a model on the meta device (move the model instead)", str(device))
        return where
    if device is not None:
        return torch.device(device)
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def load_masters(model: nn.Module, source: MasterSource) -> nn.Module:
    """Fill this rank's masters of every balanced layer from ``source``: rows ``rank * M .. (rank + 1) * M - 1`` of
    each ``[E, ...]`` expert tensor, read from a checkpoint of the unwrapped model (:class:`SafetensorsMasters`,
    :class:`DCPMasters`; keys: the unwrapped model's ``state_dict`` names) or written by an init
    (:class:`InitMasters`). Call after ``model.to_empty(device=...)`` for a model built on the meta device; on any
    wrapped model it replaces the masters' weights. Not collective: each rank reads only its own rows."""
    rt = runtime_of(model)
    inner = data_parallel.model_of(model)
    if data_parallel.has_fsdp(inner):  # a master that fully_shard took is refused before rows are written into it
        data_parallel.refuse_sharded_masters(inner, rt.layers)
    master_rows.load(rt.layers, source)
    rt.invalidate_replicas()  # (the masters were written through .data: the cache must not trust them)
    return model


def runtime_of(model: nn.Module) -> EPRuntime:
    """The :class:`EPRuntime` of a wrapped model (or of its ``DistributedDataParallel`` wrapper)."""
    rt = getattr(data_parallel.model_of(model), _ATTR, None)
    if rt is None:
        raise UltraEPError("model", "is not wrapped by ultraep (call ultraep.wrap first)")
    return rt


def unwrap(model: nn.Module) -> nn.Module:
    """Gather every layer's masters back into full ``[E, ...]`` parameters and restore the original
    experts containers (e.g. before saving a plain checkpoint). Collective: call on every rank."""
    import torch

    from ultraep.runtime.comm import _all_gather

    rt = runtime_of(model)
    for layer in rt.layers:
        for n in layer.adapter.param_names:
            p = getattr(layer, n)
            flat = torch.empty(p.numel() * rt.world_size, dtype=p.dtype, device=p.device)
            _all_gather(flat, p.detach().contiguous().view(-1), group=rt.group)
            full = flat.view(p.shape[0] * rt.world_size, *p.shape[1:])
            setattr(layer.container, n, nn.Parameter(full, requires_grad=p.requires_grad))
        parent_name, _, attr = layer.name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, attr, layer.container)
    object.__delattr__(model, _ATTR)
    master_checkpoint.detach(rt)
    have = getattr(model, "_ddp_params_and_buffers_to_ignore", None)
    if isinstance(have, data_parallel.MasterNames):  # the user's own names stay
        if have.user:
            model._ddp_params_and_buffers_to_ignore = have.user
        else:
            del model._ddp_params_and_buffers_to_ignore
    from ultraep.models.adapters import restore

    restore(model)  # blocks prepare() rewrote get their original classes back (same storage)
    return model


def expert_params(model: nn.Module) -> set[nn.Parameter]:
    """The masters of every balanced layer of a wrapped ``model`` (or its DDP wrapper): pass them to
    ``fully_shard(..., ignored_params=...)``, or leave them out of anything that treats parameters as replicated."""
    return {p for layer in runtime_of(model).layers for p in layer.master_params()}


def no_sync(model: nn.Module):
    """Gradient accumulation in one context: DDP's ``no_sync()`` (or FSDP2's ``set_requires_gradient_sync``) and
    the runtime's :meth:`EPRuntime.no_sync`. Run every microbatch but the last of a step inside it, the last
    outside (as with DDP alone)::

        for i, mb in enumerate(microbatches):
            with ultraep.no_sync(ddp_model) if i < len(microbatches) - 1 else contextlib.nullcontext():
                (loss_fn(ddp_model(mb)) / len(microbatches)).backward()
    """
    return data_parallel.accumulating(model, runtime_of(model))

"""A rank's masters as rows of the ``[E, ...]`` checkpoint tensors: read from a checkpoint (or an init) when the
model is too large to build whole, and written to a DCP checkpoint as rows of the whole tensors.

A model built on the meta device and wrapped holds, per balanced layer, ``[M, ...]`` masters (this rank's experts
``first .. first + M - 1`` of each ``[E, ...]`` expert parameter); ``model.to_empty(device=...)`` allocates them
(M rows, never E) and :func:`load_masters` fills them, each from one :class:`MasterRead`:

    safetensors   :class:`SafetensorsMasters`  ``safe_open(...).get_slice(key)[first:first + M]``: only these rows
                                               are read from the file (memory-mapped)
    DCP           :class:`DCPMasters`          ``torch.distributed.checkpoint.load`` with a planner that asks for
                                               rows ``first .. first + M - 1`` of ``key``: only the saved chunks
                                               that overlap them are read (a checkpoint saved sharded along the
                                               experts, as a wrapped model's state_dict saves it, holds them in
                                               chunks of their own; one saved whole is read one stored tensor at a
                                               time, then narrowed)
    init          :class:`InitMasters`         ``fn(out [M, ...], key, experts)``: training from scratch

Written: a wrapped model's ``state_dict()`` holds each rank's masters as its rows of one ``[E, ...]`` DTensor under
the unwrapped model's key (:mod:`ultraep.runtime.master_checkpoint`), so ``dcp.save`` with any planner writes the
unwrapped model's checkpoint, loadable by rows on any number of ranks (or whole).

A read's ``key`` is the parameter's name in the unwrapped model's ``state_dict`` (``<container path>.<name>``),
which is what a checkpoint of the unwrapped model holds; a source's ``key`` function maps it to another
checkpoint's names. Every refusal is one line naming the checkpoint key (or the layer's field).

Legend: E experts, M masters per rank, R ranks.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import torch

from ultraep.errors import UltraEPError


@dataclass(frozen=True)
class MasterRead:
    """One master tensor to fill: experts ``first .. first + M - 1`` of the tensor ``key`` into ``out`` (``[M, ...]``,
    already allocated where the master lives). ``field``: the layer's parameter, for errors.

    ``stored_shape``: the checkpoint tensor's shape when it is not ``[E, *out.shape[1:]]`` — a block ultraep
    rewrote keeps its original layout, expert-major either way: DBRX's ``[E·I, H]`` (``unit`` = I stored rows per
    expert), Longcat-Flash's ``[E + Z, 2I, H]`` (its Z zero-computation rows after the E experts, never read)."""

    key: str
    first: int
    num_experts: int
    out: torch.Tensor
    field: str
    stored_shape: tuple[int, ...] | None = None

    @property
    def rows(self) -> range:
        """The logical experts of ``out``'s rows."""
        return range(self.first, self.first + int(self.out.shape[0]))

    @property
    def want(self) -> tuple[int, ...]:
        """The shape the checkpoint tensor must have."""
        return self.stored_shape or (self.num_experts, *self.out.shape[1:])

    @property
    def unit(self) -> int:
        """Stored rows per expert."""
        row = 1
        for d in self.want[1:]:
            row *= int(d)
        return self.out[0].numel() // row

    @property
    def stored_rows(self) -> tuple[int, int]:
        """``(start, stop)``: the stored rows of this rank's experts."""
        return self.first * self.unit, (self.first + int(self.out.shape[0])) * self.unit

    def target(self) -> torch.Tensor:
        """``out`` seen in the stored layout (``[M·unit, *stored_shape[1:]]``; a view: the masters are contiguous)."""
        start, stop = self.stored_rows
        return self.out.view(stop - start, *self.want[1:])

    def check_shape(self, stored: Sequence[int], key: str, where: str) -> None:
        """Refuse a stored tensor (checkpoint key ``key``) of another shape than :attr:`want`."""
        if tuple(int(s) for s in stored) != tuple(self.want):
            raise UltraEPError(key, f"{where} holds shape {list(stored)}; {self.field} needs {list(self.want)} "
                               f"(E = {self.num_experts} experts, experts {self.first}..{self.rows[-1]} on this rank)")


class MasterSource:
    """Fills :class:`MasterRead` s. ``key``: checkpoint key of a read's unwrapped-model key (default: the same)."""

    def __init__(self, key: Callable[[str], str] | None = None) -> None:
        self._key = key or (lambda k: k)

    def stored_key(self, read: MasterRead) -> str:
        return self._key(read.key)

    def stored_keys(self, reads: list[MasterRead]) -> list[str]:
        """Each read's checkpoint key; two masters mapped to one key are refused (a ``key`` function that folds
        names would leave one of them unfilled, or fill both with the same rows)."""
        keys, seen = [self.stored_key(r) for r in reads], {}
        for k, r in zip(keys, reads):
            if k in seen:
                raise UltraEPError(k, f"is the checkpoint key of both {seen[k]} and {r.field}: the key function "
                                   "must map each master to its own tensor")
            seen[k] = r.field
        return keys

    def fill(self, reads: list[MasterRead]) -> None:  # pragma: no cover - every source defines it
        raise NotImplementedError


class SafetensorsMasters(MasterSource):
    """Rows from safetensors files: ``path`` is one ``.safetensors`` file, or a folder with a
    ``model.safetensors.index.json`` (its ``weight_map``) or with ``*.safetensors`` files (their keys are read)."""

    def __init__(self, path: str | Path, key: Callable[[str], str] | None = None) -> None:
        super().__init__(key)
        self.path = Path(path)
        if not self.path.exists():
            raise UltraEPError("masters.path", f"{self.path} does not exist (a .safetensors file or a folder of them)")

    def _files(self) -> dict[str, Path]:
        """``{checkpoint key: file}``."""
        from safetensors import safe_open

        if self.path.is_file():
            files = [self.path]
        else:
            index = self.path / "model.safetensors.index.json"
            if index.is_file():
                weight_map = json.loads(index.read_text())["weight_map"]
                return {k: self.path / f for k, f in weight_map.items()}
            files = sorted(self.path.glob("*.safetensors"))
            if not files:
                raise UltraEPError("masters.path", f"{self.path} holds no .safetensors file")
        out = {}
        for f in files:
            with safe_open(str(f), framework="pt", device="cpu") as fh:
                out.update({k: f for k in fh.keys()})
        return out

    def fill(self, reads: list[MasterRead]) -> None:
        try:
            from safetensors import safe_open
        except ImportError:  # pragma: no cover - installed with the hf extra
            raise UltraEPError("masters", "SafetensorsMasters needs the safetensors package "
                               "(pip install safetensors, or ultraep[hf])") from None
        where = self._files()
        by_file: dict[Path, list[MasterRead]] = {}
        for read, k in zip(reads, self.stored_keys(reads)):
            if k not in where:
                raise UltraEPError(k, f"not in the safetensors checkpoint {self.path} ({read.field} reads it)")
            by_file.setdefault(where[k], []).append(read)
        for f, group in by_file.items():
            with safe_open(str(f), framework="pt", device="cpu") as fh:
                for read in group:
                    sl = fh.get_slice(self.stored_key(read))
                    read.check_shape(sl.get_shape(), self.stored_key(read), f"the safetensors checkpoint {f.name}")
                    start, stop = read.stored_rows
                    with torch.no_grad():
                        read.target().copy_(sl[start:stop])


class DCPMasters(MasterSource):
    """Rows from a ``torch.distributed.checkpoint`` checkpoint (``checkpoint_id``: its folder). Each rank reads on
    its own (no collective): ``dcp.load(..., no_dist=True)`` with a planner that asks for this rank's rows only."""

    def __init__(self, checkpoint_id: str | Path, key: Callable[[str], str] | None = None) -> None:
        super().__init__(key)
        self.checkpoint_id = Path(checkpoint_id)
        if not (self.checkpoint_id / ".metadata").is_file():
            raise UltraEPError("masters.checkpoint_id", f"{self.checkpoint_id} is not a torch.distributed.checkpoint "
                               "folder (no .metadata file)")

    def fill(self, reads: list[MasterRead]) -> None:
        import warnings

        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        # checked here, before DCP runs the planner (which would wrap a refusal into its CheckpointException)
        stored = dcp.FileSystemReader(str(self.checkpoint_id)).read_metadata().state_dict_metadata
        for read, key in zip(reads, self.stored_keys(reads)):
            md = stored.get(key)
            if md is None:
                raise UltraEPError(key, f"not in the DCP checkpoint {self.checkpoint_id} ({read.field} reads it)")
            if not isinstance(md, TensorStorageMetadata):
                raise UltraEPError(key, f"is not a tensor in the DCP checkpoint ({read.field} reads it)")
            read.check_shape(md.size, key, "the DCP checkpoint")
        planner = _rows_planner({self.stored_key(r): r for r in reads})
        with warnings.catch_warnings():  # no_dist is the point here, not a fallback worth a warning
            warnings.filterwarnings("ignore", message=".*assuming the intent is to load in a single process.*")
            dcp.load({self.stored_key(r): r.target() for r in reads}, checkpoint_id=str(self.checkpoint_id),
                     planner=planner, no_dist=True)


def _rows_planner(reads: dict[str, MasterRead]):
    """A ``DefaultLoadPlanner`` whose local plan reads, for each checkpoint key, the chunk of this rank's stored rows
    (offsets ``[start, 0, ...]``, sizes of ``read.target()``) and resolves every read item into ``read.target()``."""
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata
    from torch.distributed.checkpoint.planner import LoadPlan
    from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

    class RowsPlanner(DefaultLoadPlanner):
        def create_local_plan(self) -> LoadPlan:
            items = []
            for key, read in reads.items():  # (keys and shapes checked by DCPMasters.fill)
                md = self.metadata.state_dict_metadata[key]
                target = read.target()
                chunk = ChunkStorageMetadata(offsets=torch.Size([read.stored_rows[0]] + [0] * (target.dim() - 1)),
                                             sizes=target.shape)
                items += create_read_items_for_chunk_list(key, md, [chunk])
            return LoadPlan(items)

        def resolve_tensor(self, read_item) -> torch.Tensor:
            # dest_offsets are relative to the chunk asked for, i.e. to this rank's rows
            t = reads[read_item.dest_index.fqn].target()
            for dim, (offset, length) in enumerate(zip(read_item.dest_offsets, read_item.lengths)):
                t = t.narrow(dim, offset, length)
            return t

    return RowsPlanner()


class InitMasters(MasterSource):
    """Masters initialised in place, for training from scratch: ``fn(out [M, ...], key, experts)`` fills ``out``
    (``experts``: the logical experts of its rows, a ``range``). An init that seeds per expert (e.g. a generator
    seeded with ``hash(key) + e``) gives every expert the same weights whatever the number of ranks."""

    def __init__(self, fn: Callable[[torch.Tensor, str, range], None]) -> None:
        super().__init__()
        if not callable(fn):
            raise UltraEPError("masters.fn", f"must be callable fn(out, key, experts), not {type(fn).__name__}")
        self.fn = fn

    def fill(self, reads: list[MasterRead]) -> None:
        with torch.no_grad():
            for read in reads:
                self.fn(read.out, read.key, read.rows)


def reads_of(layers) -> list[MasterRead]:
    """Every master of ``layers`` (balanced layers) as a :class:`MasterRead`; refuses one still on the meta device
    (``model.to_empty(device=...)`` allocates them first)."""
    from ultraep.models.rewrite import StackedExperts

    out = []
    for layer in layers:
        # a container ultraep built from its block: the unwrapped model's checkpoint keeps the block's original keys
        # and layouts (rewrite.py's key map, relative to the block)
        block, _, attr = layer.name.rpartition(".")
        keymap = layer.container.origin["keys"] if isinstance(layer.container, StackedExperts) else {}
        E, first = layer.topology.num_experts, layer.first_expert
        for n in layer.adapter.param_names:
            p = getattr(layer, n)
            if p.device.type == "meta":
                raise UltraEPError(f"{layer.name}.{n}", "is still on the meta device: allocate the model first "
                                   "(model.to_empty(device=...)), then load the masters into it")
            key, shape = f"{layer.name}.{n}", None
            if f"{attr}.{n}" in keymap:
                old, shape = keymap[f"{attr}.{n}"]
                key = f"{block}.{old}" if block else old
            out.append(MasterRead(key, first, E, p.data, f"{layer.name}.{n}", tuple(shape) if shape else None))
    return out


def load(layers, source: MasterSource) -> None:
    """Fill every master of ``layers`` from ``source`` (rows of this rank only) and mark the layers loaded."""
    if not isinstance(source, MasterSource):
        raise UltraEPError("masters", f"must be a SafetensorsMasters, DCPMasters or InitMasters, not "
                           f"{type(source).__name__}")
    source.fill(reads_of(layers))
    for layer in layers:
        layer.master_state.mark_loaded()


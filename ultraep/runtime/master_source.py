"""Where a rank's masters come from when the model is too large to build whole: checkpoint rows or an init.

A model built on the meta device and wrapped holds, per balanced layer, ``[M, ...]`` masters (this rank's experts
``first .. first + M - 1`` of each ``[E, ...]`` expert parameter); ``model.to_empty(device=...)`` allocates them
(M rows, never E) and :func:`load_masters` fills them, each from one :class:`MasterRead`:

    safetensors   :class:`SafetensorsMasters`  ``safe_open(...).get_slice(key)[first:first + M]``: only these rows
                                               are read from the file (memory-mapped)
    DCP           :class:`DCPMasters`          ``torch.distributed.checkpoint.load`` with a planner that asks for
                                               rows ``first .. first + M - 1`` of ``key``: only the saved chunks
                                               that overlap them are read (a checkpoint saved sharded by experts,
                                               as torchtitan's is under EP or FSDP, holds them in their own chunks;
                                               one saved whole is read one stored tensor at a time, then narrowed)
    init          :class:`InitMasters`         ``fn(out [M, ...], key, experts)``: training from scratch

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
    """One master tensor to fill: rows ``first .. first + M - 1`` of the ``[E, ...]`` tensor ``key`` into ``out``
    (``[M, ...]``, already allocated where the master lives). ``field``: the layer's parameter, for errors."""

    key: str
    first: int
    num_experts: int
    out: torch.Tensor
    field: str

    @property
    def rows(self) -> range:
        return range(self.first, self.first + int(self.out.shape[0]))

    def check_shape(self, stored: Sequence[int], key: str, where: str) -> None:
        """Refuse a stored tensor (checkpoint key ``key``) that is not ``[E, *out.shape[1:]]``."""
        want = (self.num_experts, *self.out.shape[1:])
        if tuple(int(s) for s in stored) != want:
            raise UltraEPError(key, f"{where} holds shape {list(stored)}; {self.field} needs {list(want)} "
                               f"(E = {self.num_experts} experts, rows {self.first}..{self.rows[-1]} on this rank)")


class MasterSource:
    """Fills :class:`MasterRead` s. ``key``: checkpoint key of a read's unwrapped-model key (default: the same)."""

    def __init__(self, key: Callable[[str], str] | None = None) -> None:
        self._key = key or (lambda k: k)

    def stored_key(self, read: MasterRead) -> str:
        return self._key(read.key)

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
        for read in reads:
            k = self.stored_key(read)
            if k not in where:
                raise UltraEPError(k, f"not in the safetensors checkpoint {self.path} ({read.field} reads it)")
            by_file.setdefault(where[k], []).append(read)
        for f, group in by_file.items():
            with safe_open(str(f), framework="pt", device="cpu") as fh:
                for read in group:
                    sl = fh.get_slice(self.stored_key(read))
                    read.check_shape(sl.get_shape(), self.stored_key(read), f"the safetensors checkpoint {f.name}")
                    with torch.no_grad():
                        read.out.copy_(sl[read.first:read.first + int(read.out.shape[0])])


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
        for read in reads:
            key = self.stored_key(read)
            md = stored.get(key)
            if md is None:
                raise UltraEPError(key, f"not in the DCP checkpoint {self.checkpoint_id} ({read.field} reads it)")
            if not isinstance(md, TensorStorageMetadata):
                raise UltraEPError(key, f"is not a tensor in the DCP checkpoint ({read.field} reads it)")
            read.check_shape(md.size, key, "the DCP checkpoint")
        planner = _rows_planner({self.stored_key(r): r for r in reads})
        with warnings.catch_warnings():  # no_dist is the point here, not a fallback worth a warning
            warnings.filterwarnings("ignore", message=".*assuming the intent is to load in a single process.*")
            dcp.load({self.stored_key(r): r.out for r in reads}, checkpoint_id=str(self.checkpoint_id),
                     planner=planner, no_dist=True)


def _rows_planner(reads: dict[str, MasterRead]):
    """A ``DefaultLoadPlanner`` whose local plan reads, for each checkpoint key, the chunk of rows ``read.rows``
    (offsets ``[first, 0, ...]``, sizes ``out.shape``) and resolves every read item into ``read.out``."""
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata
    from torch.distributed.checkpoint.planner import LoadPlan
    from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

    class RowsPlanner(DefaultLoadPlanner):
        def create_local_plan(self) -> LoadPlan:
            items = []
            for key, read in reads.items():  # (keys and shapes checked by DCPMasters.fill)
                md = self.metadata.state_dict_metadata[key]
                chunk = ChunkStorageMetadata(offsets=torch.Size([read.first] + [0] * (read.out.dim() - 1)),
                                             sizes=read.out.shape)
                items += create_read_items_for_chunk_list(key, md, [chunk])
            return LoadPlan(items)

        def resolve_tensor(self, read_item) -> torch.Tensor:
            # dest_offsets are relative to the chunk asked for, i.e. to this rank's [M, ...] tensor
            t = reads[read_item.dest_index.fqn].out
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
    out = []
    for layer in layers:
        E, first = layer.topology.num_experts, layer.first_expert
        for n in layer.adapter.param_names:
            p = getattr(layer, n)
            if p.device.type == "meta":
                raise UltraEPError(f"{layer.name}.{n}", "is still on the meta device: allocate the model first "
                                   "(model.to_empty(device=...)), then load the masters into it")
            out.append(MasterRead(f"{layer.name}.{n}", first, E, p.data, f"{layer.name}.{n}"))
    return out


def load(layers, source: MasterSource) -> None:
    """Fill every master of ``layers`` from ``source`` (rows of this rank only) and mark the layers loaded."""
    if not isinstance(source, MasterSource):
        raise UltraEPError("masters", f"must be a SafetensorsMasters, DCPMasters or InitMasters, not "
                           f"{type(source).__name__}")
    source.fill(reads_of(layers))
    for layer in layers:
        layer.masters_loaded()

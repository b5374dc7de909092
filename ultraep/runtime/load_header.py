"""What each rank sends with its load in a layer call's one all-gather: the counts, then a :class:`LoadHeader`.

Legend: E experts, R ranks, K = ``len(RANK_PHASES)`` measured phases, X = E + ``LoadHeader.SIZE``.

One rank's vector, ``[X]`` int64::

    [ counts of experts 0..E-1 | ids above the sentinel | measured | master epoch | cache free | K phases (ns) ]
      load row λ[r, :]          \\____________________ LoadHeader.pack() ______________________________/

Every field rides on the all-gather the call issues anyway (the layer call's one host synchronisation), so
every rank learns every rank's header without another collective:

* ``bad_ids``: top-k ids above the sentinel ``E`` or below 0 (counted on the device, so every rank refuses
  together);
* ``phases_s``: this rank's measured phases of the layer's last complete call (None: none to send), in whole
  nanoseconds — every rank calibrates the engine from the same ``[R, K]`` numbers, identically;
* ``master_epoch``: the replica cache's epoch of this rank's masters (a replica stays valid while it holds);
* ``cache_free``: this rank's replica-cache buffers may be used (no backward still reads them).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ultraep.kernels import upload
from ultraep.runtime.phases import RANK_PHASES

_K = len(RANK_PHASES)


@dataclass(frozen=True)
class LoadHeader:
    """One rank's header, after its ``E`` per-expert counts in the load all-gather."""

    bad_ids: int = 0
    phases_s: np.ndarray | None = None  # [K] seconds, RANK_PHASES order
    master_epoch: int = 0
    cache_free: bool = False

    #: int64 fields: bad ids, measured flag, master epoch, cache free, then the K phases
    SIZE = 4 + _K

    def pack(self) -> torch.Tensor:
        """``[SIZE]`` int64 (phases rounded to whole nanoseconds)."""
        out = torch.zeros(self.SIZE, dtype=torch.int64)
        out[0] = int(self.bad_ids)
        out[1] = int(self.phases_s is not None)
        out[2] = int(self.master_epoch)
        out[3] = int(self.cache_free)
        if self.phases_s is not None:
            out[4:] = torch.as_tensor(np.round(np.asarray(self.phases_s) * 1e9).astype(np.int64))
        return out

    @classmethod
    def unpack(cls, row: np.ndarray) -> "LoadHeader":
        """One rank's ``[SIZE]`` int64 → its header (phases in seconds, as every rank reads them)."""
        row = np.asarray(row)
        if row.shape != (cls.SIZE,):
            raise ValueError(f"a load header is {cls.SIZE} int64 values, got shape {row.shape}")
        return cls(bad_ids=int(row[0]), phases_s=row[4:].astype(np.float64) * 1e-9 if row[1] else None,
                   master_epoch=int(row[2]), cache_free=bool(row[3]))


def expert_counts(top_k_index: torch.Tensor, num_experts: int) -> torch.Tensor:
    """``[T, K]`` top-k ids → ``[E + 2]`` int64 counts on their device: experts ``0..E-1``, then the sentinel ``E``
    (dropped slots), then every id outside ``0..E`` (above the sentinel or negative). A scatter, not
    ``torch.bincount``: on CUDA bincount reads the largest id on the host first (a synchronisation), and it refuses
    a negative id with an error that names nothing of the model."""
    E = num_experts
    ids = top_k_index.reshape(-1).to(torch.int64)
    ids = torch.where((ids < 0) | (ids > E), torch.full_like(ids, E + 1), ids)
    return torch.zeros(E + 2, dtype=torch.int64, device=ids.device).scatter_add_(0, ids, torch.ones_like(ids))


def pack_load(counts: torch.Tensor, num_experts: int, header: LoadHeader) -> torch.Tensor:
    """This rank's ``[X]`` vector: ``counts`` (``[>= E + 1]``: the ``E`` experts, the sentinel's dropped slots, then
    the ids above it, as :func:`expert_counts` makes them) and ``header``; the bad ids are summed on the counts'
    device and the header travels there without blocking (no host sync)."""
    E = num_experts
    vec = torch.cat([counts[:E], upload([header.pack()], counts.device)[0]])
    vec[E] = counts[E + 1:].sum()  # (the sentinel E itself is a dropped slot: no load, not an error)
    return vec


@dataclass(frozen=True)
class GatheredLoad:
    """Every rank's load and header, as every rank holds them after the all-gather."""

    load_RE: np.ndarray  # [R, E] int64
    headers: tuple[LoadHeader, ...]  # [R]

    @classmethod
    def unpack(cls, gathered_RX: np.ndarray, num_experts: int) -> "GatheredLoad":
        E = num_experts
        return cls(gathered_RX[:, :E], tuple(LoadHeader.unpack(row) for row in gathered_RX[:, E:]))

    @property
    def bad_ranks(self) -> list[int]:
        """Ranks that routed ids above the sentinel."""
        return [r for r, h in enumerate(self.headers) if h.bad_ids]

    @property
    def bad_ids(self) -> int:
        return sum(h.bad_ids for h in self.headers)

    @property
    def epoch_R(self) -> np.ndarray:
        """``[R]`` int64: every rank's master epoch."""
        return np.array([h.master_epoch for h in self.headers], dtype=np.int64)

    @property
    def cache_free(self) -> bool:
        """Every rank may use its replica-cache buffers."""
        return all(h.cache_free for h in self.headers)

    def phases_RK(self) -> np.ndarray | None:
        """``[R, K]`` seconds when every rank sent its phases (of the same call), else None."""
        if not all(h.phases_s is not None for h in self.headers):
            return None
        return np.stack([h.phases_s for h in self.headers])

"""The EP group's shape: ranks, scale-up domains, nodes, masters and slots per rank, link speeds.

Legend (shape suffixes used across ultraep):
    R  ranks of the EP group          E  logical experts
    M  master slots per rank          N  redundant slots per rank
    S  slots per rank (= M + N)       D  ranks per scale-up domain

``home(e)`` is the rank holding expert ``e``'s master. By default it is contiguous,
``home(e) = e // (E / R)`` (how Hugging Face and Megatron shard experts); an explicit mapping is allowed,
in which case the master slot of ``e`` is its position among its home rank's experts in id order.

A :class:`Topology` is immutable and hashable; the index arrays it derives are cached on first use and
read-only, so the planners can take them on the hot path without copying.
"""

from __future__ import annotations

from functools import cached_property

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, model_validator

from ultraep.errors import ConfigError


class LinkSpec(BaseModel):
    """One level of the interconnect (scale-up fabric or scale-out network)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    bandwidth_GBps: float = Field(gt=0, description="Unidirectional bandwidth per rank, GB/s (1e9 bytes).")
    latency_us: float = Field(default=0.0, ge=0, description="Per-message latency, microseconds.")


class Topology(BaseModel):
    """Ranks, domains and slots of one EP group, plus the link and expert sizes that drive costs."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    num_ranks: int = Field(ge=1, description="Ranks in the EP group (R).")
    num_experts: int = Field(ge=1, description="Logical experts of one MoE layer (E).")
    num_redundant_slots: int = Field(default=0, ge=0, description="Redundant (replica) slots per rank (N).")
    domain_size: int | None = Field(
        default=None, ge=1,
        description="Ranks per scale-up domain (NVLink domain / rack); replicas never leave their master's "
        "domain. Defaults to all ranks.",
    )
    ranks_per_node: int | None = Field(
        default=None, ge=1, description="Ranks per node (host). Defaults to the domain size."
    )
    home: tuple[int, ...] | None = Field(
        default=None, description="Explicit home rank per expert; default contiguous e // (E / R)."
    )
    scale_up: LinkSpec = Field(
        default=LinkSpec(bandwidth_GBps=450.0, latency_us=2.0),
        description="Link inside a scale-up domain (default: NVLink 4 class).",
    )
    scale_out: LinkSpec = Field(
        default=LinkSpec(bandwidth_GBps=50.0, latency_us=5.0),
        description="Link between domains (default: 400 Gb/s InfiniBand class).",
    )
    expert_bytes: int = Field(
        default=0, ge=0, description="Bytes of one expert's weights (what a replica transfer moves)."
    )
    name: str = Field(default="custom", description="Preset name this topology came from, for records.")

    @model_validator(mode="after")
    def _check(self) -> "Topology":
        R, E = self.num_ranks, self.num_experts
        D = self.domain_size if self.domain_size is not None else R
        if R % D:
            raise ConfigError(
                "topology.domain_size", f"domain_size ({D}) must divide num_ranks ({R})", D
            )
        if self.ranks_per_node is not None and R % self.ranks_per_node:
            raise ConfigError(
                "topology.ranks_per_node",
                f"ranks_per_node ({self.ranks_per_node}) must divide num_ranks ({R})",
                self.ranks_per_node,
            )
        if self.home is None:
            if E % R:
                raise ConfigError(
                    "topology.num_experts",
                    f"num_experts ({E}) must be divisible by num_ranks ({R}) for the contiguous home "
                    "mapping; pass an explicit `home` tuple instead",
                    E,
                )
            M = E // R
        else:
            if len(self.home) != E:
                raise ConfigError(
                    "topology.home", f"home has {len(self.home)} entries but num_experts is {E}", len(self.home)
                )
            bad = [(e, r) for e, r in enumerate(self.home) if not 0 <= r < R]
            if bad:
                e, r = bad[0]
                raise ConfigError(f"topology.home.{e}", f"home rank {r} is outside 0..{R - 1}", r)
            M = int(np.bincount(np.asarray(self.home), minlength=R).max())
        limit = (D - 1) * M
        if self.num_redundant_slots > limit:
            raise ConfigError(
                "topology.num_redundant_slots",
                f"num_redundant_slots ({self.num_redundant_slots}) must be <= (domain_size - 1) * "
                f"num_masters ({limit}): a rank only hosts replicas of experts homed on other ranks of its "
                "domain",
                self.num_redundant_slots,
            )
        return self

    # ------------------------------------------------------------------ derived, cached, read-only
    def __eq__(self, other: object) -> bool:
        # Fields only: the cached derived arrays (home_E, ...) live in __dict__ too, and pydantic's __eq__
        # would compare them elementwise (ambiguous truth value) once they are computed.
        if not isinstance(other, Topology):
            return NotImplemented
        return self is other or all(getattr(self, f) == getattr(other, f) for f in type(self).model_fields)

    def __hash__(self) -> int:
        return hash(tuple(getattr(self, f) for f in type(self).model_fields))

    @cached_property
    def D(self) -> int:
        """Ranks per scale-up domain."""
        return self.domain_size if self.domain_size is not None else self.num_ranks

    @cached_property
    def num_domains(self) -> int:
        return self.num_ranks // self.D

    @cached_property
    def num_masters(self) -> int:
        """Master slots per rank (M): the most experts any rank is home to."""
        if self.home is None:
            return self.num_experts // self.num_ranks
        return int(np.bincount(np.asarray(self.home), minlength=self.num_ranks).max())

    @cached_property
    def num_slots(self) -> int:
        """Slots per rank (S = M + N)."""
        return self.num_masters + self.num_redundant_slots

    @cached_property
    def home_E(self) -> np.ndarray:
        """``[E]`` home rank of each expert."""
        if self.home is None:
            arr = np.arange(self.num_experts, dtype=np.int64) // self.num_masters
        else:
            arr = np.asarray(self.home, dtype=np.int64)
        return _frozen(arr)

    @cached_property
    def master_slot_E(self) -> np.ndarray:
        """``[E]`` slot of each expert's master on its home rank (its index among the rank's experts)."""
        if self.home is None:
            arr = np.arange(self.num_experts, dtype=np.int64) % self.num_masters
        else:
            arr = np.zeros(self.num_experts, dtype=np.int64)
            seen = np.zeros(self.num_ranks, dtype=np.int64)
            for e, r in enumerate(self.home_E):
                arr[e] = seen[r]
                seen[r] += 1
        return _frozen(arr)

    @cached_property
    def masters_RM(self) -> np.ndarray:
        """``[R, M]`` expert id in each master slot, ``-1`` where a rank has fewer masters."""
        arr = np.full((self.num_ranks, self.num_masters), -1, dtype=np.int64)
        arr[self.home_E, self.master_slot_E] = np.arange(self.num_experts)
        return _frozen(arr)

    @cached_property
    def domain_R(self) -> np.ndarray:
        """``[R]`` scale-up domain of each rank (domains are contiguous blocks of D ranks)."""
        return _frozen(np.arange(self.num_ranks, dtype=np.int64) // self.D)

    @cached_property
    def node_R(self) -> np.ndarray:
        """``[R]`` node of each rank."""
        per = self.ranks_per_node if self.ranks_per_node is not None else self.D
        return _frozen(np.arange(self.num_ranks, dtype=np.int64) // per)

    def with_slots(self, num_redundant_slots: int) -> "Topology":
        """The same topology with another number of redundant slots per rank (validated)."""
        return Topology.model_validate(self.model_dump() | {"num_redundant_slots": num_redundant_slots})


def _frozen(arr: np.ndarray) -> np.ndarray:
    arr.setflags(write=False)
    return arr

"""Cluster presets: the numbers that drive the cost model, next to the :class:`~ultraep.topology.Topology`.

A preset bundles three things the topology does not carry:

* the interconnect (scale-up domain size, ranks per node, :class:`~ultraep.topology.LinkSpec` per level),
* the accelerator (:class:`HardwareSpec`: GEMM throughput, grouped-GEMM efficiency curve, achievable
  fractions of link bandwidth),
* a default expert geometry (:class:`ExpertSpec`: hidden and FFN sizes → bytes per expert, FLOPs and
  bytes per token), which a model or the CLI usually overrides.

Every field can be overridden (:func:`get_preset` with a nested mapping, or ``--set key=value`` on the
CLI). :meth:`ClusterPreset.topology` turns a preset into a validated ``Topology`` for a given EP group.

Presets (numbers are public vendor figures; the efficiency factors are calibrated against the UltraEP
paper's Qwen3-235B per-layer breakdown, arXiv 2606.04101 Fig. 13, see ``docs/simulator.md``):

==============  ===============  =========================  =====================  ===================
name            scale-up domain  scale-up link              scale-out link         GEMM (bf16 dense)
==============  ===============  =========================  =====================  ===================
``h100-8x-ib``  8 GPUs (node)    NVLink 4, 450 GB/s/dir     IB 400 Gb/s, 50 GB/s   989 TFLOP/s
``gb200-nvl72`` 72 GPUs (rack)   NVLink 5, 900 GB/s/dir     800 Gb/s, 100 GB/s     2500 TFLOP/s
``cross-dc``    8 GPUs (one DC)  NVLink 4, 450 GB/s/dir     10 Gb/s per DC, shared 989 TFLOP/s
``hybridep-     8 GPUs (one DC)  PCIe 3.0 x16, 16 GB/s      10 Gb/s per DC, shared 312 TFLOP/s (A800)
a800``
==============  ===============  =========================  =====================  ===================

The scale-up domain of an EP group is the largest divisor of ``num_ranks`` that does not exceed the
preset's domain size (an EP256 group on NVL72 racks uses 64 GPUs per rack, as UltraEP's 4-rack runs do).
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ultraep.errors import ConfigError
from ultraep.topology import LinkSpec, Topology


class HardwareSpec(BaseModel):
    """One accelerator's compute and the fraction of each link it actually achieves."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str = Field(default="generic", description="Accelerator name, for records.")
    gemm_tflops: float = Field(gt=0, description="Peak dense bf16 GEMM throughput per GPU, TFLOP/s (1e12).")
    gemm_efficiency: float = Field(
        default=0.55, gt=0, le=1,
        description="Fraction of peak a large grouped GEMM reaches (the asymptote of the efficiency curve).",
    )
    gemm_half_tokens: float = Field(
        default=128.0, ge=0,
        description="Tokens per expert instance at which grouped-GEMM efficiency is half its asymptote: "
        "eff(n) = gemm_efficiency * n / (n + gemm_half_tokens). Each active instance therefore costs as "
        "much as this many extra tokens.",
    )
    a2a_efficiency: float = Field(
        default=0.7, gt=0, le=1, description="Fraction of link bandwidth the token all-to-all achieves."
    )
    copy_efficiency: float = Field(
        default=0.78, gt=0, le=1,
        description="Fraction of scale-up bandwidth replica weight copies achieve (UltraEP: ~700 of 900 GB/s).",
    )
    memory_GB: float = Field(default=80.0, gt=0, description="Device memory per GPU, GB (1e9 bytes).")
    grad_reduce_efficiency: float = Field(
        default=0.35, gt=0, le=1,
        description="Fraction of scale-up bandwidth the SM-limited gradient reduction achieves (it shares "
        "the GPU with backward compute; UltraEP: 1.9-2.4 ms with 42 SMs).",
    )


class ExpertSpec(BaseModel):
    """Geometry of one routed expert (a SwiGLU FFN by default)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    hidden_size: int = Field(default=4096, ge=1, description="Model hidden size H.")
    ffn_size: int = Field(default=1536, ge=1, description="Expert intermediate size F.")
    num_matrices: int = Field(default=3, ge=1, description="Weight matrices of H x F per expert (SwiGLU: 3).")
    weight_bytes: int = Field(default=2, ge=1, description="Bytes per weight (bf16: 2).")
    grad_bytes: int = Field(default=4, ge=1, description="Bytes per weight gradient (fp32 main grads: 4).")
    activation_bytes: int = Field(default=2, ge=1, description="Bytes per activation element in dispatch.")

    @property
    def params(self) -> int:
        return self.num_matrices * self.hidden_size * self.ffn_size

    @property
    def expert_bytes(self) -> int:
        """Bytes of one expert's weights (what a replica transfer moves)."""
        return self.params * self.weight_bytes

    @property
    def grad_bytes_per_expert(self) -> int:
        return self.params * self.grad_bytes

    @property
    def flops_per_token(self) -> float:
        """Forward FLOPs of one token–expert assignment (2 FLOPs per multiply-add)."""
        return 2.0 * self.params

    @property
    def activation_width(self) -> int:
        """Activation elements one received row keeps on its rank until the expert's backward: the row itself (H)
        and the expert's F-wide intermediates (SwiGLU: gate and up projections and their activated product, one
        per weight matrix: ``num_matrices`` x F)."""
        return self.hidden_size + self.num_matrices * self.ffn_size

    @property
    def activation_row_bytes(self) -> int:
        """Bytes of expert activations one received row holds (``activation_width`` x ``activation_bytes``)."""
        return self.activation_width * self.activation_bytes

    @property
    def token_bytes(self) -> int:
        """Bytes one token–expert assignment moves in dispatch (and again in combine)."""
        return self.hidden_size * self.activation_bytes


class ClusterPreset(BaseModel):
    """A named cluster: interconnect, accelerator and a default expert geometry."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str = Field(description="Preset name.")
    description: str = Field(default="", description="One line for humans.")
    domain_size: int = Field(ge=1, description="GPUs per scale-up domain (NVLink domain / rack / DC).")
    ranks_per_node: int = Field(ge=1, description="GPUs per host.")
    scale_up: LinkSpec = Field(description="Link inside a scale-up domain.")
    scale_out: LinkSpec = Field(description="Link between scale-up domains.")
    scale_out_shared: bool = Field(
        default=False,
        description="scale_out is one link per scale-up domain shared by its GPUs (a datacenter's WAN link), not a "
        "per-GPU NIC; the cost model then charges the busiest domain's total bytes.",
    )
    hardware: HardwareSpec = Field(description="Accelerator compute and link efficiencies.")
    expert: ExpertSpec = Field(default_factory=ExpertSpec, description="Default expert geometry (Qwen3-235B).")

    def domain_for(self, num_ranks: int) -> int:
        """Scale-up domain of an EP group of ``num_ranks``: largest divisor <= the preset's domain size."""
        for d in range(min(self.domain_size, num_ranks), 0, -1):
            if num_ranks % d == 0:
                return d
        return 1  # pragma: no cover - d = 1 always divides

    def topology(self, num_ranks: int, num_experts: int, num_redundant_slots: int = 2, **overrides: Any) -> Topology:
        """A validated :class:`Topology` for this cluster and EP group; ``overrides`` are Topology fields."""
        D = self.domain_for(num_ranks)
        per_node = self.ranks_per_node if D % self.ranks_per_node == 0 else D
        fields = dict(
            num_ranks=num_ranks, num_experts=num_experts, num_redundant_slots=num_redundant_slots,
            domain_size=D, ranks_per_node=per_node, scale_up=self.scale_up, scale_out=self.scale_out,
            expert_bytes=self.expert.expert_bytes, name=self.name,
        )
        fields.update(overrides)
        return Topology(**fields)


PRESETS: dict[str, ClusterPreset] = {
    "h100-8x-ib": ClusterPreset(
        name="h100-8x-ib",
        description="H100 SXM nodes of 8 GPUs on NVLink 4, 400 Gb/s InfiniBand per GPU between nodes",
        domain_size=8, ranks_per_node=8,
        scale_up=LinkSpec(bandwidth_GBps=450.0, latency_us=3.0),
        scale_out=LinkSpec(bandwidth_GBps=50.0, latency_us=8.0),
        hardware=HardwareSpec(name="H100-SXM", gemm_tflops=989.0),
    ),
    "gb200-nvl72": ClusterPreset(
        name="gb200-nvl72",
        description="GB200 NVL72 racks (72-GPU NVLink 5 domain), 800 Gb/s per GPU between racks",
        domain_size=72, ranks_per_node=4,
        scale_up=LinkSpec(bandwidth_GBps=900.0, latency_us=3.0),
        scale_out=LinkSpec(bandwidth_GBps=100.0, latency_us=8.0),
        hardware=HardwareSpec(name="B200 (GB200)", gemm_tflops=2500.0, gemm_efficiency=0.53, memory_GB=186.0),
    ),
    "cross-dc": ClusterPreset(
        name="cross-dc",
        description="8-GPU H100 NVLink nodes, one per datacenter, each datacenter on one ~10 Gb/s link (HybridEP's "
        "setting with H100 nodes)",
        domain_size=8, ranks_per_node=8,
        scale_up=LinkSpec(bandwidth_GBps=450.0, latency_us=3.0),
        scale_out=LinkSpec(bandwidth_GBps=1.25, latency_us=500.0), scale_out_shared=True,
        hardware=HardwareSpec(name="H100-SXM", gemm_tflops=989.0),
    ),
    "hybridep-a800": ClusterPreset(
        name="hybridep-a800",
        description="HybridEP's testbed (arXiv 2510.19470 §V): a 'DC' is one node of 8 A800 on PCIe 3.0 x16 "
        "(128 Gb/s), DCs joined by one 10 Gb/s Ethernet link each",
        domain_size=8, ranks_per_node=8,
        scale_up=LinkSpec(bandwidth_GBps=16.0, latency_us=10.0),
        scale_out=LinkSpec(bandwidth_GBps=1.25, latency_us=500.0), scale_out_shared=True,
        hardware=HardwareSpec(name="A800", gemm_tflops=312.0, memory_GB=80.0),
    ),
}


def _merge(base: dict, patch: dict, path: str) -> dict:
    out = dict(base)
    for key, value in patch.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value, f"{path}.{key}")
        else:
            out[key] = value
    return out


def get_preset(name: str, overrides: dict[str, Any] | None = None) -> ClusterPreset:
    """The preset ``name`` with ``overrides`` merged in (nested: ``{"scale_out": {"bandwidth_GBps": 5}}``).

    Raises :class:`ConfigError` for an unknown name (listing the known ones) or an invalid override
    (naming the field path and value).
    """
    if name not in PRESETS:
        raise ConfigError("topology", f"unknown preset {name!r}; available: {', '.join(sorted(PRESETS))}", name)
    preset = PRESETS[name]
    if not overrides:
        return preset
    merged = _merge(preset.model_dump(), overrides, name)
    try:
        return ClusterPreset.model_validate(merged)
    except ValidationError as exc:
        err = exc.errors()[0]
        loc = ".".join(str(p) for p in err.get("loc", ()))
        raise ConfigError(f"topology.{loc}", err.get("msg", "invalid"), err.get("input")) from None


def parse_overrides(items: list[str] | None) -> dict[str, Any]:
    """``["scale_out.bandwidth_GBps=1.25", "expert.hidden_size=2048"]`` → nested dict (values parsed as
    JSON when possible, else kept as strings)."""
    import json

    out: dict[str, Any] = {}
    for item in items or []:
        if "=" not in item:
            raise ConfigError("--set", f"expected KEY=VALUE, got {item!r}", item)
        key, raw = item.split("=", 1)
        try:
            value = json.loads(raw)
        except json.JSONDecodeError:
            value = raw
        node = out
        parts = key.strip().split(".")
        for p in parts[:-1]:
            node = node.setdefault(p, {})
            if not isinstance(node, dict):
                raise ConfigError("--set", f"{key!r} overrides a scalar with a nested key", item)
        node[parts[-1]] = value
    return out


# ---------------------------------------------------------------------------------------------- this machine
def local_seed(like, cuda: bool):
    """Seed figures for the runtime's cost model on this machine, before calibration replaces them:
    ``(HardwareSpec, ExpertSpec, LinkSpec, copy_s_per_byte)`` for one expert's tensors ``like`` (each [.., ..]).

    Rough on purpose: the runtime calibrates every scale from measured phases within a few calls (the
    first observations weigh 1/n). CPU + gloo: ~50 GFLOP/s per rank thread, ~2 GB/s loopback, host copies
    ~2 GB/s; GPU + NCCL: 100 TFLOP/s, 100 GB/s links, copy kernels overlapped (0 exposed)."""
    from ultraep.topology import LinkSpec

    mats = [t for t in like if t.dim() == 2]
    H = int(min(min(t.shape) for t in mats))
    weights = sum(t.numel() for t in mats)
    size = like[0].element_size()
    expert = ExpertSpec(hidden_size=H, ffn_size=max(1, weights // (3 * H)), num_matrices=3, weight_bytes=size,
                        activation_bytes=size)
    # a CPU GEMM reaches its speed at a few rows (half-efficiency ~16 rows, not a GPU's ~128): replicas of an
    # expert cost little beyond their rows
    hw = HardwareSpec(name="local-gpu" if cuda else "local-cpu", gemm_tflops=100.0 if cuda else 0.05,
                      gemm_half_tokens=128.0 if cuda else 16.0)
    link = LinkSpec(bandwidth_GBps=100.0 if cuda else 2.0, latency_us=10.0 if cuda else 100.0)
    return hw, expert, link, (0.0 if cuda else 0.5e-9)

"""``plan_layer``: the one-call entry point for planning a single layer and microbatch."""

from __future__ import annotations

from functools import lru_cache
from numbers import Integral

from pydantic import ValidationError

from ultraep.errors import ConfigError, UltraEPError, format_pydantic_error
from ultraep.limits import check_plan
from ultraep.load import validate_load
from ultraep.plan import Plan
from ultraep.topology import Topology


@lru_cache(maxsize=256)
def _topology(R: int, E: int, N: int, D: int | None) -> Topology:
    """The topology ``plan_layer`` builds from the load's shape; a rule it breaks (experts not divisible
    by ranks, too many slots) is raised as the one-line :class:`ConfigError` the validator made, with
    the load's shape added, not as pydantic's multi-line wrapper around it."""
    try:
        return Topology(num_ranks=R, num_experts=E, num_redundant_slots=N, domain_size=D)
    except ValidationError as exc:
        first = exc.errors()[0]
        inner = (first.get("ctx") or {}).get("error")
        if isinstance(inner, UltraEPError):
            raise ConfigError(inner.path, f"{inner.message} (load of shape [{R}, {E}])", inner.value) from None
        raise ConfigError("topology", format_pydantic_error(exc).replace("\n", "; "), (R, E, N, D)) from None


@lru_cache(maxsize=64)
def _policy(name: str, options: tuple):
    from ultraep.policies import make_policy

    return make_policy(name, **dict(options))


def plan_layer(
    load,
    policy: str = "quota",
    *,
    num_redundant_slots: int = 2,
    domain_size: int | None = None,
    topology: Topology | None = None,
    **options,
) -> Plan:
    """Plan one MoE layer for one microbatch.

    Args:
        load: ``[R, E]`` token–expert assignments per source rank and logical expert.
        policy: ``none`` | ``quota`` | ``eplb`` (or a registered third-party name).
        num_redundant_slots: redundant slots per rank (ignored when ``topology`` is given).
        domain_size: ranks per scale-up domain, default all ranks (ignored when ``topology`` is given).
        topology: a full :class:`Topology` (home mapping, link speeds, expert bytes).
        **options: policy options, e.g. ``balance_eps=0.01`` for ``quota``. One-shot ``eplb`` plans from
            this load (``use_current_load=True``, the EPLB+ baseline) unless told otherwise.

    Returns the frozen :class:`Plan`; masters are contiguous unless ``topology`` says otherwise.
    """
    if topology is None:
        if isinstance(num_redundant_slots, bool) or not isinstance(num_redundant_slots, Integral):
            raise ConfigError("num_redundant_slots", f"must be an integer, got {num_redundant_slots!r}",
                              num_redundant_slots)
        arr = validate_load(load)
        topology = _topology(arr.shape[0], arr.shape[1], int(num_redundant_slots), domain_size)
    else:
        arr = validate_load(load, topology.num_ranks, topology.num_experts)
    # the [R, R, S] routes and per-plan copies are the big allocations: refuse what cannot fit, before planning
    check_plan(topology.num_ranks, topology.num_experts, topology.num_redundant_slots)
    from ultraep.policies import get_policy_class, plan_resident

    # a policy says how it plans once, without history (EPLB: from this load, the EPLB+ baseline)
    options = {**getattr(get_policy_class(policy), "one_shot_options", {}), **options}
    try:
        pol = _policy(policy, tuple(sorted(options.items())) if options else ())
    except TypeError:  # unhashable option values: no caching
        from ultraep.policies import make_policy

        pol = make_policy(policy, **options)
    return plan_resident(pol, arr, topology, None)  # timed there: the plan's solve_time_s


_WARM: dict[str, float] = {}


def warm_up() -> float:
    """Compile every built-in planner now (or load it from numba's on-disk cache), so the first real plan
    does not pay for it inside a timed step: on a fresh machine that is ~20 s, which telemetry would
    otherwise report as planning overhead of step 0. Plans a few tiny loads (uniform, skewed, one very
    hot expert; ``[4, 8]`` int64, two domains) through fresh instances of each policy, two steps each
    (history-based planners place on their second step). Idempotent per process.

    Returns the seconds spent (0.0 when already warm).
    """
    if "s" in _WARM:
        return 0.0
    import time

    import numpy as np

    from ultraep.policies import POLICIES, make_policy

    t0 = time.perf_counter()
    uniform = np.full((4, 8), 64, dtype=np.int64)
    skewed = uniform.copy()
    skewed[:, 0] = 640
    hot = uniform.copy()
    hot[:, 3] = 64_000
    mixed = np.random.default_rng(0).integers(0, 1000, size=(4, 8), dtype=np.int64)
    for domain_size in (None, 2):  # one scale-up domain (the runtime's usual case) and two
        topo = Topology(num_ranks=4, num_experts=8, num_redundant_slots=2, domain_size=domain_size,
                        expert_bytes=1 << 20)
        for name in POLICIES:
            pol = make_policy(name)
            for load in (uniform, skewed, hot, mixed, skewed):
                for writeable in (True, False):  # numba compiles read-only arrays as a type of their own
                    arr = load.copy()
                    arr.setflags(write=writeable)
                    pol.commit(pol.plan(arr, topo))
    _WARM["s"] = time.perf_counter() - t0
    return _WARM["s"]


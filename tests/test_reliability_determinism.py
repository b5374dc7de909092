"""Determinism: the same loads give bit-identical plans across runs, processes and ranks, for every policy.

Every rank plans its layer on its own from the same all-gathered load, so any nondeterminism (hash-seed
dependent iteration order, uninitialised memory, thread timing, global RNG state) would make ranks exchange
tokens by different plans. The fingerprint of a policy is a digest over a 12-step sequence of skewed,
drifting loads (so history — EPLB windows, FEPLB's EWMA, adaptive hysteresis — takes part), each step
planned then committed; it covers placement, quotas, routes and transfers (``Plan.digest`` plus the
transfer columns). Compared:

* two fresh runs in this process (and a plan repeated without commit: planning is read-only);
* two fresh interpreters with different ``PYTHONHASHSEED`` values;
* four gloo ranks (each with a different global numpy/torch RNG state), compared through the group;
* the real runtime on two gloo ranks with ``check_plan_hash`` on, for every policy.

Plan divergence itself (ranks that *would* compute different plans) is detected by the runtime's plan-hash
check: ``tests/test_runtime.py::test_plan_divergence_is_detected_on_every_rank``.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np

from dist_utils import run_ranks

# Light at import (numpy and the planners only): the fresh interpreters below import this module to compute
# the same fingerprints. Torch and the models load in the multi-rank tests, before they fork.

POLICIES = ["none", "quota", "eplb", "feplb", "hybridep", "adaptive"]
REPO = Path(__file__).resolve().parent.parent


def fingerprints(steps: int = 12) -> dict[str, str]:
    """``{policy: hex digest}`` of planning + committing a fixed sequence of loads (module docstring)."""
    from ultraep.policies import make_policy
    from ultraep.topology import Topology

    topo = Topology(num_ranks=8, num_experts=32, num_redundant_slots=2, domain_size=4, expert_bytes=1 << 20)
    rng = np.random.default_rng(20260614)  # PCG64 with a fixed seed: the same stream in every process
    base = rng.pareto(1.2, size=32) + 0.05
    loads = []
    for step in range(steps):
        w = np.roll(base, step // 3)  # the hot experts drift every 3 steps
        loads.append(np.stack([rng.multinomial(4096, w / w.sum()) for _ in range(8)]).astype(np.int64))
    out = {}
    for name in POLICIES:
        pol = make_policy(name, **({"eplb": {"interval": 4, "window": 4}}.get(name, {})))
        h = hashlib.blake2b(digest_size=16)
        for load in loads:
            plan = pol.plan(load, topo)
            assert pol.plan(load, topo).digest() == plan.digest()  # planning is read-only: same plan again
            h.update(plan.digest().encode())
            for col in (plan.transfers.expert, plan.transfers.src, plan.transfers.dst, plan.transfers.bytes,
                        plan.transfers.stage):
                h.update(np.ascontiguousarray(col, dtype=np.int64).tobytes())
            pol.commit(plan)
        out[name] = h.hexdigest()
    return out


def test_same_process_two_runs_identical():
    a, b = fingerprints(), fingerprints()
    assert a == b
    assert len(set(a.values())) == len(a)  # and the policies do differ (the fingerprint sees the decisions)


def test_fresh_interpreters_with_different_hash_seeds_agree():
    here = fingerprints()
    code = ("import json, sys; sys.path.insert(0, 'tests'); "
            "from test_reliability_determinism import fingerprints; print(json.dumps(fingerprints()))")
    procs = []
    for seed in ("0", "12345"):
        env = dict(os.environ, PYTHONHASHSEED=seed)
        procs.append(subprocess.Popen([sys.executable, "-c", code], cwd=REPO, env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
    for p in procs:
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0, err[-2000:]
        assert json.loads(out.strip().splitlines()[-1]) == here


def _forkable() -> None:
    import transformers  # noqa: F401 - imported before fork so ranks start fast

    from ultraep.models import preload

    preload()


def _ranks_fingerprints(rank, world):
    import torch

    from ultraep.runtime.comm import all_gather_bytes

    np.random.seed(1000 + rank)  # different global RNG states must not matter
    torch.manual_seed(1000 + rank)
    fp = fingerprints()
    everyone = all_gather_bytes(hashlib.sha256(json.dumps(fp, sort_keys=True).encode()).hexdigest()[:32].encode())
    return fp, len(set(everyone))


def test_every_rank_computes_the_same_plans():
    here = fingerprints()
    _forkable()
    results = run_ranks(_ranks_fingerprints, 4, p2p=False)  # planning only: nothing moves
    for fp, distinct in results:
        assert distinct == 1 and fp == here


def _runtime_plan_hash_check(rank, world):
    import torch

    import ultraep
    from ultraep.models import build_model

    seen = {}
    for policy in POLICIES:
        torch.manual_seed(0)
        model = build_model("qwen3-moe", num_experts=8)
        cfg = {"policy": policy, "num_redundant_slots": 2, "check_plan_hash": True}
        if policy == "eplb":
            cfg["eplb"] = {"interval": 1, "window": 1}
        ultraep.wrap(model, cfg)
        rt = ultraep.runtime_of(model)
        digests = []
        for step in range(2):
            ids = torch.randint(0, 3, (2, 12), generator=torch.Generator().manual_seed(1000 * step + 17 * rank))
            model(input_ids=ids).logits.pow(2).mean().backward()  # PlanDivergenceError if ranks disagree
            digests += [layer.last_plan.digest() for layer in rt.layers]
            rt.next_step()
        seen[policy] = digests
    return seen


def test_runtime_ranks_agree_on_every_policy_with_the_plan_hash_check():
    _forkable()
    a, b = run_ranks(_runtime_plan_hash_check, 2)
    assert a == b and sorted(a) == sorted(POLICIES)

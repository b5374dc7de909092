"""Conformance: every experts container in the installed transformers balances exactly, or is refused with one line.

Discovery (no list to maintain): every ``modeling_*.py`` of the installed transformers is scanned for classes
declared with ``@use_experts_implementation`` (read from the decorator's closure) and for the non-interface
containers ultraep knows by name (:data:`ultraep.models.adapters.KNOWN_NON_INTERFACE`, :data:`~ultraep.models.adapters.REFUSED`).
Each is built tiny from its own config class (E = 8 experts, H = 16, I = 8; random weights, no download).

Check, container level, on 2 gloo ranks in ONE launch for all families, policy ``quota`` with 1 and 2 redundant
slots: every rank routes 24 tokens top-2 with a skew towards rank 0's masters (so replicas are used —
asserted), and the wrapped container must equal the unwrapped one: outputs, input and routing-weight
gradients on each rank, and each master's gradient equals the sum over ranks of the unwrapped expert's
gradient (fp32, 1e-5 relative). A container whose MoE block ``ultraep.wrap`` rewrites first
(:data:`ultraep.models.rewrite.BLOCKS`: Llama4, DBRX, JetMoE, Longcat-Flash) is checked the same way on the whole block, router
included (skewed towards rank 0's masters), against the original block, with its router gradients. A family is
otherwise refused at ``wrap`` with a one-line
:class:`~ultraep.models.adapters.UnsupportedModelError`. A negative control perturbs one master after ``wrap`` and
the same comparison must fail.

``python tests/test_adapters_conformance.py`` rewrites ``docs/models.md`` (the README's model table) from a run.
"""

from __future__ import annotations

import copy
import importlib
import inspect
import os
import re
import sys
from dataclasses import dataclass, field

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
from dist_utils import run_ranks  # noqa: E402
from numerics import assert_within, master_grad_errors, param_grad_errors, rel_error, tolerance, worst  # noqa: E402

# exactness against the CPU's kernels: CI runs these again under other kernel paths (.ci/run)
pytestmark = pytest.mark.numerics

E, H, I, T, K = 8, 16, 8, 24, 2
TOL = tolerance()  # fp32: a fraction of the reference's largest magnitude (tests/numerics.py)
DOC = os.path.join(os.path.dirname(__file__), "..", "docs", "models.md")

# Families the survey found to balance exactly on transformers 5.23 (plus the 4 end-to-end ones):
# if one of these is installed it must be *checked*, never refused.
MUST_BALANCE = {"qwen2_moe", "olmoe", "granitemoe", "deepseek_v2", "glm4_moe", "dots1", "ernie4_5_moe",
                "hunyuan_v1_moe", "phimoe", "qwen3_next", "minimax", "jamba", "flex_olmo", "lfm2_moe", "mixtral",
                "qwen3_moe", "deepseek_v3", "gpt_oss", "llama4", "dbrx", "jetmoe", "longcat_flash"}


@dataclass
class Family:
    """One experts container class of the installed transformers, and how to build it tiny."""

    family: str  # transformers model directory, e.g. "qwen3_moe"
    cls: type
    label: str = ""  # family + variant for reports
    config: object = None
    build_error: str = ""
    prepare: str = ""  # "" or "frozen_norm": freeze shared parameters before wrap
    flags: dict = field(default_factory=dict)
    block: type | None = None  # the MoE block built instead of the container (ultraep.models.rewrite)


def _config_candidates(family: str):
    """Default instances of every config class of ``family`` and their sub-configs (text/thinker/...)."""
    from transformers.configuration_utils import PreTrainedConfig

    try:
        mod = importlib.import_module(f"transformers.models.{family}.configuration_{family}")
    except ImportError:
        return
    seen = []

    def walk(cfg, depth):
        seen.append(cfg)
        for key in (getattr(type(cfg), "sub_configs", None) or {}) if depth < 3 else ():
            sub = getattr(cfg, key, None)
            if isinstance(sub, PreTrainedConfig):
                walk(sub, depth + 1)

    for obj in list(vars(mod).values()):
        if inspect.isclass(obj) and issubclass(obj, PreTrainedConfig) and obj.__module__ == mod.__name__:
            try:
                walk(obj(), 0)
            except Exception:  # noqa: BLE001 - a config that needs arguments: try the others
                continue
    yield from seen


_COUNT = re.compile(r"^(num_experts|num_local_experts|n_routed_experts|moe_num_experts)$")
_INTER = re.compile(r"(intermediate|ffn)\w*size$")


def _set(cfg, key, val, old):
    """Set ``key`` to ``val`` (or a list of it, where the config's strict field takes a list only)."""
    for v in (val, [val] * len(old) if isinstance(old, list) else [val, val]):
        try:
            setattr(cfg, key, v)
            return
        except Exception:  # noqa: BLE001 - strict config fields reject the other shape
            continue


def _shrink(cfg, depth=0):
    from transformers.configuration_utils import PreTrainedConfig

    for key in (getattr(type(cfg), "sub_configs", None) or {}) if depth < 3 else ():
        if isinstance(getattr(cfg, key, None), PreTrainedConfig):  # DBRX's block reads its ffn_config
            _shrink(getattr(cfg, key), depth + 1)
    for key, val in list(cfg.to_dict().items()):
        if isinstance(val, bool) or not (val is None or isinstance(val, (int, list))):
            continue
        if _COUNT.match(key):
            _set(cfg, key, E, val)
        elif key in ("hidden_size", "moe_hidden_size"):
            _set(cfg, key, H, val)
        elif _INTER.search(key):
            _set(cfg, key, I, val)
        elif key in ("num_experts_per_tok", "moe_top_k", "moe_topk") and isinstance(val, int):  # blocks route top-K
            _set(cfg, key, K, val)
    if getattr(cfg, "zero_expert_num", None):  # Longcat: keep 2 zero-computation experts (ids E, E+1)
        cfg.zero_expert_num = 2
    return cfg


def _size_kwargs(cls) -> dict:
    """Optional size arguments of the container's constructor (Ernie-VL passes its per-modality size)."""
    params = inspect.signature(cls.__init__).parameters
    return {n: I for n, p in params.items() if _INTER.search(n) and p.default is None}


def _tiny(fam: Family):
    """Build ``fam.cls`` from the first config candidate that yields E experts of hidden size H, or explain."""
    errors = []
    build = fam.block or fam.cls
    for cfg in _config_candidates(fam.family):
        _shrink(cfg)
        try:
            with torch.device("meta"):
                mod = build(cfg, **_size_kwargs(build))
        except Exception as exc:  # noqa: BLE001
            errors.append(f"{type(cfg).__name__}: {type(exc).__name__}")
            continue
        if sum(p.numel() for p in mod.parameters()) > 200_000:
            errors.append(f"{type(cfg).__name__}: not tiny")
            continue
        cfg._experts_implementation = "eager"
        return cfg, ""
    return None, "; ".join(errors) or "no config class"


def discover() -> list[Family]:
    """Every experts container class of the installed transformers (see the module docstring)."""
    import transformers.models as tm

    from ultraep.models.adapters import KNOWN_NON_INTERFACE, REFUSED, _declared_flags  # noqa: F401
    from ultraep.models.rewrite import BLOCKS

    rewritten = {c: b for b, c in BLOCKS.items()}  # container class -> the block prepare() rewrites

    root = os.path.dirname(tm.__file__)
    named = set(KNOWN_NON_INTERFACE) | set(REFUSED)
    out = []
    for family in sorted(os.listdir(root)):
        path = os.path.join(root, family, f"modeling_{family}.py")
        if not os.path.exists(path):
            continue
        src = open(path, encoding="utf-8").read()
        if "use_experts_implementation" not in src and not any(f"class {n}(" in src for n in named):
            continue
        module = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
        for name, cls in sorted(vars(module).items()):
            if not (inspect.isclass(cls) and cls.__module__ == module.__name__ and issubclass(cls, torch.nn.Module)):
                continue
            code = getattr(cls.__dict__.get("__init__"), "__code__", None)
            declared = code is not None and {"original_init", "has_gate"} <= set(code.co_freevars)
            if declared or name in named:
                block = getattr(module, rewritten.get(name, ""), None)
                fam = Family(family, cls, label=f"{family}" + (f" ({block.__name__} block)" if block else ""),
                             block=block)
                fam.config, fam.build_error = _tiny(fam)
                out.append(fam)
                if "has_post_expert_norm" in src and declared and fam.config is not None:
                    out.append(Family(family, cls, f"{family} (frozen post-expert norm)", fam.config,
                                      prepare="frozen_norm"))
    labels = [f.label for f in out]
    for f in out:  # two containers in one family (Qwen3-Omni thinker/talker): name them apart
        if labels.count(f.label) > 1:
            f.label = f"{f.label}:{f.cls.__name__}"
    return out


def _build(fam: Family, seed: int):
    torch.manual_seed(seed)
    build = fam.block or fam.cls
    mod = build(fam.config, **_size_kwargs(build))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in sorted(mod.named_parameters()):
            p.copy_(torch.randn(p.shape, generator=g) * (0.3 if p.dim() > 1 else 0.1))
            if fam.block is not None and "router" in n and p.shape[0] >= E:
                p[:2] += 0.25  # with inputs of mean 0.5: experts 0 and 1 (rank 0's masters) are hot
                p[E:] += 0.15  # Longcat's zero-computation experts (router rows past E) are picked too
    if fam.prepare == "frozen_norm":
        mod.post_expert_norm.requires_grad_(False)
    return mod


class Holder(torch.nn.Module):
    """The smallest model around one experts container (wrap replaces ``self.experts``)."""

    def __init__(self, experts):
        super().__init__()
        self.experts = experts

    def forward(self, x, idx, w):
        return self.experts(x, idx, w)


class BlockHolder(torch.nn.Module):
    """A whole MoE block (router included) that ``prepare`` rewrites: wrap replaces ``self.block.experts``."""

    def __init__(self, block):
        super().__init__()
        self.block = block

    def forward(self, x, idx=None, w=None):
        out = self.block(x)
        return out[0] if isinstance(out, tuple) else out  # Llama4 also returns its router logits


def _inputs(rank: int, hidden: int):
    """x [T, H], idx [T, K] (distinct per token, skewed to experts 0 and 1: rank 0's masters), w [T, K]."""
    g = torch.Generator().manual_seed(100 + rank)
    probs = torch.tensor([8.0, 6.0, 1, 1, 1, 1, 1, 1])
    idx = torch.stack([torch.multinomial(probs, K, replacement=False, generator=g) for _ in range(T)])
    x = torch.randn(T, hidden, generator=g)
    w = torch.rand(T, K, generator=g) + 0.2
    cot = torch.randn(T, hidden, generator=g)
    return x, idx, w, cot


def _compare(rank, model, ref, hidden, perturb=False):
    """Max relative difference over outputs, input/weight gradients and master gradients; replicas used."""
    import torch.distributed as dist

    import ultraep

    rt = ultraep.runtime_of(model)
    layer = rt.layers[0]
    if perturb and rank == 0:  # negative control: one master of rank 0 (expert 0, the hottest) is off
        with torch.no_grad():
            getattr(layer, layer.adapter.param_names[1])[0].add_(0.05)
    x, idx, w, cot = _inputs(rank, hidden)
    block = isinstance(model, BlockHolder)
    if block:  # the block routes: [1, T, H] rows of mean 0.5, so its skewed router favours experts 0 and 1
        x = (x + 0.5)[None]
    xs = [x.clone().requires_grad_(True) for _ in range(2)]
    ws = [w.clone().requires_grad_(True) for _ in range(2)]
    out = model(xs[0], idx, ws[0])
    ref_out = ref(xs[1], idx, ws[1])
    (out * cot.view(out.shape)).sum().backward()
    (ref_out * cot.view(ref_out.shape)).sum().backward()

    rel = rel_error  # relative to the reference's largest magnitude; inf on NaN (tests/numerics.py)

    diffs = {"out": rel(out, ref_out), "x.grad": rel(xs[0].grad, xs[1].grad)}
    if block:  # the original block's gradients, now under the container's names (grads carried), and its
        from ultraep.models.rewrite import prepare  # router/shared parameters, rank-local on both sides

        prepare(ref)
        ref_experts = ref.block.experts
        ref_params = dict(ref.named_parameters())
        for n, p in model.named_parameters():
            if not n.startswith("block.experts."):
                zero = torch.zeros_like(p)  # a missing gradient is a zero one, never a skipped check
                diffs[n + ".grad"] = rel(zero if p.grad is None else p.grad,
                                         zero if ref_params[n].grad is None else ref_params[n].grad)
    else:
        diffs["w.grad"] = rel(ws[0].grad, ws[1].grad)
        ref_experts = ref.experts
    M = layer.topology.num_masters
    for n in layer.adapter.param_names:
        full = getattr(ref_experts, n)
        g = full.grad.clone() if full.grad is not None else torch.zeros_like(full)
        dist.all_reduce(g)
        mine = getattr(layer, n).grad
        diffs[n] = rel(mine if mine is not None else torch.zeros_like(g[:M]), g[rank * M:(rank + 1) * M])
    for sub in layer.adapter.shared:  # a shared parameter (post-expert norm): the sum over ranks, as DP reduces it
        for n, p in getattr(layer, sub).named_parameters():
            pair = [q.grad.clone() if q.grad is not None else torch.zeros_like(q)
                    for q in (p, getattr(ref_experts, sub).get_parameter(n))]
            for gr in pair:
                dist.all_reduce(gr)
            diffs[f"{sub}.{n} (sum over ranks)"] = rel(*pair)
    return diffs, int(layer.last_plan.num_replicas)


def _hidden(holder) -> int:
    from ultraep.models.adapters import adapter_for

    if isinstance(holder, BlockHolder):
        return H
    mod = holder.experts
    down = getattr(mod, adapter_for(mod).param_names[1])
    return int(down.shape[2] if getattr(mod, "is_transposed", False) else down.shape[1])


def _unbuilt(fam: Family) -> dict:
    """A container not built tiny: one refused by name still reports its refusal; anything else fails."""
    from ultraep.models.adapters import REFUSED, UnsupportedModelError, adapter_for

    if fam.cls.__name__ in REFUSED:
        bare = fam.cls.__new__(fam.cls)
        torch.nn.Module.__init__(bare)
        try:
            adapter_for(bare)
        except UnsupportedModelError as exc:
            return {"status": "refused", "cls": fam.cls.__name__, "why": str(exc)}
    return {"status": "not built", "cls": fam.cls.__name__, "why": fam.build_error}


def _pair(fam: Family, seed: int):
    """(unwrapped reference, model to wrap): the same container, or block, twice."""
    container = _build(fam, seed)
    holder = BlockHolder if fam.block is not None else Holder
    return holder(copy.deepcopy(container)), holder(container)


def _conformance(rank, world, families):
    import ultraep
    from ultraep.models.adapters import UnsupportedModelError

    results = {}
    for i, fam in enumerate(families):
        if fam.config is None:
            results[fam.label] = _unbuilt(fam)
            continue
        res = {"status": "checked", "cls": fam.cls.__name__, "diff": 0.0, "replicas": [], "worst": ""}
        for slots in (1, 2):
            ref, model = _pair(fam, seed=i)
            try:
                ultraep.wrap(model, {"policy": "quota", "num_redundant_slots": slots})
            except UnsupportedModelError as exc:
                res = {"status": "refused", "cls": fam.cls.__name__, "why": str(exc)}
                break
            diffs, replicas = _compare(rank, model, ref, _hidden(ref))
            name = next((k for k, v in diffs.items() if v != v), None) or max(diffs, key=diffs.get)
            if not diffs[name] < res["diff"]:  # `not <`: a NaN replaces the figure (and fails), never skipped
                res["diff"], res["worst"] = diffs[name], name
            res["replicas"].append(replicas)
        results[fam.label] = res
    # negative control: the same comparison on a perturbed master must fail
    fam = next(f for f in families if results.get(f.label, {}).get("status") == "checked")
    ref, model = _pair(fam, seed=0)
    ultraep.wrap(model, {"policy": "quota", "num_redundant_slots": 1})
    diffs, _ = _compare(rank, model, ref, _hidden(ref), perturb=True)
    results["__negative_control__"] = {"family": fam.label, "diff": worst(diffs.values())}
    return results


_RESULTS = None


def conformance_results():
    """Run the conformance check once per pytest session (both ranks' results, families)."""
    global _RESULTS
    if _RESULTS is None:
        import transformers  # noqa: F401 - imported before fork

        from ultraep.models import preload

        preload()
        families = discover()
        _RESULTS = (run_ranks(_conformance, 2, families, timeout=240), families)
    return _RESULTS


def test_every_family_balances_exactly_or_is_refused_with_one_line():
    (r0, r1), families = conformance_results()
    assert len(families) >= 60, [f.label for f in families]
    checked, refused = [], []
    for fam in families:
        a, b = r0[fam.label], r1[fam.label]
        assert a["status"] == b["status"], (fam.label, a, b)  # ranks decide alike (else they would hang)
        if a["status"] == "refused":
            assert "\n" not in a["why"] and "refused:" in a["why"], a
            refused.append(f"{fam.label}: {a['why']}")
            continue
        assert a["status"] == "checked", (fam.label, a)
        for r in (a, b):
            assert r["diff"] < TOL, (fam.label, r)
        assert min(max(a["replicas"]), max(b["replicas"])) > 0 and all(x > 0 for x in a["replicas"]), (fam.label, a)
        checked.append(fam.label)
    print(f"\nconformance: {len(checked)} checked, {len(refused)} refused")
    print("checked: " + ", ".join(checked))
    print("refused:\n  " + "\n  ".join(refused))
    balanced = {f.family for f in families if f.label in checked}
    assert MUST_BALANCE <= balanced | (MUST_BALANCE - {f.family for f in families}), sorted(
        MUST_BALANCE & {f.family for f in families} - balanced)


def test_muse_spark_post_expert_norm_balances_trainable_and_frozen():
    (r0, _), families = conformance_results()
    labels = {f.label for f in families}
    if "muse_spark" not in labels:
        pytest.skip("this transformers has no muse_spark")
    for label in ("muse_spark", "muse_spark (frozen post-expert norm)"):
        assert r0[label]["status"] == "checked" and r0[label]["diff"] < TOL, r0[label]


def test_negative_control_perturbed_master_is_caught():
    (r0, r1), _ = conformance_results()
    assert max(r0["__negative_control__"]["diff"], r1["__negative_control__"]["diff"]) > 100 * TOL


def render_doc(results, families) -> str:
    import transformers

    r0 = results[0]
    lines = [
        "# Model families",
        "",
        f"Generated by `python tests/test_adapters_conformance.py` from the conformance test on transformers "
        f"{transformers.__version__} (do not edit by hand). **balanced** = on 2 gloo ranks, policy `quota` with 1 "
        "and 2 redundant slots and skewed routing (replicas used), the wrapped experts container equals the "
        "unwrapped one: outputs, input and routing-weight gradients, master gradients (sum over ranks) and a "
        "shared parameter's gradient (post-expert norm: its sum over ranks, as data parallelism reduces it), "
        f"max relative difference below {TOL:g}. **refused** = `ultraep.wrap` raises this one line. A family "
        "marked *(X block)* keeps its experts another way: `ultraep.wrap` rewrites block X into an experts "
        "container first (`ultraep/models/rewrite.py`), and the check runs on the whole block (its own router "
        "routes; router and shared-parameter gradients compared too) against the original, unrewritten block.",
        "",
        "| family | container | result | detail |",
        "|---|---|---|---|",
    ]
    for fam in families:
        r = r0[fam.label]
        if r["status"] == "checked":
            detail = f"replicas with 1 / 2 redundant slots: {' / '.join(map(str, r['replicas']))}"
            status = "balanced"
        else:
            detail = r["why"].replace("|", "\\|")
            status = r["status"]
        lines.append(f"| {fam.label} | `{fam.cls.__name__}` | {status} | {detail} |")
    lines += ["", "A plain PyTorch container registers with `ultraep.register_experts(cls, param_names, forward)`; "
              "see the [training guide](guide/training.md#plan-one-layer-or-register-your-own-experts).", ""]
    return "\n".join(lines)


def test_models_doc_is_current():
    import transformers

    if not os.path.exists(DOC):
        pytest.fail("docs/models.md is missing: run `python tests/test_adapters_conformance.py`")
    text = open(DOC, encoding="utf-8").read()
    if f"transformers {transformers.__version__} " not in text:
        pytest.skip(f"docs/models.md was generated on another transformers than {transformers.__version__}")
    results, families = conformance_results()
    assert text == render_doc(results, families), "docs/models.md is stale: run `python tests/test_adapters_conformance.py`"


if __name__ == "__main__":
    res, fams = conformance_results()
    with open(DOC, "w", encoding="utf-8") as fh:
        fh.write(render_doc(res, fams))
    print(f"wrote {os.path.normpath(DOC)} ({len(fams)} containers)")


# ------------------------------------------------------------------ whole models: a hybrid SSM and a shared-expert one
def _whole_model(family: str):
    import transformers as tf

    common = dict(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    if family == "jamba":  # Mamba + attention hybrid (torch Mamba path), MoE in every layer
        cfg = tf.JambaConfig(**common, intermediate_size=16, num_experts=8, num_experts_per_tok=2, attn_layer_period=2,
                             attn_layer_offset=1, expert_layer_period=1, expert_layer_offset=0, mamba_d_state=8,
                             mamba_expand=2, use_mamba_kernels=False)
        cls = tf.JambaForCausalLM
    elif family == "longcat_flash":  # zero-computation experts (ids 8, 9) beside 8 real ones, MLA attention
        cfg = tf.LongcatFlashConfig(vocab_size=64, hidden_size=32, num_layers=1, num_attention_heads=4,
                                    num_key_value_heads=4, ffn_hidden_size=16, q_lora_rank=16, kv_lora_rank=16,
                                    qk_nope_head_dim=8, qk_rope_head_dim=8, head_dim=8, v_head_dim=8, moe_topk=2,
                                    n_routed_experts=8, zero_expert_num=2, expert_ffn_hidden_size=16)
        cls = tf.LongcatFlashForCausalLM
    elif family == "jetmoe":  # MoE MLPs (rewritten by prepare) and mixture-of-attention experts (stay replicated)
        cfg = tf.JetMoeConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_key_value_heads=2, kv_channels=8,
                              intermediate_size=16, num_local_experts=8, num_experts_per_tok=2)
        cls = tf.JetMoeForCausalLM
    else:  # qwen3_next: gated linear attention + full attention hybrid, with a gated shared expert
        cfg = tf.Qwen3NextConfig(**common, head_dim=8, intermediate_size=32, moe_intermediate_size=16,
                                 shared_expert_intermediate_size=16, num_experts=8, num_experts_per_tok=2,
                                 linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=8,
                                 linear_value_head_dim=8, layer_types=["linear_attention", "full_attention"],
                                 decoder_sparse_step=1, mlp_only_layers=[])
        cls = tf.Qwen3NextForCausalLM
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    model = cls(cfg)
    for mod in model.modules():  # Longcat: a selection bias (not in the weights) so zero experts are picked
        if type(mod).__name__ == "LongcatFlashTopkRouter":
            mod.e_score_correction_bias[8:] = torch.tensor([0.02, 0.015])
    return model


def _whole(rank, world, family):
    import ultraep

    from ultraep.models.rewrite import prepare, restore

    model = _whole_model(family)
    ref = copy.deepcopy(model)
    orig = copy.deepcopy(model)  # untouched: what unwrap + restore must give back
    ultraep.wrap(model, {"policy": "quota", "num_redundant_slots": 2})
    zero_slots = []  # Longcat: slots its routers send to zero-computation experts (ids >= E) in the wrapped run
    for mod in model.modules():
        if type(mod).__name__ == "LongcatFlashTopkRouter":
            E = mod.n_routed_experts - model.config.zero_expert_num
            mod.register_forward_hook(lambda m, a, out, E=E: zero_slots.append(int((out[2] >= E).sum())))
    ids = torch.randint(0, 3, (2, 12), generator=torch.Generator().manual_seed(rank + 1))  # few ids: skewed routing
    out, ref_out = model(input_ids=ids).logits, ref(input_ids=ids).logits
    out.pow(2).mean().backward()
    ref_out.pow(2).mean().backward()
    rt = ultraep.runtime_of(model)
    prepare(ref)  # a rewritten family's reference gradients under the container's names (no-op otherwise)
    grad = master_grad_errors(rt, ref, rank)
    other = param_grad_errors(model, ref, skip=lambda n: any(n.startswith(lay.name + ".") for lay in rt.layers))
    result = [rel_error(out, ref_out), grad, other, [lay.last_plan.num_replicas for lay in rt.layers]]
    if family == "longcat_flash":
        assert sum(zero_slots) > 0, zero_slots  # zero experts were hit (and dropped by the balanced layer)
    ultraep.unwrap(model)
    restore(model)  # the original module tree: same classes, keys (in order), values and logits
    sd, osd = model.state_dict(), orig.state_dict()
    assert list(sd) == list(osd) and all(torch.equal(sd[k], osd[k]) for k in osd), family
    assert [type(m) for m in model.modules()] == [type(m) for m in orig.modules()], family
    result.append(rel_error(model(input_ids=ids).logits, orig(input_ids=ids).logits))
    return result


@pytest.mark.parametrize("family", ["jamba", "qwen3_next", "jetmoe", "longcat_flash"])
def test_whole_hybrid_model_balances_exactly(family):
    for logits, grad, other, replicas, back in run_ranks(_whole, 2, family, timeout=120):
        assert_within({"logits": logits, **grad, **other}, what=family)
        assert max(replicas) > 0, replicas
        assert_within({"logits after unwrap + restore": back}, what=family)  # the original model

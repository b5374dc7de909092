"""Models: the experts adapters (what ``wrap`` can balance, exactly or refused), the exact block rewrites for
families that keep their experts another way, and tiny Hugging Face MoE models built from configs.

* :mod:`.experts` — what one expert of a container is (``ExpertsAdapter``, the interface's flags), shared by both;
* :mod:`.adapters` — read an experts container's declared flags and parameters; ``register_experts``;
* :mod:`.rewrite` — Llama4, DBRX, JetMoE and Longcat-Flash blocks rewritten in place into the container form;
* :mod:`.tiny` — ``build_model(family)`` and ``preload()`` for tests, the demo and benchmarks.
"""

from ultraep.models.tiny import FAMILIES, build_model, preload

__all__ = ["FAMILIES", "build_model", "preload"]

"""The exact integer token splits now live in the vocabulary (:mod:`ultraep.plan.routes`), because
:class:`~ultraep.plan.Plan` derives its routes with them and the vocabulary never imports from
``policies/``. Kept so ``ultraep.policies.split`` imports keep working."""

from ultraep.plan.routes import even_split, locality_split

__all__ = ["even_split", "locality_split"]

"""Integrations with training engines: each module imports its engine, so none is imported by ``import ultraep``.

* :mod:`.torchtitan` — torchtitan's parallelize functions with the expert masters left to ultraep.
"""

"""Models the step executor can run: the ``SPModel`` protocol and the small built-in ``TinyLM``.

A new model family implements ``SPModel`` (``protocol``); Hugging Face models get it from
``flexsp.hf``'s adapter.
"""
from flexsp.runtime.models.loss import linear_cross_entropy
from flexsp.runtime.models.protocol import SPModel
from flexsp.runtime.models.tiny import TinyLM

__all__ = ["SPModel", "linear_cross_entropy", "TinyLM"]

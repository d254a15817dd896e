"""Deprecated location: this module moved to ``flexsp.evaluation.megatron``; import it from there."""
import importlib
import sys
import warnings

warnings.warn("flexsp.megatron is deprecated; import flexsp.evaluation.megatron instead", DeprecationWarning, stacklevel=2)
sys.modules[__name__] = importlib.import_module("flexsp.evaluation.megatron")

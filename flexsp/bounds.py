"""Deprecated location: this module moved to ``flexsp.evaluation.bounds``; import it from there."""
import importlib
import sys
import warnings

warnings.warn("flexsp.bounds is deprecated; import flexsp.evaluation.bounds instead", DeprecationWarning, stacklevel=2)
sys.modules[__name__] = importlib.import_module("flexsp.evaluation.bounds")

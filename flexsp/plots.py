"""Deprecated location: this module moved to ``flexsp.evaluation.plots``; import it from there."""
import importlib
import sys
import warnings

warnings.warn("flexsp.plots is deprecated; import flexsp.evaluation.plots instead", DeprecationWarning, stacklevel=2)
sys.modules[__name__] = importlib.import_module("flexsp.evaluation.plots")

"""Deprecated location: this module moved to ``flexsp.evaluation.simulate``; import it from there."""
import importlib
import sys
import warnings

warnings.warn("flexsp.simulate is deprecated; import flexsp.evaluation.simulate instead", DeprecationWarning, stacklevel=2)
sys.modules[__name__] = importlib.import_module("flexsp.evaluation.simulate")

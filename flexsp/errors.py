"""One exception family per concern, all catchable as ``FlexSPError``."""

import argparse


class FlexSPError(ValueError):
    """Base class: every error FlexSP raises on bad input is one of these."""


class ClusterError(FlexSPError):
    """The cluster description is impossible (GPU counts, node size)."""


class CostModelError(FlexSPError):
    """A cost model is missing a coefficient, has a negative one, or lacks a degree's bandwidth."""


class PlanError(FlexSPError):
    """A plan breaks a rule of docs/design.md ("Plan rules"), a plan file is corrupt, or a batch cannot be planned."""


class LengthsError(FlexSPError):
    """A batch of sequence lengths is empty or holds non-positive / non-integer lengths."""


class ContextError(LengthsError):
    """A sequence is longer than the context limit and no policy (``--over-context truncate``) says what
    to do with it: it is refused, never planned silently."""


class SizeError(FlexSPError, argparse.ArgumentTypeError):
    """A size written on the command line (``384K``, ``2M``) is not a whole number in range. Also an
    ``ArgumentTypeError`` so that argparse prints its message as is."""

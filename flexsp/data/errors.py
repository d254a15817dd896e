"""The loader's one error family: bad configuration, bad items, too-long sequences, failed plans."""
from flexsp.errors import FlexSPError


class LoaderError(FlexSPError):
    """The data loader cannot produce a step: names the offending value (index, length, key, rank)."""


class PlannerError(LoaderError):
    """The background planner process keeps dying: names how often and how it last ended."""

"""The checkpoint error family: a checkpoint that is missing, corrupt, or does not fit this job."""
from flexsp.errors import FlexSPError


class CheckpointError(FlexSPError):
    """A checkpoint cannot be written or restored: names the file (or directory) and the problem."""

"""``flexsp profile``: fit the cost model to real hardware and measure how well it predicts.

| module | job | torch |
|---|---|---|
| ``fit`` | least-squares fits (compute, per layer kind, all-to-all bandwidth) | no |
| ``shape`` | model shapes to profile (from the registry, ``flexsp.plan.specs``), ``check_model_shape`` | no |
| ``assemble`` | fitted pieces + provenance -> ``flexsp.CostModel`` | no |
| ``interconnect`` | documented interconnect presets for the degrees a run could not measure, marked assumed | no |
| ``compute`` | forward + backward timings of the runtime model over sequence lengths | yes |
| ``kinds`` | a layer of each kind (full, window, chunk, linear attention) timed apart | yes |
| ``memory`` | activation bytes per token (GPU measured / CPU estimate), model states by sharding | yes |
| ``bandwidth`` | ``all_to_all_single`` timings on every pooled SP group size | yes |
| ``check`` | run a plan's groups and compare measured to predicted group times | yes |
| ``cli`` | ``add_parser(subparsers)`` / ``run(args)`` for the ``profile`` subcommand | lazily |

Importing this package does not import torch; the torch modules are imported on use.
"""
from flexsp.plan.analytic import comm_bytes_per_token
from flexsp.profile.assemble import assemble_cost_model
from flexsp.profile.fit import (MIN_COMM_POINTS, MIN_COMPUTE_POINTS, BandwidthFit, ComputeFit, FitPoint, FitWarning,
                                fit_bandwidth, fit_compute)
from flexsp.profile.shape import ShapeWarning, check_model_shape, model_spec

__all__ = ["assemble_cost_model", "fit_compute", "fit_bandwidth", "ComputeFit", "BandwidthFit",
           "FitPoint", "FitWarning", "MIN_COMPUTE_POINTS", "MIN_COMM_POINTS", "check_model_shape", "ShapeWarning",
           "comm_bytes_per_token", "model_spec"]

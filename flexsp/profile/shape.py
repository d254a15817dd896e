"""Model shapes for profiling, and the guard against planning with a profile of another model.

A profiled cost model is only valid for the model it was measured on: alpha1/alpha2 scale with
layers x hidden, the activation memory with hidden x layers, the all-to-all bytes with the head
layout. The profile records the shape in ``CostModel.meta["model"]`` (the same layout
``flexsp.plan.analytic`` uses: ``ModelSpec.shape()``), and ``check_model_shape`` compares it with the model being planned.
"""
from __future__ import annotations

import warnings
from dataclasses import replace
from typing import Any, Mapping

from flexsp.errors import CostModelError
from flexsp.inputs import integer
from flexsp.plan.cost import CostModel
from flexsp.plan.specs import SHAPE_FIELDS, ModelSpec, get_model, model_names


class ShapeWarning(UserWarning):
    """A cost model's shape could not be verified, or differs and the caller asked for a warning."""


def model_spec(name: str | None = None, **overrides: int | None) -> ModelSpec:
    """A preset by name, with any of ``SHAPE_FIELDS`` overridden (None = keep); ``name=None`` needs all six."""
    given = {k: v for k, v in overrides.items() if v is not None}
    unknown = sorted(set(given) - set(SHAPE_FIELDS))
    if unknown:
        raise CostModelError(f"unknown model shape fields {unknown}; valid are {list(SHAPE_FIELDS)}")
    if name is None:
        missing = [f for f in SHAPE_FIELDS if f not in given]
        if missing:
            raise CostModelError(f"without a preset name the model needs {', '.join(missing)}; "
                                 f"or pick a registered model: {', '.join(model_names())}")
        spec = ModelSpec(**{f: _field(f, given[f]) for f in SHAPE_FIELDS}, name="custom")
    else:
        if name not in model_names():
            raise CostModelError(f"unknown model preset {name!r}; choose one of {', '.join(model_names())} or give "
                                 f"the shape")
        spec = get_model(name)
        if given:
            given = {k: _field(k, v) for k, v in given.items()}
            if "layers" in given:            # the first layers of its kinds (flexsp.plan.layers), experts kept
                spec = spec.with_layers(given.pop("layers"))
            spec = replace(spec, **given, name=f"{name} (modified)")
    for f in SHAPE_FIELDS:
        if getattr(spec, f) < 1:
            raise CostModelError(f"model {f} must be >= 1, got {getattr(spec, f)}")
    if (spec.head_dim is None and spec.hidden % spec.heads) or spec.heads % spec.kv_heads:
        raise CostModelError(f"hidden ({spec.hidden}) must be a multiple of heads ({spec.heads}) and heads a "
                             f"multiple of kv_heads ({spec.kv_heads})")
    return spec


def _field(name: str, value: Any, where: str = "model ") -> int:
    """A shape field as a whole number: a float (64.9), a bool or a string from a file is refused in one line, not
    truncated or read as 1."""
    return integer(value, f"{where}{name}", CostModelError, minimum=1, maximum=2**31)


def check_model_shape(cost: CostModel, spec: ModelSpec, *, strict: bool = True) -> None:
    """Make sure ``cost`` was measured (or derived) for the model ``spec`` being planned.

    Compares ``cost.meta["model"]`` field by field (layers, hidden, heads, kv_heads, ffn, vocab; the
    name is ignored). A mismatch raises ``CostModelError`` naming every differing field, or with
    ``strict=False`` warns (``ShapeWarning``) and returns. A cost model without a recorded shape (the
    paper presets, a hand-written JSON) cannot be checked: always a ``ShapeWarning``, never an error.
    """
    recorded = cost.meta.get("model") if isinstance(cost.meta, Mapping) else None
    if not isinstance(recorded, Mapping) or not any(f in recorded for f in SHAPE_FIELDS):
        warnings.warn(f"cost model ({cost.meta.get('source', 'unknown source')}) records no model shape; cannot "
                      f"check it matches {spec.name}", ShapeWarning, stacklevel=2)
        return
    diffs = [f"{f}: profile {recorded[f]} vs planned {getattr(spec, f)}" for f in SHAPE_FIELDS
             if f in recorded and _field(f, recorded[f], "the cost model's recorded model ") != getattr(spec, f)]
    if not diffs:
        return
    message = (f"cost model was measured for model {recorded.get('name', '?')!r}, not the planned {spec.name!r} "
               f"({'; '.join(diffs)}); re-run `flexsp profile` for this model")
    if strict:
        raise CostModelError(message)
    warnings.warn(message, ShapeWarning, stacklevel=2)

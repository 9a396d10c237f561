"""Lets ``onnx.checker`` validate graphs that use onnxruntime's contrib operators.

The checker skips nodes of domains it has no schemas for (``com.microsoft``), but onnxruntime registers
``SimplifiedLayerNormalization`` (RMSNorm) in the *default* domain, where onnx itself knows no such operator and the
checker fails with "No Op registered". ``register_onnxruntime_schemas`` declares that one schema to onnx, with the
inputs, outputs, types and attributes that onnxruntime's own schema lists, so the checker validates those nodes
instead of rejecting the graph.
"""

from __future__ import annotations

import functools

from onnx import defs
from onnx.defs import OpSchema

_FLOATS = ["tensor(float)", "tensor(float16)", "tensor(bfloat16)"]


@functools.cache
def register_onnxruntime_schemas() -> None:
    """Registers the schemas once per process (onnx refuses a second registration of the same version)."""
    if defs.has("SimplifiedLayerNormalization"):
        return
    optional = OpSchema.FormalParameterOption.Optional
    schema = OpSchema(
        "SimplifiedLayerNormalization",
        "",
        1,
        doc="onnxruntime's RMSNorm: X / sqrt(mean(X^2) + epsilon) * scale over the axes from `axis` on.",
        inputs=[OpSchema.FormalParameter("X", "T"), OpSchema.FormalParameter("scale", "V")],
        outputs=[
            OpSchema.FormalParameter("Y", "V"),
            OpSchema.FormalParameter("inv_std_var", "U", param_option=optional),
        ],
        type_constraints=[("T", _FLOATS, ""), ("U", ["tensor(float)"], ""), ("V", _FLOATS, "")],
        attributes=[
            OpSchema.Attribute("axis", OpSchema.AttrType.INT, "first normalised axis", required=False),
            OpSchema.Attribute("epsilon", OpSchema.AttrType.FLOAT, "", required=False),
            OpSchema.Attribute("stash_type", OpSchema.AttrType.INT, "1: compute in float32", required=False),
        ],
    )
    defs.register_schema(schema)

"""The dtypes, by name: those the commands write (``--dtype``), and the codes safetensors files spell them with.

Names only, so that the command line lists the choices without importing torch; ``torch_dtype`` resolves a name.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

# What a converted folder or an exported graph may hold, in the order the commands list them.
FLOAT_DTYPES = ("float32", "bfloat16", "float16")

# The safetensors dtype codes PyTorch has a type for, and that type's name in torch.
SAFETENSORS_DTYPES = {
    "F64": "float64",
    "F32": "float32",
    "F16": "float16",
    "BF16": "bfloat16",
    "I64": "int64",
    "I32": "int32",
    "I16": "int16",
    "I8": "int8",
    "U64": "uint64",
    "U32": "uint32",
    "U16": "uint16",
    "U8": "uint8",
    "BOOL": "bool",
    "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2",
}


def torch_dtype(name: str) -> torch.dtype:
    """``"bfloat16"`` -> ``torch.bfloat16`` (any name torch has)."""
    import torch

    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"torch has no dtype named {name!r}")
    return dtype


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``."""
    return str(dtype).removeprefix("torch.")


def safetensors_code(dtype: torch.dtype) -> str:
    """The safetensors code a tensor of ``dtype`` is written with (``torch.bfloat16`` -> ``"BF16"``)."""
    name = dtype_name(dtype)
    for code, torch_name in SAFETENSORS_DTYPES.items():
        if torch_name == name:
            return code
    raise ValueError(f"safetensors has no code for {dtype}")

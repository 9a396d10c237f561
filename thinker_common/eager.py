"""How every check runs a transformers model (the parity gate's reference and the Thinker beside it, the export's
PyTorch side): eager attention and eager experts.

Eager experts, because transformers picks its grouped_mm experts by default, and torch's CPU kernel refuses expert
rows whose stride is not a multiple of 16 bytes ("strides should be multiple of 16 bytes": an expert width of 12
in bfloat16, of 9 in float32): a check would fail on a model that is sound. The eager loop is the definition the
others are held to, and what the Thinker runs unless told otherwise.
"""

EAGER = {"attn_implementation": "eager", "experts_implementation": "eager"}

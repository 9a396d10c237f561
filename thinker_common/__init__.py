"""What every Thinker command shares, below ``converter`` and ``export`` (which import it; it imports neither).

- ``errors``: ``ThinkerError``, the one exception a user can fix.
- ``cli``: how a command reports it (one red line, exit 1, ``--debug``), and the ``thinker`` command group.
- ``staging``: output written into a hidden folder beside OUTPUT and renamed into place when complete.
- ``sources``, ``gguf_reader``: a checkpoint's tensors, lazily (safetensors, PyTorch ``.bin``/``.pth``, GGUF).
- ``side_files``: the tokenizer and config files that travel with a model folder.
- ``values``: the NaN/Inf and float16-overflow check every written tensor passes.
- ``dtypes``, ``sizes``: the dtypes the commands take by name; sizes such as ``5GB``.
- ``parity_inputs``: the left-padded batch and the tolerances both parity checks use.

Only the standard library and third-party packages are imported here, and nothing heavy at import time in the
modules the command line reads (``errors``, ``cli``, ``dtypes``, ``sizes``), so that ``--help`` is instant.
"""

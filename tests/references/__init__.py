"""Reference implementations of the source families that have no transformers class, and fixture builders.

Each reference is written from its seed's text (``/work/shared/seeds``), never from another project's code, so
that a parity test compares the Thinker against an independent reading of the source architecture.
"""

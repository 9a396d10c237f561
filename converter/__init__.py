"""thinker-convert: one streaming engine, one declarative mapping module per source family (``families/``).

Source checkpoint -> Thinker folder, and back (``--to``). Importing ``converter.load`` lets
``ThinkerForCausalLM.from_pretrained`` convert foreign checkpoints on load.
"""

"""thinker-convert: one streaming engine, one declarative mapping module per source family."""

"""Models and their files: checkpoint reads, key conversion, load strategies, merging mechanics,
memory placement and process sampling, targets (devices, flags, environment) and input validation.
May import core.methods, core.numerics and core.spec — never core.checks, core.engine or above."""

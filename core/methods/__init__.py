"""The PEFT methods as math: adapter key names and saved modules (`adapter_keys`), ΔW and merged weights per
method (`formulas`), and the pure pieces of adapter consistency (`consistency`). May import
core.numerics and core.spec only; no model loading, no files."""

"""The PEFT methods as math: one module per method family (`families`, listed by `registry`: each family's
float64 ΔW, checkpoint parameter names and PEFT layers), what they share (`reading`), the key rules every
method shares (`adapter_keys`), the ΔW dispatch and merged weights (`formulas`), ΔW with PEFT's own functions
(`peft_path`), regenerated shared projections (`projections`), and the pure pieces of adapter consistency
(`consistency`). May import core.numerics and core.spec only; no model loading, no files."""

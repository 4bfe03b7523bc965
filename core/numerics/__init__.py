"""Comparing two tensors exactly: the metrics and verdicts (`metrics`), tolerances and statistics,
the fused CPU kernel (`kernel`, its numba loops in `kernel_jit`, their exact arithmetic in
`kernel_arith`) and the bounded per-tensor sketch (`sketch`). May import core.spec only; nothing here
knows about models, checks or runs."""

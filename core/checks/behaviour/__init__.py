"""Checks of what a model *does* rather than how far its numbers moved: `generate` (greedy decoding per
target, the first token where a target's text parts from the reference's); and what the `merge` check
found beyond its numbers (`merge_tables`: the merged model's save round trip, tied storage, refusals).
Beside the numeric checks in `core.checks`, as its own package (the layering keeps a folder to 8 modules)."""

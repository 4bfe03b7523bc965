"""WeightDrift's benchmark (issue 13): the comparison kernel and `core run` end to end, measured.

`python -m bench --help` for the command; `bench/README.md` for what each number means.
"""

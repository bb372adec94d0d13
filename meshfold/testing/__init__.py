"""For tests, examples and benchmarks only: hypothesis strategies over layouts and split sizes
(:mod:`.strategies`, the one module that imports hypothesis, a test extra), worlds of ranks
(:mod:`.worlds`: cached folds, simulated ranks) and references and instruments
(:mod:`.references`).

Layer: above everything meshfold ships except the command line; no module of meshfold imports
it (``tests/test_layers.py``).
"""

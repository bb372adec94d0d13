"""For tests, examples and benchmarks only: hypothesis strategies over layouts and split sizes
(:mod:`.strategies`, the one module that imports hypothesis, a test extra), worlds of ranks
(:mod:`.worlds`: cached folds, simulated ranks), references and instruments
(:mod:`.references`), and the check that a model of one's own on a fold equals one device
(:mod:`.equivalence`: :func:`assert_matches_one_device`).

Layer: above everything meshfold ships except the command line; no module of meshfold imports
it (``tests/test_layers.py``).
"""

from meshfold.testing.equivalence import assert_matches_one_device, perturb_constants

__all__ = ["assert_matches_one_device", "perturb_constants"]

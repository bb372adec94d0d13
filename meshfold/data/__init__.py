"""Training text: which files (:mod:`.files`), byte-level corpora and their batches
(:mod:`.corpus`), and pre-tokenized shards (:mod:`.tokens`).

Layer: imports numpy, torch and the standard library, nothing else of meshfold; files, then
tokens, then corpus, with no circle (``tests/test_layers.py``).
"""

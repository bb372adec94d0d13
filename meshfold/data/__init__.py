"""Training text: documents of each format (:mod:`.records`), which files (:mod:`.files`),
byte-level corpora and their batches (:mod:`.corpus`), pre-tokenized shards (:mod:`.tokens`,
with :mod:`.progress`) and weighted mixtures of them (:mod:`.mixture`).

Layer: imports numpy, torch, the standard library and the optional format libraries (pyarrow,
datasets), nothing else of meshfold; records, files, tokens, corpus, mixture, with no circle
(``tests/test_layers.py``).
"""

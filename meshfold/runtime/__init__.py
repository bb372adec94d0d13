"""How meshfold's ranks exist: launched as local processes (:mod:`.launch`), simulated in one
process (:mod:`.simulated`, reached only through the seam :mod:`.spmd`), the process-wide CPU
allocator setting of the entry points (:mod:`.malloc`), every difference between the torch
releases meshfold supports (:mod:`.compat`), and how a rank runs two micro-batches in turns at
their all-to-alls' waits (:mod:`.overlap`, on threads kept between calls: :mod:`.pools`).

Layer: the bottom one. Imports torch and the standard library, nothing else of meshfold. Every
layer may import it (``tests/test_layers.py`` runs the import contract in ``pyproject.toml``).
"""

"""How a single-device model is laid onto a fold: its layout plan (:mod:`.plan`), meshfold's
layouts declared as data (:mod:`.layouts`), meshfold's transformer's plan (:mod:`.transformer_plan`),
the MoE layer's collectives (:mod:`.moe`), :func:`parallelize` for any model and plan with tensor and sequence
parallelism (:mod:`.transformer`), context parallelism and its ring (:mod:`.context`, :mod:`.mla`,
:mod:`.ring_attention`), data parallelism (:mod:`.data_parallel`), the pipeline
(:mod:`.pipeline`), activation recomputation (:mod:`.recompute`), batch sharding
(:mod:`.batch`) and shard-by-shard initialization (:mod:`.materialize`). :func:`place` lays out
one parameter of the user's own on a fold's mesh (use it rather than ``distribute_tensor`` when
several folds exist in one process: its docstring says why).

    model = parallelize(MoETransformer(cfg, device="meta"), fold(spec))   # or Pipeline(...) with pp > 1
    tokens, positions = shard_batch(global_tokens, spec, rank)

Layer: above ``meshfold.models``; imports models, kernels, placements, mesh, catalog and
runtime, never interop, data, plan, train, dryrun, testing or cli (``tests/test_layers.py``).
"""

from meshfold.parallel.batch import batch_rows, local_positions, shard_batch
from meshfold.parallel.data_parallel import grad_norm, reduce_gradients
from meshfold.parallel.layouts import MLA_LAYOUT, MOE_LAYOUT, TRANSFORMER_LAYOUT
from meshfold.parallel.moe import FoldedComm, parallelize_moe, place
from meshfold.parallel.pipeline import Pipeline
from meshfold.parallel.plan import Plan, SequenceParallel, VocabParallel, register_plan
from meshfold.parallel.transformer import (GlobalLogits, GlobalMeanLoss, full_state_dict, param_layouts, parallelize,
                                          single_device_name)
from meshfold.parallel.transformer_plan import check_fold, transformer_plan

__all__ = ["MLA_LAYOUT", "MOE_LAYOUT", "TRANSFORMER_LAYOUT", "FoldedComm", "GlobalLogits", "GlobalMeanLoss", "Pipeline",
           "Plan", "SequenceParallel", "VocabParallel", "batch_rows", "check_fold", "full_state_dict", "grad_norm", "local_positions",
           "param_layouts", "parallelize", "parallelize_moe", "place", "reduce_gradients", "register_plan", "shard_batch",
           "single_device_name", "transformer_plan"]

"""One build for every job: the model laid out on the fold, compiled, with its optimizer, pruner
and expert placement, as ``meshfold train``, ``meshfold dryrun`` and ``benchmarks/bench_model.py``
all run it, so the job a user dry-runs or benchmarks is the job they train."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from meshfold.models.transformer import MoETransformer
from meshfold.parallel.compile import compile_model
from meshfold.parallel.pipeline import Pipeline
from meshfold.train.config import Resolved
from meshfold.train.optim import build_optimizer
from meshfold.train.pruning import FoldedPruner
from meshfold.train.rebalance import Rebalancer

__all__ = ["DTYPES", "Built", "build"]

DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class Built:
    """What a rank trains: ``model`` (this rank's :class:`~meshfold.parallel.pipeline.Pipeline`,
    pp = 1 included), its AdamW ``optimizer`` (``build_optimizer``'s groups), the ``pruner`` of
    ``[sparsity]`` and the ``rebalancer`` of ``train.expert_placement = "balanced"`` (None where
    not set)."""

    model: Pipeline
    optimizer: torch.optim.AdamW
    pruner: FoldedPruner | None
    rebalancer: Rebalancer | None


def build(run: Resolved, folded, init_from: bool = True) -> Built:
    """``run``'s model on ``folded`` (every rank calling), laid out, compiled as ``train.compile``
    says, with its optimizer, pruner and expert placement. ``init_from``: load
    ``train.init_from``'s weights where set (False: a resumed run, which reads its own checkpoint
    instead); otherwise the model is built on the meta device and each rank materializes only its
    own shards (the same global weights on every fold, for the current seed)."""
    t, mcfg = run.train, run.model
    compute = DTYPES[t.dtype]
    microbatches = t.microbatches or run.spec.pp
    if t.init_from is not None and init_from:
        from meshfold.interop.hf import from_pretrained
        from meshfold.parallel.recompute import apply_recompute

        # laid out as parallelize lays it out, each rank reading only its own slices (pp = 1)
        whole = from_pretrained(t.init_from, mesh=folded, dtype=DTYPES[t.master_dtype], cfg=mcfg,
                                compute_dtype=compute)
        apply_recompute(whole.layers, t.recompute)
        model = Pipeline.laid_out(whole, folded, microbatches, a2a_overlap=t.a2a_overlap)
    else:
        whole = MoETransformer(mcfg, dtype=DTYPES[t.master_dtype], device="meta")  # master weights
        model = Pipeline(whole, folded, microbatches, t.schedule, t.virtual, data_parallel=t.data_parallel,
                         compute_dtype=compute, recompute=t.recompute, a2a_overlap=t.a2a_overlap)
    if t.compile:
        for chunk in model.chunks:
            compile_model(chunk)
    opt = build_optimizer(model, t)
    sp = mcfg.moe.expert_sparsity if mcfg.moe is not None else None
    pruner = FoldedPruner(model, sp, opt) if sp is not None else None
    balanced = t.expert_placement == "balanced"
    rebalancer = Rebalancer(model, t.rebalance_every, run.spec.ep, t.redundant_experts) if balanced else None
    return Built(model, opt, pruner, rebalancer)

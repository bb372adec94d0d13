"""The paper's five strategies as constraints on the search, and the paper's Table 1 figures.

Each strategy is a predicate over :class:`~meshfold.plan.cost.Layout`; its planned MFU is the
best layout the predicate admits (arXiv 2504.14960, section 5, Table 1):

* ``fsdp``: pure data parallelism with fully sharded parameters (ZeRO-3); experts not split.
  Planned as meshfold's FSDP2 (``sharding = "fsdp"``), which meshfold runs.
* ``fsdp+ep``: FSDP for everything, experts additionally split by EP (``edp = world / ep``);
  meshfold's FSDP2 too.
* ``tp+ep+dp``: Megatron distributed optimizer, no PP, no CP, no folding (``etp = tp``, EP
  carved out of DP).
* ``mcore``: 5-D parallelism without folding: ``etp = tp`` and EP a sub-dimension of DP x CP
  (with ``etp = tp`` the MoE view then reuses the attention layout, so ``ep | dp * cp``).
* ``mcore+folding``: 5-D parallelism with ETP and EP free (MoE Parallel Folding).

The last three are **Megatron-Core** runs (:data:`MEGATRON_STRATEGIES`): the distributed
optimizer (``sharding = "zero1"``), vocabulary-parallel embeddings and Megatron's schedules,
which meshfold does not have. They are planned only as comparison rows (``meshfold plan
--compare`` labels them "Megatron-Core, not meshfold"), never proposed as a meshfold layout.

Activation recomputation is a setting, not a parallel dimension, and the paper states it for no
strategy. The three Megatron-native strategies (zero1) are taken to run with Megatron-Core's
default, no recomputation (``--recompute-granularity`` defaults to None), the same default the
estimates of the paper's own configs use; with it the planner reproduces the paper's TP+EP+DP
column (Llama3-8x70B out of memory, as the paper's text says) and the four MCore configs within
7%. The FSDP strategies may recompute (the search adds it where a layout does not fit): without
it no FSDP layout fits on any Table 1 model, nor FSDP+EP on three of the four, and the paper
reports MFU for them. benchmarks/RESULTS.md, "Planner against the paper's Table 1", gives the
evidence and what changes without this assumption.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from meshfold.mesh import FoldSpec
from meshfold.plan.cost import Layout

__all__ = ["STRATEGIES", "STRATEGY_NAMES", "MEGATRON_STRATEGIES", "PaperRow", "PAPER_TABLE1", "paper_spec"]


def _fsdp(lay: Layout) -> bool:
    s = lay.spec
    return lay.sharding == "fsdp" and s.tp == s.cp == s.pp == s.ep == s.etp == 1


def _fsdp_ep(lay: Layout) -> bool:
    s = lay.spec
    return lay.sharding == "fsdp" and s.tp == s.cp == s.pp == s.etp == 1


def _megatron(lay: Layout) -> bool:
    """A Megatron-native run: distributed optimizer (ZeRO-1), Megatron-Core's default of no recomputation."""
    return lay.sharding == "zero1" and lay.recompute == "none"


def _tp_ep_dp(lay: Layout) -> bool:
    s = lay.spec
    return _megatron(lay) and s.pp == s.cp == 1 and s.etp == s.tp and s.dp % s.ep == 0


def _mcore(lay: Layout) -> bool:
    s = lay.spec
    return _megatron(lay) and s.etp == s.tp and (s.dp * s.cp) % s.ep == 0


def _folding(lay: Layout) -> bool:
    return _megatron(lay)


STRATEGIES: dict[str, Callable[[Layout], bool]] = {
    "fsdp": _fsdp, "fsdp+ep": _fsdp_ep, "tp+ep+dp": _tp_ep_dp, "mcore": _mcore, "mcore+folding": _folding,
}
STRATEGY_NAMES = {"fsdp": "FSDP", "fsdp+ep": "FSDP+EP", "tp+ep+dp": "TP+EP+DP", "mcore": "MCore",
                  "mcore+folding": "MCore + folding"}
MEGATRON_STRATEGIES = ("tp+ep+dp", "mcore", "mcore+folding")  # zero1: comparison rows, not meshfold


@dataclass(frozen=True)
class PaperRow:
    """One row of Table 1: MFU per strategy (None = the paper reports OOM) and the two configs.

    Configs are written as in the paper: MCore ``CP/TP/EP/PP`` (ETP = TP), folding ``CP/TP/EP/PP``
    plus ``/ETP``; where the paper omits ETP for the folded config it is taken as 1 (as in its
    other folded configs of arXiv 2504.14960, Table 1).
    """

    model: str
    gpus: int
    mfu: dict[str, float | None]
    mcore: tuple[int, int, int, int]            # cp, tp, ep, pp
    folding: tuple[int, int, int, int, int]     # cp, tp, ep, pp, etp


PAPER_TABLE1: dict[str, PaperRow] = {r.model: r for r in (
    PaperRow("mixtral-8x22b", 128, {"fsdp": 0.043, "fsdp+ep": 0.234, "tp+ep+dp": 0.366, "mcore": 0.463,
                                    "mcore+folding": 0.493}, (1, 2, 4, 8), (1, 2, 8, 8, 1)),
    PaperRow("qwen2-57b-a14b", 64, {"fsdp": 0.099, "fsdp+ep": 0.254, "tp+ep+dp": 0.231, "mcore": 0.353,
                                    "mcore+folding": 0.390}, (1, 2, 4, 4), (1, 2, 4, 4, 1)),
    PaperRow("mixtral-8x22b-g8t8", 128, {"fsdp": 0.022, "fsdp+ep": 0.090, "tp+ep+dp": 0.087, "mcore": 0.171,
                                         "mcore+folding": 0.288}, (1, 2, 8, 8), (1, 4, 8, 8, 1)),
    PaperRow("llama3-8x70b", 256, {"fsdp": None, "fsdp+ep": 0.196, "tp+ep+dp": None, "mcore": 0.388,
                                   "mcore+folding": 0.416}, (1, 8, 4, 8), (1, 8, 8, 16, 1)),
)}


def paper_spec(row: PaperRow, strategy: str) -> FoldSpec:
    """The FoldSpec of the paper's ``"mcore"`` or ``"mcore+folding"`` configuration of ``row``."""
    if strategy == "mcore":
        cp, tp, ep, pp = row.mcore
        return FoldSpec(row.gpus, tp=tp, cp=cp, pp=pp, ep=ep, etp=tp)
    if strategy == "mcore+folding":
        cp, tp, ep, pp, etp = row.folding
        return FoldSpec(row.gpus, tp=tp, cp=cp, pp=pp, ep=ep, etp=etp)
    raise ValueError(f"the paper gives configs only for 'mcore' and 'mcore+folding', not {strategy!r}")

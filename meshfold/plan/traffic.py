"""Seconds of one step's collectives, read off the planner's count of them.

The time model's communication terms are a function of :attr:`Estimate.collectives
<meshfold.plan.cost.Estimate.collectives>`: the ``{(kind, dim): bytes}`` per pipeline rank that
:mod:`meshfold.plan.collectives` derives from meshfold's code (and that tests check equal to
gloo's c10d calls and to ``meshfold dryrun``), in the form :func:`~meshfold.plan.collectives.
collective_traffic` gives it, with the number of calls and whether each is issued per
micro-batch or per step. So memory, traffic and time rest on one count.

Per (kind, dim): the group is the folded dim's (``FoldSpec.groups``; ``dp+cp`` a flattened
group), of size n; its input bytes B become bytes on the wire per rank by the kind, as
nccl-tests' bus bandwidth defines them (NVIDIA/nccl-tests, doc/PERFORMANCE.md):

    all_gather      (n - 1) B        (B = the rank's shard)
    reduce_scatter  (n - 1) / n B    (B = the full input)
    all_reduce      2 (n - 1) / n B
    all_to_all      (n - 1) / n B    (B = all it sends, its own share included), split into the
                                     on-node share over NVLink and the off-node share over the
                                     network at once (``Hardware.alltoall_bytes_per_s``)
    send, broadcast B
    recv            0                (the matching send carries it; links are full duplex)

and take ``calls x latency + wire / bandwidth`` at the slowest link of the worst group
(``Hardware.collective_time``), or, for an all-to-all, ``calls x latency + max(on B / B_nvlink,
off B / B_a2a)``. A group of one rank costs nothing.
"""

from __future__ import annotations

from functools import lru_cache

from meshfold.mesh import VIEWS, FoldSpec
from meshfold.plan.collectives import MICROBATCH, STEP
from meshfold.plan.hardware import Hardware

__all__ = ["TERM_OF_DIM", "term_of", "wire_share", "collective_seconds", "traffic_seconds"]

VIEW_OF_DIM = {"pp": "attn", "dp": "attn", "cp": "attn", "tp": "attn", "ep": "moe", "etp": "moe", "edp": "moe"}
# the step-time term each dim's traffic is charged to; a flattened group (FSDP2's dp+cp, the
# loop's all-rank token count) is data-parallel traffic (see term_of)
TERM_OF_DIM = {"tp": "tp", "cp": "cp", "ep": "ep", "etp": "etp", "pp": "pp", "dp": "dp", "edp": "dp"}


def term_of(kind: str, dim: str, when: str) -> str:
    """The step-time term a collective is charged to: ``dp`` for what is issued once per step
    (gradient reductions, the tp all-reduce of tp-replicated gradients, the step's scalars) and
    for FSDP2's gathers on its dp x cp group when dp = 1 names it ``cp`` (the layer code issues
    no all-gather or reduce-scatter over cp); otherwise its dim's (:data:`TERM_OF_DIM`)."""
    if when == STEP or (dim == "cp" and kind in ("all_gather", "reduce_scatter")):
        return "dp"
    return TERM_OF_DIM.get(dim, "dp")


def wire_share(kind: str, n: int) -> float:
    """Bytes a rank puts on the wire per byte of a ``kind`` collective's input, group of ``n``."""
    if n <= 1 or kind == "recv":
        return 0.0
    return {"all_gather": n - 1, "reduce_scatter": (n - 1) / n, "all_reduce": 2 * (n - 1) / n,
            "all_to_all": (n - 1) / n, "send": 1.0, "broadcast": 1.0}[kind]


@lru_cache(maxsize=None)
def _placement(view: str, shape: tuple[int, ...], dims: tuple[str, ...], world: int,
               gpus_per_node: int) -> tuple[int, bool, float, float]:
    """Where the groups of ``dims`` sit: (group size, all inside one node, on-node peer share,
    off-node share). Shares are the worst group's fraction of the group size: the peers of a rank
    on its own node (excluding itself) and on other nodes. They depend only on the view's shape."""
    spec = FoldSpec(world, **dict(zip(VIEWS[view], shape)))
    size, intra, on_share, off_share = 1, True, 1.0, 0.0
    for group in spec.groups(view, dims):
        n = size = len(group)
        per_node: dict[int, int] = {}
        for r in group:
            per_node[r // gpus_per_node] = per_node.get(r // gpus_per_node, 0) + 1
        intra &= len(per_node) == 1
        on_share = min(on_share, (max(per_node.values()) - 1) / n)
        off_share = max(off_share, (n - min(per_node.values())) / n)
    return size, intra, on_share, off_share


@lru_cache(maxsize=65536)
def _place(spec: FoldSpec, gpus_per_node: int, dim: str) -> tuple[int, bool, float, float]:
    dims = tuple(dim.split("+"))
    view = VIEW_OF_DIM[dims[0]]
    return _placement(view, spec.shape(view), dims, spec.world_size, gpus_per_node)


def collective_seconds(hw: Hardware, spec: FoldSpec, kind: str, dim: str, nbytes: float, calls: float) -> float:
    """Seconds ``calls`` collectives of ``kind`` over ``dim`` with ``nbytes`` of input in all take."""
    n, intra, on, off = _place(spec, hw.gpus_per_node, dim)
    share = wire_share(kind, n)
    if nbytes <= 0 or share == 0.0:
        return 0.0
    if kind == "all_to_all":
        return calls * hw.latency(intra) + max(on * nbytes / hw.alltoall_bytes_per_s(True),
                                               off * nbytes / hw.alltoall_bytes_per_s(False))
    return hw.collective_time(share * nbytes, intra, calls)


def traffic_seconds(hw: Hardware, spec: FoldSpec, traffic: dict) -> dict[str, dict[str, float]]:
    """``{MICROBATCH: {term: s}, STEP: {term: s}}`` per step of one rank's ``{(kind, dim, when):
    [bytes, calls]}`` (:func:`~meshfold.plan.collectives.collective_traffic`), by the time term
    of each (:func:`term_of`)."""
    out: dict[str, dict[str, float]] = {MICROBATCH: {}, STEP: {}}
    for (kind, dim, when), (nbytes, calls) in traffic.items():
        term = term_of(kind, dim, when)
        out[when][term] = out[when].get(term, 0.0) + collective_seconds(hw, spec, kind, dim, nbytes, calls)
    return out

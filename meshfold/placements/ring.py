"""A ring shift over one named mesh dim: every rank sends to the next and receives from the previous.

Ring attention (:mod:`meshfold.parallel.ring_attention`) passes key/value blocks (and, in the
backward, their gradient accumulators) around the ``cp`` ranks this way. The shift is
asynchronous, so the caller computes on the block it holds while the next one travels, and it is
not differentiable: the ring attention's own backward sends the gradients back around the ring.

Point-to-point sends, because every rank's message has the same shape (no metadata, no host
sync) and a ring step moves one block instead of a gather's ``group - 1``. The sends and
receives go out as one ``batch_isend_irecv``: NCCL then launches them as one group (separate
``isend`` / ``irecv`` calls can queue a rank's send behind its receive on one stream, a
deadlock), gloo runs them as individual operations. Each tensor gets its
own tag, so several may be in flight between the same pair of ranks (with two ranks the next and
the previous rank are the same one).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from meshfold.runtime import spmd

__all__ = ["ring_shift"]


def ring_shift(tensors: Sequence[torch.Tensor], mesh, dim: str) -> Callable[[], list[torch.Tensor]]:
    """Start sending each of ``tensors`` to rank ``i + 1`` of mesh dim ``dim`` and receiving
    the same shapes from rank ``i - 1`` (cyclically). Returns ``wait()``, which blocks until
    both are done and returns the received tensors. The inputs must not change until then."""
    group, n, me = mesh.get_group(dim), mesh.size(mesh.mesh_dim_names.index(dim)), mesh.get_local_rank(dim)
    if spmd.simulated_ranks() is not None:
        received = spmd.simulated_ring_shift(tensors, group)
        return lambda: received
    nxt, prev = (me + 1) % n, (me - 1) % n
    sends = [t.contiguous() for t in tensors]
    received = [torch.empty_like(t) for t in sends]
    ops = []
    for tag, (s, r) in enumerate(zip(sends, received)):
        ops.append(dist.P2POp(dist.irecv, r, group=group, group_peer=prev, tag=tag))
        ops.append(dist.P2POp(dist.isend, s, group=group, group_peer=nxt, tag=tag))
    works = dist.batch_isend_irecv(ops)

    def wait() -> list[torch.Tensor]:
        for w in works:
            w.wait()
        del sends[:]  # keep the contiguous copies alive until the sends are done
        return received

    return wait

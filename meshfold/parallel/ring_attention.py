"""Ring attention over the ``cp`` ranks, in the causal load-balanced chunk order.

Legend: B = sequences, h = query heads, g = key/value heads, r = h / g, d = head dim, n = tokens
per chunk, m = query rows of a block; cp rank ``c`` holds chunks ``c`` and ``2cp - 1 - c`` of
``2cp`` equal chunks (``local_positions`` in :mod:`meshfold.parallel.transformer`), so a
rank's q / k / v are [B, heads, 2n, d].

Why a ring: all-gathering K/V and masking by position costs an [S/cp, S] mask that SDPA keeps for
backward, and on CUDA a float mask with GQA falls back to the math kernel and its fp32
[B, h, S/cp, S] scores: per-rank memory cannot fall as 1/cp. Here each rank keeps its queries and
passes its K/V block around the ``cp`` ring (:func:`meshfold.placements.ring.ring_shift`, the next
block in flight while this one computes). A block is a (query chunk, key chunk) pair, classified
on the host from the chunk indices alone: key chunk before the query chunk = *full* (no mask),
the same chunk = *diagonal* (``is_causal``), after it = *future* (skipped). Each block returns
its output and log-sum-exp; outputs are merged online by log-sum-exp. The backward
(:class:`_RingAttention`) passes K/V around again with their gradient accumulators: every block
runs the kernel's backward with the *merged* output and log-sum-exp, which gives exactly that
block's share of dQ, dK, dV; after ``cp`` shifts each dK/dV accumulator is back on its owner.
Nothing of S/cp x S elements exists on any path; the largest per-block temporaries are the
kernel's own tiles (fused) or one [B, h, n, n] score block (plain kernels).

Block kernels (:data:`KERNELS`), each returning the block's output and log-sum-exp, and its
backward taking the merged ones: ``"fused"``, the CPU flash kernel
(``aten._scaled_dot_product_flash_attention_for_cpu`` and its backward: every float dtype incl.
fp64, GQA without repeating K/V); ``"flash"``, CUDA's flash kernel
(``aten._scaled_dot_product_flash_attention``, fp16 / bf16, GQA without repeating K/V);
``"efficient"``, CUDA's memory-efficient kernel (``aten._scaled_dot_product_efficient_attention``,
fp32 too; K/V repeated to the query heads, their gradients summed back); ``"plain"``, the same
maths in torch ops, the reference the fused kernels are tested against and the path for what no
fused kernel takes (fp64 on CUDA, head dims the kernels refuse). On CUDA the choice is SDPA's own
(``torch.backends.cuda.can_use_flash_attention`` / ``can_use_efficient_attention``) for the
block's shapes: :func:`block_kernels`.

Why not ``torch.distributed.tensor.experimental.context_parallel`` (read in torch 2.13,
``_context_parallel/_attention.py``): (1) its SDPA handler maps only the CUDA ops
(``_scaled_dot_product_flash_attention`` / ``_efficient_attention`` / ``_cudnn_attention`` and
backwards) to ring versions; on CPU SDPA dispatches to ``_scaled_dot_product_flash_attention_for_cpu``
(or the math path for masks / fp64 tests), which it does not handle, so it cannot run on CPU /
gloo at all (tried on 2 gloo ranks, with and without GQA: ``NotImplementedError: Operator
aten._scaled_dot_product_flash_attention_for_cpu.default does not have a sharding strategy
registered``); (2) it works by monkey-patching ``F.scaled_dot_product_attention`` process-wide inside
a context manager and wrapping SDPA's arguments as DTensors sharded over a 1-D cp mesh, whereas
meshfold's attention sees plain local tensors (parameters are unwrapped by parametrizations) and
runs inside a folded ``dp x cp x tp`` mesh with sequence-parallel tp gathered first; (3) it
assumes ``is_causal`` attention with q and k of one length and has no notion of per-token
positions, so the generic path for arbitrary positions still needs meshfold's own masked
attention; (4) its load-balanced layout is the same head-tail order, but it shards the input
buffers itself (in place, inside the context), while meshfold's data layer
(``shard_batch``) already does. What it does is the same algorithm, which this module follows.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist
from torch.utils.weak import WeakTensorKeyDictionary

from meshfold.placements.ring import ring_shift
from meshfold.runtime import spmd

__all__ = ["KERNELS", "block_kernels", "ring_attention", "rank_chunks", "block_plan", "load_balanced", "ring_applies"]


def rank_chunks(rank: int, cp: int) -> tuple[int, int]:
    """The chunks cp rank ``rank`` holds, in local order: ``rank`` and ``2cp - 1 - rank``."""
    return rank, 2 * cp - 1 - rank


def block_plan(q_chunks, k_chunks) -> list[tuple[int, int, bool]]:
    """``(local q chunk, local k chunk, causal)`` for every block that needs computing: key chunk
    before the query chunk = full (False), the same chunk = diagonal (True); later ones skipped."""
    return [(a, b, kc == qc) for a, qc in enumerate(q_chunks) for b, kc in enumerate(k_chunks) if kc <= qc]


# ---- block kernels: (q [B, h, m, d], k [B, g, n, d], v [B, g, n, dv], causal) -> (out [B, h, m, dv], lse [B, h, m])
def _padded(t, width):
    return t if t.shape[-1] == width else torch.nn.functional.pad(t, (0, width - t.shape[-1]))


def _fused_forward(q, k, v, causal):
    # the CPU flash kernel wants one head size for q, k and v (MLA's v is narrower): zero columns
    # add nothing to a score or an output, and the scale stays that of q's own width
    d, dv = q.shape[-1], v.shape[-1]
    width = max(d, dv)
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        _padded(q, width), _padded(k, width), _padded(v, width), 0.0, causal, scale=d ** -0.5)[:2]
    return out[..., :dv], lse


def _fused_backward(do, q, k, v, out, lse, causal):
    d, dv = q.shape[-1], v.shape[-1]
    width = max(d, dv)
    dq, dk, dv_ = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        _padded(do, width), _padded(q, width), _padded(k, width), _padded(v, width), _padded(out, width), lse,
        0.0, causal, scale=d ** -0.5)
    return dq[..., :d], dk[..., :d], dv_[..., :dv]


def _grouped(q, g):
    """q [B, h, m, d] -> [B, g, r*m, d]: each key/value head's r query heads as rows (a view of a
    copy at most; K/V are never repeated)."""
    B, h, m, d = q.shape
    return q.reshape(B, g, (h // g) * m, d)


def _scores(q, k, causal):
    """Scaled scores [B, g, r*m, n] in at least fp32, -inf above the diagonal when ``causal``."""
    work = torch.promote_types(q.dtype, torch.float32)
    m = q.shape[2]
    s = (_grouped(q, k.shape[1]).to(work) @ k.to(work).transpose(-1, -2)) * q.shape[-1] ** -0.5
    if causal:
        rows = torch.arange(s.shape[2], device=s.device) % m
        s = s.masked_fill(torch.arange(s.shape[3], device=s.device) > rows[:, None], float("-inf"))
    return s


def _plain_forward(q, k, v, causal):
    B, h, m, d = q.shape
    s = _scores(q, k, causal)
    lse = torch.logsumexp(s, dim=-1, keepdim=True)  # [B, g, r*m, 1]
    out = torch.exp(s - lse) @ v.to(s.dtype)  # [B, g, r*m, dv]
    return out.reshape(B, h, m, v.shape[-1]).to(q.dtype), lse.reshape(B, h, m)


def _plain_backward(do, q, k, v, out, lse, causal):
    B, h, m, d = q.shape
    g = k.shape[1]
    s = _scores(q, k, causal)
    work = s.dtype
    p = torch.exp(s - _grouped(lse.unsqueeze(-1), g).to(work))  # [B, g, r*m, n]
    do_g, out_g = _grouped(do, g).to(work), _grouped(out, g).to(work)
    dv = p.transpose(-1, -2) @ do_g  # [B, g, n, d]: sums the r query heads of each kv head
    dp = do_g @ v.to(work).transpose(-1, -2)
    ds = p * (dp - (do_g * out_g).sum(-1, keepdim=True)) * d ** -0.5
    dq = (ds @ k.to(work)).reshape(B, h, m, d)
    dk = ds.transpose(-1, -2) @ _grouped(q, g).to(work)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def _flash_forward(q, k, v, causal):
    # one head size for q, k and v, as on the CPU; the flash kernel takes GQA itself
    d, dv = q.shape[-1], v.shape[-1]
    width = max(d, dv)
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention(
        _padded(q, width), _padded(k, width), _padded(v, width), 0.0, causal, scale=d ** -0.5)[:2]
    return out[..., :dv], lse


def _flash_backward(do, q, k, v, out, lse, causal):
    d, dv = q.shape[-1], v.shape[-1]
    width = max(d, dv)
    seed, offset = _rng_placeholders("flash", q.device)
    dq, dk, dv_ = torch.ops.aten._scaled_dot_product_flash_attention_backward(
        _padded(do, width), _padded(q, width), _padded(k, width), _padded(v, width), _padded(out, width),
        lse.contiguous(), None, None, q.shape[2], k.shape[2], 0.0, causal, seed, offset, scale=d ** -0.5)
    return dq[..., :d], dk[..., :d], dv_[..., :dv]


def _repeated(t, r):
    """[B, g, n, d] -> [B, g*r, n, d]: each key/value head once per query head it serves."""
    return t if r == 1 else t.repeat_interleave(r, dim=1)


def _summed(t, r):
    """The gradient of :func:`_repeated`: [B, g*r, n, d] -> [B, g, n, d], each head's r copies summed."""
    return t if r == 1 else t.unflatten(1, (-1, r)).sum(2)


def _efficient_forward(q, k, v, causal):
    r = q.shape[1] // k.shape[1]
    out, lse = torch.ops.aten._scaled_dot_product_efficient_attention(
        q, _repeated(k, r), _repeated(v, r), None, True, 0.0, causal, scale=q.shape[-1] ** -0.5)[:2]
    return out, lse[..., :q.shape[2]]  # the kernel pads its log-sum-exp rows to a multiple of 32


def _efficient_backward(do, q, k, v, out, lse, causal):
    r = q.shape[1] // k.shape[1]
    seed, offset = _rng_placeholders("efficient", q.device)
    lse = torch.nn.functional.pad(lse.contiguous(), (0, -q.shape[2] % 32))  # the layout the forward returned
    dq, dk, dv, _ = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
        do, q, _repeated(k, r), _repeated(v, r), None, out, lse, seed, offset, 0.0, [True, True, True, False],
        causal, scale=q.shape[-1] ** -0.5)
    return dq, _summed(dk, r), _summed(dv, r)


@functools.cache
def _rng_placeholders(kernel: str, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The two random-state outputs of a CUDA kernel's forward, which its backward takes back
    (read only with dropout, which ring attention never uses): empty tensors of the shapes and
    dtypes this torch's kernel returns, read from its meta implementation."""
    q = torch.empty(1, 1, 32, 16, device="meta", dtype=torch.bfloat16)
    if kernel == "flash":
        seed, offset = torch.ops.aten._scaled_dot_product_flash_attention(q, q, q, 0.0, True)[6:8]
    else:
        seed, offset = torch.ops.aten._scaled_dot_product_efficient_attention(q, q, q, None, True, 0.0, True)[2:4]
    return tuple(torch.empty(t.shape, dtype=t.dtype, device=device) for t in (seed, offset))


KERNELS = {"fused": (_fused_forward, _fused_backward), "flash": (_flash_forward, _flash_backward),
           "efficient": (_efficient_forward, _efficient_backward), "plain": (_plain_forward, _plain_backward)}


def block_kernels(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> str:
    """The :data:`KERNELS` name ring attention uses for q [B, h, m, d], k [B, g, n, d],
    v [B, g, n, dv]: ``"fused"`` on the CPU; on CUDA ``"flash"`` where SDPA would take its flash
    kernel for a block (fp16 / bf16 on sm_80+, GQA included), else ``"efficient"`` where it would
    take the memory-efficient one (fp32 too), else ``"plain"``; ``"plain"`` on other devices."""
    if q.device.type == "cpu":
        return "fused"
    if q.device.type != "cuda":
        return "plain"
    return _cuda_block_kernels(q.device, q.dtype, q.shape[1], k.shape[1], q.shape[-1], v.shape[-1])


@functools.cache
def _cuda_block_kernels(device, dtype, h, g, d, dv) -> str:
    """SDPA's own eligibility checks on stand-ins of one block's shapes (the sequence length does
    not enter them): flash with q, k, v padded to one head size and K/V grouped, efficient with
    K/V repeated to the query heads."""
    from torch.backends.cuda import SDPAParams, can_use_efficient_attention, can_use_flash_attention

    width = max(d, dv)
    q = torch.empty(1, h, 32, width, dtype=dtype, device=device)
    if can_use_flash_attention(SDPAParams(q, q[:, :g], q[:, :g], None, 0.0, True, h != g)):
        return "flash"
    k, v = (torch.empty(1, h, 32, n, dtype=dtype, device=device) for n in (d, dv))
    if can_use_efficient_attention(SDPAParams(q[..., :d], k, v, None, 0.0, True, False)):
        return "efficient"
    return "plain"


def _merge(acc, out, lse):
    """Fold one block's (out, lse) into the running (out, lse) of its query chunk."""
    work = torch.promote_types(out.dtype, torch.float32)
    out, lse = out.to(work), lse.to(work)
    if acc is None:
        return out, lse
    acc_out, acc_lse = acc
    new = torch.logaddexp(acc_lse, lse)
    return (acc_out * torch.exp(acc_lse - new).unsqueeze(-1) + out * torch.exp(lse - new).unsqueeze(-1)), new


def _keys_values(expand, travel, weights):
    """What a block attends to: the travelling tensors themselves (K, V) or ``expand`` of them."""
    return tuple(travel) if expand is None else expand(*travel, *weights)


# One ring step's blocks on this rank. Which blocks a step computes depends on the rank, so under
# LocalTensorMode (many simulated ranks in one process) each runs once per rank (per_rank).
@spmd.per_rank
def _forward_step(acc, qs, ks, vs, me, i, cp, fwd):
    """Fold the blocks of ring step ``i`` (keys ``ks`` / values ``vs`` of cp rank ``me - i``)
    into the running (out, lse) ``acc`` of this rank's two query chunks ``qs``."""
    acc = list(acc)
    for a, b, causal in block_plan(rank_chunks(me, cp), rank_chunks((me - i) % cp, cp)):
        acc[a] = _merge(acc[a], *fwd(qs[a], ks[b], vs[b], causal))
    return acc


@spmd.per_rank
def _backward_step(grads, saved, kv, me, i, cp, bwd):
    """Add the gradients of ring step ``i``'s blocks, in place, to ``grads`` = (dq chunks,
    d keys chunks, d values chunks) from ``saved`` = (d out, q, out, lse chunks) and ``kv`` =
    (key chunks, value chunks)."""
    (dqs, dks, dvs), (dos, qs, outs, lses), (ks, vs) = grads, saved, kv
    for a, b, causal in block_plan(rank_chunks(me, cp), rank_chunks((me - i) % cp, cp)):
        gq, gk, gv = bwd(dos[a], qs[a], ks[b], vs[b], outs[a], lses[a], causal)
        dqs[a].add_(gq)
        dks[b].add_(gk)
        dvs[b].add_(gv)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, mesh, dim, kernels, expand, *weights):
        fwd, _ = kernels
        cp, me = mesh.size(mesh.mesh_dim_names.index(dim)), mesh.get_local_rank(dim)
        n = q.shape[2] // 2
        qs = q.split(n, dim=2)
        travel = [k.contiguous(), v.contiguous()]
        acc = [None, None]
        for i in range(cp):
            wait = ring_shift(travel, mesh, dim) if i < cp - 1 else None  # the next block travels meanwhile
            keys, values = _keys_values(expand, travel, weights)  # one block's at a time, never kept
            acc = _forward_step(acc, qs, keys.split(n, dim=2), values.split(n, dim=2), me, i, cp, fwd)
            if wait is not None:
                travel = wait()
        B, h, dv = q.shape[0], q.shape[1], acc[0][0].shape[-1]
        # [B, h, 2n, dv] laid out as [B, 2n, h, dv] (as SDPA's own output): the caller's
        # transpose(1, 2).reshape(B, 2n, h * dv) before the output projection is then a view, so
        # the projection saves this same tensor for backward instead of a second copy
        out = q.new_empty(B, 2 * n, h, dv).transpose(1, 2)
        for a, (o, _) in enumerate(acc):
            out[:, :, a * n:(a + 1) * n] = o
        lse = torch.cat([l_ for _, l_ in acc], dim=2)  # [B, h, 2n]
        ctx.save_for_backward(q, k, v, out, lse, *weights)
        ctx.meta = (mesh, dim, kernels, expand, cp, me)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse, *weights = ctx.saved_tensors
        mesh, dim, (_, bwd), expand, cp, me = ctx.meta
        work = torch.promote_types(q.dtype, torch.float32)
        n = q.shape[2] // 2
        qs, dos, outs, lses = q.split(n, 2), grad_out.contiguous().split(n, 2), out.split(n, 2), lse.split(n, 2)
        dq = torch.zeros(q.shape, dtype=work, device=q.device)
        dqs = dq.split(n, 2)
        travel = [k.contiguous(), v.contiguous()]
        dtravel = [torch.zeros(t.shape, dtype=torch.promote_types(t.dtype, torch.float32), device=t.device)
                   for t in travel]
        dweights = [torch.zeros(w.shape, dtype=torch.promote_types(w.dtype, torch.float32), device=w.device)
                    for w in weights]
        for i in range(cp):
            wait = ring_shift(travel, mesh, dim) if i < cp - 1 else None
            if expand is None:  # K/V travel: their gradients accumulate in the travelling accumulators
                keys, values = travel
                dkeys, dvalues = dtravel
            else:  # recompute this block's K/V from what travelled, then backpropagate through it
                with torch.enable_grad():
                    leaves = [t.detach().requires_grad_() for t in (*travel, *weights)]
                    keys, values = expand(*leaves)
                dkeys = torch.zeros(keys.shape, dtype=work, device=keys.device)
                dvalues = torch.zeros(values.shape, dtype=work, device=values.device)
            _backward_step((dqs, dkeys.split(n, 2), dvalues.split(n, 2)), (dos, qs, outs, lses),
                           (keys.split(n, 2), values.split(n, 2)), me, i, cp, bwd)
            if expand is not None:
                grads = torch.autograd.grad((keys, values), leaves, (dkeys.to(keys.dtype), dvalues.to(values.dtype)),
                                            allow_unused=True)
                for acc, g in zip(dtravel + dweights, grads):
                    if g is not None:
                        acc.add_(g)
            # the accumulators follow their block; the cp-th shift brings each one home
            if cp > 1:
                dtravel = ring_shift(dtravel, mesh, dim)()
            if wait is not None:
                travel = wait()
        return (dq.to(q.dtype), dtravel[0].to(k.dtype), dtravel[1].to(v.dtype), None, None, None, None,
                *(g.to(w.dtype) for g, w in zip(dweights, weights)))


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mesh, dim: str = "cp",
                   kernels: str | None = None, expand=None, weights: tuple = ()) -> torch.Tensor:
    """Causal attention of this rank's ``q`` [B, h, 2n, d] against every ``dim`` rank's ``k``
    [B, g, 2n, d] / ``v`` [B, g, 2n, dv] -> [B, h, 2n, dv], all in the load-balanced chunk order
    (see the module docstring). Equals causal attention over the whole sequence, restricted to
    this rank's queries. ``kernels``: a :data:`KERNELS` name (None: :func:`block_kernels`' choice
    for the blocks' keys and values). Differentiable in q, k, v (and ``weights``); collective over ``dim``
    (forward and backward).

    ``expand`` (None: k and v are the keys and values): what travels is then ``k`` / ``v`` as
    given, any two [B, *, 2n, *] tensors (MLA's latent and shared rope key), and each rank
    computes the keys and values of a block it holds as ``expand(k, v, *weights) -> (keys
    [B, g, 2n, d], values [B, g, 2n, dv])``, a differentiable function of the block and
    ``weights`` (its own, e.g. this rank's heads of an up projection). The backward recomputes
    it per block and sends the gradient of what travelled home around the ring, as for K/V."""
    if q.shape[2] % 2 or k.shape[2] != q.shape[2] or v.shape[2] != q.shape[2]:
        raise ValueError(f"ring_attention: q {tuple(q.shape)} / k {tuple(k.shape)} / v {tuple(v.shape)}: "
                         f"needs q, k, v of one even length (two chunks)")
    if expand is None and q.shape[1] % k.shape[1]:
        raise ValueError(f"ring_attention: q {tuple(q.shape)} / k {tuple(k.shape)}: needs query heads a "
                         f"multiple of key/value heads")
    if kernels is None:
        kernels = block_kernels(q, k, v) if expand is None else _expanded_kernels(q, k, v, expand, weights)
    if kernels not in KERNELS:
        raise ValueError(f"ring_attention: kernels = {kernels!r}; valid: {list(KERNELS)} (None: block_kernels' choice)")
    return _RingAttention.apply(q, k, v, mesh, dim, KERNELS[kernels], expand, *weights)


def _expanded_kernels(q, k, v, expand, weights) -> str:
    """block_kernels for the keys and values ``expand`` makes (shapes only, on the meta device)."""
    if q.device.type != "cuda":
        return block_kernels(q, k, v)
    meta = [torch.empty(t.shape, dtype=t.dtype, device="meta") for t in (k, v, *weights)]
    keys, values = expand(*meta)
    return _cuda_block_kernels(q.device, q.dtype, q.shape[1], keys.shape[1], q.shape[-1], values.shape[-1])


def load_balanced(pos: torch.Tensor, rank: int, cp: int) -> bool:
    """Whether ``pos`` [2n] or [B, 2n] are cp rank ``rank``'s two chunks (each sequence up to one
    offset), i.e. whether the ring could apply on this rank. A rank's answer alone must not pick
    its attention's collectives (the other cp ranks may answer otherwise): a context hook asks
    :func:`ring_applies`, which decides for every cp rank together (and remembers its answer per
    positions tensor).

    Checked on every device, from the steps between neighbours (1 inside a chunk, the gap to the
    second chunk between them), so no index tensor is built; off the CPU the answer is a host
    read. Under ``torch.compile`` the layout is trusted (a read would break the graph)."""
    length = pos.shape[-1]
    if length % 2 or length == 0:
        return False
    if torch.compiler.is_compiling():
        return True
    return bool(_balanced(pos, rank, cp))


def _balanced(pos: torch.Tensor, rank: int, cp: int) -> torch.Tensor:
    """:func:`load_balanced` as a 0-dim bool tensor (no host read)."""
    length = pos.shape[-1]
    if length % 2 or length == 0:
        return torch.zeros((), dtype=torch.bool, device=pos.device)
    n = length // 2
    first, second = rank_chunks(rank, cp)
    steps = pos[..., 1:] - pos[..., :-1]  # [..., 2n - 1]
    gap = (second - first - 1) * n + 1  # from the last position of chunk `first` to the first of `second`
    return (steps[..., :n - 1] == 1).all() & (steps[..., n:] == 1).all() & (steps[..., n - 1] == gap).all()


def ring_applies(pos: torch.Tensor, mesh, dim: str = "cp") -> bool:
    """Whether ring attention applies to this forward: every ``dim`` rank's positions ``pos``
    ([s] or [B, s], its own tokens) are its two chunks (:func:`load_balanced`). Decided by all
    ``dim`` ranks together (one all-reduce over ``dim`` of a few integers), so every rank takes
    the same path and runs the same collectives: a rank deciding alone could take the ring while
    another all-gathers, and both would wait until the process group's timeout.

    Raises ``ValueError`` on every ``dim`` rank alike when the ranks' positions overlap, i.e. all
    of them start some sequence at one position (a forward given no positions, each rank then
    numbering its own tokens 0..s-1): no path computes one device's attention from those.

    One host read per positions tensor, remembered while the tensor lives and is unchanged in
    place, on every device and rank alike, so the ranks make the same calls; the layers, micro-
    batches and recomputation of one step share its positions and agree once. Under
    ``torch.compile`` the layout is trusted and nothing is read or reduced."""
    if not isinstance(pos, torch.Tensor):  # the same on every rank: raised before any collective
        raise ValueError(f"a context-parallel attention hook got positions {pos!r} on a fold with {dim} > 1: each "
                         f"rank holds two chunks of every sequence, so the module must pass the positions of its "
                         f"tokens (forward(x, positions) with those shard_batch returns)")
    length = pos.shape[-1]
    if torch.compiler.is_compiling():
        return length % 2 == 0 and length > 0
    key = (pos._version, id(mesh), dim)
    hit = _agreed.get(pos)
    if hit is not None and hit[0] == key:
        return hit[1]
    cp, rank = mesh.size(mesh.mesh_dim_names.index(dim)), mesh.get_local_rank(dim)
    first = pos[..., 0].reshape(-1).long() if length else pos.new_zeros(0, dtype=torch.long)  # [B] or [1]
    # one MAX over dim: [any rank off the layout, each sequence's largest first position, minus its smallest]
    votes = torch.cat([(~_balanced(pos, rank, cp)).long().reshape(1), first, -first])
    if votes.device.type != mesh.device_type:  # positions made on the host: NCCL reduces device tensors only
        votes = votes.to(mesh.device_type)
    dist.all_reduce(votes, op=dist.ReduceOp.MAX, group=mesh.get_group(dim))
    b = first.numel()
    shared_B = votes[1:1 + b] == -votes[1 + b:]  # every rank starts sequence i at one position
    # one host read: 1 = ring, 0 = all-gather, 2 = overlapping positions (a dry run's fake read
    # answers 1, the path of the positions shard_batch gives)
    verdict = int(torch.where(shared_B.any(), 2, (votes[0] == 0).long()).item())
    if verdict == 2:
        i = int(shared_B.nonzero()[0, 0])
        raise ValueError(f"every {dim} rank's positions start sequence {i} at position {int(votes[1 + i])}: the "
                         f"{cp} {dim} ranks' tokens overlap, as when a forward is called without positions on a "
                         f"fold with {dim} = {cp} (each rank numbering its own tokens 0..s-1), so attention cannot "
                         f"be one device's; pass the positions shard_batch returns (model(tokens, positions), "
                         f"loss(tokens, targets, positions))")
    ok = verdict == 1
    _agreed[pos] = (key, ok)
    return ok


_agreed = WeakTensorKeyDictionary()  # positions -> ((version, mesh, dim), the ranks' answer), while they live

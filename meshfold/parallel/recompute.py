"""Activation checkpointing of blocks: ``recompute`` = none | selective | full.

Both modes are one non-reentrant :func:`torch.utils.checkpoint.checkpoint` around each block, any
``nn.Module`` (:func:`apply_recompute` sets the module's ``forward`` to a :class:`Checkpointed`
one, from outside, so parameter names, and FSDP2's hooks around the module's call, stay as they
are: the checkpoint runs inside the block's FSDP2 group), with a
:func:`~torch.utils.checkpoint.create_selective_checkpoint_contexts` policy that says which op
outputs the forward keeps; everything else the block saved for backward is recomputed from the
block's input when the backward reaches the block.

* ``full``: keep only the block's input and the routing decisions (below).
* ``selective``: keep also the output of every weight GEMM (:data:`SAVED_PRODUCTS`: the attention
  projections, the MoE router, the experts' grouped GEMMs, the shared expert, the dense MLP),
  expensive to recompute; recompute what is cheap and large: the norms (their fp32 statistics
  and normalized copies), RoPE, the attention core (the fused SDPA kernel: its output and
  log-sum-exp are not kept; a math fallback's scores neither), the experts' and MLPs' SwiGLU (the
  activation that feeds the down projection is not kept), softmax / sigmoid scores, gathers,
  permutes and the weighted combine (a batched product with k terms per token). What it keeps per
  layer is in docs/plan.md (*Memory*), the planner's model of it. Under TP it keeps the output
  projections' tp-partial outputs (all T tokens before the reduce-scatter), tp times the tokens
  a rank holds between blocks: selective saves less there the larger tp is.
  ``benchmarks/bench_recompute.py`` measures the saved bytes.

MoE blocks, and what makes their recomputation safe:

* **Routing is replayed, never recomputed.** :data:`ROUTING_OPS` (``topk``, ``sort``: the
  router's choice of experts and the dropping / permute orders) are MUST_SAVE in both modes, so the
  recompute returns the forward's indices and scores instead of choosing again: a router that would
  route differently on recompute (input jitter, a bias changed in between, non-deterministic
  near-ties) cannot; checkpoint's determinism check would raise CheckpointError otherwise.
* **Nothing is counted twice.** The recompute reruns :meth:`MoELayer.forward`, whose side effects
  (``_loss_shares``, ``last_metrics``, ``_bias_counts``, the step's sums) are set, for the recompute, to what the
  forward found (so it takes the same branches) and afterwards back to what they were just
  before the recompute. The balancing losses enter the gradient through the
  forward's graph only (the recomputed graph just refills saved tensors), so they are counted once.
* **Collectives in the same order on every rank.** The recompute reissues the block's collectives
  (TP / CP all-gathers, token-statistic all-reduces, the dispatch's counts exchange and
  all-to-all, FSDP2's all-gather of expert weights) during backward, when the backward reaches
  the block. Every rank of a group runs the same blocks in the same order and recomputes each one
  whole: checkpoint's *early stop* (end the recompute once every saved tensor is refilled) is
  turned off, since where it stops could depend on a rank's data, and collectives after that
  point would then run on some ranks only. The recomputed dispatch reads its counts on the host
  again (one read per recomputed MoE layer, in backward; the forward keeps its one).
* **No growth across steps.** The kept outputs live in the checkpoint's frame, which the
  backward consumes and frees with the graph; ``tests/parallel/test_recompute.py`` checks the bytes alive
  after each step.

Without autograd (evaluation under ``torch.no_grad``) blocks run plainly.
"""

from __future__ import annotations

import contextlib
import importlib

import torch
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from meshfold.catalog import RECOMPUTE, check_choice
from meshfold.models.moe import MoELayer
from meshfold.runtime.overlap import keeping_turn

__all__ = ["RECOMPUTE", "ROUTING_OPS", "SAVED_PRODUCTS", "check_recompute", "BlockRecompute",
           "Checkpointed", "apply_recompute", "read_twice"]

aten = torch.ops.aten

# Selective checkpointing counts every op of the forward and raises if the recompute runs one more
# often. FSDP2's hooks on a group nested in the block (the experts, on the MoE mesh) run in the
# recompute too, in the state of the backward (a group already unsharded, or unsharded again;
# gradient sync off under a pipeline schedule), so they may mark profiler ranges, allocate,
# all-gather, view and copy unsharded weights a different number of times than in the forward
# (found so with fp32 and bf16 compute, with and without pp: under pp 2 x cp 2 x etp 2 the
# recompute met one more aten.view than the forward). The count matters only for the ops the
# policy may keep: a kept op's outputs are matched to its calls by their index, while every other
# op is run again anyway. So inside one of meshfold's blocks (forward and recompute) SAC ignores
# every op but those (:data:`ROUTING_OPS`, :data:`SAVED_PRODUCTS`), via the set it already
# treats so (torch.utils.checkpoint.SAC_IGNORED_OPS, e.g. checkpoint's own detach calls); outside
# them the set is torch's own, so another library's selective checkpointing in the same process
# sees every op (:func:`_hook_ops_ignored`).


def _all_ops() -> set:
    """Every op overload registered now ("ns::name.overload" -> torch.ops.ns.name.overload)."""
    out = set()
    for qualified in torch._C._dispatch_get_all_op_names():
        ns, rest = qualified.split("::", 1)
        name, _, overload = rest.partition(".")
        try:
            out.add(getattr(getattr(getattr(torch.ops, ns), name), overload or "default"))
        except (AttributeError, RuntimeError):  # namespaces torch.ops does not expose
            continue
    return out


_HOOK_OPS: frozenset = frozenset()  # filled at the first block: every op overload but the kept ones
_hook_ops_depth = 0  # blocks running or recomputing now (nested: a recompute inside a backward)


@contextlib.contextmanager
def _hook_ops_ignored():
    """SAC ignores :data:`_HOOK_OPS` inside this context; the set is torch's own again outside."""
    global _hook_ops_depth, _HOOK_OPS
    if not _HOOK_OPS:
        importlib.import_module("torch.distributed.fsdp")  # registers torch.ops.fsdp
        kept = {getattr(p, o) for p in ROUTING_OPS + SAVED_PRODUCTS for o in p.overloads()}
        _HOOK_OPS = frozenset(_all_ops() - kept - torch.utils.checkpoint.SAC_IGNORED_OPS)
    if _hook_ops_depth == 0:
        torch.utils.checkpoint.SAC_IGNORED_OPS.update(_HOOK_OPS)
    _hook_ops_depth += 1
    try:
        yield
    finally:
        _hook_ops_depth -= 1
        if _hook_ops_depth == 0:
            torch.utils.checkpoint.SAC_IGNORED_OPS.difference_update(_HOOK_OPS)


ROUTING_OPS = (aten.topk, aten.sort)  # top-k experts; dropping and permute orders


def _saved_products():
    importlib.import_module("meshfold.kernels.grouped_mm")  # registers torch.ops.meshfold.grouped_mm
    return (aten.mm, aten.addmm, torch.ops.meshfold.grouped_mm)


SAVED_PRODUCTS = _saved_products()


def check_recompute(mode) -> str:
    """``mode`` if it is one of :data:`~meshfold.catalog.RECOMPUTE`, else ``ValueError`` listing them."""
    return check_choice("recompute", mode, RECOMPUTE)


def _policy(saved: tuple):
    packets = frozenset(saved)

    def policy(ctx, func, *args, **kwargs):
        # out= variants write into a buffer of the caller's: recomputed, never cached (a cached
        # buffer would be written again on recompute)
        keep = getattr(func, "_overloadpacket", func) in packets and not func._schema.is_mutable
        return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE

    return policy


# MoELayer's per-forward state
FIELDS = ("_loss_shares", "_loss_totals", "last_metrics", "_bias_counts", "_step_entry", "_step")


def _state(layers) -> list[dict]:
    return [{f: getattr(m, f) for f in FIELDS} for m in layers]


def _set_state(layers, state: list[dict]) -> None:
    for m, fields in zip(layers, state):
        for f, v in fields.items():
            setattr(m, f, v)


@contextlib.contextmanager
def _record_state(layers, seen: list):
    """The forward: note the MoE layers' state as the block's forward finds it."""
    seen[:] = _state(layers)
    yield


@contextlib.contextmanager
def _replay_state(layers, seen: list):
    """The recompute: run with the state the forward found (so it takes the forward's branches,
    e.g. the first expert-bias count of a step), then put back the state as the recompute found
    it, so the recompute leaves no trace (nothing counted twice)."""
    now = _state(layers)
    _set_state(layers, seen)
    try:
        # in turns (a2a_overlap), the other micro-batch must not run while the layers hold the
        # replayed state: its forward would count into it, and the restore below would drop that
        with keeping_turn():
            yield
    finally:
        _set_state(layers, now)


@contextlib.contextmanager
def _stacked(*contexts):
    """``contexts`` entered in order (the first outermost)."""
    with contextlib.ExitStack() as stack:
        for context in contexts:
            stack.enter_context(context)
        yield


class _EachTime:
    """A context built afresh by ``make()`` each time it is entered. torch's checkpoint enters a
    block's recompute context once per backward pass that reads the block: once, except under the
    zero-bubble schedules, whose input- and weight-gradient passes each recompute it."""

    def __init__(self, make):
        self.make, self.open = make, []

    def __enter__(self):
        context = self.make()
        self.open.append(context)
        return context.__enter__()

    def __exit__(self, *exc):
        return self.open.pop().__exit__(*exc)


@contextlib.contextmanager
def _read_again(recompute):
    """``recompute`` (selective checkpointing's replay of the saved op outputs) leaving those
    outputs readable by a later recompute of the same block: torch marks each one consumed when
    read, which is right when one backward reads a block; the zero-bubble schedules' weight pass
    reads it a second time. The outputs stay alive until the block's graph is freed."""
    kept = {key: dict(outputs) for key, outputs in recompute.storage.items()}
    with recompute:
        yield
    for key, outputs in kept.items():
        recompute.storage[key].update(outputs)


class BlockRecompute:
    """``hook(fn, *args, **kwargs)`` runs ``fn(*args, **kwargs)`` under non-reentrant activation
    checkpointing with the policy of ``mode`` ("selective" or "full"); ``layers`` are the block's
    MoE layers, whose state the recompute must not change. ``read_twice``: the backward reads the
    block in two passes (the zero-bubble schedules: :func:`read_twice`), each recomputing it from
    the same kept outputs."""

    def __init__(self, mode: str, layers=(), read_twice: bool = False):
        if check_recompute(mode) == "none":
            raise ValueError("BlockRecompute needs recompute = 'selective' or 'full'; 'none' sets no hook")
        self.mode, self.layers, self.read_twice = mode, list(layers), read_twice
        self.policy = _policy(ROUTING_OPS + (SAVED_PRODUCTS if mode == "selective" else ()))

    def _contexts(self):
        forward, recompute = create_selective_checkpoint_contexts(self.policy)
        seen: list = []
        replay = _EachTime(lambda: _read_again(recompute)) if self.read_twice else recompute
        return (_stacked(_hook_ops_ignored(), _record_state(self.layers, seen), forward),
                _EachTime(lambda: _stacked(_hook_ops_ignored(), _replay_state(self.layers, seen), replay)))

    def __call__(self, fn, *args, **kwargs):
        if not torch.is_grad_enabled():
            return fn(*args, **kwargs)
        return checkpoint(fn, *args, use_reentrant=False, context_fn=self._contexts, early_stop=False, **kwargs)

    def __repr__(self) -> str:
        return f"BlockRecompute({self.mode!r})"


class Checkpointed:
    """A module's ``forward`` under activation checkpointing: set as the module's own
    ``forward`` attribute, it calls the forward it replaced through ``hook`` (a
    :class:`BlockRecompute`). Set on the instance, it leaves the module's class, parameters and
    names as they are."""

    def __init__(self, forward, hook: BlockRecompute):
        self.forward, self.hook = forward, hook

    def __call__(self, *args, **kwargs):
        return self.hook(self.forward, *args, **kwargs)

    def __repr__(self) -> str:
        return f"Checkpointed({self.hook.mode!r})"


def apply_recompute(blocks, mode: str) -> None:
    """Checkpoint the forward of every module in ``blocks`` (any ``nn.Module``) with ``mode``'s
    policy, or, for "none", restore its own forward. Applying it again replaces the mode."""
    check_recompute(mode)
    for block in blocks:
        if isinstance(block.__dict__.get("forward"), Checkpointed):
            del block.forward
        if mode != "none":
            layers = [m for m in block.modules() if isinstance(m, MoELayer)]
            block.forward = Checkpointed(block.forward, BlockRecompute(mode, layers))


def read_twice(module) -> None:
    """Let the backward of every checkpointed block under ``module`` recompute it twice (the
    zero-bubble schedules' input-gradient and weight-gradient passes each do), from the same
    kept outputs (:class:`BlockRecompute`'s ``read_twice``)."""
    for m in module.modules():
        forward = m.__dict__.get("forward")
        if isinstance(forward, Checkpointed):
            forward.hook.read_twice = True

"""Where ranks are: one rank layout seen as an attention mesh and as an MoE mesh.

MoE Parallel Folding (arXiv 2504.14960) lays the same ``world_size`` ranks out twice:

* attention view ``attn``: dims ``(pp, dp, cp, tp)``
* MoE view ``moe``:        dims ``(pp, edp, ep, etp)``

Dims are listed leftmost slowest, so rank ``r`` has attention coordinates given by
``r = ((pp_i * dp + dp_i) * cp + cp_i) * tp + tp_i``. This is Megatron-Core's default order
"tp-cp-ep-dp-pp" read from fastest to slowest, so a Megatron-Core layout ports unchanged. The
only coupling between the views is that their ``pp`` groups are identical; inside one pipeline
stage the ``dp * cp * tp`` attention ranks are re-read as ``edp * ep * etp`` expert ranks.

Example (16 ranks, attention tp2 x cp2 x dp2 x pp2, experts ep8)::

    >>> spec = FoldSpec(16, tp=2, cp=2, pp=2, ep=8)
    >>> spec.dp, spec.edp
    (2, 1)
    >>> spec.groups("attn", "tp")[:2]
    [[0, 1], [2, 3]]
    >>> spec.groups("moe", "ep")
    [[0, 1, 2, 3, 4, 5, 6, 7], [8, 9, 10, 11, 12, 13, 14, 15]]

:class:`FoldSpec` is pure Python (no process group needed); :func:`fold` builds the two named
:class:`~torch.distributed.device_mesh.DeviceMesh` views over an initialised process group.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Iterable, Mapping, Sequence

__all__ = ["ATTN_DIMS", "MOE_DIMS", "VIEWS", "FoldSpec", "FoldedMesh", "backend_device_type", "collective_backend",
           "fold", "valid_folds"]

ATTN_DIMS: tuple[str, ...] = ("pp", "dp", "cp", "tp")
MOE_DIMS: tuple[str, ...] = ("pp", "edp", "ep", "etp")
VIEWS: dict[str, tuple[str, ...]] = {"attn": ATTN_DIMS, "moe": MOE_DIMS}


def _is_size(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def _divisors(n: int) -> list[int]:
    """The divisors of ``n`` in increasing order, in O(sqrt(n)) steps (``n`` may be any world size
    a user types)."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return small + [n // d for d in reversed(small) if d * d != n]


@dataclass(frozen=True)
class FoldSpec:
    """A validated rank layout seen as an attention view and an MoE view.

    Args:
        world_size: number of ranks.
        tp, cp, dp, pp: attention tensor, context, data and pipeline sizes. ``dp`` is derived as
            ``world_size // (tp * cp * pp)`` when omitted.
        etp, ep, edp: expert tensor, expert and expert-data sizes. ``edp`` is derived as
            ``world_size // (etp * ep * pp)`` when omitted.

    Attention dims are ``(pp, dp, cp, tp)`` and MoE dims ``(pp, edp, ep, etp)``, leftmost slowest
    (Megatron-Core's "tp-cp-ep-dp-pp" order, tp fastest). Both views share ``pp``, hence identical
    pipeline groups. Raises ``ValueError`` naming the offending numbers for an invalid layout.
    """

    world_size: int
    tp: int = 1
    cp: int = 1
    dp: int | None = None
    pp: int = 1
    etp: int = 1
    ep: int = 1
    edp: int | None = None
    _strides: dict = field(default=None, init=False, repr=False, compare=False, hash=False)

    def __post_init__(self) -> None:
        W = self.world_size
        if not _is_size(W):
            raise ValueError(f"world_size must be a positive integer, got {W!r}")
        for name in ("tp", "cp", "pp", "etp", "ep"):
            v = getattr(self, name)
            if not _is_size(v):
                raise ValueError(f"{name} must be a positive integer, got {v!r}")
        for name in ("dp", "edp"):
            v = getattr(self, name)
            if v is not None and not _is_size(v):
                raise ValueError(f"{name} must be a positive integer or None (derived), got {v!r}")
        object.__setattr__(self, "dp", self._resolve("attn", "dp", ("tp", "cp", "pp")))
        object.__setattr__(self, "edp", self._resolve("moe", "edp", ("etp", "ep", "pp")))
        strides = {}
        for view, dims in VIEWS.items():
            stride, s = {}, 1
            for d in reversed(dims):
                stride[d] = s
                s *= getattr(self, d)
            strides[view] = stride
        object.__setattr__(self, "_strides", strides)

    def _resolve(self, view: str, free: str, fixed: tuple[str, ...]) -> int:
        """Derive or check the data-parallel size of one view so the view covers the world."""
        W = self.world_size
        sizes = {d: getattr(self, d) for d in fixed}
        prod = math.prod(sizes.values())
        named = "*".join(fixed)
        given = ", ".join(f"{d}={v}" for d, v in sizes.items())
        if W % prod:
            raise ValueError(
                f"{view} {named} = {prod} does not divide world size {W}, so {free} would not be "
                f"an integer ({given}; the product must be one of the divisors of {W}: "
                f"{_divisors(W)})")
        derived = W // prod
        value = getattr(self, free)
        if value is None:
            return derived
        if value * prod != W:
            raise ValueError(
                f"{view} {named}*{free} = {prod * value} but world size is {W} "
                f"(valid {free} for {given}: {derived})")
        return value

    @classmethod
    def from_views(cls, world_size: int, attn: Mapping[str, int], moe: Mapping[str, int]) -> "FoldSpec":
        """Build a spec from the two views given separately, each with its own ``pp``.

        The folding rule requires identical pipeline groups, so the two ``pp`` must agree.
        ``attn`` takes keys from ``tp, cp, dp, pp`` and ``moe`` from ``etp, ep, edp, pp``.
        """
        for view, given in (("attn", attn), ("moe", moe)):
            unknown = sorted(set(given) - set(VIEWS[view]))
            if unknown:
                raise ValueError(f"{view} view has no dims {unknown}; valid dims: {list(VIEWS[view])}")
        attn_pp, moe_pp = attn.get("pp", 1), moe.get("pp", 1)
        if attn_pp != moe_pp:
            raise ValueError(
                f"pp differs between views: attn pp = {attn_pp}, moe pp = {moe_pp}; folding needs "
                f"identical pipeline groups, so both must be equal (e.g. pp={attn_pp} in both)")
        kwargs = {k: v for k, v in attn.items()}
        kwargs.update({k: v for k, v in moe.items() if k != "pp"})
        return cls(world_size, **kwargs)

    # ---- reading the layout -------------------------------------------------------------
    def sizes(self, view: str) -> dict[str, int]:
        """``{dim: size}`` of one view, in layout order (leftmost slowest)."""
        return {d: getattr(self, d) for d in self._dims(view)}

    def shape(self, view: str) -> tuple[int, ...]:
        """Mesh shape of one view, e.g. ``(pp, dp, cp, tp)`` for ``"attn"``."""
        return tuple(self.sizes(view).values())

    def coords(self, rank: int) -> dict[str, dict[str, int]]:
        """A rank's coordinates in both views: ``{"attn": {"pp":..,...}, "moe": {...}}``."""
        self._check_rank(rank)
        out = {}
        for view, dims in VIEWS.items():
            st = self._strides[view]
            out[view] = {d: (rank // st[d]) % getattr(self, d) for d in dims}
        return out

    def rank(self, view: str, **coords: int) -> int:
        """The rank at the given coordinates of one view (inverse of :meth:`coords`)."""
        dims = self._dims(view)
        if set(coords) != set(dims):
            raise ValueError(f"{view} coordinates need exactly {list(dims)}, got {sorted(coords)}")
        r = 0
        for d in dims:
            c = coords[d]
            if not (isinstance(c, int) and 0 <= c < getattr(self, d)):
                raise ValueError(f"{view} coordinate {d}={c!r} out of range [0, {getattr(self, d)})")
            r += c * self._strides[view][d]
        return r

    def groups(self, view: str, dims: str | Sequence[str]) -> list[list[int]]:
        """Every group of ranks that varies only along ``dims`` of ``view``.

        ``dims`` is one dim name or a tuple of them (e.g. ``("dp", "cp")`` for gradient reduction,
        ``("ep", "etp")``). Returns the groups as sorted rank lists, sorted by their first rank.
        Within a group ranks are ordered by rank number, which for a tuple in layout order is the
        row-major order of the sub-mesh.
        """
        names = (dims,) if isinstance(dims, str) else tuple(dims)
        all_dims = self._dims(view)
        bad = [d for d in names if d not in all_dims]
        if bad or not names or len(set(names)) != len(names):
            raise ValueError(f"{view} view has dims {list(all_dims)}; got {list(names)!r}")
        st = self._strides[view]
        buckets: dict[tuple[int, ...], list[int]] = {}
        for r in range(self.world_size):
            key = tuple((r // st[d]) % getattr(self, d) for d in all_dims if d not in names)
            buckets.setdefault(key, []).append(r)
        return sorted(buckets.values())

    def group_of(self, rank: int, view: str, dims: str | Sequence[str]) -> list[int]:
        """The group of ``groups(view, dims)`` that contains ``rank``."""
        self._check_rank(rank)
        return next(g for g in self.groups(view, dims) if rank in g)

    def _dims(self, view: str) -> tuple[str, ...]:
        if view not in VIEWS:
            raise ValueError(f"unknown view {view!r}; valid views: {list(VIEWS)}")
        return VIEWS[view]

    def _check_rank(self, rank: int) -> None:
        if not (isinstance(rank, int) and 0 <= rank < self.world_size):
            raise ValueError(f"rank {rank!r} out of range [0, {self.world_size})")

    def process_group_count(self) -> tuple[int, int]:
        """(groups :func:`fold` creates, groups building each view separately would create).

        ``fold`` creates one process group per group of ranks of every *distinct* partition of
        the world among the dims of both views; a dim whose partition another dim already has
        (pp in both views, etp == tp, size-1 dims) shares it, and the whole world reuses the
        default group. Counted from sizes and strides alone (no rank is enumerated): a dim of
        size s > 1 and stride t partitions the world as every other such dim of equal (s, t) does.
        """
        seen, shared, unshared = set(), 0, 0
        for view, dims in VIEWS.items():
            for d in dims:
                size = getattr(self, d)
                n_groups = self.world_size // size
                key = (size, self._strides[view][d]) if size > 1 else (1, 0)
                unshared += n_groups
                if key not in seen:
                    seen.add(key)
                    shared += n_groups if n_groups > 1 else 0
        return shared, unshared

    def first_groups(self, view: str, dim: str, count: int) -> list[range]:
        """The first ``count`` groups of ``groups(view, dim)`` as ranges, built from the layout's
        strides without enumerating the world (``describe`` of any world size is instant)."""
        self._dims(view)
        size, stride = getattr(self, dim), self._strides[view][dim]
        out = []
        block = 0
        while len(out) < count and block < self.world_size:  # ranks whose `dim` coordinate is 0
            for first in range(block, min(block + stride, self.world_size)):
                out.append(range(first, first + size * stride, stride))
                if len(out) == count:
                    break
            block += size * stride
        return out

    # ---- presentation ---------------------------------------------------------------------
    def describe(self) -> str:
        """Human-readable table of both views: which ranks share each dim."""
        lines = [f"FoldSpec: {self.world_size} ranks"]
        for view, dims in VIEWS.items():
            sizes = " x ".join(f"{d}{getattr(self, d)}" for d in dims)
            lines.append(f"\n{view} view ({sizes}), dims leftmost slowest")
            width = max(len(d) for d in dims)
            for d in dims:
                n_groups = self.world_size // getattr(self, d)
                shown = " ".join(_fmt_group(g) for g in self.first_groups(view, d, 8))
                more = f" ... ({n_groups} groups)" if n_groups > 8 else ""
                lines.append(f"  {d:<{width}} size {getattr(self, d):>3}: {shown}{more}")
        created, unshared = self.process_group_count()
        lines.append(f"\nfold() creates {created} process groups ({unshared} if each view built "
                     f"its own; dims with the same rank sets share one)")
        lines.append("\nrank  " + "  ".join(f"{view}({','.join(dims)})" for view, dims in VIEWS.items()))
        for r in range(min(self.world_size, 32)):
            c = self.coords(r)
            cells = "  ".join(
                ("(" + ",".join(str(c[v][d]) for d in VIEWS[v]) + ")").ljust(len(v) + 2 + 3 * len(VIEWS[v]))
                for v in VIEWS)
            lines.append(f"{r:>4}  {cells}")
        if self.world_size > 32:
            lines.append(f"  ... ({self.world_size - 32} more ranks)")
        return "\n".join(lines)


def _fmt_group(group: range) -> str:
    """``[4-7]`` for consecutive ranks, ``[0,8]`` for a few, ``[0,2,4,...,98]`` for many."""
    if len(group) > 2 and group.step == 1:
        return f"[{group[0]}-{group[-1]}]"
    if len(group) > 8:
        return f"[{group[0]},{group[1]},{group[2]},...,{group[-1]}]"
    return "[" + ",".join(map(str, group)) + "]"


@dataclass
class FoldedMesh:
    """Two named DeviceMesh views of the same ranks.

    ``attn`` has dims ``("pp", "dp", "cp", "tp")`` and ``moe`` has ``("pp", "edp", "ep", "etp")``.
    ``num_process_groups`` counts the process groups this fold's views use (over all ranks;
    folds over the same default group share the groups of equal rank partitions);
    ``num_process_groups_unshared`` is what building each view on its own would have created.
    """

    spec: FoldSpec
    attn: object  # DeviceMesh
    moe: object  # DeviceMesh
    num_process_groups: int
    num_process_groups_unshared: int
    _owned_groups: list = field(default_factory=list, repr=False)
    _stages: dict = field(default_factory=dict, repr=False)

    @property
    def device_type(self) -> str:
        return self.attn.device_type

    @property
    def device(self):
        """This rank's ``torch.device``: its current GPU under CUDA, else the CPU."""
        import torch

        if self.device_type == "cuda":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device(self.device_type)

    def destroy(self) -> None:
        """Release this fold's process groups (call on every rank, when done): each is destroyed
        once no other live fold over the same default group uses it."""
        for partition in self._owned_groups:
            _release_group(partition)
        self._owned_groups.clear()

    def view(self, name: str):
        """The DeviceMesh for ``"attn"`` or ``"moe"``."""
        if name not in VIEWS:
            raise ValueError(f"unknown view {name!r}; valid views: {list(VIEWS)}")
        return getattr(self, name)

    def stage(self, name: str):
        """This rank's pipeline stage of view ``name``: the DeviceMesh without ``pp``, i.e.
        ``(dp, cp, tp)`` or ``(edp, ep, etp)``. Always the same object per view, so all the
        parameters laid out on it share one mesh (FSDP2 groups parameters by mesh identity)."""
        if name not in self._stages:
            self._stages[name] = self.view(name)[VIEWS[name][1:]]
        return self._stages[name]


# backends that take tensors of any device but are not an accelerator's own collective library:
# gloo stages CUDA tensors through the host, the fake backend of dry runs moves nothing
_HOST_BACKENDS = ("gloo", "fake")


def collective_backend(group=None, device_type: str = "cpu") -> str | None:
    """The backend that runs ``group``'s collectives on ``device_type`` tensors (None: none does).

    Read from the group's backend config, one ``device:backend`` pair per device type: a group
    made with ``"nccl"`` has ``cuda:nccl``, with ``"gloo"`` ``cpu:gloo,cuda:gloo``, and with
    ``"cpu:gloo,cuda:nccl"`` (torch's default on a CUDA machine) both; so the backend's *name*
    (``dist.get_backend``) does not tell which library a CUDA tensor's collective reaches."""
    import torch.distributed as dist

    for entry in dist.get_backend_config(group).split(","):
        device, _, backend = entry.strip().rpartition(":")
        if device in ("", device_type):  # a bare name serves every device type
            return backend
    return None


def backend_device_type(group=None) -> str:
    """The device a process group's ranks compute on: the accelerator its config serves with an
    accelerator's collective library (``"cuda"`` under NCCL, alone or as ``cpu:gloo,cuda:nccl``),
    else ``"cpu"`` (gloo, whose CUDA support stages through the host, and the fake backend)."""
    import torch.distributed as dist

    for entry in dist.get_backend_config(group).split(","):
        device, _, backend = entry.strip().rpartition(":")
        if device not in ("", "cpu") and backend not in _HOST_BACKENDS:
            return device
    return "cpu"


def fold(spec: FoldSpec, device_type: str | None = None) -> FoldedMesh:
    """Build the attention and MoE DeviceMesh views of ``spec`` over the default process group.

    ``device_type`` defaults to what the process group's backend implies
    (:func:`backend_device_type`): ``"cuda"`` under NCCL (also as ``cpu:gloo,cuda:nccl``),
    ``"cpu"`` under gloo, so the same code runs on a laptop's gloo ranks and under torchrun on GPUs
    without pushing CPU tensors into NCCL groups.

    Every rank must call this (it creates process groups collectively). A dim whose rank groups
    already exist for another dim (for instance ``etp`` when ``etp == tp``, ``pp`` in both views, or
    every size-1 dim), in this fold or in another live fold over the same default group, reuses
    the existing process group instead of creating a duplicate; this is done by building the
    groups with ``torch.distributed.new_subgroups_by_enumeration`` and the meshes with the public
    ``DeviceMesh.from_group``.
    """
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    if not dist.is_initialized():
        raise RuntimeError("fold() needs an initialised default process group; use "
                           "meshfold.runtime.launch.spawn or torchrun first")
    if dist.get_world_size() != spec.world_size:
        raise ValueError(f"spec.world_size = {spec.world_size} but the process group has "
                         f"{dist.get_world_size()} ranks")
    if device_type is None:
        device_type = backend_device_type()
    used: dict[tuple[tuple[int, ...], ...], object] = {}
    owned = []
    unshared = 0
    views = {}
    for view, dims in VIEWS.items():
        my_groups = []
        for d in dims:
            partition = tuple(tuple(g) for g in spec.groups(view, d))
            unshared += len(partition)
            if partition not in used:
                if len(partition) == 1:
                    pg = dist.group.WORLD  # the whole world: reuse the default group
                else:
                    pg = _acquire_group(partition)
                    owned.append(partition)
                used[partition] = pg
            my_groups.append(used[partition])
        mesh = torch.arange(spec.world_size, dtype=torch.int).reshape(spec.shape(view))
        views[view] = DeviceMesh.from_group(my_groups, device_type, mesh=mesh, mesh_dim_names=dims)
    group_count = sum(len(p) for p in owned)
    return FoldedMesh(spec, views["attn"], views["moe"], group_count, unshared, owned)


# Process groups by rank partition, shared by every fold over the same default group. Each gloo
# group keeps a transport thread that wakes about a hundred times a second even when idle, so a
# long-lived process that folds many layouts (a test world, a notebook) would otherwise pay for
# every group it ever made; distinct partitions of a world are few. Entries: partition ->
# [this rank's group, number of live folds using it], valid while ``_GROUPS_OF`` is the default group.
_GROUPS: dict[tuple[tuple[int, ...], ...], list] = {}
_GROUPS_OF: list = [None]


def _acquire_group(partition: tuple[tuple[int, ...], ...]):
    """This rank's process group of ``partition`` (a partition of the world into rank groups),
    created collectively on first use; every rank must acquire the same partitions in the same
    order, as with ``fold``."""
    import torch.distributed as dist

    if _GROUPS_OF[0] is not dist.group.WORLD:  # a new default group: the old groups are gone
        _GROUPS.clear()
        _GROUPS_OF[0] = dist.group.WORLD
    if partition not in _GROUPS:
        pg, _ = dist.new_subgroups_by_enumeration([list(g) for g in partition])
        _GROUPS[partition] = [pg, 0]
    _GROUPS[partition][1] += 1
    return _GROUPS[partition][0]


def _release_group(partition: tuple[tuple[int, ...], ...]) -> None:
    import torch.distributed as dist

    entry = _GROUPS.get(partition)
    if entry is None or _GROUPS_OF[0] is not dist.group.WORLD:
        return  # its default group was destroyed, and every subgroup with it
    entry[1] -= 1
    if entry[1] == 0:
        del _GROUPS[partition]
        dist.destroy_process_group(entry[0])


def valid_folds(world_size: int, pp: Iterable[int] | None = None) -> list[FoldSpec]:
    """Every valid FoldSpec of ``world_size`` ranks (all factorizations of both views)."""
    out = []
    for p in _divisors(world_size) if pp is None else pp:
        inner = world_size // p
        for tp in _divisors(inner):
            for cp in _divisors(inner // tp):
                for etp in _divisors(inner):
                    for ep in _divisors(inner // etp):
                        out.append(FoldSpec(world_size, tp=tp, cp=cp, pp=p, etp=etp, ep=ep))
    return out

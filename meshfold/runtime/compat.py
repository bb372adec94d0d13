"""Every difference between the torch releases meshfold supports, in one place.

meshfold runs on torch ``>= 2.11, < 2.16`` (:data:`SUPPORTED`). A torch API that only part of that
range has is listed in :data:`VERSIONED` with the first release that has it, and used only through
this module, which falls back to an older API on older releases; no other file of meshfold looks
at the torch version or catches an ImportError of a torch symbol. ``tests/runtime/test_compat.py`` resolves
every torch symbol meshfold's sources name and fails naming any this torch lacks and this module
does not replace. docs/torch-versions.md says how each release is tested.

The fallbacks:

==============================================================  ==========================================
newer API (first release)                                       fallback
==============================================================  ==========================================
``fully_shard(dp_mesh_dims=DataParallelMeshDims(...))`` (2.13)  FSDP2 over the data dims flattened into
                                                                one submesh, each parameter a DTensor on
                                                                the submesh of the remaining dims: FSDP2's
                                                                FSDP + TP/EP mode before 2.13, the same sums
``dist.all_gather_single`` (2.13)                               ``dist.all_gather_into_tensor``
``dist.reduce_scatter_single`` (2.13)                           ``dist.reduce_scatter_tensor``
``_StridedShardOffsetMode`` (2.13): a strided shard's indices   the shard of an index range split as
                                                                the placement splits data
==============================================================  ==========================================

One difference is of behaviour, not of API: from 2.14 a pipeline schedule on a fake process group
skips the first step's warm-up vote a real group runs; :func:`pipeline_votes_on_fake_groups` makes
the dry run's fake side vote as the real side does, so its collectives equal the real step's.

:func:`hiding` makes this module take the fallbacks on a torch that has the newer API, so tests
compare both paths on the same release.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import re
import sys
from dataclasses import dataclass
from pathlib import Path

__all__ = ["SUPPORTED", "VERSIONED", "Versioned", "all_gather_single", "check_torch_version", "fully_shard_over",
           "has", "hiding", "needs", "parse_version", "pipeline_votes_on_fake_groups", "reduce_scatter_single",
           "resolve", "strided_shard_indices", "torch_version"]

SUPPORTED = ((2, 11), (2, 16))  # torch releases meshfold runs on: from the first, up to (not including) the second


@dataclass(frozen=True)
class Versioned:
    """A torch symbol only part of the supported range has: the first release with it, and what
    meshfold does without it."""

    since: tuple[int, int]
    fallback: str


VERSIONED = {
    "torch.distributed.fsdp.DataParallelMeshDims": Versioned(
        (2, 13), "FSDP2 over the flattened data dims, parameters on the other dims' submesh"),
    "torch.distributed.all_gather_single": Versioned((2, 13), "torch.distributed.all_gather_into_tensor"),
    "torch.distributed.reduce_scatter_single": Versioned((2, 13), "torch.distributed.reduce_scatter_tensor"),
    "torch.distributed.tensor.placement_types._StridedShardOffsetMode": Versioned(
        (2, 13), "an index range split as the placement splits data"),
}

_hidden: set[str] = set()


def parse_version(version: str) -> tuple[int, int]:
    """``(major, minor)`` of a torch version string such as ``2.13.0+cpu`` or ``2.16.0.dev20261101``."""
    m = re.match(r"(\d+)\.(\d+)", version)
    if m is None:
        raise ValueError(f"torch version {version!r} is not of the form MAJOR.MINOR[...]")
    return int(m.group(1)), int(m.group(2))


def _range() -> str:
    (a, b), (c, d) = SUPPORTED
    return f">= {a}.{b}, < {c}.{d}"


def torch_version() -> str:
    """The version string of the torch this Python imports, read without importing it when it is
    not imported yet (``import torch`` takes seconds; ``meshfold layout`` does not need it)."""
    if "torch" in sys.modules:
        return sys.modules["torch"].__version__
    spec = importlib.util.find_spec("torch")
    if spec is None or spec.origin is None:
        raise ImportError(f"meshfold needs torch {_range()}, and this Python has no torch")
    version_py = Path(spec.origin).with_name("version.py")
    m = re.search(r"""^__version__\s*=\s*['"]([^'"]+)['"]""", version_py.read_text(), re.M) \
        if version_py.is_file() else None
    if m is None:
        import torch

        return torch.__version__
    return m.group(1)


def check_torch_version(version: str | None = None) -> str:
    """Raise ImportError naming ``version`` (default: this Python's torch) and the supported range
    unless meshfold supports it; return it."""
    version = torch_version() if version is None else version
    low, high = SUPPORTED
    if not low <= parse_version(version) < high:
        raise ImportError(f"meshfold needs torch {_range()}, but this Python has torch {version} "
                          f"(pip install 'torch>={low[0]}.{low[1]},<{high[0]}.{high[1]}')")
    return version


def resolve(name: str):
    """The object a dotted torch name refers to (``torch.distributed.fsdp.fully_shard``), importing
    the longest module prefix; AttributeError naming it if this torch lacks it or :func:`hiding`
    hides it, ModuleNotFoundError naming the package if its torch module imports one that is not
    installed (``torch.utils.tensorboard`` needs ``tensorboard``)."""
    if name in _hidden:
        raise AttributeError(f"{name} is hidden (meshfold.runtime.compat.hiding)")
    parts = name.split(".")
    for k in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:k]))
        except ModuleNotFoundError as err:
            if err.name and err.name.split(".")[0] != "torch":  # torch has the module, not its dependency
                raise ModuleNotFoundError(f"{name} needs the package {err.name!r}, which is not installed",
                                          name=err.name) from None
            continue
        except ImportError:
            continue
        for i, attr in enumerate(parts[k:], k):
            try:
                obj = getattr(obj, attr)
            except AttributeError:
                raise AttributeError(f"torch {torch_version()} has no {name} ({'.'.join(parts[:i])} has no "
                                     f"{attr!r})") from None
        return obj
    raise AttributeError(f"torch {torch_version()} has no {name}")


def has(name: str) -> bool:
    """Whether this torch has the versioned symbol ``name`` (and it is not hidden)."""
    if name not in VERSIONED:
        raise KeyError(f"{name} is not a versioned torch symbol; valid: {sorted(VERSIONED)}")
    try:
        resolve(name)
    except AttributeError:
        return False
    return True


def needs(name: str) -> str:
    """A skip reason for a test that needs ``name``: ``needs torch >= 2.13 (...DataParallelMeshDims)``."""
    major, minor = VERSIONED[name].since
    return f"needs torch >= {major}.{minor} ({name}); this is torch {torch_version()}"


@contextlib.contextmanager
def hiding(*names: str):
    """Take the fallbacks of the versioned symbols ``names`` (default: all) inside the block, as
    on a torch without them."""
    names = names or tuple(VERSIONED)
    unknown = [n for n in names if n not in VERSIONED]
    if unknown:
        raise KeyError(f"{unknown} are not versioned torch symbols; valid: {sorted(VERSIONED)}")
    saved = set(_hidden)
    _hidden.update(names)
    try:
        yield
    finally:
        _hidden.clear()
        _hidden.update(saved)


# ---- collectives ---------------------------------------------------------------------------------
def all_gather_single(out, x, group=None) -> None:
    """``out`` = the concatenation along dim 0 of every rank's ``x`` (all the same shape)."""
    import torch.distributed as dist

    if has("torch.distributed.all_gather_single"):
        dist.all_gather_single(out, x, group=group)
    else:
        dist.all_gather_into_tensor(out, x, group=group)


def reduce_scatter_single(out, x, group=None) -> None:
    """``out`` = this rank's block (dim 0) of the sum over ranks of ``x``."""
    import torch.distributed as dist

    if has("torch.distributed.reduce_scatter_single"):
        dist.reduce_scatter_single(out, x, group=group)
    else:
        dist.reduce_scatter_tensor(out, x, group=group)


# ---- DTensor placements ----------------------------------------------------------------------------
def strided_shard_indices(placement, size: int, num_chunks: int, index: int) -> list[int]:
    """Which of ``size`` positions along its dim the ``index``-th of ``num_chunks`` shards of a
    ``_StridedShard`` placement holds, in order."""
    if has("torch.distributed.tensor.placement_types._StridedShardOffsetMode"):
        from torch.distributed.tensor.placement_types import _StridedShardOffsetMode

        n, offsets = placement._local_shard_size_and_offset(size, num_chunks, index,
                                                            offset_mode=_StridedShardOffsetMode.ALL)
        return list(offsets[:n]) if n else []
    import torch

    positions = torch.arange(size).view([1] * placement.dim + [size])  # split along the placement's dim
    shards, _ = placement._split_tensor(positions, num_chunks, with_padding=False, contiguous=True)
    return shards[index].flatten().tolist()


# ---- pipelining on a fake process group -------------------------------------------------------------
class _VotingDist:
    """``torch.distributed`` as ``torch.distributed.pipelining.schedules`` sees it inside
    :func:`pipeline_votes_on_fake_groups`: the fake backend does not call itself ``fake``."""

    def __getattr__(self, name):
        import torch.distributed as dist

        return getattr(dist, name)

    @staticmethod
    def get_backend(group=None):
        import torch.distributed as dist

        backend = dist.get_backend(group)
        return "fake (voting)" if backend == "fake" else backend


@contextlib.contextmanager
def pipeline_votes_on_fake_groups():
    """Pipeline schedules on a fake process group run the first step's warm-up vote, as on a real one.

    From torch 2.14 a schedule whose stages sit on a fake group settles their shape-inference mode
    locally (static when every stage was given its shapes) and skips the vote a real group runs at
    its first step: each stage sends the product of the votes so far to the next (4 bytes) and the
    result travels back (4 bytes). torch 2.13 votes on both, and torch 2.11 has no vote. Inside this
    block a fake group votes too, so a dry run issues the point-to-point messages the real first
    step does on every release; its host read of the result is answered like any other (static)."""
    from unittest import mock

    from torch.distributed.pipelining import schedules

    with mock.patch.object(schedules, "dist", _VotingDist()):
        yield


# ---- FSDP2 over some dims of a mesh ------------------------------------------------------------------
def fully_shard_over(module, mesh, data_dims: tuple[str, ...], **kwargs) -> None:
    """``fully_shard(module, **kwargs)`` sharding ``module``'s parameters over the ``data_dims`` of
    ``mesh``, on which they are DTensors replicated over ``data_dims`` (FSDP2's SPMD mode).

    Without ``dp_mesh_dims`` the data dims are flattened into one submesh that FSDP2 shards over,
    and each parameter becomes a DTensor on the submesh of ``mesh``'s other dims with the same
    placements there: FSDP2's mode for FSDP + TP / EP before 2.13. Gradients are the same sums:
    FSDP2 first redistributes a gradient to the parameter's placements on the other dims (a
    ``Partial`` one, e.g. a norm's over tp, is all-reduced), then reduce-scatters over the data dims.
    """
    from torch.distributed.fsdp import fully_shard

    data_dims = tuple(data_dims)
    if has("torch.distributed.fsdp.DataParallelMeshDims"):
        from torch.distributed.fsdp import DataParallelMeshDims

        dims = DataParallelMeshDims(shard=data_dims if len(data_dims) > 1 else data_dims[0])
        fully_shard(module, mesh=mesh, dp_mesh_dims=dims, **kwargs)
        return
    names = tuple(mesh.mesh_dim_names)
    missing = [d for d in data_dims if d not in names]
    if missing or not data_dims:
        raise ValueError(f"data dims {data_dims} are not dims of the mesh {names}")
    model_dims = tuple(d for d in names if d not in data_dims)
    if not model_dims:
        raise ValueError(f"mesh {names} has no dims besides the data dims {data_dims}")
    key = (id(mesh), data_dims)
    if key not in _submeshes:  # flattening creates process groups: once per mesh
        dp_mesh = mesh[data_dims]._flatten("_".join(data_dims)) if len(data_dims) > 1 else mesh[data_dims[0]]
        _submeshes[key] = (mesh, dp_mesh, mesh[model_dims])
    _, dp_mesh, model_mesh = _submeshes[key]
    _move_params_to_submesh(module, mesh, model_mesh, [names.index(d) for d in model_dims])
    fully_shard(module, mesh=dp_mesh, **kwargs)


_submeshes: dict = {}  # (id(mesh), data dims) -> (mesh, data submesh, model submesh)


def _move_params_to_submesh(module, mesh, model_mesh, keep: list[int]) -> None:
    """Every parameter FSDP2 would manage in ``module`` (none of an FSDP2 submodule's) that is a
    DTensor on ``mesh`` becomes a DTensor on ``model_mesh`` with its placements on the ``keep`` dims;
    a placement other than Replicate on a dropped dim is an error."""
    import torch
    from torch import nn
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor, Replicate

    managed, stack = [], [module]
    while stack:
        m = stack.pop()
        managed.append(m)
        stack.extend(c for c in m.children() if not isinstance(c, FSDPModule))
    moved: dict[int, nn.Parameter] = {}
    for m in managed:
        for name, p in list(m._parameters.items()):
            if id(p) in moved:
                m._parameters[name] = moved[id(p)]
                continue
            if not isinstance(p, DTensor) or p.device_mesh is not mesh:
                continue
            dropped = [q for i, q in enumerate(p.placements) if i not in keep]
            if not all(isinstance(q, Replicate) for q in dropped):
                raise ValueError(f"parameter {name} of {type(m).__name__} has placements {p.placements} on "
                                 f"{mesh.mesh_dim_names}: FSDP2 shards it over the data dims, so it must be "
                                 f"Replicate there")
            with torch.no_grad():
                local = DTensor.from_local(p.to_local(), model_mesh, [p.placements[i] for i in keep],
                                           run_check=False, shape=p.shape, stride=p.stride())
            moved[id(p)] = m._parameters[name] = nn.Parameter(local, requires_grad=p.requires_grad)

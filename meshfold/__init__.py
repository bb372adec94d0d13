"""meshfold: Mixture-of-Experts training with MoE Parallel Folding, DeviceMesh/DTensor-native.

The attention layers of a model see the ranks as a ``(pp, dp, cp, tp)`` mesh and the MoE layers
see the same ranks as ``(pp, edp, ep, etp)``; :class:`FoldSpec` describes such a layout and
:func:`fold` builds both views as named DeviceMeshes.
"""

from meshfold.runtime.compat import check_torch_version

check_torch_version()  # an unsupported torch fails here, naming its version and the supported range

from meshfold.mesh import FoldedMesh, FoldSpec, fold, valid_folds  # noqa: E402

__all__ = ["FoldSpec", "FoldedMesh", "fold", "redistribute", "valid_folds"]


def __getattr__(name):
    # Lazy, so that `meshfold layout` and FoldSpec do not import torch.distributed.tensor.
    if name == "redistribute":
        from meshfold.placements import redistribute

        return redistribute
    raise AttributeError(f"module 'meshfold' has no attribute {name!r}")
__version__ = "0.1.0"

"""A new MoE block variant in a few dozen lines, checked against one device on folded layouts.

The variant is X-MoE's cosine router (Chi et al., "On the Representation Collapse of Sparse
Mixture of Experts", NeurIPS 2022): tokens are projected to a small routing space, and an
expert's logit is the cosine similarity between that projection and the expert's learnable
embedding, divided by a learnable temperature. Cosine scores keep the router from collapsing onto
the token representation's few dominant directions; everything after the logits (top-k, dispatch,
experts, combine) is meshfold's unchanged MoELayer, which takes the router as a plug:
``MoELayer(cfg, router=CosineRouter(cfg))`` (the router's contract:
``meshfold.models.interfaces.MoERouter``).

Legend: T = tokens on this rank, H = hidden, D = routing dim, E = experts, k = top-k.

The router is written as single-device code. Its parameters get a layout beside it, as data
(``XMOE_LAYOUT``: ``meshfold.parallel.layouts.MOE_LAYOUT`` plus the new parameters);
``parallelize_moe(layer, mesh, layout=XMOE_LAYOUT)`` applies it, leaving the library table as it is.
Then hypothesis draws folds of 4 CPU ranks (any attn tp x cp x dp and moe etp x ep x edp) and
each rank checks its outputs, its input gradients and every full parameter gradient against the
single-device block's, twice:

* fp64: equal to 1e-10 (relative to the largest value);
* bf16 compute over fp32 master experts (``compute_dtype=torch.bfloat16``), the router's three
  parameters kept in their fp64 (a router computes in its own precision): within 5e-2 of the
  fp64 single-device block fed the same bf16-rounded tokens, a few bf16 ulps.

::

    python examples/custom_router_block.py [--examples 4]

Prints one line per fold and dtype and exits non-zero on any mismatch.
"""

import argparse
import logging
import math
import sys

import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, Phase, given, settings
from torch import nn
from torch.distributed.tensor import Replicate

from meshfold import fold
from meshfold.runtime.launch import RankError, World
from meshfold.models import MoEConfig, MoELayer
from meshfold.parallel.moe import parallelize_moe
from meshfold.parallel.layouts import MOE_LAYOUT
from meshfold.models.router import topk_routing
from meshfold.testing.strategies import fold_specs

R = Replicate()
# every rank routes its own tokens: the router's parameters are replicated over attn (dp, cp, tp)
# (their gradients come back Partial over those dims and are summed, like router.weight's).
# parallelize_moe looks every layer parameter up in the layout: a copy of the library's, extended
XMOE_LAYOUT = {**MOE_LAYOUT, "router.proj": ("attn", (R, R, R)), "router.log_temp": ("attn", (R, R, R))}


class CosineRouter(nn.Module):
    """X-MoE routing: ``logits_TE = cos(x_TH @ proj_DH.T, weight_ED) / exp(log_temp)``, then
    meshfold's top-k.

    ``weight`` (the expert embeddings, [E, D]) keeps the name of the linear router's weight;
    ``proj`` [D, H] and ``log_temp`` [] are new; all three in ``cfg.router_dtype``.
    ``local(name, param)`` (the layer's comm) gives this rank's view of each parameter, named
    within the layer.
    """

    def __init__(self, cfg: MoEConfig, dim: int = 8, temperature: float = 0.3):
        super().__init__()
        self.cfg = cfg
        dt = cfg.router_dtype
        self.weight = nn.Parameter(torch.randn(cfg.num_experts, dim, dtype=dt))
        self.proj = nn.Parameter(torch.randn(dim, cfg.hidden, dtype=dt) * cfg.hidden ** -0.5)
        self.log_temp = nn.Parameter(torch.tensor(math.log(temperature), dtype=dt))

    def forward(self, x_TH, local):
        dt = self.cfg.router_dtype
        z_TD = F.normalize(F.linear(x_TH.to(dt), local("router.proj", self.proj)), dim=-1)
        e_ED = F.normalize(local("router.weight", self.weight), dim=-1)
        logits_TE = z_TD @ e_ED.T / local("router.log_temp", self.log_temp).exp()
        probs_TK, experts_TK = topk_routing(logits_TE, self.cfg)
        return probs_TK, experts_TK, logits_TE


def xmoe_layer(cfg: MoEConfig, dtype=None) -> MoELayer:
    """meshfold's MoELayer with the cosine router plugged in (experts in ``dtype``)."""
    return MoELayer(cfg, dtype=dtype, router=CosineRouter(cfg))


# ---------------------------------------------------------------- check against one device
CFG = MoEConfig(hidden=16, ffn=8, num_experts=8, topk=2, router_dtype=torch.float64)
B, S = 4, 8  # divisible by every dp and by every cp x tp of 4 ranks
# (master dtype of the experts, compute dtype, largest |difference| / largest |value| allowed)
DTYPES = {"fp64": (torch.float64, None, 1e-10), "bf16": (torch.float32, torch.bfloat16, 5e-2)}


def check_fold(rank, world_size, spec, seed, dtype_name):
    """Largest |folded - single device| relative to the largest single-device value, for the
    output, the input gradient and the worst parameter gradient."""
    logging.getLogger("torch.distributed.tensor").setLevel(logging.ERROR)  # full_tensor's hints
    master, compute, _ = DTYPES[dtype_name]
    torch.manual_seed(seed)
    ref = xmoe_layer(CFG, dtype=torch.float64)
    block = xmoe_layer(CFG, dtype=master)
    block.load_state_dict(ref.state_dict())
    parallelize_moe(block, fold(spec), layout=XMOE_LAYOUT, compute_dtype=compute)
    g = torch.Generator().manual_seed(seed + 1)
    X, W = (torch.randn(B, S, CFG.hidden, generator=g, dtype=torch.float64) for _ in range(2))
    if compute is not None:  # the block computes on tokens in the compute dtype; the reference on the same values
        X = X.to(compute).double()
    Xr = X.clone().requires_grad_(True)
    Y = ref(Xr)
    (Y * W).sum().backward()
    # this rank's tokens: batch over dp, sequence over cp x tp (any even split works for one layer)
    c, b, s = spec.coords(rank)["attn"], B // spec.dp, S // (spec.cp * spec.tp)
    rows = slice(c["dp"] * b, (c["dp"] + 1) * b)
    cols = slice((c["cp"] * spec.tp + c["tp"]) * s, (c["cp"] * spec.tp + c["tp"] + 1) * s)
    x = X[rows, cols].to(compute or X.dtype).clone().requires_grad_(True)
    y = block(x)
    (y * W[rows, cols]).sum().backward()
    grads = {n: p.grad.full_tensor() for n, p in block.named_parameters()}  # sums Partial grads

    def rel(a, want):
        return ((a.double() - want).abs().max() / want.abs().max()).item()

    return (rel(y, Y[rows, cols]), rel(x.grad, Xr.grad[rows, cols]),
            max(rel(grads[n], p.grad) for n, p in ref.named_parameters()))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--examples", type=int, default=4, help="folds hypothesis draws")
    args = ap.parse_args()
    world, report = World(4, timeout=60.0), []

    @settings(max_examples=args.examples, deadline=None, database=None, derandomize=True,
              phases=[Phase.generate], suppress_health_check=list(HealthCheck))
    @given(fold_specs(world_sizes=[4], pp=[1]))
    def check(spec):
        seed = len(report)
        for name, (_, _, tol) in DTYPES.items():
            diffs = [max(col) for col in zip(*world.run(check_fold, spec, seed, name))]
            report.append((spec, name, diffs))
            assert max(diffs) < tol, f"{spec} {name}: max relative differences {diffs} (limit {tol})"

    try:
        check()
        ok = True
    except (AssertionError, RankError) as err:
        ok = False
        print(f"MISMATCH: {err}")
    finally:
        world.close()
    print(f"X-MoE cosine router, E={CFG.num_experts} k={CFG.topk}, folded on 4 ranks vs one device "
          f"(max |difference| / max |value|):")
    for spec, name, (dy, dx, dw) in report:
        print(f"  {name}  attn tp{spec.tp} cp{spec.cp} dp{spec.dp} | moe etp{spec.etp} ep{spec.ep} edp{spec.edp}"
              f"   dy {dy:.1e}  dx {dx:.1e}  dgrad {dw:.1e}")
    folds = len({spec for spec, _, _ in report})
    print(f"{'all folds match one device' if ok else 'FAILED'} ({folds} folds, fp64 and bf16 compute)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

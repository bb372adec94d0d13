"""A new MoE block variant in a few dozen lines, checked against one device on folded layouts.

The variant is X-MoE's cosine router (Chi et al., "On the Representation Collapse of Sparse
Mixture of Experts", NeurIPS 2022): tokens are projected to a small routing space, and an
expert's logit is the cosine similarity between that projection and the expert's learnable
embedding, divided by a learnable temperature. Cosine scores keep the router from collapsing onto
the token representation's few dominant directions; everything after the logits (top-k, dispatch,
experts, combine) is meshfold's unchanged MoELayer.

Legend: T = tokens on this rank, H = hidden, D = routing dim, E = experts, k = top-k.

The block is written as single-device code. Its new parameters get a layout beside it, as data
(``XMOE_LAYOUT``: ``meshfold.parallel.layouts.MOE_LAYOUT`` plus the new parameters);
``parallelize_moe(layer, mesh, layout=XMOE_LAYOUT)`` applies it, leaving the library table as it is.
Then hypothesis draws folds of 4 CPU ranks (any attn tp x cp x dp and moe etp x ep x edp) and
each rank checks, in fp64, that its outputs, its input gradients and every full parameter
gradient equal the single-device block's::

    python examples/custom_router_block.py [--examples 4]

Prints one line per fold and exits non-zero on any mismatch.
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
from meshfold.models import MoEConfig, MoELayer, Router
from meshfold.parallel.moe import parallelize_moe
from meshfold.parallel.layouts import MOE_LAYOUT
from meshfold.models.router import topk_routing
from meshfold.testing.strategies import fold_specs

R = Replicate()
# every rank routes its own tokens: the router's parameters are replicated over attn (dp, cp, tp)
# (their gradients come back Partial over those dims and are summed, like router.weight's).
# parallelize_moe looks every layer parameter up in the layout: a copy of the library's, extended
XMOE_LAYOUT = {**MOE_LAYOUT, "router.proj": ("attn", (R, R, R)), "router.log_temp": ("attn", (R, R, R))}


class CosineRouter(Router):
    """X-MoE routing: ``logits_TE = cos(x_TH @ proj_DH.T, weight_ED) / exp(log_temp)``.

    ``weight`` (the expert embeddings, [E, D]) keeps the name of the linear router's weight;
    ``proj`` [D, H] and ``log_temp`` [] are new. ``local(name, param)`` (the layer's comm) gives
    this rank's view of each parameter; on one device it is None.
    """

    def __init__(self, cfg: MoEConfig, dim: int = 8, temperature: float = 0.3):
        super().__init__(cfg)
        dt = cfg.router_dtype
        self.weight = nn.Parameter(torch.randn(cfg.num_experts, dim, dtype=dt))
        self.proj = nn.Parameter(torch.randn(dim, cfg.hidden, dtype=dt) * cfg.hidden ** -0.5)
        self.log_temp = nn.Parameter(torch.tensor(math.log(temperature), dtype=dt))

    def forward(self, x_TH, local=None):
        local = local or (lambda name, p: p)
        dt = self.cfg.router_dtype
        z_TD = F.normalize(F.linear(x_TH.to(dt), local("router.proj", self.proj)), dim=-1)
        e_ED = F.normalize(local("router.weight", self.weight), dim=-1)
        logits_TE = z_TD @ e_ED.T / local("router.log_temp", self.log_temp).exp()
        probs_TK, experts_TK = topk_routing(logits_TE, self.cfg)
        return probs_TK, experts_TK, logits_TE


class XMoELayer(MoELayer):
    """MoELayer with the cosine router; ``mesh`` lays it out with ``XMOE_LAYOUT``."""

    def __init__(self, cfg: MoEConfig, mesh=None, dtype=None):
        super().__init__(cfg, dtype=dtype)
        self.router = CosineRouter(cfg)
        if mesh is not None:
            parallelize_moe(self, mesh, layout=XMOE_LAYOUT)


# ---------------------------------------------------------------- check against one device
CFG = MoEConfig(hidden=16, ffn=8, num_experts=8, topk=2, router_dtype=torch.float64)
B, S = 4, 8  # divisible by every dp and by every cp x tp of 4 ranks


def check_fold(rank, world_size, spec, seed):
    """Max |difference| folded vs. single device: (output, input grad, worst parameter grad)."""
    logging.getLogger("torch.distributed.tensor").setLevel(logging.ERROR)  # full_tensor's hints
    torch.manual_seed(seed)
    ref = XMoELayer(CFG, dtype=torch.float64)
    block = XMoELayer(CFG, dtype=torch.float64)
    block.load_state_dict(ref.state_dict())
    parallelize_moe(block, fold(spec), layout=XMOE_LAYOUT)
    g = torch.Generator().manual_seed(seed + 1)
    X, W = (torch.randn(B, S, CFG.hidden, generator=g, dtype=torch.float64) for _ in range(2))
    Xr = X.clone().requires_grad_(True)
    Y = ref(Xr)
    (Y * W).sum().backward()
    # this rank's tokens: batch over dp, sequence over cp x tp (any even split works for one layer)
    c, b, s = spec.coords(rank)["attn"], B // spec.dp, S // (spec.cp * spec.tp)
    rows = slice(c["dp"] * b, (c["dp"] + 1) * b)
    cols = slice((c["cp"] * spec.tp + c["tp"]) * s, (c["cp"] * spec.tp + c["tp"] + 1) * s)
    x = X[rows, cols].clone().requires_grad_(True)
    y = block(x)
    (y * W[rows, cols]).sum().backward()
    grads = {n: p.grad.full_tensor() for n, p in block.named_parameters()}  # sums Partial grads
    return ((y - Y[rows, cols]).abs().max().item(), (x.grad - Xr.grad[rows, cols]).abs().max().item(),
            max((grads[n] - p.grad).abs().max().item() for n, p in ref.named_parameters()))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--examples", type=int, default=4, help="folds hypothesis draws")
    args = ap.parse_args()
    world, report = World(4, timeout=60.0), []

    @settings(max_examples=args.examples, deadline=None, database=None, derandomize=True,
              phases=[Phase.generate], suppress_health_check=list(HealthCheck))
    @given(fold_specs(world_sizes=[4], pp=[1]))
    def check(spec):
        diffs = [max(col) for col in zip(*world.run(check_fold, spec, len(report)))]
        report.append((spec, diffs))
        assert max(diffs) < 1e-10, f"{spec}: max differences {diffs}"

    try:
        check()
        ok = True
    except (AssertionError, RankError) as err:
        ok = False
        print(f"MISMATCH: {err}")
    finally:
        world.close()
    print(f"X-MoE cosine router, E={CFG.num_experts} k={CFG.topk}, fp64, folded on 4 ranks vs one device:")
    for spec, (dy, dx, dw) in report:
        print(f"  attn tp{spec.tp} cp{spec.cp} dp{spec.dp} | moe etp{spec.etp} ep{spec.ep} edp{spec.edp}"
              f"   max|dy| {dy:.1e}  max|dx| {dx:.1e}  max|dgrad| {dw:.1e}")
    print(f"{'all folds match one device' if ok else 'FAILED'} ({len(report)} folds)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

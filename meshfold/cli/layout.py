"""``meshfold layout``: print both views of a fold, or the error that makes it invalid."""

from __future__ import annotations

import argparse

from meshfold.mesh import FoldSpec


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--world-size", type=int, default=16, help="number of ranks (default 16)")
    for dim, help_text in (("tp", "attention tensor parallel"), ("cp", "context parallel"),
                           ("pp", "pipeline parallel (shared by both views)"),
                           ("etp", "expert tensor parallel"), ("ep", "expert parallel")):
        parser.add_argument(f"--{dim}", type=int, default=1, help=f"{help_text} size (default 1)")
    parser.add_argument("--dp", type=int, default=None, help="data parallel size (derived if omitted)")
    parser.add_argument("--edp", type=int, default=None,
                        help="expert data parallel size (derived if omitted)")
    parser.add_argument("--moe-pp", type=int, default=None,
                        help="pp of the MoE view, if given separately (must equal --pp)")


def main(args: argparse.Namespace) -> int:
    attn = dict(tp=args.tp, cp=args.cp, pp=args.pp)
    moe = dict(etp=args.etp, ep=args.ep, pp=args.pp if args.moe_pp is None else args.moe_pp)
    if args.dp is not None:
        attn["dp"] = args.dp
    if args.edp is not None:
        moe["edp"] = args.edp
    spec = FoldSpec.from_views(args.world_size, attn=attn, moe=moe)
    print(spec.describe())
    return 0

"""``meshfold upcycle``: a dense Hugging Face checkpoint into an MoE one equal to it at
initialization (:mod:`meshfold.interop.upcycle` has the method)."""

from __future__ import annotations

import argparse

from meshfold.interop.upcycle import TARGETS

__all__ = ["configure", "main"]


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("src", metavar="SRC",
                        help="dense Hugging Face checkpoint folder (Llama, Mistral, Qwen2, all-dense DeepSeek-V3)")
    parser.add_argument("out", metavar="OUT", help="new folder for the MoE checkpoint (must not exist)")
    parser.add_argument("--experts", type=int, required=True, metavar="E", help="copies of each dense MLP")
    parser.add_argument("--topk", type=int, required=True, metavar="k", help="copies each token is routed to")
    parser.add_argument("--granularity", type=int, default=1, metavar="G",
                        help="split each copy into G experts of ffn/G, routing to k*G of the E*G (default 1)")
    parser.add_argument("--arch", choices=tuple(TARGETS), default=None,
                        help="MoE architecture written (default: deepseek_v3 for DeepSeek-V3, qwen2_moe for "
                             "Qwen2, else mixtral)")
    parser.add_argument("--ep", type=int, default=None, help="fail unless the E*G experts divide over this ep")
    parser.add_argument("--seed", type=int, default=0, help="seed of the router weights (default 0)")
    parser.add_argument("--first-dense", type=int, default=None, metavar="K",
                        help="deepseek_v3: layers 0..K-1 keep their dense MLP (default 0: every layer MoE)")
    parser.add_argument("--n-group", type=int, default=None, metavar="N",
                        help="deepseek_v3: routing groups, each of whole copies (default 1: no group limit)")
    parser.add_argument("--topk-group", type=int, default=None, metavar="T",
                        help="deepseek_v3: groups each token's experts come from (default: --n-group)")
    parser.add_argument("--shared-slices", type=int, default=None, metavar="S",
                        help="deepseek_v3: the first S of each MLP's G slices become one shared expert, each copy "
                             "keeping G-S routed ones (default 0)")


def main(args: argparse.Namespace) -> int:
    from meshfold.interop.upcycle import upcycle

    hf = upcycle(args.src, args.out, args.experts, args.topk, args.granularity, args.arch, args.ep, args.seed,
                 first_dense=args.first_dense, n_group=args.n_group, topk_group=args.topk_group,
                 shared_slices=args.shared_slices)
    routed = hf.get("n_routed_experts") or args.experts * args.granularity
    print(f"wrote {args.out}: {hf['architectures'][0]} with {hf['num_experts_per_tok']} of {routed} experts "
          f"per token; train from it with meshfold train --set train.init_from={args.out}")
    return 0

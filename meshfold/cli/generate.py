"""``meshfold generate``: sample text from a trained checkpoint, byte by byte."""

from __future__ import annotations

import argparse

__all__ = ["configure_generate", "main_generate"]


def configure_generate(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("checkpoint", nargs="?", default="runs/default",
                        help="run folder or checkpoint folder (default runs/default)")
    parser.add_argument("--prompt", default="def ", help="text to continue")
    parser.add_argument("--tokens", type=int, default=200, help="bytes to generate")
    parser.add_argument("--temperature", type=float, default=0.8)
    parser.add_argument("--top-k", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)


def main_generate(args: argparse.Namespace) -> int:
    import torch

    if args.tokens < 1 or args.temperature <= 0 or args.top_k < 1:
        raise ValueError(f"need --tokens >= 1, --temperature > 0, --top-k >= 1; got {args.tokens}, "
                         f"{args.temperature}, {args.top_k}")
    from meshfold.train.trained import load_trained

    model, state = load_trained(args.checkpoint)
    g = torch.Generator().manual_seed(args.seed)
    ids = list(args.prompt.encode("utf-8")) or [10]
    max_seq = model.cfg.max_seq
    with torch.no_grad():
        for _ in range(args.tokens):
            ctx = torch.tensor([ids[-max_seq:]])
            logits = model(ctx)[0, -1].float() / args.temperature
            top = torch.topk(logits, min(args.top_k, logits.numel()))
            probs = torch.softmax(top.values, -1)
            ids.append(int(top.indices[torch.multinomial(probs, 1, generator=g)]))
    print(bytes(ids).decode("utf-8", errors="replace"))
    return 0

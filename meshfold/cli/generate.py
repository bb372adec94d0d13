"""``meshfold generate``: sample text from a trained checkpoint, in the run's own ids (bytes, or
its tokenizer's tokens), streamed as it is sampled."""

from __future__ import annotations

import argparse
import sys

__all__ = ["configure_generate", "main_generate"]


def configure_generate(parser: argparse.ArgumentParser) -> None:
    from meshfold.train.generate import MAX_TOKENS

    parser.add_argument("checkpoint", nargs="?", default="runs/default",
                        help="run folder or checkpoint folder (default runs/default)")
    parser.add_argument("--prompt", default="def ", help="text to continue")
    parser.add_argument("--tokens", type=int, default=200,
                        help=f"ids to sample: bytes, or tokens of the run's tokenizer (default 200, at most {MAX_TOKENS:,})")
    parser.add_argument("--temperature", type=float, default=0.8)
    parser.add_argument("--top-k", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tokenizer", help="encode and decode with this tokenizer.json (default: the run's "
                                            "own, or bytes for a run that trained on bytes)")


def main_generate(args: argparse.Namespace) -> int:
    from meshfold.train.generate import MAX_TOKENS, run_codec, sample, stream_text
    from meshfold.train.trained import load_trained

    if not 1 <= args.tokens <= MAX_TOKENS or args.temperature <= 0 or args.top_k < 1:
        raise ValueError(f"need 1 <= --tokens <= {MAX_TOKENS:,}, --temperature > 0, --top-k >= 1; got "
                         f"{args.tokens}, {args.temperature}, {args.top_k}")
    model, state = load_trained(args.checkpoint)
    codec = run_codec(args.checkpoint, model.cfg.vocab, args.tokenizer)
    print(f"meshfold generate: step {state['step']} of {args.checkpoint}; {codec.name}", file=sys.stderr, flush=True)
    prompt = codec.encode(args.prompt) or ([] if codec.start is None else [codec.start])
    if not prompt:
        raise ValueError("an empty --prompt needs a tokenizer with an end-of-text token to start from; give a prompt")
    samples = sample(model, prompt, args.tokens, args.temperature, args.top_k, args.seed, codec.vocab)
    for piece in stream_text(codec, prompt, samples):
        sys.stdout.write(piece)
        sys.stdout.flush()
    sys.stdout.write("\n")
    return 0

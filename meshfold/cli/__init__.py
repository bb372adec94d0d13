"""The ``meshfold`` command: ``meshfold layout``, ``meshfold plan``, ... (argparse subcommands).

Each subcommand is one file of this package that exposes ``configure(parser)`` and ``main(args)
-> int``: argparse, then calls into the library (``meshfold.train``, ``meshfold.plan``, ...).
This file only wires them together, importing each lazily so that ``meshfold layout`` does not
pay for importing torch.

Layer: the top one; may import every other (``tests/test_layers.py``).
"""

from __future__ import annotations

import argparse
import importlib
import sys

from meshfold import __version__

# name -> (module, one-line help, function suffix: configure<suffix> / main<suffix>)
SUBCOMMANDS = {
    "train": ("meshfold.cli.train", "train a MoE transformer folded over local ranks (default: a "
              "4-rank CPU run on the Python standard library)", ""),
    "generate": ("meshfold.cli.generate", "sample text from a trained checkpoint", "_generate"),
    "export": ("meshfold.cli.export", "write a checkpoint in Hugging Face format", "_export"),
    "tokenize": ("meshfold.cli.tokenize", "write pre-tokenized shards of text files for meshfold train", ""),
    "upcycle": ("meshfold.cli.upcycle", "turn a dense Hugging Face checkpoint (Llama, Mistral, Qwen2, DeepSeek-V3) "
                "into an MoE one (Mixtral, Qwen2-MoE, DeepSeek-V3) equal to it at initialization", ""),
    "layout": ("meshfold.cli.layout", "print the attention and MoE views of a fold", ""),
    "plan": ("meshfold.cli.plan", "choose a folded layout for a cluster (cost and memory model)", ""),
    "dryrun": ("meshfold.cli.dryrun", "run one training step of an N-rank job on fake tensors: per-rank "
               "memory, collectives and host reads", ""),
}


def build_parser(load: str | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="meshfold", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"meshfold {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module, help_text, suffix) in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        if load == name:
            getattr(importlib.import_module(module), "configure" + suffix)(p)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    chosen = next((a for a in argv if a in SUBCOMMANDS), None)
    parser = build_parser(load=chosen)
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    try:
        module, _, suffix = SUBCOMMANDS[args.command]
        return getattr(importlib.import_module(module), "main" + suffix)(args)
    except ValueError as err:  # invalid settings: one clear line, no traceback
        print(f"meshfold {args.command}: error: {err}", file=sys.stderr)
        return 2
    except OSError as err:  # a file or folder we could not use: name it, no traceback
        where = f": {err.filename}" if err.filename else ""
        print(f"meshfold {args.command}: error: {err.strerror or err}{where}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"\nmeshfold {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())

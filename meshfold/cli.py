"""The ``meshfold`` command: ``meshfold layout``, ``meshfold plan``, ... (argparse subcommands).

Each subcommand lives beside the concept it drives and exposes ``configure(parser)`` and
``main(args) -> int``; this file only wires them together, importing each lazily so that
``meshfold layout`` does not pay for importing torch.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# name -> (module, one-line help)
SUBCOMMANDS = {
    "layout": ("meshfold.layout_cli", "print the attention and MoE views of a fold"),
    "plan": ("meshfold.plan.cli", "choose a folded layout for a cluster (cost and memory model)"),
}


def build_parser(load: str | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="meshfold", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module, help_text) in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        if load == name:
            importlib.import_module(module).configure(p)
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
        return importlib.import_module(SUBCOMMANDS[args.command][0]).main(args)
    except ValueError as err:  # invalid settings: one clear line, no traceback
        print(f"meshfold {args.command}: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

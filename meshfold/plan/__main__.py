"""``python -m meshfold.plan ...``: the same as ``meshfold plan ...``."""

import argparse
import sys

from meshfold.cli.plan import configure, main

if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m meshfold.plan", description=__doc__)
    configure(parser)
    sys.exit(main(parser.parse_args()))

"""``meshfold export``: a checkpoint in Hugging Face format (config.json + model.safetensors)."""

from __future__ import annotations

import argparse
from pathlib import Path

__all__ = ["configure_export", "main_export"]


def configure_export(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("checkpoint", help="run folder or checkpoint folder")
    parser.add_argument("out", help="output folder for config.json + model.safetensors")
    parser.add_argument("--arch", default=None, help="Hugging Face architecture (default: Mixtral, "
                                                      "or Qwen2-MoE when the model has shared experts)")
    parser.add_argument("--force", action="store_true", help="write into a folder that is not empty")
    parser.add_argument("--dtype", choices=("float32", "float64", "bfloat16"), default=None,
                        help="dtype of the written weights, routers excepted (default: the run's compute "
                             "dtype, train.dtype; checkpoints hold the master weights)")


def main_export(args: argparse.Namespace) -> int:
    from meshfold.interop.hf import save_pretrained

    src, dst = Path(args.checkpoint).resolve(), Path(args.out).resolve()
    run = src.parent.parent if src.parent.name == "checkpoints" else src
    if dst in (run, src) or run / "checkpoints" in (dst, *dst.parents):
        raise ValueError(f"export target {args.out} is the run being read or inside its checkpoints; "
                         f"choose a folder of its own")
    if dst.exists() and not dst.is_dir():
        raise ValueError(f"export target {args.out} is a file; give a folder (new or empty) for config.json "
                         f"and model.safetensors")
    if dst.exists() and any(dst.iterdir()) and not args.force:
        raise ValueError(f"export target {args.out} is not empty; choose an empty or new folder, or pass "
                         f"--force to overwrite its config.json and model.safetensors")
    from meshfold.train.trained import load_trained

    model, state = load_trained(args.checkpoint)
    from meshfold.train.build import DTYPES

    dtype = args.dtype or state.get("dtype", "float32")
    save_pretrained(model, args.out, arch=args.arch, dtype=DTYPES[dtype])
    print(f"wrote {args.out}/config.json and model.safetensors (Hugging Face format, {dtype})")
    return 0

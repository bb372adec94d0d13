"""``meshfold train``, ``meshfold generate`` and ``meshfold export``."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

__all__ = ["configure", "main", "configure_generate", "main_generate", "configure_export", "main_export"]


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", help="TOML settings file (sections model, moe, fold, train, data)")
    parser.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                        help="override one setting, e.g. --set fold.ep=2 (repeatable)")
    parser.add_argument("--steps", type=int, help="shorthand for --set train.steps=N")
    parser.add_argument("--out-dir", help="shorthand for --set train.out_dir=DIR")
    parser.add_argument("--data", nargs="+", help="text files or folders to train on "
                                                   "(default: the Python standard library)")


def _config(args):
    from meshfold.train.config import load_config

    overrides = list(args.set)
    if args.steps is not None:
        overrides.append(f"train.steps={args.steps}")
    if args.out_dir:
        overrides.append(f"train.out_dir={json.dumps(args.out_dir)}")
    cfg = load_config(args.config, overrides)
    if args.data:
        cfg.data.paths = list(args.data)
    return cfg


def main(args: argparse.Namespace) -> int:
    cfg = _config(args)
    spec, mcfg = cfg.validate()  # every setting checked before any process starts
    from meshfold.data import corpus_description
    from meshfold.launch import RankError, spawn
    from meshfold.train.loop import train_rank
    from meshfold.train.plots import write_plots

    out = Path(cfg.train.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    rank = int(os.environ.get("RANK", "0"))
    if rank == 0:
        n_params = _count_params(mcfg)
        print(f"meshfold train: {cfg.model.get('name', 'model')} ({n_params / 1e6:.2f}M parameters, "
              f"{len(mcfg.moe_layer_ids)} MoE layers) on {spec.world_size} ranks", flush=True)
        print(f"  attn  pp{spec.pp} x dp{spec.dp} x cp{spec.cp} x tp{spec.tp}   "
              f"moe  pp{spec.pp} x edp{spec.edp} x ep{spec.ep} x etp{spec.etp}", flush=True)
        print(f"  data: {corpus_description(cfg.data.paths)}; {cfg.train.steps} steps of "
              f"{cfg.train.batch} x {cfg.train.seq} tokens; output in {out}/", flush=True)
    try:  # train.timeout bounds each collective; the run itself may take as long as it needs
        results = spawn(train_rank, spec.world_size, cfg, timeout=cfg.train.timeout)
    except RankError as err:
        print(f"meshfold train: rank {err.rank} failed:\n{err.remote_traceback}", file=sys.stderr)
        return 1
    except TimeoutError as err:
        print(f"meshfold train: {err}", file=sys.stderr)
        return 1
    if rank == 0:
        plots = write_plots(out)
        r = results[0]
        print(f"done: final loss {r['final_loss']:.4f}; metrics {out / 'metrics.jsonl'}; "
              f"checkpoint {r['checkpoint']}" if r["final_loss"] is not None else
              f"done: nothing to train (already at step {cfg.train.steps}); checkpoint {r['checkpoint']}")
        print(f"plots: {', '.join(map(str, plots))}" if isinstance(plots, list) else f"note: {plots}")
    return 0


def _count_params(mcfg) -> int:
    import torch

    from meshfold.models.transformer import MoETransformer

    with torch.device("meta"):
        model = MoETransformer(mcfg)
    return sum(p.numel() for p in model.parameters())


# ---- loading a trained model on one process -----------------------------------------------------
def load_trained(run_or_checkpoint: str):
    """(model, trainer state) from a run folder (its newest checkpoint) or a checkpoint folder."""
    from meshfold.models.transformer import MoETransformer
    from meshfold.train import checkpoint
    from meshfold.train.config import TrainConfig

    path = Path(run_or_checkpoint)
    if (path / "checkpoints").is_dir():
        found = checkpoint.latest(path / "checkpoints")
        if found is None:
            raise ValueError(f"{path}/checkpoints has no complete checkpoint")
        path = found
    try:
        state = json.loads((path / "trainer.json").read_text())
    except FileNotFoundError:
        raise ValueError(f"{path} is neither a run folder nor a checkpoint (no trainer.json)") from None
    cfg = TrainConfig(model=state["model"], moe=state.get("moe", {}), sparsity=state.get("sparsity", {}))
    model = MoETransformer(cfg.model_config())
    checkpoint.load(path, model, None, restore_rng=False)
    return model.eval(), state


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


def configure_export(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("checkpoint", help="run folder or checkpoint folder")
    parser.add_argument("out", help="output folder for config.json + model.safetensors")
    parser.add_argument("--arch", default=None, help="Hugging Face architecture (default: Mixtral, "
                                                      "or Qwen2-MoE when the model has shared experts)")


def main_export(args: argparse.Namespace) -> int:
    from meshfold.models.hf import save_pretrained

    model, _ = load_trained(args.checkpoint)
    save_pretrained(model, args.out, arch=args.arch)
    print(f"wrote {args.out}/config.json and model.safetensors (Hugging Face format)")
    return 0

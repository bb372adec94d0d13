"""Load a Hugging Face MoE checkpoint straight onto a folded layout of 4 CPU ranks and run it.

1. transformers builds a tiny random Mixtral (nothing is downloaded) and ``save_pretrained``
   writes it to a temporary directory: ``config.json`` + ``model.safetensors``, the same files a
   Hub checkpoint has.
2. On 4 gloo ranks, ``meshfold.interop.hf.from_pretrained(path, mesh=folded)`` returns the model
   already laid out (attention ``tp x cp x dp``, experts ``etp x ep x edp``); each rank reads only
   the slices of the checkpoint tensors it holds.
3. Every rank runs the forward on its shard of one batch (``shard_batch``: batch over dp,
   sequence over cp x tp). The forward returns the logits as a DTensor on the attention mesh;
   ``.full_tensor()`` is the whole batch's logits, compared with transformers' own model on one
   process.

    python examples/hf_checkpoint_folded.py [--tp 2] [--cp 1] [--ep 4]

Shapes: B = sequences, S = sequence length, V = vocab.
"""

import argparse
import sys
import tempfile

import torch
from transformers import MixtralConfig, MixtralForCausalLM
from transformers.utils import logging as hf_logging

from meshfold import FoldSpec, fold
from meshfold.runtime.launch import spawn
from meshfold.interop.hf import from_pretrained
from meshfold.parallel.batch import shard_batch

WORLD, B, S = 4, 4, 32


def folded_logits(rank, world_size, path, spec, tokens_BS):
    """The global logits [B, S, V] and the fraction of the model's weights this rank holds."""
    model = from_pretrained(path, mesh=fold(spec)).eval()
    params = list(model.parameters())
    held = sum(p.to_local().numel() for p in params)
    local_tokens, positions = shard_batch(tokens_BS, spec, rank)
    with torch.no_grad():
        logits = model(local_tokens, positions)  # a DTensor on the attention mesh
    # numpy, not tensors: torch pickles a tensor as a shared-memory handle, gone when the rank exits
    return logits.full_tensor().numpy(), held / sum(p.numel() for p in params)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--cp", type=int, default=1)
    ap.add_argument("--ep", type=int, default=4)
    ap.add_argument("--etp", type=int, default=1)
    args = ap.parse_args()
    spec = FoldSpec(WORLD, tp=args.tp, cp=args.cp, ep=args.ep, etp=args.etp)

    torch.manual_seed(0)  # initializer_range = hidden^-1/2: unit-scale weights, logits of order 1
    cfg = MixtralConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, num_local_experts=8,
                        num_experts_per_tok=2, max_position_embeddings=512, initializer_range=0.125,
                        tie_word_embeddings=False, attn_implementation="eager")
    hf = MixtralForCausalLM(cfg).eval()
    tokens_BS = torch.randint(0, cfg.vocab_size, (B, S), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected_BSV = hf(tokens_BS).logits

    hf_logging.disable_progress_bar()
    with tempfile.TemporaryDirectory() as path:
        hf.save_pretrained(path)
        shards = spawn(folded_logits, WORLD, path, spec, tokens_BS)

    diff = max((torch.from_numpy(logits) - expected_BSV).abs().max().item() for logits, _ in shards)
    ok = diff < 1e-4
    print(f"Mixtral (transformers, {sum(p.numel() for p in hf.parameters()):,} parameters) on {WORLD} ranks: "
          f"attn tp{spec.tp} cp{spec.cp} dp{spec.dp} | moe etp{spec.etp} ep{spec.ep} edp{spec.edp}")
    print("weights held per rank: " + ", ".join(f"{100 * s[1]:.0f}%" for s in shards))
    print(f"logits [{B}, {S}, {cfg.vocab_size}] vs transformers on one process: max |diff| {diff:.2e} "
          f"({'match' if ok else 'MISMATCH'}, fp32 tolerance 1e-4)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

"""Multi-token prediction on folds: loss and every gradient equal one device (fp64).

Each rank gets its slice of the side-by-side targets (:func:`meshfold.models.mtp.mtp_targets` of
the global batch, sharded like the tokens), so no depth needs a token from another rank. The MTP
blocks run under the same tp (sequence parallel), cp (ring attention) and ep x etp layouts as the
main layers; the shared embedding and head are called once per depth.
"""

import pytest
import torch

from meshfold.mesh import FoldSpec
from meshfold.models import MoEConfig
from meshfold.models.mla import MLAConfig
from meshfold.models.mtp import mtp_targets
from meshfold.models.transformer import MoETransformer, TransformerConfig
from meshfold.testing import assert_matches_one_device

pytestmark = pytest.mark.multirank

V, H, S = 32, 16, 16


def _config(mla: bool) -> TransformerConfig:
    # layer ids 0..3: MoE, dense, then MTP depth 1 (MoE) and depth 2 (dense), so both kinds of MTP block run
    moe = MoEConfig(hidden=H, ffn=4, num_experts=4, topk=2, router_dtype=torch.float64,
                    seq_aux_loss_coeff=0.01)  # per sequence: the same on every dp split
    extra = dict(mla=MLAConfig(q_lora_rank=8, kv_lora_rank=8, qk_nope_head_dim=4, qk_rope_head_dim=4,
                               v_head_dim=4)) if mla else dict(kv_heads=2)
    return TransformerConfig(vocab=V, hidden=H, layers=2, heads=4, ffn=8, moe=moe, moe_every=2,
                             mtp_depth=2, mtp_loss_weight=0.3, **extra)


g = torch.Generator().manual_seed(3)
CHUNK = torch.randint(0, V, (4, S + 1), generator=g)
BATCH = (CHUNK[:, :-1], mtp_targets(CHUNK[:, 1:], 2))


def _check(rank, world_size, spec, mla, data_parallel, recompute):
    def build(device):
        return MoETransformer(_config(mla), dtype=torch.float64, device=device, seed=4)

    return assert_matches_one_device(build, None, spec, BATCH, data_parallel=data_parallel, recompute=recompute,
                                     on_meta=True)


@pytest.mark.parametrize("spec, mla, data_parallel, recompute", [
    (FoldSpec(4, tp=2, cp=2, ep=2, etp=2), False, "fsdp", "none"),   # tp2 x cp2 | ep2 x etp2
    (FoldSpec(4, dp=2, tp=2, ep=2), True, "allreduce", "none"),      # dp2 x tp2 | edp2 x ep2, MLA
    (FoldSpec(4, dp=2, cp=2, ep=4), False, "fsdp", "full"),          # dp2 x cp2 | ep4, recomputed blocks
], ids=["gqa-tp2cp2-ep2etp2", "mla-dp2tp2-edp2ep2", "gqa-dp2cp2-ep4-recompute"])
def test_mtp_loss_and_gradients_equal_one_device_on_folds(worlds, spec, mla, data_parallel, recompute):
    for diff in worlds(4).run(_check, spec, mla, data_parallel, recompute):
        assert diff["loss"] < 1e-10 and diff["grad"] < 1e-9


@pytest.mark.parametrize("spec, mla", [
    (FoldSpec(4, pp=2, tp=2, ep=2), False),   # pp2 x tp2 | pp2 x ep2
    (FoldSpec(4, pp=2, dp=2, ep=2), True),    # pp2 x dp2 | pp2 x ep2, MLA
], ids=["gqa-pp2tp2-ep2", "mla-pp2dp2-ep2"])
def test_mtp_on_pipeline_stages_equals_one_device(worlds, spec, mla):
    """The depths on the last stage, the embeddings of the tokens they read made on the first and
    handed down the pipeline with the hidden state (their gradients come back the same way)."""
    for diff in worlds(4).run(_check, spec, mla, "fsdp", "none"):
        assert diff["loss"] < 1e-10 and diff["grad"] < 1e-9


def _microbatched(rank, world_size, spec, schedule, virtual, microbatches):
    """Pipeline.step_parts over micro-batches against one device's whole batch, with a third of
    the targets masked (-100) unevenly: each term weighted by its own share of positions."""
    from meshfold.parallel.batch import shard_batch
    from meshfold.parallel.pipeline import Pipeline
    from meshfold.parallel.transformer import single_device_name
    from meshfold.testing.worlds import cached_fold

    cfg = _config(False)
    cfg.layers = 4  # one layer a chunk with two chunks a rank
    tokens = CHUNK[:, :-1]
    nexts = CHUNK[:, 1:].clone()
    nexts[torch.rand(nexts.shape, generator=torch.Generator().manual_seed(5)) < 0.33] = -100
    targets = mtp_targets(nexts, 2)
    ref = MoETransformer(cfg, dtype=torch.float64, seed=4)
    want = ref.loss_parts(tokens, targets)
    want["loss"].backward()
    pipe = Pipeline(MoETransformer(cfg, dtype=torch.float64, device="meta", seed=4), cached_fold(spec),
                    microbatches, schedule, virtual)
    local_tokens, pos = shard_batch(tokens, spec, rank)
    local_targets, _ = shard_batch(targets, spec, rank)
    loss, parts = pipe.step_parts(local_tokens, local_targets, pos)
    pipe.reduce_gradients()
    tol = dict(rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(loss.item(), want["loss"].item(), **tol)
    torch.testing.assert_close(parts["main"].item(), want["main"].item(), **tol)
    torch.testing.assert_close(parts["mtp_depths"], want["mtp_depths"], **tol)
    grads = {n: p.grad for n, p in ref.named_parameters()}
    for name, p in pipe.named_parameters():
        name = single_device_name(name)
        torch.testing.assert_close(p.grad.full_tensor(), grads[name], **tol, msg=lambda m: f"{name}: {m}")
    return True


@pytest.mark.parametrize("schedule, virtual", [("1f1b", 1), ("zbv", 2)])
def test_mtp_through_a_microbatched_schedule_weights_each_term_by_its_own_positions(worlds, schedule, virtual):
    spec = FoldSpec(4, pp=2, dp=2, ep=2)
    assert all(worlds(4).run(_microbatched, spec, schedule, virtual, 2))

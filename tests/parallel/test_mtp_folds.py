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
from meshfold.parallel.transformer_plan import check_fold
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


def test_mtp_with_pipeline_stages_is_refused_naming_both_settings():
    with pytest.raises(ValueError, match=r"model.mtp_depth = 2 with fold.pp = 2"):
        check_fold(_config(False), FoldSpec(4, pp=2, tp=2))

"""A plan that fits a model but would compute other numbers than one device is refused before
the first step, naming the module or parameter and the plan entry; mistakes of a model of one's
own that used to surface as an unrelated error name their cause. The model and plan are
test_layout_plan's (a user's own names and blocks)."""

import dataclasses
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from meshfold.kernels import grouped_mm
from meshfold.mesh import FoldSpec
from meshfold.models import init
from meshfold.models.transformer import cross_entropy_sum
from meshfold.parallel.batch import shard_batch
from meshfold.parallel.pipeline import ModelChunk, Pipeline
from meshfold.parallel.plan import SequenceParallel
from meshfold.parallel.transformer import parallelize
from meshfold.testing.worlds import cached_fold
from tests.parallel.test_layout_plan import PLAN, TinyLM, _batch


def _spec_only(**dims):
    """A fold that has only its spec: what parallelize checks before it touches any mesh."""
    return SimpleNamespace(spec=FoldSpec(4, **dims))


def test_a_context_hook_without_a_context_entry_is_refused_with_cp():
    with pytest.raises(ValueError, match=r"cp = 2: 'blocks.0.mixer' \(Mixer\) has a context hook .* no "
                                         r"Plan.context entry"):
        parallelize(TinyLM(), _spec_only(cp=2, tp=2), dataclasses.replace(PLAN, context={}))


def test_a_weight_sharded_over_tp_outside_sequence_parallel_is_refused():
    with pytest.raises(ValueError, match=r"tp = 2: parameter 'blocks.0.mixer.to_q' is laid out S\(1\) over "
                                         r"tp .* no Plan.tp entry covers 'blocks.0.mixer'"):
        parallelize(TinyLM(), _spec_only(tp=2), dataclasses.replace(PLAN, tp={}))


def test_sequence_parallel_around_an_moe_layer_is_refused():
    plan = dataclasses.replace(PLAN, tp={"blocks.*": SequenceParallel(positions=True)})
    with pytest.raises(ValueError, match=r"Plan.tp\['blocks.0'\] = .* holds the MoE layer 'blocks.0.ffn'"):
        parallelize(TinyLM(), _spec_only(tp=2), plan)


def _tied():
    model = TinyLM()
    model.unembed.weight = model.tok.weight  # the Hugging Face way: one Parameter under two names
    return model


def test_a_tie_is_refused_by_parallelize_and_by_a_pipeline_naming_it_and_the_supported_way():
    with pytest.raises(ValueError, match=r"parameters \['tok.weight', 'unembed.weight'\] of TinyLM are one tensor "
                                         r"\(tied\).*F.linear\(x, self.embed.weight\)"):
        parallelize(_tied(), _spec_only(dp=4), PLAN)
    with pytest.raises(ValueError, match=r"\['tok.weight', 'unembed.weight'\] of TinyLM are one tensor"):
        ModelChunk(_tied(), [0], first=True, last=False, plan=PLAN)


class _TiedLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(8, 4)
        self.lm_head = nn.Linear(4, 8, bias=False)
        self.lm_head.weight = self.embed.weight


def test_init_build_keeps_a_hugging_face_tie():
    model = init.build(_TiedLM, seed=0, device="cpu")
    assert model.lm_head.weight is model.embed.weight
    assert [n for n, _ in model.named_parameters()] == ["embed.weight"]


def test_a_declaration_lost_inside_nn_parameter_names_the_fix():
    class Lost(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(init.normal_(torch.empty(4, 4), std=1.0))

    with pytest.raises(ValueError, match=r"\['w \(Lost\)'\] declare no initialization.*declare the Parameter "
                                         r"itself, init.normal_\(nn.Parameter"):
        init.build(Lost, seed=0)


def test_experts_reading_every_expert_instead_of_their_shard_are_told_to_use_local():
    x, w = torch.randn(3, 4), torch.randn(4, 4, 2)  # w: all 4 experts; offsets: this rank's 1
    with pytest.raises(ValueError, match=r"w holds 4 experts but offsets counts 1.*local\(name, param\)"):
        grouped_mm(x, w, torch.tensor([3], dtype=torch.int32))


def _logits(model, tokens, positions):
    x = model.tok(tokens)
    for block in model.blocks:
        x = block(x, torch.arange(tokens.shape[1]) if positions is None else positions)
    return model.unembed(model.final(x))


class _ZLossLM(TinyLM):
    """Adds a term of its own to the loss, but does not say what it is through loss_terms."""

    loss_terms = None

    def loss(self, tokens, targets, positions=None):
        total, count = cross_entropy_sum(_logits(self, tokens, positions), targets)
        return self.reduce_loss(total, count) + 1e-4 * self.tok.weight.square().sum()


def test_a_pipeline_refuses_a_model_loss_it_cannot_see_and_names_loss_terms():
    with pytest.raises(ValueError, match=r"_ZLossLM defines loss but no loss_terms\(logits, targets\)"):
        Pipeline(_ZLossLM(), _spec_only(pp=2), microbatches=2, plan=PLAN)


class _LocalMeanLM(TinyLM):
    """Forgets reduce_loss: each rank's loss is the mean of its own tokens."""

    def loss(self, tokens, targets, positions=None):
        total, count = cross_entropy_sum(_logits(self, tokens, positions), targets)
        return total / count


def _wrong_loss_calls(rank, world_size, spec):
    """Each mistake raises on every rank (returned, so no rank waits for another)."""
    tokens, targets = _batch(spec)
    local, pos = shard_batch(tokens, spec, rank)
    local_targets, _ = shard_batch(targets, spec, rank)
    errors = []
    for model, positions in ((_LocalMeanLM(), pos), (TinyLM(), None)):
        model = parallelize(model, cached_fold(spec), PLAN, data_parallel="allreduce")
        try:
            model.loss(local, local_targets, positions)
            errors.append(None)
        except ValueError as err:
            errors.append(str(err))
    return errors


@pytest.mark.multirank
def test_a_loss_without_reduce_loss_or_without_positions_on_cp_is_an_error_on_every_rank(worlds):
    for no_reduce, no_positions in worlds(4).run(_wrong_loss_calls, FoldSpec(4, cp=2, dp=2)):
        assert "_LocalMeanLM.loss returned without calling self.reduce_loss" in no_reduce
        assert "TinyLM.loss called without positions on a fold with cp = 2" in no_positions


class _ForwardLM(TinyLM):
    def forward(self, tokens, positions=None):  # numbers its tokens 0..s-1 when given no positions
        return _logits(self, tokens, positions)


def _forward_with_and_without_positions(rank, world_size, spec):
    tokens, _ = _batch(spec)
    local, pos = shard_batch(tokens, spec, rank)
    model = parallelize(_ForwardLM(), cached_fold(spec), PLAN, data_parallel="allreduce")
    logits = model(local, pos)
    try:
        model(local)
    except ValueError as err:
        return tuple(logits.shape), str(err)
    return tuple(logits.shape), None


@pytest.mark.multirank
def test_a_forward_without_positions_on_cp_is_an_error_on_every_rank_not_a_hang(worlds):
    """Every cp rank numbering its own tokens 0..s-1 is refused by every rank alike (the last
    cp rank's 0..s-1 looked like the ring's layout to it alone, so it took the ring while the
    others all-gathered, and all waited until the time-out)."""
    spec = FoldSpec(2, cp=2)
    for shape, error in worlds(2).run(_forward_with_and_without_positions, spec, timeout=20):
        assert shape == (2, 4, 16)  # with positions: its 4 tokens of each of 2 sequences
        assert error is not None and "every cp rank's positions start sequence 0 at position 0" in error
        assert "a forward is called without positions" in error

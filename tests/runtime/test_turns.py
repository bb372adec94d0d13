"""meshfold.runtime.overlap: pieces take turns at their waits, in an order fixed by the code."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from meshfold.runtime.overlap import in_turns, keeping_turn, run_in_turns, wait_for


class _Work:
    """A collective's handle that is done once ``done`` is set."""

    def __init__(self, log, name, done=True):
        self.log, self.name, self.done = log, name, done

    def is_completed(self):
        return self.done

    def wait(self):
        self.log.append(f"{self.name} waited")


def _piece(log, name, waits):
    def run():
        for i in range(waits):
            log.append(f"{name}{i}")
            wait_for(_Work(log, f"{name}{i}"))
        return name
    return run


def test_turns_alternate_at_waits_and_a_finished_piece_passes_the_turn_for_good():
    log = []
    results, stats = run_in_turns(_piece(log, "a", 3), _piece(log, "b", 1))
    assert results == ["a", "b"]
    # a runs to its first wait, b to its only one, a waits (b computed meanwhile) and goes on;
    # b waits after a's next turn, then finishes; a's last wait has nobody to hand over to
    assert log == ["a0", "b0", "a0 waited", "a1", "b0 waited", "a1 waited", "a2", "a2 waited"]
    assert (stats.waited, stats.crossed, stats.arrived) == (4, 3, 3)


def test_outside_turns_a_wait_is_a_plain_wait():
    log = []
    assert not in_turns()
    wait_for(_Work(log, "x"))
    assert log == ["x waited"]


def test_an_all_to_all_not_yet_arrived_is_counted_crossed_but_not_arrived():
    log = []

    def late():
        wait_for(_Work(log, "late", done=False))

    _, stats = run_in_turns(late, _piece(log, "b", 1))
    assert (stats.waited, stats.crossed, stats.arrived) == (2, 2, 1)


def test_an_error_in_one_piece_is_raised_and_stops_the_other_at_its_next_wait():
    """The other piece's next collectives would pair with the peers' pieces in another order:
    it raises at its next wait instead of issuing them."""
    log, seen = [], []

    def broken():
        wait_for(_Work(log, "x"))
        raise ValueError("piece failed")

    def other():
        try:
            _piece(log, "b", 3)()
        except RuntimeError as e:
            seen.append(str(e))
            raise

    with pytest.raises(ValueError, match="piece failed"):
        run_in_turns(broken, other)
    assert "b2" not in log and seen and "the other micro-batch on this rank raised ValueError" in seen[0]


def test_keeping_the_turn_makes_waits_plain():
    log = []

    def keeper():
        with keeping_turn():
            wait_for(_Work(log, "k0"))  # no hand-over: b has not started
        wait_for(_Work(log, "k1"))

    _, stats = run_in_turns(keeper, _piece(log, "b", 1))
    assert log == ["k0 waited", "b0", "k1 waited", "b0 waited"]
    assert (stats.waited, stats.crossed) == (2, 2)  # the kept wait is not counted


def test_pieces_run_in_the_callers_grad_mode_and_dispatch_modes_and_cannot_nest():
    seen = []

    class Ops(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(func)
            return func(*args, **(kwargs or {}))

    def piece():
        x = torch.ones(2, requires_grad=True)
        return torch.is_grad_enabled(), (x * 2).requires_grad

    with torch.no_grad():
        assert run_in_turns(piece, piece)[0] == [(False, False)] * 2
    with Ops():
        run_in_turns(piece, piece)
    assert seen.count(torch.ops.aten.mul.Tensor) == 2
    with pytest.raises(RuntimeError, match="inside run_in_turns"):
        run_in_turns(lambda: run_in_turns(piece, piece), piece)
    with pytest.raises(ValueError, match="two or more"):
        run_in_turns(piece)


def test_a_recomputation_keeps_its_turn_so_the_other_micro_batchs_counts_survive():
    """A recomputation runs with the MoE layers' state as its forward found it, then puts back
    the state it found (meshfold.parallel.recompute). Were its all-to-all waits to pass the turn,
    the other micro-batch's forward would count into the replayed state, and the put-back would
    drop that count (the expert-bias counts of a step)."""
    from meshfold.models import MoEConfig, MoELayer
    from meshfold.parallel.recompute import _replay_state, _state

    layer = MoELayer(MoEConfig(hidden=4, ffn=4, num_experts=2, topk=1, expert_bias=True))
    saved = _state([layer])              # as the block's forward found it: nothing counted yet
    layer._bias_counts = torch.tensor([1, 0])  # what the step counted since

    def recompute():
        with _replay_state([layer], saved):
            wait_for(_Work([], "recompute's all-to-all"))

    def other_forward():                 # the other micro-batch's forward counts its rows
        seen = layer._bias_counts
        layer._bias_counts = torch.tensor([0, 5]) if seen is None else seen + torch.tensor([0, 5])

    run_in_turns(recompute, other_forward)
    assert layer._bias_counts.tolist() == [1, 5]

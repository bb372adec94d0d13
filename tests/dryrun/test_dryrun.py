"""meshfold dryrun: a fake step of one rank reports what the real step of that rank does.

The real side is :func:`meshfold.dryrun.step_report` (pp 1 or 2) on a spawned gloo world (one world per
size, reused), recording the block counts it reads; the dry side runs the same rank on the fake
backend in a fresh process, replaying those counts (:class:`~meshfold.dryrun.Replay`), so both
route the same rows. Properties: parameter, gradient and optimizer bytes equal exactly, the
collective logs are equal record by record (kind, dim, bytes), and the forward/backward peak of
live storage is within 10% (the same tracker on both sides).
"""

from __future__ import annotations

import pytest
from hypothesis import Phase, given, settings
from hypothesis import strategies as st

from meshfold.cli import main as cli_main
from meshfold.dryrun import Balanced, Replay, Zipf, dim_names, dry_run, parse_routing, record_block_counts, step_report
from meshfold.mesh import VIEWS, FoldSpec
from meshfold.testing.strategies import divisors, fold_specs
from meshfold.train.config import TrainConfig

TINY = {"batch": 8, "seq": 16}  # tiny-mixtral: 4 heads, 2 kv heads, 4 experts, ffn 128


def _cfg(fold: dict, dtype: str, recompute: str, microbatches: int, mtp_depth: int = 0) -> TrainConfig:
    cfg = TrainConfig(model={"name": "tiny-mixtral", "mtp_depth": mtp_depth}, fold=fold)
    cfg.train.batch, cfg.train.seq = TINY["batch"], TINY["seq"]
    cfg.train.dtype, cfg.train.recompute = dtype, recompute
    cfg.train.microbatches = microbatches
    return cfg


def _real_step(rank, world_size, fold, dtype, recompute, microbatches, mtp_depth=0):
    from meshfold.testing.worlds import cached_fold

    cfg = _cfg(fold, dtype, recompute, microbatches, mtp_depth)
    spec, _ = cfg.validate()
    calls, on_counts = record_block_counts()
    return step_report(cfg.resolve(), rank, cached_fold(spec), on_counts=on_counts), calls


@st.composite
def tiny_folds(draw, world_size: int) -> dict:
    """Folds of ``world_size`` ranks that tiny-mixtral (2 layers) divides over, pp 1 or 2."""
    pp = draw(st.sampled_from([p for p in (1, 2) if world_size % p == 0]))
    inner = world_size // pp
    tp = draw(st.sampled_from([d for d in (1, 2) if inner % d == 0]))
    cp = draw(st.sampled_from([d for d in (1, 2) if (inner // tp) % d == 0 and 16 % (2 * d * tp) == 0]))
    etp = draw(st.sampled_from([d for d in (1, 2) if inner % d == 0]))
    ep = draw(st.sampled_from([d for d in divisors(4) if (inner // etp) % d == 0]))
    return {"world_size": world_size, "pp": pp, "tp": tp, "cp": cp, "ep": ep, "etp": etp}


def _check_same_step(worlds, data, world_size):
    fold = data.draw(tiny_folds(world_size), label="fold")
    dtype = data.draw(st.sampled_from(["float64", "bfloat16"]), label="dtype")
    spec = TrainConfig(fold=fold).fold_spec()
    recompute = data.draw(st.sampled_from(["none", "full"]), label="recompute")
    microbatches = data.draw(st.sampled_from([m for m in (1, 2) if (TINY["batch"] // spec.dp) % m == 0
                                              and m >= spec.pp]), label="microbatches")
    rank = data.draw(st.integers(0, world_size - 1), label="rank")
    _check_rank(worlds, fold, dtype, recompute, microbatches, rank)


def _check_rank(worlds, fold, dtype, recompute, microbatches, rank, mtp_depth=0):
    spec = TrainConfig(fold=fold).fold_spec()
    real, calls = worlds(fold["world_size"]).run(_real_step, fold, dtype, recompute, microbatches, mtp_depth)[rank]
    (fake,) = dry_run(_cfg(fold, dtype, recompute, microbatches, mtp_depth), Replay(calls), ranks=[rank])
    assert (fake.param_bytes, fake.grad_bytes, fake.optimizer_bytes) == \
        (real.param_bytes, real.grad_bytes, real.optimizer_bytes)
    assert real.param_bytes > 0 and real.optimizer_bytes >= 2 * real.param_bytes  # AdamW: two moments
    assert fake.collectives == real.collectives
    if spec.pp > 1:  # activations and their gradients travel between stages
        assert {r["kind"] for r in real.collectives if r["dim"] == "pp"} >= {"send", "recv"}
    if spec.ep > 1:  # the dispatch all-to-all is there, named after ep
        assert any(r["kind"] == "all_to_all" and r["dim"] == "ep" and r["bytes"] for r in real.collectives)
    assert abs(fake.activation_peak_bytes - real.activation_peak_bytes) <= 0.1 * real.activation_peak_bytes


NO_SHRINK = (Phase.explicit, Phase.reuse, Phase.generate)  # an example costs a process start (~10 s)


@settings(max_examples=2, phases=NO_SHRINK)
@given(data=st.data())
def test_dry_run_reports_the_real_step_on_4_ranks(worlds, data):
    _check_same_step(worlds, data, 4)


@pytest.mark.slow
@settings(max_examples=3, phases=NO_SHRINK)
@given(data=st.data())
def test_dry_run_reports_the_real_step_on_8_ranks(worlds, data):
    _check_same_step(worlds, data, 8)


def test_dry_run_reports_the_real_pipeline_step_of_the_last_stage(worlds):
    """pp = 2 always (the draws above reach it only sometimes): the last stage receives
    activations, sends their gradients back and holds the head."""
    _check_rank(worlds, {"world_size": 4, "pp": 2, "ep": 2}, "float64", "none", 2, 3)


def test_dry_run_reports_the_real_multi_token_prediction_step_on_pipeline_stages(worlds):
    """model.mtp_depth runs the training step's objective in the dry run too (it ran the plain
    loss, whose targets a fold cannot shift, and failed): pp 2, the first stage, which embeds the
    tokens the depth reads and sends them down with the hidden state."""
    _check_rank(worlds, {"world_size": 4, "pp": 2, "ep": 2}, "float64", "none", 2, 0, mtp_depth=1)


@pytest.mark.slow
def test_dry_run_reports_the_real_bf16_step_with_tp_2_cp_2_etp_2(worlds):
    """bf16 with tp 2: at the end of backward, where rank 6 peaks, FSDP2's post-backward
    all-reduces the fp32 gradients that are partial over tp (the embedding's [V, H]); eager, each
    comes back wrapped in an AsyncCollectiveTensor (the draws above do not reach this fold in CI)."""
    _check_rank(worlds, {"world_size": 8, "pp": 1, "tp": 2, "cp": 2, "ep": 4, "etp": 2}, "bfloat16", "full", 1, 6)


# ---- the step's one recording mode against the three modes it merges -----------------------------
def _recorded_work(rank, world_size, rows, answer, merged):
    """A few ops of each kind the recorders see, recorded by StepRecorder (``merged``) or by the
    three modes stacked as they were (the log innermost, the live peak outermost): a backward,
    a view and host reads under the peak, then collectives over the default group (outside it:
    gloo frees its buffers on its own thread, so live bytes around a collective vary by timing)."""
    import contextlib

    import torch
    import torch.distributed as dist

    from meshfold.dryrun import CollectiveLog, HostReads, LivePeak, StepRecorder

    log, reads = CollectiveLog(FoldSpec(world_size, dp=world_size), rank), HostReads(answer=answer)
    with contextlib.ExitStack() as stack:
        recorder = None
        if merged:
            recorder = stack.enter_context(StepRecorder(log, reads))
        else:
            stack.enter_context(log)
            stack.enter_context(reads)
        with recorder.measuring(LivePeak()) if merged else LivePeak() as peak:
            x_RC = torch.randn(rows, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(rank),
                               requires_grad=True)
            y_RR = torch.relu(x_RC @ x_RC.T)
            loss = y_RR[1:].sum()  # a view, then a reduction
            loss.backward()
            read = (bool(y_RR.sum() >= 0), loss.item())
        s_RR = y_RR.detach().clone()
        dist.all_reduce(s_RR)
        gathered = torch.empty(world_size * rows, 3, dtype=torch.float64)
        dist.all_gather_into_tensor(gathered, x_RC.detach())
        dist.all_to_all_single(torch.empty_like(gathered), gathered)
    return log.records, reads.reads, peak.peak, peak.live, read


@settings(max_examples=4)
@given(rows=st.integers(1, 6), answer=st.booleans())
def test_the_step_recorder_records_what_the_three_modes_stacked_record(worlds, rows, answer):
    merged = worlds(4).run(_recorded_work, rows, answer, True)
    stacked = worlds(4).run(_recorded_work, rows, answer, False)
    assert merged == stacked
    records, reads, peak, _, _ = merged[0]
    assert [r["kind"] for r in records] == ["all_reduce", "all_gather", "all_to_all"]
    assert [what for what, _ in reads] == ["_local_scalar_dense"] * 2 and peak > 0  # bool() and .item()


# ---- errors: the same one line as meshfold layout and meshfold train --------------------------
def _error_line(argv, capsys) -> str:
    assert cli_main(argv) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines
    return lines[0].split(": error: ", 1)[1]


def _dryrun(fold: str, capsys, gpus: int = 8) -> str:
    return _error_line(["dryrun", "--model", "tiny-mixtral", "--gpus", str(gpus), "--fold", fold,
                        "--gbs", "8", "--seq", "128"], capsys)


def _train(capsys, **fold) -> str:
    sets = [f"fold.{k}={v}" for k, v in fold.items()]
    return _error_line(["train", *[a for s in sets for a in ("--set", s)]], capsys)


def test_an_invalid_fold_gives_the_errors_of_layout_and_train(capsys):
    mine = _dryrun("1/3/1/1/1", capsys)
    assert mine == _error_line(["layout", "--world-size", "8", "--tp", "3"], capsys)
    assert mine == _train(capsys, world_size=8, tp=3)
    assert "tp" in mine and "8" in mine


def test_a_model_that_does_not_divide_gives_the_error_of_train(capsys):
    mine = _dryrun("1/1/8/1/1", capsys)  # tiny-mixtral has 4 experts
    assert mine == _train(capsys, world_size=8, ep=8)
    assert mine.startswith("num_experts = 4 is not divisible by ep = 8")


@pytest.mark.parametrize("argv, message", [
    (["--gpus", "8", "--fold", "1/2/4/1", "--gbs", "6"], "--gbs 6 is not divisible by dp = 4"),
    (["--gpus", "8", "--fold", "1/2/4/1", "--gbs", "8", "--seq", "33"], "--seq 33 is not divisible by 2"),
    (["--gpus", "0", "--fold", "1/1/1/1"], "--gpus must be an integer >= 1, got 0"),
    (["--gpus", "8", "--fold", "1/1/1/8", "--gbs", "8", "--seq", "128"], "pp of --fold = 8: "),
], ids=["gbs", "seq", "gpus", "pp"])
def test_errors_name_dryruns_own_flags(capsys, argv, message):
    line = _error_line(["dryrun", "--model", "tiny-mixtral", *argv], capsys)
    assert line.startswith(message) and "train." not in line and "fold." not in line, line


def test_a_malformed_fold_names_the_notation(capsys):
    assert "CP/TP/EP/PP" in _dryrun("1/2/x/1", capsys)


# ---- routing models -----------------------------------------------------------------------------
@settings(max_examples=25)
@given(pairs=st.integers(0, 500), experts=st.integers(1, 64), source=st.integers(0, 63))
def test_balanced_counts_sum_to_the_pairs_and_differ_by_at_most_one(pairs, experts, source):
    counts = Balanced().counts(pairs, experts, source)
    assert sum(counts) == pairs and max(counts) - min(counts) <= 1


@settings(max_examples=25)
@given(pairs=st.integers(0, 500), experts=st.integers(1, 64), s=st.floats(0.1, 3.0))
def test_zipf_counts_sum_to_the_pairs_and_fall_with_the_expert(pairs, experts, s):
    counts = Zipf(s).counts(pairs, experts, 0)
    assert sum(counts) == pairs
    assert all(a >= b for a, b in zip(counts, counts[1:]))


@settings(max_examples=25)
@given(pairs=st.integers(0, 500), n_ep=st.sampled_from([1, 2, 4, 8]), n_etp=st.sampled_from([1, 2]),
       per_rank=st.sampled_from([1, 2, 4]))
def test_balanced_blocks_give_experts_rows_within_one_of_each_other(pairs, n_ep, n_etp, per_rank):
    E = n_ep * per_rank
    C = Balanced().block(0, pairs, E, n_ep, n_etp)
    per_expert = [sum(C[q][i][e] for q in range(n_etp) for i in range(n_ep)) for e in range(E)]
    assert max(per_expert) - min(per_expert) <= 1
    assert sum(per_expert) == pairs * n_ep * n_etp


def test_zipf_one_gives_the_first_of_eight_experts_most():
    counts = Zipf(1.0).counts(10000, 8, 0)
    assert counts[0] == max(counts) and 0.35 < counts[0] / 10000 < 0.39  # 1 / H_8 = 0.368


def test_routing_names_parse_and_bad_ones_say_what_is_valid():
    assert parse_routing("balanced") == Balanced() and parse_routing("zipf:1.5") == Zipf(1.5)
    for bad in ("zipf", "zipf:-1", "uniform"):
        with pytest.raises(ValueError, match="balanced"):
            parse_routing(bad)


def test_a_balanced_placement_moves_zipf_rows_off_the_busiest_ep_rank():
    """Under Placed the dispatch counts are per slot: the same rows, permuted, so the balanced
    placement of Zipf loads gives ep rank 0 (the static placement's busiest) fewer rows to receive."""
    from meshfold.dryrun.routing import Placed, expert_rows
    from meshfold.plan.placement import balanced, rank_loads, static

    loads = expert_rows(Zipf(1.5), 1000, 4, 2, 1)
    slots = balanced(loads, 2)
    placed = expert_rows(Placed(Zipf(1.5), slots), 1000, 4, 2, 1)
    assert placed == [loads[e] for e in slots]
    assert max(rank_loads(loads, slots, 2)) < max(rank_loads(loads, static(4, 2), 2)) == rank_loads(loads, static(4, 2), 2)[0]
    cfg = _cfg({"world_size": 4, "tp": 2, "ep": 2}, "float64", "none", 1)
    received = []
    for routing in (Zipf(1.5), Placed(Zipf(1.5), slots)):
        (first,) = dry_run(cfg, routing, ranks=[0])
        received.append(sum(r["bytes"] for r in first.collectives if r["kind"] == "all_to_all" and r["dim"] == "ep"))
    assert received[1] < received[0]


# ---- naming groups by folded dims ---------------------------------------------------------------
@settings(max_examples=25)
@given(spec=fold_specs(max_world_size=64), prefer=st.sampled_from(["attn", "moe"]), data=st.data())
def test_each_dim_names_its_own_group_unless_an_earlier_dim_spans_the_same_ranks(spec, prefer, data):
    rank = data.draw(st.integers(0, spec.world_size - 1))
    names = dim_names(spec, rank, prefer)
    attn, moe = [("attn", d) for d in ("tp", "cp", "dp", "pp")], [("moe", d) for d in ("etp", "ep", "edp")]
    order = attn + moe if prefer == "attn" else moe + attn
    for k, (view, d) in enumerate(order):
        ranks = frozenset(spec.group_of(rank, view, d))
        earlier = {frozenset(spec.group_of(rank, v, e)) for v, e in order[:k]}
        assert names[ranks] == d or ranks in earlier
    big = [d for d in VIEWS[prefer] if getattr(spec, d) > 1]  # two dims > 1: joined, slowest first
    if len(big) == 2 and frozenset(spec.group_of(rank, prefer, big)) not in {
            frozenset(spec.group_of(rank, v, e)) for v, e in order}:
        assert names[frozenset(spec.group_of(rank, prefer, big))] == "+".join(big)


def test_dim_names_of_the_docstring_example():
    spec = FoldSpec(16, tp=2, cp=2, pp=2, ep=8)
    names = dim_names(spec, 5)
    assert names[frozenset({4, 5})] == "tp"
    assert names[frozenset(range(8))] == "ep"  # the stage's 8 ranks: ep, not dp+cp+tp
    assert names[frozenset({5, 13})] == "pp"
    spec = FoldSpec(8, cp=2, ep=2)  # cp and ep span the same pairs of ranks
    assert dim_names(spec, 0, "attn")[frozenset({0, 1})] == "cp"
    assert dim_names(spec, 0, "moe")[frozenset({0, 1})] == "ep"


def test_under_zipf_routing_the_stages_first_rank_receives_most_and_peaks_highest():
    """The representative rank of a stage (its first, ep rank 0) is its worst case under skew."""
    cfg = _cfg({"world_size": 8, "tp": 2, "ep": 4}, "float64", "none", 1)
    first, last_ep = dry_run(cfg, Zipf(1.5), ranks=[0, 3])  # ep ranks 0 and 3 of stage 0
    sent = [sum(r["bytes"] for r in rep.collectives if r["kind"] == "all_to_all" and r["dim"] == "ep")
            for rep in (first, last_ep)]
    assert sent[0] > sent[1]  # the combine sends back the rows its experts received
    assert first.activation_peak_bytes > last_ep.activation_peak_bytes


def test_the_last_pipeline_stage_keeps_no_logits_of_finished_micro_batches():
    """Under 1F1B the last stage runs each micro-batch's backward right after its forward, so two
    more micro-batches of one sequence add less than one micro-batch's logits [1, s, V] to its
    forward/backward peak. torch's schedule kept every micro-batch's logits until the step ended
    (to return them merged); ``Pipeline.step`` asks it not to (``return_outputs=False``)."""
    peaks = []
    for m in (2, 4):
        cfg = TrainConfig(model={"name": "tiny-mixtral"}, fold={"world_size": 4, "pp": 2, "ep": 2})
        cfg.train.batch, cfg.train.seq, cfg.train.microbatches = 2 * m, TINY["seq"], m  # dp 2: mbs 1
        (last,) = dry_run(cfg, ranks=[2])
        peaks.append(last.activation_peak_bytes)
    _, mcfg = cfg.validate()
    logits = TINY["seq"] * mcfg.vocab * 4  # fp32 (train.dtype's default)
    assert peaks[1] - peaks[0] < logits, (peaks, logits)

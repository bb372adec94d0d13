"""The planner's time model reads what the planner counts (benchmarks/RESULTS.md, "Planner: the
time model away from Table 1").

Communication seconds are a function of ``Estimate.collectives`` (the bytes per (kind, mesh dim)
that tests/plan/test_plan_collectives.py checks against gloo's c10d calls), and dense layers
(``ModelShape.is_moe_layer`` False: DeepSeek-V3's first 3) are charged as the dense SwiGLU MLPs
that memory.py and collectives.py count, with no expert GEMMs and no dispatch traffic.
"""

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from meshfold.mesh import FoldSpec
from meshfold.plan import HARDWARE, MODELS, Layout, estimate, hardware
from meshfold.plan import cost, traffic
from meshfold.plan.collectives import collective_bytes, loop_collectives

H100 = HARDWARE["h100"]
NO_LATENCY = hardware("h100", nvlink_latency_us=0.0, internode_latency_us=0.0)
COMM = ("tp", "cp", "ep", "etp", "dp", "pp")

# A DeepSeek-V3-like shape small enough to plan quickly: MLA, a shared expert, 8 layers of which
# the first ``first_k_dense`` are dense SwiGLU MLPs of ffn 1536.
BASE = dataclasses.replace(MODELS["deepseek-v2-lite"], name="dense-first", layers=8, first_k_dense=0)


def _with_dense(k: int, **kw):
    return dataclasses.replace(BASE, first_k_dense=k, **kw)


LAYOUTS = [Layout(FoldSpec(16, tp=2, ep=8)), Layout(FoldSpec(16, tp=2, cp=2, ep=4, etp=2), sharding="allreduce"),
           Layout(FoldSpec(32, tp=2, ep=16), recompute="full")]


# ---- dense layers ----------------------------------------------------------------------------------

@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda lay: lay.describe())
@pytest.mark.parametrize("k", [1, 3, 6])
def test_expert_traffic_is_charged_for_moe_layers_only(layout, k):
    """ep and etp seconds scale with the MoE layers (L - k of L): a dense layer dispatches nothing.
    (The old time model charged every layer's dispatch.)"""
    moe, mixed = (estimate(m, H100, layout, 4096, 64) for m in (_with_dense(0), _with_dense(k)))
    for term in ("ep", "etp"):
        assert mixed.time[term] == pytest.approx(moe.time[term] * (BASE.layers - k) / BASE.layers, rel=1e-9), term


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda lay: lay.describe())
def test_a_dense_layers_compute_depends_on_its_ffn_and_not_on_the_experts(layout):
    """Changing the experts changes compute in proportion to the MoE layers only, and a larger
    dense ffn makes the dense layers (and only them) slower."""
    k, L, seq = 3, BASE.layers, 4096
    c = lambda m: estimate(m, H100, layout, seq, 64).time["compute"]
    bigger_experts = dict(expert_ffn=2 * BASE.expert_ffn)
    all_moe = c(_with_dense(0, **bigger_experts)) - c(_with_dense(0))
    assert all_moe > 0
    assert c(_with_dense(k, **bigger_experts)) - c(_with_dense(k)) == pytest.approx(all_moe * (L - k) / L, rel=1e-9)
    assert c(_with_dense(k, dense_ffn=2 * BASE.dense_ffn)) > c(_with_dense(k)) * 1.05
    assert c(_with_dense(0, dense_ffn=2 * BASE.dense_ffn)) == pytest.approx(c(_with_dense(0)), rel=1e-12)


def test_deepseek_v3s_dense_first_stage_is_not_the_slowest():
    """pp 16 puts the 3 dense layers alone on pipeline rank 0 (no experts): it issues no ep or etp
    traffic and is not the stage that sets the pace."""
    e = estimate(MODELS["deepseek-v3-671b"], HARDWARE["h200"], Layout(FoldSpec(2048, pp=16, ep=64, tp=8)), 4096, 2048)
    first = e.collectives_per_rank[0]
    assert not [key for key in first if key[1] in ("ep", "etp")]
    assert e.detail["slowest_rank"] != 0
    seconds = e.detail["stage_seconds"]
    assert seconds[0] < min(seconds[1:])


# ---- communication reads Estimate.collectives ---------------------------------------------------------

@pytest.mark.parametrize("layout", LAYOUTS + [Layout(FoldSpec(16, pp=2, tp=2, ep=8), mbs=1, sharding="allreduce"),
                                              Layout(FoldSpec(16, pp=2, tp=2, ep=4, etp=2), sharding="zero1")],
                         ids=lambda lay: lay.describe())
def test_communication_seconds_follow_the_counted_bytes(monkeypatch, layout):
    """Without latency, doubling every byte the planner counts (the step's and the loop's
    traffic, which Estimate.collectives sums) doubles every communication term and leaves
    compute alone."""
    model = _with_dense(2)
    base = estimate(model, NO_LATENCY, layout, 4096, 64)
    step, loop = cost.collective_traffic, cost.loop_traffic
    double = lambda t: {key: [2 * nbytes, calls] for key, (nbytes, calls) in t.items()}
    monkeypatch.setattr(cost, "collective_traffic", lambda *a, **kw: [double(t) for t in step(*a, **kw)])
    monkeypatch.setattr(cost, "loop_traffic", lambda *a, **kw: double(loop(*a, **kw)))
    twice = estimate(model, NO_LATENCY, layout, 4096, 64)
    assert twice.time["compute"] == pytest.approx(base.time["compute"], rel=1e-12)
    assert sum(base.time[t] for t in COMM) > 0
    for term in COMM:
        assert twice.time[term] == pytest.approx(2 * base.time[term], rel=1e-9, abs=1e-15), term


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda lay: lay.describe())
def test_estimate_collectives_are_the_counted_step_and_loop(layout):
    """What the time model reads is what the dry-run comparison reads (collective_bytes + the loop's)."""
    model = _with_dense(2)
    e = estimate(model, H100, layout, 4096, 64)
    loop = loop_collectives(layout, 64)
    for got, step in zip(e.collectives_per_rank, collective_bytes(model, layout, 4096, 64)):
        want = dict(step)
        for key, v in loop.items():
            want[key] = want.get(key, 0.0) + v
        assert got == pytest.approx(want, rel=1e-12)


# nccl-tests (NVIDIA/nccl-tests, doc/PERFORMANCE.md): busbw = algbw x factor, algbw = S / t, with S
# the size it reports (all_gather, reduce_scatter: the whole gathered / reduced buffer, n x the
# shard; all_reduce: the buffer; alltoall: all a rank sends; sendrecv: the message). So a
# collective moving at bus bandwidth bw takes S x factor / bw.
NCCL_TESTS = {  # kind: (S for an input of B bytes on n ranks, busbw factor)
    "all_gather": (lambda B, n: n * B, lambda n: (n - 1) / n),
    "reduce_scatter": (lambda B, n: B, lambda n: (n - 1) / n),
    "all_reduce": (lambda B, n: B, lambda n: 2 * (n - 1) / n),
    "all_to_all": (lambda B, n: B, lambda n: (n - 1) / n),
    "send": (lambda B, n: B, lambda n: 1.0),
}


@settings(max_examples=40)
@given(st.sampled_from(sorted(NCCL_TESTS)), st.sampled_from([("tp", FoldSpec(8, tp=8)), ("ep", FoldSpec(8, ep=4)),
                                                             ("tp", FoldSpec(16, tp=2)), ("etp", FoldSpec(8, etp=8))]),
       st.floats(1e3, 1e10))
def test_each_kind_takes_its_nccl_tests_bus_bytes_on_nvlink(kind, group, nbytes):
    dim, spec = group
    n = getattr(spec, dim)
    size, factor = NCCL_TESTS[kind]
    seconds = traffic.collective_seconds(NO_LATENCY, spec, kind, dim, nbytes, 1)
    assert seconds * NO_LATENCY.link_bytes_per_s(True) == pytest.approx(size(nbytes, n) * factor(n), rel=1e-12)
    with_latency = traffic.collective_seconds(H100, spec, kind, dim, nbytes, 3)
    assert with_latency == pytest.approx(seconds + 3 * H100.latency(True), rel=1e-12)


def test_a_group_of_one_rank_and_a_recv_cost_nothing():
    spec = FoldSpec(8, tp=8)
    assert traffic.collective_seconds(H100, spec, "all_gather", "cp", 1e9, 4) == 0.0
    assert traffic.collective_seconds(H100, spec, "recv", "tp", 1e9, 4) == 0.0


def test_an_all_to_all_leaving_the_node_sends_its_off_node_share_at_the_all_to_all_rate():
    # ep 16 over 2 nodes: 7 of 16 peers on the node (NVLink), 8 off it (network, all-to-all rate)
    spec, B = FoldSpec(16, ep=16), 1e9
    want = max(7 / 16 * B / NO_LATENCY.alltoall_bytes_per_s(True), 8 / 16 * B / NO_LATENCY.alltoall_bytes_per_s(False))
    assert traffic.collective_seconds(NO_LATENCY, spec, "all_to_all", "ep", B, 1) == pytest.approx(want, rel=1e-12)


@pytest.mark.parametrize("spec", [FoldSpec(16, cp=2, tp=8, ep=8), FoldSpec(32, cp=4, tp=8, ep=8, etp=2)],
                         ids=lambda s: f"cp{s.cp} tp{s.tp} dp{s.dp}")
def test_data_parallel_traffic_is_dp_time_even_on_a_group_named_cp(spec):
    """With dp = 1 FSDP2's dp x cp group is the cp group (the dry run names it cp); its gathers
    and reduce-scatters are still data-parallel time: the cp term is the ring's whatever the
    sharding, and FSDP2 pays its reduction in dp."""
    model = _with_dense(2)
    fsdp, allreduce = (estimate(model, H100, Layout(spec, sharding=sh), 4096, 4) for sh in ("fsdp", "allreduce"))
    assert spec.dp == 1 and ("all_gather", "cp") in fsdp.collectives
    assert fsdp.time["cp"] == pytest.approx(allreduce.time["cp"], rel=1e-12)
    assert fsdp.time["dp"] > 0

"""meshfold.plan as a specification: Table 1 of arXiv 2504.14960, and properties of the cost model.

Table 1 checks run the planner in the paper's Table 1 setting (H100, seq 4096, global batch 256,
cp = 1 as in every Table 1 config), with the paper's Megatron strategies at Megatron-Core's default
of no activation recomputation (benchmarks/RESULTS.md, "Planner against the paper's Table 1").
"""

import argparse
import dataclasses
import itertools
from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from meshfold.mesh import FoldSpec
from meshfold.plan import (HARDWARE, MEGATRON_SHARDINGS, MEGATRON_STRATEGIES, MODELS, PAPER_TABLE1, RECOMPUTE,
                           SCHEDULES, SHARDINGS, STRATEGIES, TIME_TERMS, Layout, ModelShape, candidates, check_layout,
                           estimate, hardware, paper_spec, plan)
from meshfold.cli import plan as cli
from meshfold.plan.memory import REDUCE_BUCKET_BYTES, stage_layers

H100 = HARDWARE["h100"]
SEQ, GBS = 4096, 256


def _cp1(layout: Layout) -> bool:
    return layout.spec.cp == 1


@pytest.fixture(scope="module")
def table1():
    """Best estimate per strategy for each Table 1 model: {model: {strategy: Estimate}}.

    Each search keeps only layouts some of its strategies accept (``where``): the best of a
    strategy is the same as in the full search, in a ninth of the time."""
    ours = [k for k in STRATEGIES if k not in MEGATRON_STRATEGIES]
    out = {}
    for name, row in PAPER_TABLE1.items():
        found = {}
        for keys, shardings in ((ours, SHARDINGS), (MEGATRON_STRATEGIES, MEGATRON_SHARDINGS)):
            est = plan(name, row.gpus, H100, SEQ, GBS, shardings=shardings,
                       where=lambda lay: _cp1(lay) and any(STRATEGIES[k](lay) for k in keys))
            found.update({k: next(e for e in est if STRATEGIES[k](e.layout)) for k in keys})
        out[name] = {k: found[k] for k in STRATEGIES}
    return out


def _paper_estimate(name: str, strategy: str):
    """The paper's own config with Megatron-Core defaults for what it does not state (mbs 1, no vpp)."""
    row = PAPER_TABLE1[name]
    return estimate(MODELS[name], H100, Layout(paper_spec(row, strategy), sharding="zero1"), SEQ, GBS)


# ---- Table 1 -------------------------------------------------------------------------------------

# Pairs the planner ranks against the paper, each with why (benchmarks/RESULTS.md, "Planner against the paper's Table 1"). The test
# checks that they still disagree, so a change that repairs one has to remove it here.
# Qwen2: with Transformer Engine 2.2's grouped-GEMM figures (hardware.py) the 32 local experts of
# TP+EP+DP's 1/4/2/1/4 ([1024, 3584] x [3584, 1280] each) lose less to their partial waves than the
# older per-expert constant implied; TP+EP+DP 27.3% vs FSDP+EP 26.1% (paper 23.1% vs 25.4%). The
# paper's order returns once an expert GEMM loses more than 1.6e6 outputs' worth per expert (a
# kernel as slow as tgale96/grouped_gemm's CUTLASS SM90 path, 2.7e6).
# Llama3-8x70B: the paper's FSDP runs out of memory on 256 H100s, as does TP+EP+DP; meshfold's FSDP2
# with full recomputation fits (64.6 GiB: its step peak is the largest phase of the step, and one
# layer's 8 experts gathered with their bf16 gradients and fp32 reduce-scatter copy set it; the
# dry run of that layout with 2 layers peaks 43.2 GiB against the planner's 40.4, 0.935).
KNOWN_RANKING_DEVIATIONS = {("qwen2-57b-a14b", "fsdp+ep", "tp+ep+dp"), ("llama3-8x70b", "fsdp", "tp+ep+dp")}


@pytest.mark.parametrize("name", PAPER_TABLE1)
def test_strategy_ranking_matches_paper(table1, name):
    paper = {k: -1.0 if v is None else v for k, v in PAPER_TABLE1[name].mfu.items()}
    ours = {k: e.mfu if e.feasible else -1.0 for k, e in table1[name].items()}
    sign = lambda x: (x > 0) - (x < 0)
    for a, b in itertools.combinations(STRATEGIES, 2):
        agree = sign(ours[a] - ours[b]) == sign(paper[a] - paper[b])
        assert agree != ((name, a, b) in KNOWN_RANKING_DEVIATIONS), (a, b, ours, paper)


@pytest.mark.parametrize("name", PAPER_TABLE1)
def test_best_fold_at_least_paper_folded_config(table1, name):
    best = table1[name]["mcore+folding"]
    paper_cfg = _paper_estimate(name, "mcore+folding")
    assert best.mfu >= paper_cfg.mfu
    assert best.mfu >= PAPER_TABLE1[name].mfu["mcore+folding"]


@pytest.mark.parametrize("name", PAPER_TABLE1)
def test_paper_folded_config_within_25_percent_of_reported_mfu(name):
    e = _paper_estimate(name, "mcore+folding")
    reported = PAPER_TABLE1[name].mfu["mcore+folding"]
    assert e.feasible, e.reason
    assert abs(e.mfu / reported - 1) <= 0.25, (e.mfu, reported)


@pytest.mark.parametrize("name", PAPER_TABLE1)
def test_paper_unfolded_config_within_25_percent_of_reported_mfu(name):
    # Unfolded MCore sends its EP all-to-all across nodes: this checks the all-to-all term.
    e = _paper_estimate(name, "mcore")
    reported = PAPER_TABLE1[name].mfu["mcore"]
    assert e.feasible, e.reason
    assert abs(e.mfu / reported - 1) <= 0.25, (e.mfu, reported)


def test_inter_node_all_to_all_runs_below_the_ring_bandwidth():
    hw = H100
    assert hw.alltoall_bytes_per_s(False) < hw.link_bytes_per_s(False)
    assert hw.alltoall_bytes_per_s(True) == hw.link_bytes_per_s(True)


@pytest.mark.parametrize("strategy", ["tp+ep+dp"])  # and FSDP, which meshfold's fits (KNOWN_RANKING_DEVIATIONS)
def test_strategies_the_paper_reports_oom_are_infeasible_for_llama3(table1, strategy):
    assert PAPER_TABLE1["llama3-8x70b"].mfu[strategy] is None
    assert not table1["llama3-8x70b"][strategy].feasible
    assert "out of memory" in table1["llama3-8x70b"][strategy].reason


def test_megatron_strategies_keep_megatron_default_of_no_recomputation():
    lay = Layout(FoldSpec(8, tp=2, ep=2, etp=2), sharding="zero1")
    for key in ("tp+ep+dp", "mcore", "mcore+folding"):
        assert STRATEGIES[key](lay), key
        for mode in ("selective", "full"):
            assert not STRATEGIES[key](dataclasses.replace(lay, recompute=mode)), (key, mode)
    fsdp = Layout(FoldSpec(8), sharding="fsdp")
    assert all(STRATEGIES["fsdp"](dataclasses.replace(fsdp, recompute=mode)) for mode in RECOMPUTE)


# ---- properties ------------------------------------------------------------------------------------

SMALL = ["tiny-moe", "olmoe-1b-7b", "mixtral-8x7b"]


@st.composite
def requests(draw):
    name = draw(st.sampled_from(SMALL))
    gpus = draw(st.sampled_from([1, 2, 4, 8, 16]))
    gbs = gpus * draw(st.sampled_from([1, 2, 4]))
    seq = draw(st.sampled_from([1024, 4096]))
    return MODELS[name], gpus, seq, gbs


@st.composite
def layouts(draw):
    model, gpus, seq, gbs = draw(requests())
    lay = draw(st.sampled_from(list(candidates(model, gpus, seq, gbs))))
    modes = [r for r in RECOMPUTE if not check_layout(model, dataclasses.replace(lay, recompute=r), seq, gbs)]
    return model, dataclasses.replace(lay, recompute=draw(st.sampled_from(modes))), seq, gbs


@pytest.mark.slow
@settings(max_examples=15)
@given(requests(), st.sampled_from(["h100", "h200"]))
def test_every_plan_is_a_valid_foldspec(req, gpu):
    model, gpus, seq, gbs = req
    for e in plan(model, gpus, gpu, seq, gbs):
        s = e.layout.spec
        rebuilt = FoldSpec(gpus, tp=s.tp, cp=s.cp, dp=s.dp, pp=s.pp, etp=s.etp, ep=s.ep, edp=s.edp)
        assert rebuilt == s
        assert s.tp * s.cp * s.dp * s.pp == s.etp * s.ep * s.edp * s.pp == gpus
        assert check_layout(model, e.layout, seq, gbs) == ""


@pytest.mark.slow
@settings(max_examples=15)
@given(requests(), st.floats(0.25, 32.0))
def test_recomputation_is_tried_only_where_the_layout_without_it_does_not_fit(req, memory_gib):
    model, gpus, seq, gbs = req
    hw = hardware("h100", memory_gib=memory_gib, reserved_gib=0.0)
    results = plan(model, gpus, hw, seq, gbs)
    by_layout = {e.layout: e for e in results}
    assert len(by_layout) == len(results)
    for e in results:
        if e.layout.recompute != "none":
            assert not by_layout[dataclasses.replace(e.layout, recompute="none")].feasible
        if e.layout.recompute == "full":
            assert not by_layout[dataclasses.replace(e.layout, recompute="selective")].feasible


@settings(max_examples=25)
@given(layouts(), st.floats(1.0, 4.0))
def test_more_memory_never_makes_a_feasible_fold_infeasible(case, factor):
    model, lay, seq, gbs = case
    small = estimate(model, H100, lay, seq, gbs)
    big = estimate(model, hardware("h100", memory_gib=H100.memory_gib * factor), lay, seq, gbs)
    assert big.memory == small.memory
    assert big.feasible or not small.feasible


@settings(max_examples=25)
@given(layouts(), st.floats(0.05, 1.0), st.floats(0.05, 1.0))
def test_time_never_decreases_when_bandwidth_falls(case, nvlink_scale, net_scale):
    model, lay, seq, gbs = case
    fast = estimate(model, H100, lay, seq, gbs)
    slow_hw = hardware("h100", nvlink_gbps=H100.nvlink_gbps * nvlink_scale,
                       internode_gbps=H100.internode_gbps * net_scale)
    slow = estimate(model, slow_hw, lay, seq, gbs)
    assert slow.step_time >= fast.step_time * (1 - 1e-12)
    for term in TIME_TERMS:
        assert slow.time[term] >= fast.time[term] * (1 - 1e-12) - 1e-15, term


@settings(max_examples=25)
@given(layouts())
def test_time_terms_sum_to_step_time_and_give_the_mfu(case):
    model, lay, seq, gbs = case
    e = estimate(model, H100, lay, seq, gbs)
    assert sum(e.time.values()) == pytest.approx(e.step_time)
    flops = model.step_flops(gbs, seq)
    assert e.mfu == pytest.approx(flops / (e.step_time * lay.spec.world_size * H100.peak_tflops * 1e12))


# ---- shapes, inputs and the CLI ----------------------------------------------------------------------

def test_paper_model_sizes_match_their_names():
    assert MODELS["mixtral-8x22b"].total_params == pytest.approx(141e9, rel=0.01)
    assert MODELS["qwen2-57b-a14b"].total_params == pytest.approx(57.4e9, rel=0.01)


def test_model_shape_reads_any_config_with_the_usual_attributes():
    hf = SimpleNamespace(hidden_size=3584, num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
                         num_experts=64, num_experts_per_tok=8, moe_intermediate_size=2560,
                         shared_expert_intermediate_size=20480, vocab_size=151936, qkv_bias=True)
    assert ModelShape.from_config(hf, name="qwen2-57b-a14b") == MODELS["qwen2-57b-a14b"]
    with pytest.raises(ValueError, match=r"none of the attributes \['num_attention_heads'"):
        ModelShape.from_config(SimpleNamespace(hidden_size=8))


def test_invalid_layout_names_the_offending_value():
    lay = Layout(FoldSpec(8, tp=8))
    with pytest.raises(ValueError, match="tp=8 must divide heads=8 and kv_groups=2"):
        estimate(MODELS["tiny-moe"], H100, lay, SEQ, 8)


def _args(**kw):
    parser = argparse.ArgumentParser()
    cli.configure(parser)
    argv = list(itertools.chain.from_iterable((f"--{k}", str(v)) for k, v in kw.items() if v is not True))
    argv += [f"--{k}" for k, v in kw.items() if v is True]
    return parser.parse_args(argv)


@pytest.mark.slow
def test_cli_prints_best_folds_and_the_baselines(capsys):
    assert cli.main(_args(model="qwen2-57b-a14b", gpus=64, gpu="h100", seq=4096, gbs=256, top=3,
                          compare=True, cp1=True)) == 0
    out = capsys.readouterr().out
    assert "#1" in out and "MCore + folding" in out and "39.0%" in out
    table = out[:out.index("the paper's strategies")]
    assert "zero1" not in table and "[Megatron]" not in table           # proposals are meshfold's
    assert out.count("[Megatron]") >= 3 and "FSDP+EP " in out           # comparison rows, labelled


@pytest.mark.slow
def test_cli_costs_meshfold_layouts_at_the_attention_kernel_meshfold_runs(capsys):
    """meshfold's rows at torch SDPA's FlashAttention-2 rates, the [Megatron] rows at the preset's fa3."""
    assert cli.main(_args(model="qwen2-57b-a14b", gpus=64, gpu="h100", seq=4096, gbs=256, top=1, cp1=True)) == 0
    out = capsys.readouterr().out
    assert "attention costed at fa2" in out
    cp1 = lambda lay: lay.spec.cp == 1
    ours = plan("qwen2-57b-a14b", 64, hardware("h100", attention_kernel="fa2"), 4096, 256, where=cp1)[0]
    theirs = plan("qwen2-57b-a14b", 64, hardware("h100"), 4096, 256, where=cp1)[0]
    assert ours.time["compute"] > theirs.time["compute"]  # FA-2 is slower than FA-3 at every length
    first = next(line for line in out.splitlines() if line.startswith("#1"))
    assert f"{ours.step_time:.2f}" in first.split()


@pytest.mark.parametrize("kw, message", [
    ({"model": "gpt-5"}, "unknown model 'gpt-5'; valid choices"),
    ({"gpu": "a100"}, "unknown GPU 'a100'; valid choices: ['h100', 'h200']"),
    ({"gbs": 3, "gpus": 7, "model": "tiny-moe"}, "global batch must be divisible"),
])
def test_cli_rejects_bad_input_naming_the_value(capsys, kw, message):
    base = {"model": "tiny-moe", "gpus": 8, "gpu": "h100"}
    assert cli.main(_args(**{**base, **kw})) == 2
    assert message in capsys.readouterr().err


def test_cli_fails_when_no_layout_fits(capsys):
    assert cli.main(_args(model="mixtral-8x22b", gpus=1, gpu="h100")) == 1  # 141B parameters on one GPU
    assert "no layout fits in memory; closest:" in capsys.readouterr().out


def test_cli_rejects_non_positive_gpus():
    with pytest.raises(SystemExit):
        _args(model="tiny-moe", gpus=0)


# ---- the time model away from Table 1 (docs/plan.md, "Time model away from Table 1") ----------------

def _family(tps: tuple[int, ...], ep: int, etps: tuple[int, ...] = (1,), pps: tuple[int, ...] = (4, 8),
            recompute: tuple[str, ...] = ("none",)):
    """A small layout family (for speed): tp in ``tps``, this ep, etp in ``etps``, pp in ``pps``,
    micro-batch 1, either of meshfold's data-parallel shardings, recomputation in ``recompute``
    (default none), cp free; vpp as the search allows."""
    def keep(lay: Layout) -> bool:
        s = lay.spec
        return (s.tp in tps and s.ep == ep and s.etp in etps and s.pp in pps and lay.mbs == 1
                and lay.recompute in recompute)
    return keep


def _best(model, gpus, seq, gbs, where):
    return next(e for e in plan(model, gpus, H100, seq, gbs, where=where) if e.feasible)


def test_mfu_with_the_causal_count_falls_from_4k_to_128k_at_fixed_gpus_and_tokens():
    # 128 GPUs and the paper's 1M tokens per step; at 128k the family has to use cp to fit, and
    # recomputation (meshfold's layers keep 800+ MiB a layer at 4k tokens per rank: fp32 norms)
    from meshfold.plan.curves import causal_mfu
    model, tokens = MODELS["mixtral-8x22b"], 256 * 4096
    family = _family((2, 8), 8, etps=(1, 4), pps=(2, 4, 8), recompute=("none", "selective", "full"))
    short = _best(model, 128, 4096, tokens // 4096, family)
    long = _best(model, 128, 131072, tokens // 131072, family)
    assert long.layout.spec.cp > 1
    assert causal_mfu(long, model, 131072, 8) < causal_mfu(short, model, 4096, 256) - 0.02
    # why: the attention core (below GEMM rate) takes a growing share, and so does cp's K/V ring
    assert long.detail["attn_core_s"] / long.step_time > 4 * short.detail["attn_core_s"] / short.step_time
    assert long.time["cp"] / long.step_time > max(0.01, short.time["cp"] / short.step_time)


@settings(max_examples=25)
@given(st.sampled_from(["h100", "h200"]), st.floats(4096, 131072), st.floats(64, 256))
def test_causal_attention_runs_below_gemm_efficiency_at_long_context(gpu, seq, head_dim):
    hw = hardware(gpu)
    fwd = hw.attention_fraction(seq, head_dim, causal=True, backward=False)
    bwd = hw.attention_fraction(seq, head_dim, causal=True, backward=True)
    fwd_bwd = 3.5 / (1 / fwd + 2.5 / bwd)  # FlashAttention's FLOP split: backward = 2.5x forward
    assert fwd_bwd < hw.grouped_gemm_efficiency < hw.gemm_efficiency


@settings(max_examples=25)
@given(st.sampled_from(["fa3", "fa2"]), st.floats(256, 262144), st.floats(1.01, 4), st.floats(32, 512),
       st.booleans(), st.booleans())
def test_attention_throughput_never_falls_with_sequence_and_the_mask_never_helps(kernel, seq, grow, d, causal,
                                                                               backward):
    hw = hardware("h100", attention_kernel=kernel)
    assert hw.attention_fraction(seq * grow, d, causal, backward) >= hw.attention_fraction(seq, d, causal, backward)
    assert hw.attention_fraction(seq, d, True, backward) <= hw.attention_fraction(seq, d, False, backward)


def test_attention_rates_are_flashattention3s_h100_figures():
    # FlashAttention-3 (arXiv 2407.08608) Fig. 5: causal forward, head dim 128, 579 TFLOP/s at 4k and
    # 616 at 16k; Fig. 6: backward without mask, head dim 128, 542 at 4k.
    assert H100.attention_fraction(4096, 128, True, False) * H100.peak_tflops == pytest.approx(579)
    assert H100.attention_fraction(16384, 128, True, False) * H100.peak_tflops == pytest.approx(616)
    assert H100.attention_fraction(4096, 128, False, True) * H100.peak_tflops == pytest.approx(542)


def test_fine_grained_g8t8_expert_gemms_run_below_coarse_mixtral_per_flop():
    # the paper's folded configs of both (Table 1): same hidden size, experts 8x smaller
    fine = _paper_estimate("mixtral-8x22b-g8t8", "mcore+folding")
    coarse = _paper_estimate("mixtral-8x22b", "mcore+folding")
    assert fine.detail["expert_gemm_fraction"] < coarse.detail["expert_gemm_fraction"] - 0.05


def test_grouped_gemm_rate_is_transformer_engine_22s_measured_rate():
    # NVIDIA/TransformerEngine#2045, TE 2.2 on H100: 508.77 TFLOP/s at 8 x (4096, 768, 2048) and
    # 398.81 at 16 x (2048, 768, 2048); torch._grouped_mm 16 x (128000, 7168, 7168) in 298.7 ms
    # (pytorch#156203): 0.71 of peak.
    assert H100.grouped_gemm_fraction(4096, 768, 2048) * H100.peak_tflops == pytest.approx(508.77, rel=0.01)
    assert H100.grouped_gemm_fraction(2048, 768, 2048) * H100.peak_tflops == pytest.approx(398.81, rel=0.01)
    assert H100.grouped_gemm_time(128000, 7168, 7168, 16) == pytest.approx(0.2987, rel=0.01)


@settings(max_examples=25)
@given(st.floats(16, 65536), st.sampled_from([256, 768, 2048, 7168]), st.sampled_from([512, 2048, 7168]),
       st.sampled_from([2, 4, 8]))
def test_splitting_experts_finer_never_makes_their_gemms_faster(rows, n, k, g):
    # g experts of n/g columns each, the same rows and total FLOPs (granularity g), cost no less
    assert H100.grouped_gemm_time(rows, n / g, k, 8 * g) >= H100.grouped_gemm_time(rows, n, k, 8) * (1 - 1e-12)
    # and more rows per expert never lowers the rate
    assert H100.grouped_gemm_fraction(2 * rows, n, k) >= H100.grouped_gemm_fraction(rows, n, k) * (1 - 1e-12)


def test_strong_scaling_efficiency_falls_from_64_to_1024_gpus_at_fixed_global_batch():
    model = MODELS["mixtral-8x22b"]
    # recomputation allowed: on 64 GPUs no layout of the family fits without it (meshfold's layers
    # keep their norms' fp32 upcasts, docs/plan.md "Memory")
    family = _family((2,), 8, pps=(8,), recompute=("none", "selective", "full"))
    small = _best(model, 64, SEQ, GBS, lambda lay: _cp1(lay) and family(lay))
    big = _best(model, 1024, SEQ, GBS, lambda lay: _cp1(lay) and family(lay))
    assert big.mfu < 0.8 * small.mfu
    # per-GPU throughput falls: fewer micro-batches per step fill the pipeline less
    assert big.time["bubble"] / big.step_time > small.time["bubble"] / small.step_time


@pytest.mark.parametrize("name", ["mixtral-8x22b", "mixtral-8x22b-g8t8"])
def test_exposed_dp_time_shrinks_relative_to_compute_as_global_batch_grows(name):
    lay = Layout(paper_spec(PAPER_TABLE1[name], "mcore+folding"))
    ratios = [(e.time["dp"] / e.time["compute"])
              for e in (estimate(MODELS[name], H100, lay, SEQ, gbs) for gbs in (64, 128, 256, 512, 1024))]
    assert all(b < a for a, b in zip(ratios, ratios[1:])), ratios
    mfus = [estimate(MODELS[name], H100, lay, SEQ, gbs).mfu for gbs in (64, 1024)]
    assert mfus[1] > mfus[0]


@settings(max_examples=25)
@given(st.sampled_from(["h100", "h200"]), st.booleans(), st.floats(1e3, 1e10), st.floats(1.01, 16))
def test_collective_bandwidth_grows_with_message_size_toward_the_link_rate(gpu, intra, nbytes, grow):
    hw = hardware(gpu)
    assert hw.bus_bandwidth(nbytes, intra) < hw.bus_bandwidth(nbytes * grow, intra) < hw.link_bytes_per_s(intra)
    half = hw.latency(intra) * hw.link_bytes_per_s(intra)   # latency x bandwidth: half the link rate
    assert hw.bus_bandwidth(half, intra) == pytest.approx(hw.link_bytes_per_s(intra) / 2)
    assert hw.bus_bandwidth(nbytes, False) < hw.bus_bandwidth(nbytes, True)


def test_causal_count_removes_half_the_s_squared_attention_flops():
    # the paper's count at N = B s tokens is F = N (A + C s): doubling s at fixed N adds exactly the
    # s^2 attention term N C s, and the causal count keeps half of it
    from meshfold.plan.curves import causal_mfu
    model, lay = MODELS["mixtral-8x22b"], Layout(paper_spec(PAPER_TABLE1["mixtral-8x22b"], "mcore+folding"))
    e = estimate(model, H100, lay, SEQ, GBS)
    f1, f2 = model.step_flops(GBS, SEQ), model.step_flops(GBS // 2, 2 * SEQ)   # same tokens, s doubled
    assert causal_mfu(e, model, SEQ, GBS) == pytest.approx(e.mfu * (f1 - (f2 - f1) / 2) / f1)
# ---- the planner plans what meshfold builds and runs -------------------------------------------------

def test_parameter_count_of_every_named_config_is_the_built_models():
    """Dense layers (DeepSeek's first_k_dense_replace, Qwen's sparse step), ungated shared experts,
    biases and per-head norms counted as meshfold builds them: exactly sum(p.numel())."""
    from meshfold.models.configs import CONFIGS
    from meshfold.models.transformer import MoETransformer

    for name, cfg in CONFIGS.items():
        built = MoETransformer(cfg, device="meta")
        assert MODELS[name].total_params == sum(p.numel() for p in built.parameters()), name
        assert MODELS[name].dense_layers == len(built.layers) - len(built.moe_layers()), name
    assert MODELS["deepseek-v3-671b"].dense_layers == 3


def test_deepseek_config_reads_its_dense_layers():
    hf = SimpleNamespace(hidden_size=7168, num_hidden_layers=61, num_attention_heads=128, num_key_value_heads=128,
                         n_routed_experts=256, num_experts_per_tok=8, moe_intermediate_size=2048,
                         intermediate_size=18432, n_shared_experts=1, first_k_dense_replace=3, moe_layer_freq=1,
                         vocab_size=129280, head_dim=56, kv_lora_rank=512, q_lora_rank=1536, qk_nope_head_dim=128,
                         qk_rope_head_dim=64, v_head_dim=128)
    assert ModelShape.from_config(hf, name="deepseek-v3-671b") == MODELS["deepseek-v3-671b"]
    qwen = SimpleNamespace(hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_experts=8,
                           num_experts_per_tok=2, moe_intermediate_size=32, intermediate_size=96,
                           decoder_sparse_step=2, vocab_size=256)
    shape = ModelShape.from_config(qwen)
    assert [shape.is_moe_layer(i) for i in range(4)] == [False, True, False, True]  # HF: (i + 1) % 2 == 0


@settings(max_examples=25)
@given(st.integers(1, 64), st.integers(1, 8), st.integers(1, 4))
def test_stage_layers_are_the_pipelines_chunks(layers, pp, vpp):
    from meshfold.parallel.pipeline import chunk_layers

    if pp * vpp > layers:
        return
    chunks = chunk_layers(layers, pp * vpp)
    assert stage_layers(layers, pp, vpp) == [[i for c in chunks[r::pp] for i in c] for r in range(pp)]


def test_knob_names_are_meshfolds():
    from meshfold.parallel.data_parallel import REDUCE_BUCKET_BYTES as runtime_bucket
    from meshfold.parallel.pipeline import SCHEDULES as runtime_schedules
    from meshfold.catalog import DATA_PARALLEL

    from meshfold.train.config import TrainSettings, rules

    assert SHARDINGS == DATA_PARALLEL == rules(TrainSettings)["data_parallel"].choices
    assert set(SCHEDULES) == set(runtime_schedules) == set(rules(TrainSettings)["schedule"].choices)
    assert REDUCE_BUCKET_BYTES == runtime_bucket
    assert not set(MEGATRON_SHARDINGS) & set(SHARDINGS)


@pytest.mark.parametrize("name, gpus, seq, gbs", [
    ("tiny-deepseek-v3", 8, 128, 16), ("tiny-qwen2-moe", 8, 64, 8), ("tiny-mixtral", 4, 64, 8),
    ("tiny-qwen3-moe", 6, 96, 12)])
def test_every_proposed_layout_is_accepted_by_meshfold_train(name, gpus, seq, gbs):
    """Every layout the search proposes, recomputing ones included, passes ``meshfold train``'s
    validation (fold, pipeline and divisibility checks, data parallelism) with the overrides it
    prints, and none is a Megatron-only knob."""
    from meshfold.catalog import DATA_PARALLEL
    from meshfold.train.config import load_config

    results = plan(name, gpus, "h100", seq, gbs, max_mbs=4)
    assert {e.layout.recompute for e in plan(name, gpus, hardware("h100", memory_gib=4.00001, reserved_gib=4.0),
                                             seq, gbs, max_mbs=2)} >= {"selective", "full"}
    seen = set()
    for e in results:
        lay = e.layout
        assert lay.sharding in DATA_PARALLEL and not lay.megatron
        assert not (lay.spec.pp > 1 and lay.sharding == "fsdp" and lay.recompute != "none")
        key = tuple(lay.train_overrides(name, seq, gbs))
        if key in seen:
            continue
        seen.add(key)
        spec, _ = load_config(None, list(key)).validate()
        assert spec == lay.spec


def test_the_planner_leaves_out_recompute_under_a_pipeline_with_fsdp_which_meshfold_runs():
    """The planner does not model it (its pipeline moments were checked without recomputation),
    so it proposes it nowhere; meshfold train accepts it (Pipeline once refused it with bf16)."""
    from meshfold.train.config import load_config

    lay = Layout(FoldSpec(4, pp=2, ep=2), recompute="full")
    assert "not modelled by the planner" in check_layout(MODELS["tiny-mixtral"], lay, 64, 8)
    load_config(None, lay.train_overrides("tiny-mixtral", 64, 8)).validate()
    allreduce = dataclasses.replace(lay, sharding="allreduce")
    assert check_layout(MODELS["tiny-mixtral"], allreduce, 64, 8) == ""
    load_config(None, allreduce.train_overrides("tiny-mixtral", 64, 8)).validate()


def test_uneven_pipeline_chunks_put_deepseeks_dense_layers_on_the_first_rank():
    e = estimate(MODELS["deepseek-v3-671b"], HARDWARE["h200"], Layout(FoldSpec(2048, pp=16, ep=64, tp=8)),
                 4096, 2048)
    stages = e.detail["params_per_rank"]
    assert [len(stage.layers) for stage in stages] == [len(ids) for ids in stage_layers(61, 16, 1)]
    assert stages[0].layers == (0, 1, 2) and stages[0].experts == 0   # 61 // 16 = 3 layers, all dense
    assert sum(stage.experts for stage in stages) * 64 == MODELS["deepseek-v3-671b"].moe_layers * 256 * \
        MODELS["deepseek-v3-671b"].expert_params


def _held_state_bytes(rank, world_size, spec, data_parallel):
    """Bytes of this rank's parameters, gradients and AdamW state after one step of
    tiny-deepseek-v3 (bf16 compute over fp32 masters), each to_local()."""
    import torch

    from meshfold.models.configs import get_config
    from meshfold.models.transformer import MoETransformer
    from meshfold.parallel.transformer import parallelize
    from meshfold.parallel.data_parallel import reduce_gradients
    from meshfold.parallel.batch import shard_batch
    from meshfold.testing.worlds import cached_fold

    cfg = get_config("tiny-deepseek-v3")
    model = MoETransformer(cfg, dtype=torch.float32, device="meta", seed=0)
    parallelize(model, cached_fold(spec), data_parallel=data_parallel, compute_dtype=torch.bfloat16)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)
    tokens, pos = shard_batch(torch.randint(0, cfg.vocab, (2 * spec.dp, 16)), spec, rank)
    model.loss(tokens, tokens, pos).backward()
    reduce_gradients(model)
    opt.step()

    def nbytes(t):
        t = t.to_local() if hasattr(t, "to_local") else t
        return t.numel() * t.element_size()

    params = list(model.parameters())
    state = [v for s in opt.state.values() for v in s.values() if v.dim() > 0]  # "step" is a scalar
    return sum(map(nbytes, params)), sum(nbytes(p.grad) for p in params), sum(map(nbytes, state))


@pytest.mark.slow
@pytest.mark.multirank
@pytest.mark.parametrize("data_parallel", ["fsdp", "allreduce"])
def test_params_grads_and_optimizer_terms_are_what_a_step_holds(worlds, data_parallel):
    """fp32 masters, fp32 gradients and AdamW's two fp32 moments: sharded under FSDP2, whole
    replicas under the all-reduce path (one micro-batch, no pipeline: sync on)."""
    spec = FoldSpec(4, tp=2, ep=2)
    e = estimate(MODELS["tiny-deepseek-v3"], H100, Layout(spec, mbs=2, sharding=data_parallel), 16, 4)
    for params, grads, state in worlds(4).run(_held_state_bytes, spec, data_parallel):
        assert (params, grads, state) == (e.memory["params"], e.detail["grads_held"], e.memory["optimizer"])


def _local_param_numel(rank, world_size, spec, name, data_parallel):
    """(pp rank, parameters this rank holds) of ``name`` parallelized on ``spec`` from the meta
    device, bf16 compute over fp32 master weights, as meshfold train lays it out."""
    import torch

    from meshfold.models.configs import get_config
    from meshfold.parallel.pipeline import Pipeline
    from meshfold.models.transformer import MoETransformer
    from meshfold.parallel.transformer import parallelize
    from meshfold.testing.worlds import cached_fold

    folded = cached_fold(spec)
    model = MoETransformer(get_config(name), dtype=torch.float32, device="meta")
    if spec.pp > 1:
        model = Pipeline(model, folded, 2, data_parallel=data_parallel, compute_dtype=torch.bfloat16)
    else:
        parallelize(model, folded, data_parallel=data_parallel, compute_dtype=torch.bfloat16)
    numel = sum(p.to_local().numel() for p in model.parameters())
    nbytes = sum(p.to_local().numel() * p.to_local().element_size() for p in model.parameters())
    return spec.coords(rank)["attn"]["pp"], numel, nbytes


@pytest.mark.slow
@pytest.mark.multirank
@pytest.mark.parametrize("spec, data_parallel", [
    (FoldSpec(4, tp=2, ep=2), "fsdp"), (FoldSpec(4, tp=2, ep=4), "allreduce"),
    (FoldSpec(4, tp=2, pp=2, etp=2), "fsdp")])
def test_per_rank_parameter_bytes_are_the_parallelized_models(worlds, spec, data_parallel):
    """tiny-deepseek-v3 (MLA with replicated latent projections, a dense first layer, an ungated
    shared expert; with pp = 2 the uneven chunks [0] and [1, 2]): the planner's parameters per
    rank, and its params memory term (fp32 masters), are the local tensors meshfold builds."""
    name = "tiny-deepseek-v3"
    got = worlds(4).run(_local_param_numel, spec, name, data_parallel)
    lay = Layout(spec, sharding=data_parallel)
    e = estimate(MODELS[name], H100, lay, 64, 8)
    n_dense, n_exp = (spec.dp * spec.cp, spec.edp) if data_parallel == "fsdp" else (1, 1)
    for stage in e.detail["params_per_rank"]:
        ranks = [(numel, nbytes) for r, numel, nbytes in got if r == stage.rank]
        assert ranks and all(numel == stage.dense / n_dense + stage.experts / n_exp for numel, _ in ranks), \
            (stage, got)
        assert all(nbytes == 4 * numel for numel, nbytes in ranks)
    worst = e.detail["worst_rank"]
    assert e.memory["params"] == max(nbytes for r, _, nbytes in got if r == worst)


def test_the_plan_guide_is_a_guide_and_its_tables_are_in_results():
    """docs/plan.md holds usage, the cost model and a validation summary (about 450 lines, 480 with
    the hot-expert copies' terms and their table; no issue numbers); the validation tables live in
    benchmarks/RESULTS.md beside the commands that regenerate them."""
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    guide = (root / "docs" / "plan.md").read_text()
    results = (root / "benchmarks" / "RESULTS.md").read_text()
    assert len(guide.splitlines()) <= 480, len(guide.splitlines())
    assert not re.search(r"\bissues? \d+", guide, re.I)
    for heading, command in [("### Planner against the paper's Table 1", "python -m meshfold.plan.curves table1"),
                             ("### Planner against the dry run", "python -m meshfold.dryrun.check")]:
        assert heading in results and command in results.split(heading, 1)[1][:600], heading
    assert "274 of 274 terms within 10%" in results.split("### Planner against the dry run", 1)[1]

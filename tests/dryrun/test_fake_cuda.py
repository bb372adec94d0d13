"""The dry run on fake CUDA tensors (``device="cuda"``): the CUDA branches of a GPU job's step,
backward included, run without a GPU, and the device does not change the job's state or its
communication. Needs torch's CUDA wheel; skipped with the reason elsewhere."""

import pytest
import torch

from meshfold.dryrun import dry_run
from meshfold.dryrun import fake_cuda
from meshfold.train.config import TrainConfig

needs_cuda_wheel = pytest.mark.skipif(not fake_cuda.available(), reason=f"needs torch's CUDA wheel (.ci/run installs "
                                      f"torch==2.14.1 in .venv-cuda and runs this file there): {fake_cuda.why_unavailable()}")

# the default model (tiny-mixtral) and a DeepSeek-V3-style one (MLA, shared experts, sigmoid
# router with bias), each on a pipeline fold and on a folded etp > 1 fold with a cp ring
JOBS = [("tiny-mixtral", {"world_size": 8, "pp": 2, "ep": 2, "tp": 2}),
        ("tiny-mixtral", {"world_size": 8, "cp": 2, "ep": 4, "tp": 2, "etp": 2}),
        ("tiny-deepseek-v3", {"world_size": 8, "pp": 2, "ep": 2, "tp": 2}),
        ("tiny-deepseek-v3", {"world_size": 8, "cp": 2, "ep": 4, "tp": 2, "etp": 2})]

# host reads a CUDA step may make besides the dispatch's one per MoE layer forward: the loss and
# the gradient norm once per step, the pipeline schedule's step, AdamW's step counters (host
# tensors), and the ring's check of its positions layout (parallel/ring_attention.py), once per
# forward (the layers share their positions)
STEP_READS = ("train/loop.py", "parallel/pipeline.py", "optim/optimizer.py", "parallel/ring_attention.py", "?")


PEAK_SLACK = 4096  # bytes: see the activation-peak assertion
SDPA_AT_PEAK = [JOBS[0]]  # plain SDPA attention (GQA, cp = 1): its scores hold the fake-CUDA peak


def _cfg(model: str, fold: dict) -> TrainConfig:
    cfg = TrainConfig(model={"name": model}, fold=fold)
    cfg.train.batch, cfg.train.seq, cfg.train.dtype = 8, 64, "bfloat16"
    return cfg


def test_a_cuda_dry_run_is_refused_before_any_rank_starts_where_it_cannot_run():
    cfg = _cfg(*JOBS[0])
    with pytest.raises(ValueError, match="device = 'tpu'; valid: cpu, cuda"):
        dry_run(cfg, ranks=[0], device="tpu")
    if not fake_cuda.available():
        with pytest.raises(ValueError, match="device = 'cuda': .*CUDA"):
            dry_run(cfg, ranks=[0], device="cuda")


@needs_cuda_wheel
def test_a_backward_on_fake_cuda_tensors_runs_inside_the_shims_only():
    from torch._subclasses.fake_tensor import FakeTensorMode

    def step():
        with FakeTensorMode():
            w = torch.empty(4, 4, device="cuda", requires_grad=True)
            (torch.empty(2, 4, device="cuda") @ w).sum().backward()
            return w.grad

    with fake_cuda.fake_cuda():
        assert step().device == torch.device("cuda", 0)
    with pytest.raises(RuntimeError, match="hasPrimaryContext"):  # the engine's own check, restored
        step()


@needs_cuda_wheel
@pytest.mark.slow
@pytest.mark.parametrize("model, fold", JOBS)
def test_the_cuda_dry_run_has_the_cpu_dry_runs_state_and_collectives(model, fold):
    cfg = _cfg(model, fold)
    cuda = dry_run(cfg, device="cuda")
    cpu = dry_run(cfg, device="cpu")
    _, mcfg = cfg.validate()
    for on_cuda, on_cpu in zip(cuda, cpu, strict=True):
        assert (on_cuda.param_bytes, on_cuda.grad_bytes, on_cuda.optimizer_bytes) == \
               (on_cpu.param_bytes, on_cpu.grad_bytes, on_cpu.optimizer_bytes)
        assert on_cuda.collective_summary() == on_cpu.collective_summary()
        # the same program up to what only the device decides: this rank's tokens, targets and
        # positions copied onto it (2.3 KB here), the ring's block kernels (fused on the CPU, plain
        # on a fake GPU), the host checks run on the CPU only or cached off it, the 16-byte RNG
        # state, and SDPA's kernel: its flash kernel on the CPU, its math kernel on a fake GPU (no
        # compute capability to qualify flash), whose [B, h, S, S] scores add to the peak
        cuda_peak, cpu_peak = on_cuda.activation_peak_bytes, on_cpu.activation_peak_bytes
        if (model, fold) in SDPA_AT_PEAK:
            assert cuda_peak > cpu_peak + PEAK_SLACK
        else:
            assert abs(cuda_peak - cpu_peak) <= PEAK_SLACK
        counts = [where for what, where in on_cuda.host_reads if what == "block_counts"]
        assert len(counts) == len(on_cuda.expert_rows)  # one per MoE layer forward
        others = [where for what, where in on_cuda.host_reads if what != "block_counts"]
        assert all(where.startswith(STEP_READS) for where in others), others
        forwards = cfg.train.microbatches or 1
        assert sum(where.startswith("parallel/ring_attention.py") for where in others) <= forwards

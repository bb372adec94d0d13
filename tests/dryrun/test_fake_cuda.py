"""The dry run on fake CUDA tensors (``device="cuda"``): the CUDA branches of a GPU job's step,
backward included, run without a GPU, and the device does not change the job's state or its
communication. Needs torch's CUDA wheel; skipped with the reason elsewhere."""

import json

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


# The activation peaks of the two devices agree to this many bytes where both take a fused
# attention kernel: what remains is what only the device decides (this rank's tokens, targets and
# positions copied onto it, the host checks run on the CPU only or cached off it, the 16-byte RNG
# state the pipeline schedule forks, the kernels' saved statistics); 128 to 240 bytes here.
PEAK_SLACK = 1024

# which fused attention kernels each job's step runs (forward, backward) on fake CUDA, as on an
# H100 (sm_90: torch 2.14 puts cuDNN attention first there), and on the CPU. Ring attention (cp > 1)
# takes the flash block kernels on CUDA (bf16), the CPU flash kernel on the CPU; plain SDPA on the
# CPU takes its flash kernel where q, k, v share one head size, its math kernel (no fused kernel)
# for MLA, whose values are narrower than its queries.
CUDNN = ["_scaled_dot_product_cudnn_attention", "_scaled_dot_product_cudnn_attention_backward"]
FLASH = ["_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_backward"]
CPU_FLASH = ["_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention_for_cpu_backward"]
KERNELS = {JOBS[0][0] + str(JOBS[0][1]): (CUDNN, CPU_FLASH), JOBS[1][0] + str(JOBS[1][1]): (FLASH, CPU_FLASH),
           JOBS[2][0] + str(JOBS[2][1]): (CUDNN, []), JOBS[3][0] + str(JOBS[3][1]): (FLASH, CPU_FLASH)}


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
def test_sdpa_and_the_ring_choose_their_kernels_as_on_an_h100_inside_the_shims_only():
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.backends.cuda import SDPAParams, can_use_flash_attention

    from meshfold.parallel import ring_attention

    def flash_allowed():
        with FakeTensorMode():
            q = torch.empty(1, 4, 32, 16, dtype=torch.bfloat16, device="cuda")
            return can_use_flash_attention(SDPAParams(q, q, q, None, 0.0, True, False))

    def ring_kernels(dtype):  # GQA: 8 query heads over 2 key/value heads
        with FakeTensorMode():
            q, kv = (torch.empty(1, h, 32, 16, dtype=dtype, device="cuda") for h in (8, 2))
            return ring_attention.block_kernels(q, kv, kv)

    ring_attention._cuda_block_kernels.cache_clear()
    try:
        with fake_cuda.fake_cuda():
            assert flash_allowed()
            # flash takes fp16 / bf16 with GQA; efficient takes fp32; no fused kernel takes fp64
            assert [ring_kernels(d) for d in (torch.bfloat16, torch.float32, torch.float64)] == \
                   ["flash", "efficient", "plain"]
    finally:
        ring_attention._cuda_block_kernels.cache_clear()
    assert not flash_allowed()  # torch's own answer without a device, restored


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
        cuda_kernels, cpu_kernels = KERNELS[model + str(fold)]
        assert (on_cuda.attention_kernels, on_cpu.attention_kernels) == (cuda_kernels, cpu_kernels)
        # the same program up to what only the device decides (PEAK_SLACK); where the CPU takes
        # SDPA's math kernel, its [B, h, S, S] scores and their softmax add to the CPU's peak only
        cuda_peak, cpu_peak = on_cuda.activation_peak_bytes, on_cpu.activation_peak_bytes
        if cpu_kernels:
            assert abs(cuda_peak - cpu_peak) <= PEAK_SLACK, (cuda_peak, cpu_peak)
        else:
            assert cuda_peak < cpu_peak, (cuda_peak, cpu_peak)
        counts = [where for what, where in on_cuda.host_reads if what == "block_counts"]
        assert len(counts) == len(on_cuda.expert_rows)  # one per MoE layer forward
        others = [where for what, where in on_cuda.host_reads if what != "block_counts"]
        assert all(where.startswith(STEP_READS) for where in others), others
        forwards = cfg.train.microbatches or 1
        assert sum(where.startswith("parallel/ring_attention.py") for where in others) <= forwards


class DiscardingWriter:
    """A ``torch.distributed.checkpoint`` storage writer that takes every tensor a save hands it,
    copies it to the host as a file writer does, records where it came from, and writes nothing."""

    def __init__(self):
        self.tensors: dict[str, tuple[torch.device, torch.device]] = {}  # fqn: (its device, its copy's)

    def reset(self, checkpoint_id=None):
        pass

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id):
        return True

    def set_up_storage_writer(self, is_coordinator, *args, **kwargs):
        pass

    def prepare_local_plan(self, plan):
        return plan

    def prepare_global_plan(self, plans):
        return plans

    def write_data(self, plan, planner):
        from torch.distributed.checkpoint.storage import WriteResult

        results = []
        for item in plan.items:
            tensor = planner.resolve_data(item)
            self.tensors[item.index.fqn] = (tensor.device, tensor.detach().cpu().device)
            results.append(WriteResult(index=item.index, size_in_bytes=0, storage_data=None))
        done = torch.futures.Future()
        done.set_result(results)
        return done

    def finish(self, metadata, results):
        pass

    def storage_meta(self):
        return None


@needs_cuda_wheel
@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_a_checkpoint_save_of_a_fake_cuda_model_reaches_the_writer_and_keeps_the_cuda_rng_state(tmp_path):
    """The train's save (one process: DCP plans alone, as it does without a process group) on a
    model and AdamW on fake CUDA tensors: every tensor reaches the storage writer from the device,
    and the CUDA RNG state is read on the host into the rank's RNG file."""
    from unittest import mock

    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed.checkpoint.storage import StorageWriter

    from meshfold.models.transformer import MoETransformer
    from meshfold.train import checkpoint

    StorageWriter.register(DiscardingWriter)
    writer = DiscardingWriter()
    model = MoETransformer(_cfg(*JOBS[0]).model_config(), dtype=torch.bfloat16, seed=0, device="meta")
    with fake_cuda.fake_cuda(), FakeTensorMode(allow_non_fake_inputs=True):
        model.to_empty(device="cuda")
        opt = torch.optim.AdamW(model.parameters())
        with mock.patch.object(checkpoint.dcp, "HuggingFaceStorageWriter", lambda path, save_distributed: writer), \
                mock.patch.object(torch.cuda, "is_available", lambda: True), \
                mock.patch.object(torch.cuda, "is_initialized", lambda: True):  # a rank training on its GPU
            final = checkpoint.save(tmp_path, 1, model, opt, {"step": 1})
    cuda, host = torch.device("cuda", 0), torch.device("cpu")
    names = [n for n, _ in model.named_parameters()]
    # each parameter, its two AdamW moments and its step count, and the buffers
    assert len(writer.tensors) == 4 * len(names) + len(list(model.named_buffers()))
    steps = {fqn for fqn in writer.tensors if fqn.endswith(".step")}  # AdamW keeps its step count on the host
    assert len(steps) == len(names) and all(writer.tensors[f] == (host, host) for f in steps)
    assert all(writer.tensors[f] == (cuda, host) for f in set(writer.tensors) - steps)
    rng = json.loads((final / "rng_rank0.json").read_text())
    assert len(rng["cuda"]) == 16  # CUDA's Philox state: seed and offset

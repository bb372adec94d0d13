"""Every tensor a folded model holds, and every collective input, is on the device the process
group's backend implies (the CPU under gloo, this rank's GPU under NCCL): no tensor left on the
meta device by sharded construction, no CPU buffer reaching a CUDA module or an NCCL collective."""

import os

import pytest
import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from meshfold.mesh import FoldSpec, fold
from meshfold.models import MoEConfig
from meshfold.parallel.pipeline import Pipeline
from meshfold.models.transformer import MoETransformer, TransformerConfig
from meshfold.parallel.transformer import parallelize
from meshfold.parallel.batch import shard_batch
from meshfold.testing.worlds import cached_fold


class CollectiveInputs(TorchDispatchMode):
    """Records the device of every tensor handed to a c10d collective (the ``c10d`` ops behind
    ``torch.distributed`` calls and the ``_c10d_functional`` ops behind DTensor and FSDP2)."""

    def __init__(self):
        super().__init__()
        self.devices: dict[str, set] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace in ("c10d", "_c10d_functional"):
            for t in tree_leaves((args, kwargs)):
                if isinstance(t, torch.Tensor):
                    self.devices.setdefault(func.__name__, set()).add(t.device)
        return func(*args, **(kwargs or {}))


def _config(spec):
    moe = MoEConfig(hidden=16, ffn=4 * spec.etp, num_experts=4, topk=2, shared_ffn=2 * spec.tp,
                    expert_bias=True, seq_aux_loss_coeff=0.01)
    return TransformerConfig(vocab=32, hidden=16, layers=2 * spec.pp, heads=4, ffn=4 * spec.tp, moe=moe,
                             first_k_dense=1, qkv_bias=True)


def _held_tensors(model, opt):
    """Every tensor the model and its optimizer hold: parameters, gradients, buffers, tensor
    attributes of modules (caches, masks) and optimizer state."""
    from torch.distributed.tensor import DTensor

    modules = [m for c in (model.chunks if isinstance(model, Pipeline) else [model]) for m in c.modules()]
    out = {}
    for n, p in model.named_parameters():
        out[n] = p
        if p.grad is not None:
            out[n + ".grad"] = p.grad
    out.update(dict(model.named_buffers()))
    for i, m in enumerate(modules):
        for k, v in vars(m).items():
            if isinstance(v, torch.Tensor) and not isinstance(v, torch.nn.Parameter):
                out[f"module{i}.{k}"] = v
    for i, state in enumerate(opt.state.values()):
        for k, v in state.items():
            if isinstance(v, torch.Tensor) and v.dim() > 0:  # AdamW's "step" is a CPU scalar by design
                out[f"opt{i}.{k}"] = v
    return {n: (t.to_local() if isinstance(t, DTensor) else t).device for n, t in out.items()}


def _train_step_devices(rank, world_size, spec, data_parallel, folded=None):
    folded = folded or cached_fold(spec)
    device = folded.device
    cfg = _config(spec)
    model = MoETransformer(cfg, device="meta", seed=0)
    if spec.pp > 1:
        model = Pipeline(model, folded, microbatches=spec.pp, data_parallel=data_parallel)
    else:
        parallelize(model, folded, data_parallel=data_parallel)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, cfg.vocab, (2 * spec.dp, 4 * spec.cp * spec.tp), generator=g)
    local, pos = (x.to(device) for x in shard_batch(tokens, spec, rank))
    seen = CollectiveInputs()
    with seen:
        if isinstance(model, Pipeline):
            model.step(local, local, pos)
        else:
            model.loss(local, local, pos).backward()
            from meshfold.parallel.data_parallel import reduce_gradients

            reduce_gradients(model)
        opt.step()
    held = _held_tensors(model, opt)
    wrong = {n: d for n, d in held.items() if d != device}
    wrong_collectives = {op: ds for op, ds in seen.devices.items() if ds != {device}}
    return {"wrong": {n: str(d) for n, d in wrong.items()},
            "wrong_collectives": {op: sorted(map(str, ds)) for op, ds in wrong_collectives.items()},
            "collectives": sorted(seen.devices), "held": len(held)}


@pytest.mark.multirank
@pytest.mark.parametrize("spec,data_parallel", [
    (FoldSpec(4, tp=2, ep=4), "fsdp"),
    (FoldSpec(4, cp=2, ep=2, etp=2), "allreduce"),
    (FoldSpec(4, pp=2, tp=2, ep=2), "fsdp"),
])
def test_every_held_tensor_and_collective_input_is_on_the_backends_device(worlds, spec, data_parallel):
    for r in worlds(4).run(_train_step_devices, spec, data_parallel):
        assert r["collectives"] and r["held"] > 10  # the check saw collectives and tensors
        assert not r["wrong"], f"tensors off the backend's device: {r['wrong']}"
        assert not r["wrong_collectives"], f"collective inputs off the backend's device: {r['wrong_collectives']}"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (an NCCL process group)")
def test_under_nccl_everything_is_on_the_gpu(tmp_path):
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29571")
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", rank=0, world_size=1)
    try:
        spec = FoldSpec(1)
        folded = fold(spec)  # no device given: NCCL implies CUDA
        assert folded.device.type == "cuda"
        r = _train_step_devices(0, 1, spec, "fsdp", folded)
        assert not r["wrong"] and not r["wrong_collectives"], r
    finally:
        dist.destroy_process_group()

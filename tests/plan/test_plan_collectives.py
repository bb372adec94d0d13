"""The planner's per-collective bytes (meshfold.plan.collectives) against a real gloo step.

A dispatch mode records every c10d collective one training step of a parallelized
tiny-deepseek-v3 issues (bf16 compute over fp32 masters, as the planner assumes): its kind, the
group it runs on and the bytes of its input. Groups are labelled by the fold dims whose group on
this rank has the same ranks (tp and ep share ranks on some folds, and one process group may
serve both), on both sides, so the comparison does not depend on which dim name a shared group
was created under. Values are averaged over the ranks of a pipeline rank: routing is not
balanced per rank, but what ranks send and receive adds up (the planner assumes balance).
"""

from collections import defaultdict

import pytest
import torch

from meshfold.mesh import FoldSpec
from meshfold.plan import MODELS, Layout
from meshfold.plan.collectives import KINDS, collective_bytes, group_name

NAME = "tiny-deepseek-v3"

_KIND = {"allgather_": "all_gather", "_allgather_base_": "all_gather", "allgather_into_tensor_coalesced_": "all_gather",
         "all_gather_into_tensor": "all_gather", "reduce_scatter_": "reduce_scatter",
         "_reduce_scatter_base_": "reduce_scatter", "reduce_scatter_tensor_coalesced_": "reduce_scatter",
         "reduce_scatter_tensor": "reduce_scatter", "allreduce_": "all_reduce", "allreduce_coalesced_": "all_reduce",
         "all_reduce": "all_reduce", "alltoall_base_": "all_to_all", "alltoall_": "all_to_all",
         "all_to_all_single": "all_to_all", "send": "send", "recv_": "recv", "broadcast_": "broadcast"}
_DIMS = {"attn": ("pp", "dp", "cp", "tp"), "moe": ("ep", "etp", "edp")}


def _labels(spec, rank) -> tuple[dict, callable]:
    """(fold dim or flattened group -> label, ranks -> label) on this rank."""
    mine = {}
    for view, dims in _DIMS.items():
        for d in dims:
            mine[d] = next(tuple(sorted(g)) for g in spec.groups(view, (d,)) if rank in g)
    flat = next(tuple(sorted(g)) for g in spec.groups("attn", ("dp", "cp")) if rank in g)

    def label(ranks: tuple) -> str:
        return "|".join(sorted(d for d, r in mine.items() if r == ranks)) or ("dp+cp" if ranks == flat else f"?{ranks}")

    names = {d: label(r) for d, r in mine.items()}
    sizes = {d: len(r) for d, r in mine.items()}
    names[group_name(("dp", "cp"), sizes)] = label(flat)
    return names, label


def _recorded_step(rank, world_size, spec, data_parallel, recompute, batch, seq, microbatches, overlap=False):
    """One training step (the second: the first settles pipelining's shape inference) recorded as
    {(kind, label): input bytes}, and this rank's dim labels."""
    import torch.distributed as dist
    from torch.utils._python_dispatch import TorchDispatchMode

    from meshfold.models.configs import get_config
    from meshfold.parallel.pipeline import Pipeline
    from meshfold.models.transformer import MoETransformer
    from meshfold.parallel.transformer import parallelize
    from meshfold.parallel.data_parallel import reduce_gradients
    from meshfold.parallel.batch import shard_batch
    from meshfold.testing.worlds import cached_fold
    from meshfold.parallel.pipeline import _keep_gathered, accumulate

    names, label = _labels(spec, rank)
    seen: dict = defaultdict(float)

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kind = _KIND.get(func._overloadpacket.__name__) if func.namespace in ("c10d", "_c10d_functional") else None
            if kind is not None:
                if func.namespace == "_c10d_functional":
                    x, pg = args[0], dist.distributed_c10d._resolve_process_group(args[-1])
                else:
                    first = kind in ("all_reduce", "send", "recv", "broadcast")
                    x, pg = (args[0], args[1]) if first else (args[1], args[2])
                    pg = dist.ProcessGroup.unbox(pg)
                xs = x if isinstance(x, (list, tuple)) else [x]
                seen[kind, label(tuple(sorted(dist.get_process_group_ranks(pg))))] += sum(
                    t.numel() * t.element_size() for t in xs)
            return func(*args, **(kwargs or {}))

    folded = cached_fold(spec)
    cfg = get_config(NAME)
    model = MoETransformer(cfg, dtype=torch.float32, device="meta", seed=0)
    if spec.pp > 1:
        model = Pipeline(model, folded, microbatches, data_parallel=data_parallel, compute_dtype=torch.bfloat16,
                         recompute=recompute)
    else:
        parallelize(model, folded, data_parallel=data_parallel, compute_dtype=torch.bfloat16, recompute=recompute)
        if overlap:  # as Pipeline(..., a2a_overlap=True) lays it out
            _keep_gathered(model, in_turns=True)
    tokens = torch.randint(0, cfg.vocab, (batch, seq), generator=torch.Generator().manual_seed(0))
    local, pos = shard_batch(tokens, spec, rank)
    for step in range(2):
        pos = pos.clone()  # each step's batch brings new positions (their tp gather is kept per tensor)
        mode = Record() if step == 1 else None
        if mode is not None:
            mode.__enter__()
        if spec.pp > 1:
            model.step(local, local, pos)
        else:
            accumulate(model, local, local, pos, [1.0] * microbatches, backward=True, overlap=overlap)
            reduce_gradients(model)
        if mode is not None:
            mode.__exit__(None, None, None)
        for p in model.parameters():  # the optimizer's zero_grad
            p.grad = None
    return spec.coords(rank)["attn"]["pp"], dict(seen), names


@pytest.mark.slow
@pytest.mark.multirank
@pytest.mark.parametrize("spec, data_parallel, recompute, microbatches, overlap", [
    (FoldSpec(4, tp=2, ep=2), "fsdp", "none", 2, False),           # tp + FSDP2 over dp and edp, accumulation
    (FoldSpec(4, cp=2, ep=2, etp=2), "allreduce", "none", 1, False),  # ring attention, ragged etp, all-reduce
    (FoldSpec(4, tp=2, ep=4), "fsdp", "full", 1, False),           # recomputation reissues forward collectives
    (FoldSpec(4, pp=2, tp=2, ep=2), "fsdp", "none", 2, False),     # pipeline P2P, uneven chunks [0] and [1, 2]
    (FoldSpec(4, pp=2, ep=2), "fsdp", "none", 4, False),           # FSDP2 under 1F1B: m + 1 gathers, not 2 m
    (FoldSpec(4, ep=2), "fsdp", "none", 4, True),                  # a2a_overlap: blocks gathered once a step
])
def test_collective_bytes_are_what_a_gloo_step_issues(worlds, spec, data_parallel, recompute, microbatches, overlap):
    batch, seq = 2 * spec.dp * microbatches, 32
    lay = Layout(spec, mbs=batch // (spec.dp * microbatches), recompute=recompute, sharding=data_parallel,
                 a2a_overlap=overlap)
    planned = collective_bytes(MODELS[NAME], lay, seq, batch, backend="gloo")
    results = worlds(4).run(_recorded_step, spec, data_parallel, recompute, batch, seq, microbatches, overlap,
                            timeout=300)  # a loaded machine: the session world's 60 s is too short
    for stage, want_by_dim in enumerate(planned):
        ranks = [(seen, names) for r, seen, names in results if r == stage]
        got, want = defaultdict(float), defaultdict(float)
        for seen, names in ranks:
            for key, v in seen.items():
                got[key] += v / len(ranks)
            for (kind, dim), v in want_by_dim.items():
                assert kind in KINDS
                want[kind, names[dim]] += v / len(ranks)
        assert set(got) == set(want), (stage, sorted(got), sorted(want))
        for key in got:
            assert got[key] == pytest.approx(want[key], rel=1e-9), (stage, key, got[key], want[key])

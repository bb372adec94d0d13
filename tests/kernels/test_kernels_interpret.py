"""The Triton grouped-GEMM kernels, checked without a GPU.

Numerics: the cases marked ``@case`` run the real kernels (forward, dX, dW) on the Triton CPU
interpreter against the per-expert reference. ``TRITON_INTERPRET=1`` must be set before triton is
imported and the rest of the suite must not run under it, so the cases run together in one child
process (``TRITON_INTERPRET=1 python tests/kernels/test_kernels_interpret.py`` prints a JSON report) and
one pytest test per case reads its entry. Shapes stay tiny: the interpreter runs every program
instance in Python.

GPU code generation (compiled ahead of time for sm_80 / sm_90): tests/kernels/test_kernels_sm90.py.
"""

import json
import os
import subprocess
import sys
import traceback
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from meshfold.kernels import expand_tile_mask, grouped_mm  # noqa: E402
from tests.kernels.test_kernels import assert_matches_reference, grads, make_case  # noqa: E402

CASES = {}


def case(fn):
    CASES[fn.__name__] = fn
    return fn


def mask_with_density(E, kt, nt, density, seed=0):
    """[E, kt, nt] mask keeping exactly round(density * E * kt * nt) tiles at random places."""
    g = torch.Generator().manual_seed(seed)
    keep = torch.zeros(E * kt * nt, dtype=torch.bool)
    keep[torch.randperm(keep.numel(), generator=g)[: round(density * keep.numel())]] = True
    return keep.reshape(E, kt, nt)


def triton_grads(x, w, offsets, mask):
    dy = torch.randn(x.shape[0], w.shape[2], generator=torch.Generator().manual_seed(2)).to(x.device, x.dtype)
    return grads(lambda a, b: grouped_mm(a, b, offsets, tile_mask=mask, backend="triton"), x, w, dy)


FP32_TOL = dict(atol=1e-4, rtol=1e-4)


@case
def zero_token_experts_partial_m_tiles_and_tail_rows_match_reference():
    x, w, offsets, _ = make_case([0, 5, 0, 19, 1], 32, 48, tail=3)
    assert_matches_reference(x, w, offsets, None, backend="triton", **FP32_TOL)


@case
def one_expert_holding_all_tokens_matches_reference():
    x, w, offsets, _ = make_case([0, 0, 40, 0], 32, 32)
    assert_matches_reference(x, w, offsets, None, backend="triton", **FP32_TOL)


def _density_case(density):
    def run():
        # mask tile 32 x 16 over K x N = 64 x 48: two kernel K-blocks per mask tile
        x, w, offsets, _ = make_case([7, 0, 20, 2], 64, 48, tail=2)
        mask = mask_with_density(4, 2, 3, density, seed=int(density * 100))
        assert_matches_reference(x, w, offsets, mask, backend="triton", **FP32_TOL)
        y, _, dw = triton_grads(x, w, offsets, mask)
        pruned = ~expand_tile_mask(mask, 64, 48)
        assert torch.all(dw[pruned] == 0), "pruned tiles must get exactly zero gradient"
        if density == 0:
            assert torch.all(y == 0)

    run.__name__ = f"mask_density_{density}_matches_reference_and_pruned_dw_is_zero"
    return case(run)


for _d in (1.0, 0.5, 0.25, 0.0):
    _density_case(_d)


@case
def all_pruned_tile_column_gives_zero_output_columns():
    x, w, offsets, _ = make_case([9, 12], 32, 48)
    mask = torch.ones(2, 2, 3, dtype=torch.bool)
    mask[1, :, 2] = False  # expert 1 drops output columns 32:48 entirely
    assert_matches_reference(x, w, offsets, mask, backend="triton", **FP32_TOL)
    y, _, dw = triton_grads(x, w, offsets, mask)
    assert torch.all(y[9:, 32:] == 0) and torch.all(y[:9, 32:] != 0)
    assert torch.all(dw[1, :, 32:] == 0)


@case
def all_kept_mask_equals_the_dense_kernel_bit_for_bit():
    x, w, offsets, _ = make_case([5, 0, 14], 32, 32, tail=1)
    dense = torch.ones(3, 2, 2, dtype=torch.bool)
    for got, want in zip(triton_grads(x, w, offsets, dense), triton_grads(x, w, offsets, None)):
        assert torch.equal(got, want)


@case
def bf16_and_fp16_inputs_match_the_fp32_accumulating_reference():
    for dtype in (torch.bfloat16, torch.float16):
        x, w, offsets, mask = make_case([6, 0, 11], 32, 32, tail=1, tile=(16, 16), density=0.5, dtype=dtype)
        assert grouped_mm(x, w, offsets, backend="triton").dtype == dtype
        assert_matches_reference(x, w, offsets, mask, backend="triton", atol=0.1, rtol=0.02)


@case
def gpu_launch_geometry_132_programs_group_m_8_matches_reference():
    """The forward / dX launch as on an H200: one persistent program per SM (132) and bands of
    GROUP_M = 8 M-tiles, over more tiles than programs (some programs take a second tile, in
    another expert's group) and a group whose last band is partial (25 M-tiles = 3 x 8 + 1)."""
    from meshfold.kernels import triton_grouped as tg

    saved = dict(tg.INTERPRET_GEOMETRY)
    tg.INTERPRET_GEOMETRY.update(programs=132, group_m=8)
    try:
        x, w, offsets, _ = make_case([400, 0, 260, 37], 32, 48, tail=5)  # 45 + 1 M-tiles x 3 N-tiles
        assert_matches_reference(x, w, offsets, None, backend="triton", **FP32_TOL)
    finally:
        tg.INTERPRET_GEOMETRY.update(saved)


def run_cases() -> dict[str, str]:
    """Run every case in this process; 'ok' or the failure's traceback per case."""
    report = {}
    for name, fn in CASES.items():
        try:
            fn()
            report[name] = "ok"
        except Exception:  # noqa: BLE001 - the report carries the failure to the parent
            report[name] = traceback.format_exc()
    return report



# ----------------------------------------------------------------------------- pytest side


@pytest.fixture(scope="module")
def interpreter_report():
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, __file__], env=env, cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.slow  # one interpreted child runs every case: ~20-30 s
@pytest.mark.parametrize("name", list(CASES))
def test_interpreted_kernel(name, interpreter_report):
    assert interpreter_report[name] == "ok", interpreter_report[name]


def test_main_process_is_not_interpreted():
    """The interpreter stays confined to the child, so the rest of the suite runs normally."""
    assert os.environ.get("TRITON_INTERPRET", "0") != "1"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("tile", [None, (64, 128), (128, 128)])
def test_triton_on_cuda_matches_reference_with_tails_empty_experts_and_masks(dtype, tile):
    """The interpreter cases at autotuned GPU tile sizes: 8 experts, two empty, a partial tail."""
    x, w, offsets, mask = make_case([300, 0, 77, 1, 0, 512, 129, 64], 256, 384, tail=17, tile=tile,
                                    density=0.5, dtype=dtype)
    x, w, offsets = x.cuda(), w.cuda(), offsets.cuda()
    mask = None if mask is None else mask.cuda()
    tol = dict(atol=1e-3, rtol=1e-4) if dtype == torch.float32 else dict(atol=0.25, rtol=0.02)
    assert_matches_reference(x, w, offsets, mask, backend="triton", **tol)
    if mask is not None:
        _, _, dw = triton_grads(x, w, offsets, mask)
        assert torch.all(dw[~expand_tile_mask(mask, 256, 384)] == 0)


def test_autotune_keeps_only_configs_that_divide_the_mask_tile_and_fit_shared_memory():
    from meshfold.kernels import triton_grouped as tg

    configs = tg._configs(tg._ROWS_CONFIGS, True)
    args = {"a_ptr": torch.empty(1, dtype=torch.bfloat16)}
    kept = tg._prune_configs(configs, args, HAS_MASK=True, MASK_BK=64, MASK_BN=128, smem_limit=100 * 1024)
    assert kept and all(64 % c.kwargs["BLOCK_K"] == 0 and 128 % c.kwargs["BLOCK_N"] == 0 for c in kept)
    assert all(c.num_stages * (c.kwargs["BLOCK_M"] + c.kwargs["BLOCK_N"]) * c.kwargs["BLOCK_K"] * 2 <= 100 * 1024
               for c in kept)
    (fallback,) = tg._prune_configs(configs, args, HAS_MASK=True, MASK_BK=48, MASK_BN=80, smem_limit=100 * 1024)
    assert (fallback.kwargs["BLOCK_K"], fallback.kwargs["BLOCK_N"]) == (16, 16)


if __name__ == "__main__":
    assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"
    print(json.dumps(run_cases()))
    sys.exit(0)

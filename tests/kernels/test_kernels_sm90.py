"""The Triton grouped-GEMM kernels compiled for the GPU without one.

triton compiles for a named target (``GPUTarget("cuda", 90, 32)``) with its bundled ptxas, so the
GPU code can be checked on a CPU machine: type errors the interpreter forgives, whether the main
loops are software-pipelined (cp.async) and use wgmma on Hopper, and, for every config the
autotuner would time on an H200 (each pass, precision and mask layout), that it compiles, fits
the H200's shared memory and, in half precision, does not spill registers to local memory
(read from the cubin with the bundled ``cuobjdump -res-usage``).

Shapes of the launches: forward C = A [M, K] @ B [E, K, N]; dX the same kernel with B = w^T (a
transposed view); dW [E, K, N] = x^T @ dy per expert.
"""

import os
import re
import subprocess
import tempfile

import pytest
import torch

from meshfold.kernels import triton_grouped as tg

# unit strides of the forward / dX (B = w^T, a transposed view) / dW launches
FWD_UNIT = {"stride_ak", "stride_bn", "stride_cn"}
DX_UNIT = {"stride_ak", "stride_bk", "stride_cn"}
DW_UNIT = {"stride_xk", "stride_dyn", "stride_wn"}
ALIGNED = {"N", "K", "stride_am", "stride_be", "stride_bk", "stride_bn", "stride_cm", "stride_xm", "stride_dym",
           "stride_we", "stride_wk"}
H200_SMEM = 227 * 1024  # sharedMemPerBlockOptin of sm_90 (H100 / H200)
TRITON_TYPE = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}
# precision name -> (dtype, tl.dot input_precision), as _input_precision chooses them
PRECISIONS = {"bf16": (torch.bfloat16, None), "fp16": (torch.float16, None),
              "fp32-tf32": (torch.float32, "tf32"), "fp32-ieee": (torch.float32, "ieee")}
PASSES = {"fwd": (tg._grouped_rows_kernel, FWD_UNIT), "dx": (tg._grouped_rows_kernel, DX_UNIT),
          "dw": (tg._grouped_dw_kernel, DW_UNIT)}


def compile_for(kernel, capability, unit_strides, consts, num_warps, num_stages, dtype=torch.bfloat16):
    """Compile ``kernel`` for sm_<capability> as a launch on aligned, contiguous ``dtype`` tensors
    would specialise it (unit strides constant, pointers and other strides 16-divisible)."""
    import triton
    from triton.backends.compiler import GPUTarget

    signature, attrs, constexprs = {}, {}, dict(consts)
    for i, name in enumerate(kernel.arg_names):
        if name in consts or name in unit_strides:
            signature[name] = "constexpr"
            constexprs.setdefault(name, 1)
            continue
        if name.endswith("_ptr"):
            signature[name] = ("*i32" if name.startswith(("offs", "kept")) else "*u8" if name == "mask_ptr"
                               else f"*{TRITON_TYPE[dtype]}")
        else:
            signature[name] = "i32"
        if name.endswith("_ptr") or name in ALIGNED:
            attrs[(i,)] = [["tt.divisibility", 16]]
    src = triton.compiler.ASTSource(fn=kernel, signature=signature, constexprs=constexprs, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", capability, 32),
                          options=dict(num_warps=num_warps, num_stages=num_stages, **tg.GPU_OPTIONS))


def _compile_or_skip(*args, **kwargs):
    try:
        return compile_for(*args, **kwargs)
    except (ImportError, FileNotFoundError) as err:
        pytest.skip(f"triton's CUDA backend or bundled ptxas is unavailable: {err}")


def local_memory_bytes(compiled) -> int:
    """Stack frame + local memory of the compiled kernel (spilled registers live there): the
    cubin's resource usage as the bundled ``cuobjdump -res-usage`` prints it."""
    import triton

    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        usage = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True, check=True).stdout
    found = re.search(r"STACK:(\d+).*LOCAL:(\d+)", usage)
    assert found, f"no resource usage in cuobjdump's output: {usage!r}"
    return int(found.group(1)) + int(found.group(2))


@pytest.mark.parametrize("capability", [80, 90])
def test_kernels_compile_for_ampere_and_hopper_with_pipelined_main_loops(capability):
    common = dict(HAS_MASK=True, MASK_BK=128, MASK_BN=128, UPCAST=False, INPUT_PRECISION=None)
    rows_tile = dict(common, BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, GROUP_M=8)
    fwd = _compile_or_skip(tg._grouped_rows_kernel, capability, FWD_UNIT, rows_tile, 8, 3)
    dx = compile_for(tg._grouped_rows_kernel, capability, DX_UNIT, rows_tile, 8, 3)
    dw = compile_for(tg._grouped_dw_kernel, capability, DW_UNIT, dict(common, BLOCK_M=64, BLOCK_N=128, BLOCK_K=128),
                     8, 3)
    for kernel in (fwd, dx, dw):
        ttgir = kernel.asm["ttgir"]
        assert "async_copy_global_to_local" in ttgir, "main loop is not software-pipelined"
        assert (capability == 90) == ("warp_group_dot" in ttgir), "wgmma expected on Hopper only"
        assert kernel.metadata.shared <= (227 if capability == 90 else 163) * 1024


def h200_configs(pass_name: str, dtype: torch.dtype, precision, masked: bool):
    """The configs the autotuner would time for this launch on an H200 (its own pruning)."""
    tuned = tg._tuned_dw_kernel() if pass_name == "dw" else tg._tuned_rows_kernel()
    mask = dict(HAS_MASK=True, MASK_BK=128, MASK_BN=128) if masked else dict(HAS_MASK=False, MASK_BK=1, MASK_BN=1)
    return tuned.early_config_prune(tuned.configs, {"a_ptr": torch.empty(0, dtype=dtype)}, smem_limit=H200_SMEM,
                                    INPUT_PRECISION=precision, **mask), mask


@pytest.mark.slow
@pytest.mark.parametrize("masked", [False, True], ids=["dense", "masked"])
@pytest.mark.parametrize("precision", list(PRECISIONS))
@pytest.mark.parametrize("pass_name", list(PASSES))
def test_every_h200_config_compiles_for_sm90_fits_shared_memory_and_half_precision_does_not_spill(
        pass_name, precision, masked):
    dtype, input_precision = PRECISIONS[precision]
    kernel, unit = PASSES[pass_name]
    configs, mask = h200_configs(pass_name, dtype, input_precision, masked)
    assert configs, f"{pass_name} {precision}: no config left to tune"
    spilled, over = [], []
    for cfg in configs:
        consts = dict(cfg.kwargs, **mask, UPCAST=False, INPUT_PRECISION=input_precision)
        compiled = _compile_or_skip(kernel, 90, unit, consts, cfg.num_warps, cfg.num_stages, dtype=dtype)
        if compiled.metadata.shared > H200_SMEM:
            over.append(f"{cfg}: {compiled.metadata.shared} bytes")
        if local_memory_bytes(compiled):
            spilled.append(str(cfg))
    assert not over, f"{pass_name} {precision}: configs kept for timing need more shared memory than an H200 has: {over}"
    if dtype != torch.float32:
        assert not spilled, f"{pass_name} {precision}: configs spill registers: {spilled}"


def test_autotuning_times_the_launchs_precision_table_capped_and_caches_on_disk(monkeypatch):
    """fp32-ieee launches time only the small FMA tiles, every other launch only the tensor-core
    tiles; MESHFOLD_TRITON_MAX_CONFIGS keeps the first N; the winners are cached on disk, keyed
    by the precision too (a TF32 winner is no answer for an ieee launch of the same shape)."""
    rows = tg._tuned_rows_kernel()
    ieee = {str(c) for c in tg._configs(tg._ROWS_CONFIGS_IEEE, True)}
    dense = dict(HAS_MASK=False, MASK_BK=1, MASK_BN=1)
    args = {"a_ptr": torch.empty(0, dtype=torch.float32)}
    kept = {}
    for precision in ("ieee", "tf32", None):
        kept[precision] = rows.early_config_prune(rows.configs, args, smem_limit=H200_SMEM, INPUT_PRECISION=precision,
                                                  **dense)
        assert len(kept[precision]) > 2, precision
        assert all((str(c) in ieee) == (precision == "ieee") for c in kept[precision]), precision
    monkeypatch.setenv(tg.MAX_CONFIGS_ENV, "2")
    capped = rows.early_config_prune(rows.configs, args, smem_limit=H200_SMEM, INPUT_PRECISION="tf32", **dense)
    assert capped == kept["tf32"][:2]
    monkeypatch.setenv(tg.MAX_CONFIGS_ENV, "none")
    with pytest.raises(ValueError, match="MESHFOLD_TRITON_MAX_CONFIGS = 'none'; valid: a positive integer"):
        rows.early_config_prune(rows.configs, args, smem_limit=H200_SMEM, INPUT_PRECISION="tf32", **dense)
    for tuned in (rows, tg._tuned_dw_kernel()):
        assert tuned.cache_results and "INPUT_PRECISION" in tuned.keys

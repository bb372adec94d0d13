"""``describe`` names what a bf16 timing depends on; every timing benchmark prints it."""

import ast
from pathlib import Path

import pytest

from meshfold.runtime.machine import describe

ROOT = Path(__file__).resolve().parents[2]
BASE = "avx avx2 avx512f avx512bw fma"


def _cpuinfo(model: str, flags: str) -> str:
    # two CPUs, as /proc/cpuinfo lists them; the second's fields must not override the first's
    cpu = "processor\t: {i}\nmodel name\t: {model}\nflags\t\t: {flags}\n"
    return "\n".join(cpu.format(i=i, model=model, flags=flags) for i in range(2))


@pytest.mark.parametrize("flags, says, not_says", [
    (f"{BASE} avx512_bf16 amx_bf16 amx_tile amx_int8", "AMX (amx_bf16, amx_tile)", "no AMX"),
    (f"{BASE} avx512_bf16", "avx512_bf16, no AMX", "AMX ("),
    (BASE, "no AMX, no avx512_bf16", "AMX ("),
    (f"{BASE} amx_tile", "no AMX, no avx512_bf16", "AMX ("),  # AMX tiles without its bf16 unit
])
def test_describe_names_the_bf16_instructions(flags, says, not_says):
    line = describe(_cpuinfo("Some CPU 9000", flags))
    assert line.startswith("Some CPU 9000, ") and says in line and not_says not in line


def test_describe_says_when_the_flags_are_unknown_and_names_a_oneDNN_cap(monkeypatch):
    assert "bf16 instructions unknown" in describe("")
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX512_CORE_BF16")
    line = describe(_cpuinfo("Some CPU", f"{BASE} avx512_bf16 amx_bf16 amx_tile"))
    assert "(ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16)" in line


def _timing_benchmarks() -> list[Path]:
    b = ROOT / "benchmarks"
    return sorted(b.glob("bench_*.py")) + [b / "ab_moe_layer.py", b / "profile_moe_layer.py", b / "step_phases.py"]


@pytest.mark.parametrize("path", _timing_benchmarks(), ids=lambda p: p.name)
def test_every_timing_benchmark_prints_the_machine_first(path):
    tree = ast.parse(path.read_text())
    main = next(n for n in tree.body if isinstance(n, ast.If) and "__main__" in ast.unparse(n.test))
    calls = [ast.unparse(n.func) for stmt in main.body for n in ast.walk(stmt) if isinstance(n, ast.Call)]
    assert calls and calls[0] == "print_machine", f"{path.name}'s __main__ block calls {calls}, not print_machine() first"

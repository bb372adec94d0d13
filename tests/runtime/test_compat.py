"""meshfold.runtime.compat: every torch symbol meshfold names exists on this torch or has a fallback there,
no other file branches on the torch version, and each fallback computes what the newer API does."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from meshfold.runtime import compat
from meshfold.mesh import FoldSpec

ROOT = Path(__file__).resolve().parents[2]
SOURCES = sorted((ROOT / "meshfold").rglob("*.py"))
COMPAT = ROOT / "meshfold" / "runtime" / "compat.py"


def _is_torch(module: str | None) -> bool:
    return module is not None and (module == "torch" or module.startswith("torch."))


def _chain(node: ast.AST) -> list[str] | None:
    """``a.b.c`` as ``["a", "b", "c"]`` (None unless it is names and attributes only)."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    return [node.id, *reversed(parts)]


def torch_symbols(tree: ast.AST) -> set[str]:
    """The dotted torch names a module imports or reaches through an attribute chain on a name
    bound by a torch import (``dist.all_to_all_single``, ``torch.ops.aten.mm.default``)."""
    aliases, names = {}, set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if _is_torch(a.name):
                    names.add(a.name)
                    aliases[a.asname or "torch"] = a.name if a.asname else "torch"
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and _is_torch(node.module):
            for a in node.names:
                names.add(f"{node.module}.{a.name}")
                aliases[a.asname or a.name] = f"{node.module}.{a.name}"
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load):
            chain = _chain(node)
            if chain and chain[0] in aliases and chain[:3] != ["torch", "ops", "meshfold"]:  # meshfold's own ops
                names.add(".".join([aliases[chain[0]], *chain[1:]]))
    return names


def _versioned(name: str) -> str | None:
    return next((v for v in compat.VERSIONED if name == v or name.startswith(v + ".")), None)


def test_every_torch_symbol_meshfold_names_resolves_through_compat():
    """Each torch symbol in meshfold's sources exists on this torch, or is a versioned one that
    only meshfold/runtime/compat.py names and whose fallback exists here."""
    missing, outside = [], []
    for path in SOURCES:
        for name in sorted(torch_symbols(ast.parse(path.read_text(), str(path)))):
            versioned = _versioned(name)
            if versioned is not None:
                if path != COMPAT:
                    outside.append(f"{path.relative_to(ROOT)}: {name}")
                continue
            try:
                compat.resolve(name)
            except AttributeError as err:
                missing.append(f"{path.relative_to(ROOT)}: {err}")
            except ModuleNotFoundError:
                continue  # behind an optional extra this venv lacks (tensorboard); CI's test extra has it
    assert not outside, f"versioned torch symbols named outside meshfold/runtime/compat.py: {outside}"
    assert not missing, f"torch {torch.__version__} lacks symbols meshfold uses: {missing}"
    for name, v in compat.VERSIONED.items():  # on this torch: the symbol itself, or its fallback
        if not compat.has(name) and v.fallback.startswith("torch."):
            compat.resolve(v.fallback)


def test_a_missing_optional_package_is_named_not_blamed_on_torch(monkeypatch):
    monkeypatch.delitem(sys.modules, "torch.utils.tensorboard", raising=False)
    monkeypatch.setitem(sys.modules, "tensorboard", None)  # importing it now fails, as when not installed
    with pytest.raises(ModuleNotFoundError, match="needs the package 'tensorboard'"):
        compat.resolve("torch.utils.tensorboard.SummaryWriter")


def test_the_scan_finds_imports_aliases_and_attribute_chains():
    tree = ast.parse("import torch\nimport torch.distributed as dist\nfrom torch.distributed.tensor import Shard as S\n"
                     "def f(x):\n    dist.all_gather_single(x)\n    return torch.ops.aten.mm.default, S.dim\n")
    assert torch_symbols(tree) >= {"torch.distributed.all_gather_single", "torch.ops.aten.mm.default",
                                   "torch.distributed.tensor.Shard.dim", "torch.distributed"}
    with pytest.raises(AttributeError, match="torch.distributed.no_such_collective"):
        compat.resolve("torch.distributed.no_such_collective")


def _branches_on_torch(tree: ast.AST) -> list[str]:
    """Lines that read the torch version or catch a failed torch import."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in ("__version__", "TorchVersion") \
                and (_chain(node) or [""])[0] in ("torch", "version"):
            found.append(f"line {node.lineno}: {ast.unparse(node)}")
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "hasattr" \
                and node.args and (_chain(node.args[0]) or [""])[0] in ("torch", "dist", "nn", "F"):
            found.append(f"line {node.lineno}: {ast.unparse(node)}")
        if isinstance(node, ast.Try):
            caught = {n for h in node.handlers for n in ast.unparse(h.type or ast.Name("BaseException")).split()}
            imports_torch = any(isinstance(n, (ast.Import, ast.ImportFrom)) and
                                any(_is_torch(m) for m in ([node_.name for node_ in n.names] if isinstance(n, ast.Import)
                                                           else [n.module]))
                                for stmt in node.body for n in ast.walk(stmt))
            if imports_torch and any(e.strip("(),") in ("ImportError", "ModuleNotFoundError", "AttributeError",
                                                        "Exception", "BaseException") for e in caught):
                found.append(f"line {node.lineno}: try: import torch... except {sorted(caught)}")
    return found


def test_no_file_but_compat_branches_on_the_torch_version():
    found = [f"{p.relative_to(ROOT)} {line}" for p in SOURCES + sorted((ROOT / "tests").glob("*.py"))
             if p not in (COMPAT, Path(__file__).resolve()) for line in _branches_on_torch(ast.parse(p.read_text()))]
    assert not found, f"branch on the torch version only in meshfold/runtime/compat.py: {found}"
    assert _branches_on_torch(ast.parse("try:\n    from torch.x import y\nexcept ImportError:\n    y = None\n"))
    assert _branches_on_torch(ast.parse("import torch\nok = torch.__version__ >= '2.13'\n"))


def test_the_supported_range_is_checked_at_import():
    for v in ("2.11.0+cu130", "2.13.0+cpu", "2.14.1", "2.15.0", "2.15.3.dev20261101"):
        assert compat.check_torch_version(v) == v
    for v in ("2.10.1", "2.16.0", "3.0.0"):
        with pytest.raises(ImportError, match=rf"needs torch >= 2.11, < 2.16, but this Python has torch {v}"):
            compat.check_torch_version(v)
    # `import meshfold` itself, with a torch 2.10 in place (a stand-in module: no real import)
    code = ("import sys, types; sys.modules['torch'] = types.SimpleNamespace(__version__='2.10.0')\n"
            "import meshfold\n")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert run.returncode != 0
    assert "ImportError: meshfold needs torch >= 2.11, < 2.16, but this Python has torch 2.10.0" in run.stderr


STRIDED = "torch.distributed.tensor.placement_types._StridedShardOffsetMode"


@pytest.mark.skipif(not compat.has(STRIDED), reason=compat.needs(STRIDED))
def test_strided_shard_indices_fallback_equals_torchs_offsets():
    from torch.distributed.tensor.placement_types import _StridedShard

    for dim, split, size, chunks in [(0, 2, 8, 2), (1, 2, 7, 3), (0, 4, 10, 2), (2, 3, 5, 2)]:
        p = _StridedShard(dim, split_factor=split)
        for i in range(chunks):
            new = compat.strided_shard_indices(p, size, chunks, i)
            with compat.hiding(STRIDED):
                old = compat.strided_shard_indices(p, size, chunks, i)
            assert new == old, (dim, split, size, chunks, i)


def _fallback_run(rank, world_size, case):
    """The fp64 transformer test's run with every versioned symbol hidden: FSDP2 over flattened
    data dims, the older collective names; loss, gradients, norm and logits equal one device."""
    import torch.distributed as dist

    from tests.parallel.test_transformer_parallel import _run

    with compat.hiding():
        assert _run(rank, world_size, case)
        x = torch.arange(3.0) + 10 * rank
        out = torch.empty(3 * world_size)
        compat.all_gather_single(out, x, group=dist.group.WORLD)
        gathered = out.clone()
        compat.reduce_scatter_single(out[:3], torch.arange(3.0 * world_size), group=dist.group.WORLD)
    return gathered, out[:3].clone()


@pytest.mark.slow
def test_fallbacks_compute_what_one_device_computes(worlds):
    """FSDP2 without dp_mesh_dims (norms' gradients partial over tp, dense weights over dp x cp
    flattened, experts over edp) gives the single-device gradients in fp64, and the older
    collectives gather and reduce-scatter."""
    spec = FoldSpec(4, tp=2, ep=2)  # dp 2, edp 2
    case = (spec, 2 * spec.dp, 4 * spec.cp * spec.tp, 3, True, True, False, 0.01)
    for rank, (gathered, scattered) in enumerate(worlds(4).run(_fallback_run, case)):
        assert gathered.tolist() == [float(10 * r + i) for r in range(4) for i in range(3)]
        assert scattered.tolist() == [4.0 * (3 * rank + i) for i in range(3)]

"""Fake CUDA for a dry run on a machine without a GPU: the shims torch needs to run a training step's
CUDA branches on fake ``cuda:0`` tensors.

Fake tensors carry a device and no data, so the CUDA branches of meshfold's code (and torch's:
DTensor, FSDP2, the collectives' device checks) run as on a GPU up to each kernel, whose fake
(meta) implementation answers from there. What needs a shim is what torch asks the CUDA *runtime*
even for fake tensors; each shim is the smallest that answers, and each is listed in
``docs/dryrun.md``:

* ``torch.cuda.current_device`` answers 0: there is one fake device per rank (a launcher would
  have selected LOCAL_RANK's; the dry run's rank is alone in its process).
* streams and events (FSDP2 overlaps its all-gathers and reduce-scatters on side streams): a
  CUDA stream exists only on a device, so ``torch.cuda.Stream``, ``Event``, ``current_stream``,
  ``default_stream`` and ``stream`` answer with :class:`FakeStream` / :class:`FakeEvent`, which
  order nothing (fake kernels finish when called) and record which waits were asked for.
* RNG state (``torch.cuda.get_rng_state`` / ``set_rng_state``: torch's pipeline schedule forks
  the RNG of every visible device when it initializes a stage, a checkpoint saves it): the
  generator's state lives on the device. Getting answers the 16 bytes of a Philox state (seed and
  offset), all zero, in a real host tensor as CUDA's is (a checkpoint reads it on the host, under
  the fake mode too); setting checks the size and keeps nothing.
* the autograd engine's check that a CUDA context exists: before a backward touching CUDA
  tensors, the engine records each device's current stream where
  ``CUDAHooks::hasPrimaryContext(i)`` holds, for every device the CUDA device guard counts. With
  no GPU, ``FakeTensorMode`` installs a no-op guard counting one device, and the hooks then
  refuse device 0 (``hasPrimaryContext expects a valid device index``), a C++ check no Python
  setting reaches. The shim points that one virtual method of torch's ``CUDAHooks`` at a
  function answering True (the fake device has a context, whose current stream is the no-op
  guard's default stream), for the duration of the dry run. It needs the CUDA wheel's
  ``libtorch_cuda.so`` with its symbol table (the released wheels ship it).
* the device SDPA's kernel checks ask about (``sdp_utils.cpp``: is there a CUDA device, then its
  compute capability, for flash, memory-efficient and cuDNN attention): with no device every
  fused kernel is refused, so SDPA would take its math kernel (whose [B, h, S, S] scores a GPU
  never holds) and ring attention its plain blocks. The shim points ``libtorch_cuda``'s two jump
  slots for ``c10::cuda::device_count`` and ``at::cuda::getCurrentDeviceProperties`` at functions
  answering one device, an H100 (sm_90), for the duration of the dry run; torch's own rules then
  choose the kernel, as on that GPU.

On a machine with a GPU none of this is needed: the fake tensors stand on the real device, whose
context is created first (the autograd engine asks for it). Needs torch built with CUDA (``torch.backends.cuda.is_built()``); a CPU-only wheel fails earlier
(``distribute_tensor``'s ``.contiguous()`` on a fake CUDA tensor: ``PyTorch is not linked with
support for cuda devices``).
"""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import os
import struct
from unittest import mock

import torch

from meshfold.runtime import compat

__all__ = ["available", "why_unavailable", "fake_cuda", "FakeStream", "FakeEvent"]

_HOOKS_VTABLE = "_ZTVN2at4cuda6detail9CUDAHooksE"  # at::cuda::detail::CUDAHooks's virtual table
_HAS_PRIMARY_CONTEXT = "_ZNK2at4cuda6detail9CUDAHooks17hasPrimaryContextEa"  # CUDAHooks::hasPrimaryContext(int8)
_ANSWER = ctypes.CFUNCTYPE(ctypes.c_bool, ctypes.c_void_p, ctypes.c_int8)(lambda hooks, device_index: True)


def why_unavailable() -> str | None:
    """Why a fake-CUDA dry run cannot run in this process (None: it can)."""
    if not torch.backends.cuda.is_built():
        return (f"torch {compat.torch_version()} is built without CUDA; the fake-CUDA dry run needs torch's "
                f"CUDA wheel (measured with torch 2.14.1+cu130; no GPU needed)")
    if not torch.cuda.is_available() and not os.path.exists(_library()):
        return f"{_library()} not found"
    return None


def available() -> bool:
    return why_unavailable() is None


def _library() -> str:
    return os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cuda.so")


def _sections(f) -> list[tuple]:
    """The ELF64 section headers of the open file ``f``, each as its ten fields (``Elf64_Shdr``)."""
    f.seek(0)
    header = f.read(64)
    (shoff,) = struct.unpack_from("<Q", header, 0x28)
    shentsize, shnum = struct.unpack_from("<HH", header, 0x3A)
    f.seek(shoff)
    return [struct.unpack("<IIQQQQIIQQ", f.read(shentsize)) for _ in range(shnum)]


def _read(f, section) -> bytes:
    f.seek(section[4])
    return f.read(section[5])


def _name(strings: bytes, at: int) -> bytes:
    return strings[at:strings.index(b"\0", at)]


def _symbols(path: str, names: list[str]) -> dict:
    """``{name: value}`` of ``names`` in the ELF64 symbol table (``.symtab``) of ``path``: the
    offset from the library's load address for a shared library's local symbols."""
    with open(path, "rb") as f:
        sections = _sections(f)
        symtab = next((s for s in sections if s[1] == 2), None)  # SHT_SYMTAB
        if symtab is None:
            raise RuntimeError(f"{path} has no symbol table; the fake-CUDA shim needs it")
        strings, table = _read(f, sections[symtab[6]]), _read(f, symtab)
    wanted, found = {n.encode() for n in names}, {}
    for off in range(0, len(table), 24):
        name_at, value = struct.unpack_from("<I", table, off)[0], struct.unpack_from("<Q", table, off + 8)[0]
        name = _name(strings, name_at)
        if name in wanted:
            found[name.decode()] = value
    missing = set(names) - set(found)
    if missing:
        raise RuntimeError(f"{path} lacks {sorted(missing)}; the fake-CUDA shim supports torch's CUDA wheels")
    return found


def _call_slots(path: str, names: list[str]) -> dict:
    """``{name: offset}`` of the slots (global offset table entries, offsets from the library's
    load address) through which ``path`` calls the functions ``names`` of its own or other
    libraries: its ``.rela.plt`` jump-slot relocations, whose symbols are in ``.dynsym``."""
    with open(path, "rb") as f:
        sections = _sections(f)
        dynsym = next(s for s in sections if s[1] == 11)  # SHT_DYNSYM
        strings, symbols = _read(f, sections[dynsym[6]]), _read(f, dynsym)
        relocations = b"".join(_read(f, s) for s in sections if s[1] == 4)  # SHT_RELA
    wanted, found = {n.encode() for n in names}, {}
    for off in range(0, len(relocations), 24):
        offset, info = struct.unpack_from("<QQ", relocations, off)
        if info & 0xFFFFFFFF != 7:  # R_X86_64_JUMP_SLOT
            continue
        name = _name(strings, struct.unpack_from("<I", symbols, 24 * (info >> 32))[0])
        if name in wanted:
            found[name.decode()] = offset
    missing = set(names) - set(found)
    if missing:
        raise RuntimeError(f"{path} calls {sorted(missing)} through no jump slot; the fake-CUDA shim "
                           f"supports torch's CUDA wheels")
    return found


def _load_address(path: str) -> int:
    name = os.path.realpath(path)
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split()
            if len(fields) >= 6 and os.path.realpath(fields[5]) == name and int(fields[2], 16) == 0:
                return int(fields[0].split("-")[0], 16)
    raise RuntimeError(f"{path} is not loaded in this process")


@contextlib.contextmanager
def _writable(address: int):
    libc = ctypes.CDLL(None)
    libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    page = address & ~(mmap.PAGESIZE - 1)
    if libc.mprotect(page, mmap.PAGESIZE, mmap.PROT_READ | mmap.PROT_WRITE) != 0:
        raise OSError(ctypes.get_errno(), f"mprotect of the page at {page:#x} failed")
    try:
        yield
    finally:
        libc.mprotect(page, mmap.PAGESIZE, mmap.PROT_READ)


@contextlib.contextmanager
def _primary_context_answered():
    """``CUDAHooks::hasPrimaryContext`` answering True while inside (its virtual-table slot
    pointed at :data:`_ANSWER`, restored on exit)."""
    torch.cuda.is_available()  # loads libtorch_cuda's hooks
    path = _library()
    symbols = _symbols(path, [_HOOKS_VTABLE, _HAS_PRIMARY_CONTEXT])
    base = _load_address(path)
    table, method = base + symbols[_HOOKS_VTABLE], base + symbols[_HAS_PRIMARY_CONTEXT]
    slots = (ctypes.c_uint64 * 256).from_address(table)
    found = [i for i in range(256) if slots[i] == method]
    if len(found) != 1:
        raise RuntimeError(f"CUDAHooks::hasPrimaryContext found {len(found)} times in its virtual table")
    slot = ctypes.c_uint64.from_address(table + 8 * found[0])
    with _writable(ctypes.addressof(slot)):
        slot.value = ctypes.cast(_ANSWER, ctypes.c_void_p).value
    try:
        yield
    finally:
        with _writable(ctypes.addressof(slot)):
            slot.value = method


class _DeviceProperties(ctypes.Structure):
    """The leading fields of CUDA 13's ``cudaDeviceProp`` (``driver_types.h``), through the compute
    capability: the fields SDPA's kernel checks read. ctypes lays them out as C does."""

    _fields_ = [("name", ctypes.c_char * 256), ("uuid", ctypes.c_char * 16), ("luid", ctypes.c_char * 8),
                ("luidDeviceNodeMask", ctypes.c_uint), ("totalGlobalMem", ctypes.c_size_t),
                ("sharedMemPerBlock", ctypes.c_size_t), ("regsPerBlock", ctypes.c_int), ("warpSize", ctypes.c_int),
                ("memPitch", ctypes.c_size_t), ("maxThreadsPerBlock", ctypes.c_int),
                ("maxThreadsDim", ctypes.c_int * 3), ("maxGridSize", ctypes.c_int * 3),
                ("totalConstMem", ctypes.c_size_t), ("major", ctypes.c_int), ("minor", ctypes.c_int)]


_PROPERTY_BYTES = 4096  # above sizeof(cudaDeviceProp) (1,008 bytes in CUDA 13.0); the rest reads 0
_H100 = ctypes.create_string_buffer(_PROPERTY_BYTES)
_h100 = _DeviceProperties.from_buffer(_H100)
_h100.name, _h100.totalGlobalMem, _h100.warpSize, _h100.major, _h100.minor = b"NVIDIA H100 80GB HBM3", 80 << 30, 32, 9, 0

_DEVICE_COUNT = "_ZN3c104cuda12device_countEv"  # c10::cuda::device_count()
_DEVICE_PROPERTIES = "_ZN2at4cuda26getCurrentDevicePropertiesEv"  # at::cuda::getCurrentDeviceProperties()
_ONE_DEVICE = ctypes.CFUNCTYPE(ctypes.c_int8)(lambda: 1)
_H100_PROPERTIES = ctypes.CFUNCTYPE(ctypes.c_void_p)(lambda: ctypes.addressof(_H100))


@contextlib.contextmanager
def _device_answered():
    """``libtorch_cuda``'s calls of ``c10::cuda::device_count`` answering 1 and of
    ``at::cuda::getCurrentDeviceProperties`` answering an H100's properties (sm_90) while inside:
    their jump slots pointed at :data:`_ONE_DEVICE` / :data:`_H100_PROPERTIES`, restored on exit.
    SDPA's kernel checks (``sdp_utils.cpp``: ``at::cuda::is_available()``, then the compute
    capability) then decide as on an H100; every other rule of theirs is torch's own."""
    torch.cuda.is_available()  # loads libtorch_cuda
    path = _library()
    base = _load_address(path)
    answers = {_DEVICE_COUNT: _ONE_DEVICE, _DEVICE_PROPERTIES: _H100_PROPERTIES}
    slots = {name: ctypes.c_uint64.from_address(base + offset)
             for name, offset in _call_slots(path, list(answers)).items()}
    before = {name: slot.value for name, slot in slots.items()}
    for name, slot in slots.items():
        with _writable(ctypes.addressof(slot)):
            slot.value = ctypes.cast(answers[name], ctypes.c_void_p).value
    try:
        yield
    finally:
        for name, slot in slots.items():
            with _writable(ctypes.addressof(slot)):
                slot.value = before[name]


class FakeEvent:
    """A CUDA event with nothing to wait for."""

    def __init__(self, *args, **kwargs):
        pass

    def record(self, stream=None):
        pass

    def wait(self, stream=None):
        pass

    def query(self) -> bool:
        return True

    def synchronize(self):
        pass


class FakeStream:
    """A CUDA stream of the fake device: its work is done when issued, so every wait is met."""

    device = torch.device("cuda", 0)

    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, stream):
        pass

    def wait_event(self, event):
        pass

    def record_event(self, event=None):
        return event if event is not None else FakeEvent()

    def query(self) -> bool:
        return True

    def synchronize(self):
        pass


_DEFAULT_STREAM = FakeStream()
_RNG_STATE_BYTES = 16  # CUDA's Philox generator: a 64-bit seed and a 64-bit offset


def _get_rng_state(device="cuda"):
    # a real host tensor, as CUDA's answer is, even under the fake mode: a checkpoint reads it
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    with unset_fake_temporarily():
        return torch.zeros(_RNG_STATE_BYTES, dtype=torch.uint8)


def _set_rng_state(new_state, device="cuda"):
    if new_state.dtype != torch.uint8 or new_state.numel() != _RNG_STATE_BYTES:
        raise ValueError(f"a CUDA RNG state is {_RNG_STATE_BYTES} uint8 bytes, got {new_state.numel()} "
                         f"{new_state.dtype}")


def _streams():
    stack = contextlib.ExitStack()
    for name, value in (("Stream", FakeStream), ("Event", FakeEvent),
                        ("current_stream", lambda device=None: _DEFAULT_STREAM),
                        ("default_stream", lambda device=None: _DEFAULT_STREAM),
                        ("stream", lambda stream=None: contextlib.nullcontext()),
                        ("set_stream", lambda stream: None),
                        ("get_rng_state", _get_rng_state), ("set_rng_state", _set_rng_state)):
        stack.enter_context(mock.patch.object(torch.cuda, name, value))
    return stack


@contextlib.contextmanager
def fake_cuda():
    """The shims (module docstring) while inside; raises where :func:`why_unavailable` says why."""
    reason = why_unavailable()
    if reason is not None:
        raise RuntimeError(f"--device cuda: {reason}")
    if torch.cuda.is_available():  # a real device answers everything once it has a context
        torch.empty(1, device="cuda")
        yield
        return
    with (_primary_context_answered(), _device_answered(),
          mock.patch.object(torch.cuda, "current_device", lambda: 0), _streams()):
        yield

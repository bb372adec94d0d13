"""What a run records besides its metrics: per-rank memory, TensorBoard, W&B and the profiler.

* **Memory**, every step, on every rank, gathered into rank 0's metrics row (``memory``): on
  CUDA the step's ``torch.cuda.max_memory_allocated`` and ``max_memory_reserved`` (peaks reset at
  each step's start); on CPU the process's peak resident set during the step (Linux: the
  kernel's ``VmHWM``, reset at each step's start through ``/proc/self/clear_refs``; elsewhere the
  peak since the process started), and with ``train.tensor_memory`` the step's peak of live
  tensor storage bytes (:class:`meshfold.runtime.live_bytes.LiveBytes`, which counts from the
  weights, gradients and optimizer state alive at the step's start; off by default, as its
  dispatch mode slows every op). The busiest rank's figure is in the progress line.
* **TensorBoard** (``train.tensorboard``): rank 0 writes the scalars of every metrics row into
  ``<out_dir>/tensorboard/`` with ``torch.utils.tensorboard``; a resumed run purges the events
  after the step it resumed from, as metrics.jsonl drops its rows.
* **W&B** (``train.wandb``): rank 0 logs the same scalars with ``wandb``, the run's identity
  (run.json) as its config.
* **Profiler** (``train.profile_steps = [a, b]``): rank 0 (or every rank, ``train.profile_ranks
  = "all"``) records steps a to b with ``torch.profiler`` (each step a ``step N`` range) and
  writes a Chrome trace to ``<out_dir>/profile/rank<r>-steps<a>-<b>.json``; on CUDA also a
  memory snapshot (``torch.cuda.memory._dump_snapshot``), ``rank<r>-memory-steps<a>-<b>.pickle``,
  for https://pytorch.org/memory_viz.

The packages are optional extras; :func:`check_trackers` names the missing one before any rank
starts.
"""

from __future__ import annotations

import importlib.util
import json
import resource
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed as dist

from meshfold.runtime.live_bytes import LiveBytes

__all__ = ["check_trackers", "StepMemory", "Trackers", "Profiler", "scalars"]

_MIB = 1 << 20


def check_trackers(t) -> None:
    """Raise ValueError naming the extra to install when a tracker is asked for without its package."""
    for setting, package in (("tensorboard", "tensorboard"), ("wandb", "wandb")):
        if getattr(t, setting) and importlib.util.find_spec(package) is None:
            raise ValueError(f'train.{setting} = true needs the {package} package, which is not installed: '
                             f'pip install "meshfold[{package}]" (or set train.{setting}=false)')


class StepMemory:
    """This rank's memory peaks over one step: ``with step():`` around it, then ``gather()`` (a
    collective) returns rank 0's ``memory`` record, the same on every rank. ``state()`` yields
    the tensors alive before the step (weights, gradients, optimizer state), counted in the CPU's
    tensor peak from the start."""

    def __init__(self, device: torch.device, tensors: bool = False, state=lambda: ()):
        self.device, self.state = device, state
        self._clear_refs = Path("/proc/self/clear_refs")
        self.tensors = LiveBytes() if tensors and device.type == "cpu" else None

    @contextmanager
    def step(self):
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
            yield
            return
        if self._clear_refs is not None:
            try:
                self._clear_refs.write_text("5")  # VmHWM := the current resident set
            except OSError:
                self._clear_refs = None  # not Linux, or not allowed: the peak since the process started
        if self.tensors is None:
            yield
            return
        self.tensors.adopt(self.state())
        self.tensors.reset_peak()
        with self.tensors:
            yield

    def _mine(self) -> list[float]:
        if self.device.type == "cuda":
            return [torch.cuda.max_memory_allocated(self.device) / _MIB,
                    torch.cuda.max_memory_reserved(self.device) / _MIB]
        try:
            status = Path("/proc/self/status").read_text().splitlines()
            hwm = next(int(line.split()[1]) for line in status if line.startswith("VmHWM:"))
        except (OSError, StopIteration, ValueError):
            hwm = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
        return [hwm / 1024, self.tensors.peak / _MIB if self.tensors is not None else 0.0]

    def gather(self) -> dict:
        mine = torch.tensor(self._mine(), dtype=torch.float64, device=self.device)
        every = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
        dist.all_gather(every, mine)
        peak, second = [float(x[0]) for x in every], [float(x[1]) for x in every]
        record = {"kind": "cuda_max_allocated" if self.device.type == "cuda" else "cpu_peak_rss",
                  "mib": peak, "peak_rank": _busiest(peak)}
        if self.device.type == "cuda":
            record["reserved_mib"] = second
        elif self.tensors is not None:
            record["tensor_mib"], record["tensor_peak_rank"] = second, _busiest(second)
        return record


def _busiest(mib: list[float]) -> int:
    return max(range(len(mib)), key=mib.__getitem__)


def scalars(record: dict) -> dict[str, float]:
    """The numbers of a metrics row, flat, by name (``aux/aux``, ``memory/peak_mib``,
    ``ep_load/max_over_mean``, ...)."""
    out = {k: float(v) for k, v in record.items()
           if isinstance(v, (int, float)) and not isinstance(v, bool) and k != "step"}
    out.update({f"aux/{k}": float(v) for k, v in record.get("aux_losses", {}).items()})
    if record.get("ep_max_over_mean"):  # the worst MoE layer's, as the progress line shows it
        out["ep_load/max_over_mean"] = max(record["ep_max_over_mean"])
    if "memory" in record:
        out["memory/peak_mib"] = max(record["memory"]["mib"])
        if "tensor_mib" in record["memory"]:
            out["memory/tensor_peak_mib"] = max(record["memory"]["tensor_mib"])
    return out


class Trackers:
    """Rank 0's TensorBoard writer and W&B run, as the settings ask; ``log(record)`` per step."""

    def __init__(self, t, out: Path, start: int):
        self.tb = self.wandb = None
        if t.tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(str(out / "tensorboard"), purge_step=start + 1 if start else None)
        if t.wandb:
            import wandb

            identity = json.loads((out / "run.json").read_text())["identity"] if (out / "run.json").exists() else {}
            self.wandb = wandb.init(dir=str(out), name=out.resolve().name, config=identity)

    def log(self, record: dict) -> None:
        values = scalars(record)
        if self.tb is not None:
            for name, value in values.items():
                self.tb.add_scalar(name, value, record["step"])
            self.tb.flush()
        if self.wandb is not None:
            self.wandb.log(values, step=record["step"])

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()
        if self.wandb is not None:
            self.wandb.finish()


class Profiler:
    """``train.profile_steps`` on this rank: ``begin(n)`` before step ``n`` and ``end(n)`` after it."""

    def __init__(self, t, out: Path, rank: int, device: torch.device):
        steps = t.profile_steps
        self.on = steps is not None and (rank == 0 or t.profile_ranks == "all")
        self.first, self.last = steps if self.on else (0, -1)
        self.stem = out / "profile" / f"rank{rank}-steps{self.first}-{self.last}"
        self.device, self._prof, self._range = device, None, None

    def begin(self, n: int) -> None:
        if not self.first <= n <= self.last:
            return
        if n == self.first:
            cuda = self.device.type == "cuda"
            kinds = torch.profiler.ProfilerActivity
            activities = [kinds.CPU, kinds.CUDA] if cuda else [kinds.CPU]
            # every thread's ops: train.a2a_overlap runs the micro-batches on threads of their own
            every_thread = torch._C._profiler._ExperimentalConfig(profile_all_threads=True)
            self._prof = torch.profiler.profile(activities=activities, record_shapes=True, profile_memory=True,
                                                experimental_config=every_thread)
            self._prof.__enter__()
            if cuda:
                torch.cuda.memory._record_memory_history(max_entries=200_000)
        self._range = torch.profiler.record_function(f"step {n}")
        self._range.__enter__()

    def end(self, n: int) -> None:
        if self._range is None:
            return
        self._range.__exit__(None, None, None)
        self._range = None
        if n == self.last:
            self._prof.__exit__(None, None, None)
            self.stem.parent.mkdir(parents=True, exist_ok=True)
            self._prof.export_chrome_trace(str(self.stem) + ".json")
            if self.device.type == "cuda":
                snapshot = self.stem.with_name(self.stem.name.replace("-steps", "-memory-steps") + ".pickle")
                torch.cuda.memory._dump_snapshot(str(snapshot))
                torch.cuda.memory._record_memory_history(enabled=None)
            self._prof = None

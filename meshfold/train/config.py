"""Training settings: one TOML file, overridable on the command line, validated before spawning.

Sections and keys (every key optional; defaults are the embedded default run):

```toml
[model]   # a named config from meshfold.models.configs, then any field overridden
name = "tiny-mixtral"
layers = 4

[moe]     # any MoEConfig field (capacity_factor, drop_policy, aux_loss_coeff, ...)
aux_loss_coeff = 0.01

[fold]    # world size and every fold dimension
world_size = 4
tp = 2
ep = 4

[train]
steps = 200

[sparsity]  # tile-sparse experts (meshfold.sparsity.ExpertSparsity fields)
tile = [16, 16]
schedule = [0.25, 0.5]
start_step = 50
steps_per_stage = 50
```

Command-line overrides use ``section.key=value`` (``--set fold.ep=2 --set train.steps=50``);
values are parsed as TOML scalars.
"""

from __future__ import annotations

import dataclasses
import tomllib
from dataclasses import dataclass, field
from typing import Any

from meshfold.mesh import FoldSpec

__all__ = ["TrainConfig", "load_config", "parse_override"]


@dataclass
class TrainSettings:
    steps: int = 200
    batch: int = 8  # global batch (sequences); split over dp
    seq: int = 128  # tokens per sequence; split over cp x tp
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup: int = 20
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    seed: int = 0
    dtype: str = "float32"
    eval_every: int = 50
    eval_batches: int = 4
    ckpt_every: int = 100
    out_dir: str = "runs/default"
    resume: bool = True
    stop_at: int | None = None  # end this invocation after this step (the schedule still spans steps)
    skip_nonfinite: bool = False  # skip steps whose loss is not finite instead of stopping
    timeout: float = 300.0  # seconds a collective may wait before the run is declared hung
    # CPU ranks keep freed memory for reuse (meshfold.malloc): fewer page faults per step on large
    # activations, at the price of holding the peak heap (and some fragmentation) until exit
    retain_cpu_memory: bool = False
    # pipeline parallelism (fold.pp > 1): microbatches per step (default pp), schedule
    # ("gpipe", "1f1b", "interleaved-1f1b") and model chunks per rank (interleaved: >= 2)
    microbatches: int | None = None
    schedule: str = "1f1b"
    virtual: int = 1
    # testing aids for failure handling (tests/test_train.py), steps counted from 1: make the loss
    # NaN at a step, kill one rank at a step ([rank, step]), or crash rank 0 while it saves
    inject_nan_at: int | None = None
    kill_rank_at: list | None = None
    crash_in_save_at: int | None = None


@dataclass
class DataSettings:
    paths: list = field(default_factory=list)  # empty: the Python standard library
    val_fraction: float = 0.05


@dataclass
class TrainConfig:
    model: dict = field(default_factory=lambda: {"name": "tiny-mixtral"})
    moe: dict = field(default_factory=lambda: {"aux_loss_coeff": 0.01})
    fold: dict = field(default_factory=lambda: {"world_size": 4, "tp": 2, "ep": 4})
    train: TrainSettings = field(default_factory=TrainSettings)
    data: DataSettings = field(default_factory=DataSettings)
    sparsity: dict = field(default_factory=dict)

    def fold_spec(self) -> FoldSpec:
        f = dict(self.fold)
        ws = f.pop("world_size", None)
        if ws is None:
            raise ValueError("fold.world_size is required")
        unknown = sorted(set(f) - {"tp", "cp", "dp", "pp", "etp", "ep", "edp"})
        if unknown:
            raise ValueError(f"fold has no settings {unknown}; valid: world_size, tp, cp, dp, pp, etp, ep, edp")
        return FoldSpec(ws, **f)

    def model_config(self):
        from meshfold.models.configs import get_config

        m = dict(self.model)
        base = get_config(m.pop("name", "tiny-mixtral"))
        moe = base.moe
        if self.moe:
            if moe is None:
                raise ValueError("[moe] settings given but the model has no MoE layers")
            bad = sorted(set(self.moe) - {f.name for f in dataclasses.fields(moe)})
            if bad:
                raise ValueError(f"[moe] has no settings {bad}")
            moe = dataclasses.replace(moe, **self.moe)
        if self.sparsity:
            if moe is None:
                raise ValueError("[sparsity] settings given but the model has no MoE layers")
            from meshfold.sparsity import ExpertSparsity

            sp = dict(self.sparsity)
            for key in ("tile", "schedule"):
                if key in sp:
                    sp[key] = tuple(sp[key])
            bad = sorted(set(sp) - {f.name for f in dataclasses.fields(ExpertSparsity)})
            if bad:
                raise ValueError(f"[sparsity] has no settings {bad}")
            moe = dataclasses.replace(moe, expert_sparsity=ExpertSparsity(**sp))
        if moe is not None and self.train.dtype == "float64":
            import torch

            moe = dataclasses.replace(moe, router_dtype=torch.float64)  # no fp32 step in an fp64 run
        if moe is not None and "hidden" in m:
            moe = dataclasses.replace(moe, hidden=m["hidden"])  # the MoE layers follow the model
        bad = sorted(set(m) - {f.name for f in dataclasses.fields(base)})
        if bad:
            raise ValueError(f"[model] has no settings {bad}")
        return dataclasses.replace(base, moe=moe, **m)

    def validate(self):
        """Everything that can be checked before any process starts; returns (spec, model cfg)."""
        spec = self.fold_spec()
        cfg = self.model_config()
        t = self.train
        for name in ("steps", "batch", "seq", "eval_every", "ckpt_every", "eval_batches"):
            v = getattr(t, name)
            if not (isinstance(v, int) and v >= 1):
                raise ValueError(f"train.{name} must be a positive integer, got {v!r}")
        for name in ("resume", "skip_nonfinite", "retain_cpu_memory"):
            v = getattr(t, name)
            if not isinstance(v, bool):
                raise ValueError(f"train.{name} must be true or false, got {v!r}")
        if t.dtype not in ("float32", "float64", "bfloat16"):
            raise ValueError(f"train.dtype = {t.dtype!r}; valid: float32, float64, bfloat16")
        if not t.lr > 0:
            raise ValueError(f"train.lr must be > 0, got {t.lr}")
        if t.batch % spec.dp:
            raise ValueError(f"train.batch = {t.batch} is not divisible by dp = {spec.dp} "
                             f"(valid batches: multiples of {spec.dp})")
        split = 2 * spec.cp * spec.tp if spec.cp > 1 else spec.tp
        if t.seq % split:
            raise ValueError(f"train.seq = {t.seq} is not divisible by {split} (cp = {spec.cp} "
                             f"gives 2*cp load-balanced chunks, each split over tp = {spec.tp})")
        if t.seq > cfg.max_seq:
            raise ValueError(f"train.seq = {t.seq} exceeds model max_seq = {cfg.max_seq}")
        if spec.pp > 1:
            from meshfold.models.pipeline import check_pipeline

            mb = t.microbatches or spec.pp
            try:
                check_pipeline(spec.pp, cfg, mb, t.schedule, t.virtual)
            except ValueError as err:
                raise ValueError(f"fold.pp = {spec.pp}: {err} (train.microbatches, train.schedule, "
                                 f"train.virtual)") from None
            if (t.batch // spec.dp) % mb:
                raise ValueError(f"train.batch / dp = {t.batch // spec.dp} sequences per rank is not "
                                 f"divisible by train.microbatches = {mb}")
            if self.sparsity:
                raise ValueError("[sparsity] with fold.pp > 1: the pruner's global threshold spans "
                                 "all layers, which pipeline stages hold apart; use pp = 1")
        from meshfold.models.transformer_parallel import check_fold

        check_fold(cfg, spec)  # the divisibility checks parallelize runs, before any process starts
        return spec, cfg


def parse_override(text: str) -> tuple[str, str, Any]:
    """``"fold.ep=2"`` -> ("fold", "ep", 2); the value is a TOML scalar (strings may be bare)."""
    if "=" not in text or "." not in text.split("=", 1)[0]:
        raise ValueError(f"override {text!r} must look like section.key=value (e.g. fold.ep=2)")
    key, raw = text.split("=", 1)
    section, name = key.strip().split(".", 1)
    try:
        value = tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw  # a bare string
    return section, name.strip(), value


def load_config(path: str | None = None, overrides: list[str] = ()) -> TrainConfig:
    """Read ``path`` (TOML) if given, then apply ``section.key=value`` overrides."""
    raw: dict = {}
    if path:
        try:
            with open(path, "rb") as f:
                raw = tomllib.load(f)
        except FileNotFoundError:
            raise ValueError(f"--config {path}: no such file") from None
        except tomllib.TOMLDecodeError as err:
            raise ValueError(f"--config {path}: not valid TOML: {err}") from None
    for text in overrides:
        section, name, value = parse_override(text)
        raw.setdefault(section, {})[name] = value
    cfg = TrainConfig()
    for section, values in raw.items():
        if section not in ("model", "moe", "fold", "train", "data", "sparsity"):
            raise ValueError(f"unknown section [{section}]; valid: model, moe, fold, train, data, sparsity")
        if not isinstance(values, dict):
            raise ValueError(f"[{section}] must be a table of settings")
        if section in ("model", "moe", "fold", "sparsity"):
            getattr(cfg, section).update(values)
            continue
        target = getattr(cfg, section)
        names = {f.name for f in dataclasses.fields(target)}
        for k, v in values.items():
            if k not in names:
                raise ValueError(f"[{section}] has no setting {k!r}; valid: {sorted(names)}")
            setattr(target, k, v)
    return cfg

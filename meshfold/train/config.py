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

[sparsity]  # tile-sparse experts (meshfold.train.sparsity.ExpertSparsity fields)
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

from meshfold.catalog import DATA_PARALLEL, RECOMPUTE, SCHEDULES, ZERO_BUBBLE
from meshfold.mesh import FoldSpec
from meshfold.plan.hardware import HARDWARE
from meshfold.train.optim import NO_DECAY_KINDS

__all__ = ["TrainConfig", "Resolved", "load_config", "parse_override", "master_dtype"]


@dataclass(frozen=True)
class Rule:
    """What one setting may hold: its type, range or choices, and what it means (for the docs).

    ``kind`` is int, float, bool, str or list; a float setting takes TOML integers too. ``low``
    / ``high`` bound numbers (``open_low``: strictly above ``low``); ``optional``: unset (None)
    is allowed, which only the default can be, since TOML has no null. A list holds ``item``
    values (str, int or float), each checked against ``choices`` or the bounds, and exactly
    ``length`` of them when that is set.
    """

    kind: type
    doc: str
    low: float | None = None
    high: float | None = None
    open_low: bool = False
    open_high: bool = False
    choices: tuple = ()
    optional: bool = False
    item: type = str
    length: int | None = None

    def check(self, key: str, value: Any) -> Any:
        """``value`` as the setting holds it, or ValueError naming ``key``, the value and what is valid."""
        if value is None and self.optional:
            return None
        if self.kind is bool:
            if not isinstance(value, bool):
                raise ValueError(f"{key} must be true or false, got {value!r}")
            return value
        if self.kind in (int, float):
            ok = isinstance(value, int) if self.kind is int else isinstance(value, (int, float))
            if isinstance(value, bool) or not ok:
                raise ValueError(f"{key} must be {self.describe()}, got {value!r}")
            below = self.low is not None and (value <= self.low if self.open_low else value < self.low)
            above = self.high is not None and (value >= self.high if self.open_high else value > self.high)
            if below or above:
                raise ValueError(f"{key} must be {self.describe()}, got {value!r}")
            return float(value) if self.kind is float else value
        if self.kind is str:
            if not isinstance(value, str) or (self.choices and value not in self.choices) or not value:
                raise ValueError(f"{key} = {value!r}; valid: {self.describe()}")
            return value
        if not isinstance(value, list) or (self.length is not None and len(value) != self.length):
            raise ValueError(f"{key} must be {self.describe()}, got {value!r}")
        if self.item is str and not self.choices:
            ok = all(isinstance(v, str) for v in value)
        else:
            one = Rule(self.item, "", self.low, self.high, self.open_low, self.open_high, self.choices)
            try:
                value = [one.check(key, v) for v in value]
                ok = True
            except ValueError:
                ok = False
        if not ok:
            raise ValueError(f"{key} must be {self.describe()}, got {value!r}")
        return value

    def describe(self) -> str:
        """What is valid, in words: ``an integer >= 1``, ``one of gpipe, 1f1b``."""
        if self.kind is list:
            one = Rule(self.item, "", self.low, self.high, self.open_low, self.open_high, self.choices)
            if self.choices:
                return f"a list of any of {one.describe()}"
            count = f"{self.length} " if self.length is not None else ""
            if self.item is str:
                return f"a list of {count}strings"
            bounds = one.describe().split(" ", 2)[2:]  # "a number >= 0 ..." -> ">= 0 ..."
            return f"a list of {count}{'integers' if self.item is int else 'numbers'}" + \
                (f" {bounds[0]}" if bounds else "")
        if self.choices:
            return ", ".join(self.choices)
        if self.kind is bool:
            return "true or false"
        if self.kind is str:
            return "a non-empty string"
        what = "an integer" if self.kind is int else "a number"
        bounds = []
        if self.low is not None:
            bounds.append(f"{'>' if self.open_low else '>='} {self.low:g}")
        if self.high is not None:
            bounds.append(f"{'<' if self.open_high else '<='} {self.high:g}")
        return what + (" " + " and ".join(bounds) if bounds else "")


def setting(default, kind, doc, **rule):
    """A dataclass field whose metadata carries its :class:`Rule` (the one table of settings)."""
    r = Rule(kind, doc, **rule)
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata={"rule": r})
    return field(default=default, metadata={"rule": r})


DTYPE_NAMES = ("float32", "float64", "bfloat16")
DTYPE_BITS = {"bfloat16": 16, "float32": 32, "float64": 64}


def master_dtype(compute: str, master: str | None) -> str:
    """``train.master_dtype`` resolved: float32 by default, or the compute dtype where that is
    wider; a master dtype narrower than the compute dtype raises, naming both."""
    if master is None:
        return compute if DTYPE_BITS[compute] > DTYPE_BITS["float32"] else "float32"
    if DTYPE_BITS[master] < DTYPE_BITS[compute]:
        valid = [d for d in DTYPE_NAMES if DTYPE_BITS[d] >= DTYPE_BITS[compute]]
        raise ValueError(f"train.master_dtype = {master!r} is narrower than train.dtype = {compute!r}; "
                         f"valid master dtypes for {compute} compute: {', '.join(valid)}")
    return master


@dataclass
class TrainSettings:
    steps: int = setting(200, int, "optimizer steps of the whole run; the learning-rate schedule spans "
                         "them", low=1)
    batch: int = setting(8, int, "global batch in sequences, split over dp", low=1)
    seq: int = setting(128, int, "tokens per sequence, split over cp x tp", low=1)
    lr: float = setting(3e-3, float, "peak learning rate (AdamW)", low=0, open_low=True)
    min_lr_ratio: float = setting(0.1, float, "the cosine decay ends at lr x min_lr_ratio", low=0, high=1)
    warmup: int = setting(20, int, "steps of linear warm-up", low=0)
    weight_decay: float = setting(0.01, float, "AdamW's decoupled weight decay, on every parameter but those "
                                  "train.no_weight_decay names", low=0)
    no_weight_decay: list = setting(["1d"], list, "parameter kinds AdamW does not decay: 1d (biases, norm gains, "
                                    "every other one-dimensional parameter), embedding, head (the output "
                                    "projection; a tied head is the embedding), router (the routers' weights)",
                                    choices=NO_DECAY_KINDS)
    betas: list = setting([0.9, 0.95], list, "AdamW's (beta1, beta2): decay rates of the gradient's first and "
                          "second moment estimates", item=float, length=2, low=0, high=1, open_high=True)
    eps: float = setting(1e-8, float, "AdamW's epsilon, added to the root of the second moment", low=0,
                         open_low=True)
    grad_clip: float = setting(1.0, float, "clip the global gradient norm to this (0: no clipping)", low=0)
    seed: int = setting(0, int, "seed of the weights and of the batches drawn", low=0)
    dtype: str = setting("float32", str, "compute dtype: what the layers compute in (bfloat16: mixed "
                         "precision over train.master_dtype weights)", choices=DTYPE_NAMES)
    master_dtype: str | None = setting(None, str, "dtype of the parameters (master weights), their gradients, "
                                       "the gradient sums and AdamW states, and of checkpoints (default: unset: "
                                       "float32, or train.dtype where that is wider)", choices=DTYPE_NAMES,
                                       optional=True)
    eval_every: int = setting(50, int, "steps between validation losses (and at the last step)", low=1)
    eval_batches: int = setting(4, int, "validation batches per evaluation", low=1)
    ckpt_every: int = setting(100, int, "steps between checkpoints (and at the last step)", low=1)
    out_dir: str = setting("runs/default", str, "run folder: checkpoints, metrics, plots, logs")
    plots: bool = setting(True, bool, "draw loss.png and expert_load.png into the run folder at the end "
                          "(needs matplotlib)")
    resume: bool = setting(True, bool, "continue from the run folder's newest checkpoint; false starts "
                           "the folder over, moving the earlier run aside")
    init_from: str | None = setting(None, str, "a Hugging Face MoE checkpoint folder (config.json + safetensors, "
                                    "e.g. from meshfold upcycle) to start from instead of a random init: the "
                                    "model's shape comes from its config.json ([model] settings are refused), "
                                    "each rank reads only its own slices (default: unset)", optional=True)
    stop_at: int | None = setting(None, int, "end this invocation after this step; the schedule still "
                                  "spans train.steps (default: unset)", low=1, optional=True)
    skip_nonfinite: bool = setting(False, bool, "skip steps whose loss is not finite instead of stopping; "
                                   "each skip is a line on the console, and metrics.jsonl counts them "
                                   "(skipped_steps)")
    timeout: float = setting(300.0, float, "seconds a collective may wait, and half of it a rank may go "
                             "without a heartbeat, before the job is declared hung", low=0, open_low=True)
    retain_cpu_memory: bool = setting(False, bool, "CPU ranks keep freed memory for reuse "
                                      "(meshfold.runtime.malloc): fewer page faults, the peak heap held until exit")
    tensor_memory: bool = setting(False, bool, "CPU ranks also record each step's peak of live tensor bytes "
                                  "(metrics memory.tensor_mib), counted by a dispatch mode over every op, which "
                                  "slows each step (benchmarks/RESULTS.md)")
    microbatches: int | None = setting(None, int, "micro-batches per step: the pipeline schedule's with "
                                       "fold.pp > 1 (default pp), else gradient accumulation (default 1)",
                                       low=1, optional=True)
    gpu: str | None = setting(None, str, "hardware preset (meshfold plan's) whose dense BF16 peak is MFU's "
                              "denominator (default: unset, no MFU on CPU)", choices=tuple(HARDWARE),
                              optional=True)
    peak_tflops: float | None = setting(None, float, "peak TFLOP/s per rank for MFU, instead of train.gpu's",
                                        low=0, open_low=True, optional=True)
    data_parallel: str = setting("fsdp", str, "data parallelism: fsdp (FSDP2: parameters, gradients and AdamW "
                                 "state sharded over dp x cp, experts over edp) or allreduce (whole replicas, "
                                 "gradients all-reduced once per step)", choices=DATA_PARALLEL)
    schedule: str = setting("1f1b", str, "pipeline schedule with fold.pp > 1 (torch.distributed.pipelining's "
                            "classes; interleaved-zb, zbv and dualpipev are the zero-bubble ones, which split each "
                            "backward into input and weight gradients; zbv and dualpipev lay 2 chunks a rank out "
                            "in a V)", choices=SCHEDULES)
    virtual: int = setting(1, int, "model chunks per rank (interleaved-1f1b, interleaved-zb: >= 2; zbv, "
                           "dualpipev: 2)", low=1)
    tensorboard: bool = setting(False, bool, "also write the metrics as TensorBoard event files into "
                                "<out_dir>/tensorboard/ (needs the tensorboard package: pip install "
                                "\"meshfold[tensorboard]\")")
    wandb: bool = setting(False, bool, "also log the metrics to Weights & Biases (needs the wandb package: pip "
                          "install \"meshfold[wandb]\"; project, entity and mode come from its WANDB_* "
                          "environment variables, e.g. WANDB_MODE=offline)")
    profile_steps: list | None = setting(None, list, "[a, b]: record steps a to b (inclusive) with "
                                         "torch.profiler into <out_dir>/profile/ (a Chrome trace per rank; on "
                                         "CUDA also a memory snapshot) (default: unset, no profile)",
                                         item=int, length=2, low=1, optional=True)
    profile_ranks: str = setting("rank0", str, "which ranks train.profile_steps records", choices=("rank0", "all"))
    expert_placement: str = setting("static", str, "which experts each ep rank holds: static (ep rank r holds "
                                    "experts r * E / ep ..) or balanced (every train.rebalance_every steps the "
                                    "experts are re-assigned to ep ranks from the rows routed to them since the "
                                    "last re-assignment, lowering the busiest rank's load; weights and AdamW state "
                                    "move with them and the math is unchanged; needs MoE layers, ep >= 2 and pp = 1)",
                                    choices=("static", "balanced"))
    rebalance_every: int = setting(50, int, "steps between expert re-placements with train.expert_placement = "
                                   "balanced", low=1)
    redundant_experts: int = setting(0, int, "copy slots for hot experts, R / ep on each ep rank (0: none); with "
                                     "train.expert_placement = balanced each re-placement copies the hottest "
                                     "experts into them and splits their rows over the copies; a multiple of "
                                     "fold.ep, at most moe.num_experts, dropless routing", low=0)
    recompute: str = setting("none", str, "activation recomputation of every transformer block: selective "
                             "keeps the matrix products' outputs and recomputes norms, RoPE, attention "
                             "core and activations; full keeps only each block's input (both replay "
                             "the forward's routing); results are identical, memory smaller",
                             choices=RECOMPUTE)
    compile: bool = setting(False, bool, "torch.compile each block's elementwise work from outside the model "
                            "(meshfold.parallel.compile: the RMSNorms, RoPE and the dense SwiGLU MLPs, and on CPU "
                            "the MoE layers' dropless combine and permute-backward row passes); routing, "
                            "dispatch, expert GEMMs, collectives and host reads stay eager. The first step compiles (slow on "
                            "CPU: tens of seconds per distinct shape), later steps reuse the graphs")
    a2a_overlap: bool = setting(False, bool, "run two micro-batches in turns so that one's expert dispatch and "
                                "combine all-to-alls travel while the other computes (meshfold.runtime.overlap): "
                                "without pp each accumulated micro-batch's forward beside the previous one's backward; with pp, schedule 1f1b runs as "
                                "combined 1F1B (each steady forward beside another micro-batch's backward, one more "
                                "warm-up forward) and dualpipev with its overlapped forward and backward; the same "
                                "values; needs MoE layers and ep > 1; under FSDP2 each block stays gathered from its "
                                "forward to the step's end")


@dataclass
class DataSettings:
    paths: list = setting([], list, "text files or folders to train on (--data); empty: the Python "
                          "standard library's sources. In folders, hidden files and folders and binary files "
                          "are skipped; a binary file named itself is refused. One folder written by meshfold "
                          "tokenize trains on its tokens")
    val_fraction: float = setting(0.05, float, "the last fraction of the text, held out for validation",
                                  low=0, high=1, open_low=True, open_high=True)
    tokenizer: str | None = setting(None, str, "a Hugging Face tokenizers tokenizer.json, or a checkpoint folder "
                                    "holding one: the text is tokenized into <out_dir>/tokens/ before the ranks "
                                    "start (default: unset, byte-level)", optional=True)
    text_field: str = setting("text", str, "the field (JSON Lines, JSON) or column (Parquet, a save_to_disk "
                              "folder) holding each record's text (meshfold.data.records)")
    split: str = setting("train", str, "the split of a save_to_disk DatasetDict folder to read")
    weights: list = setting([], list, "a mixture: one weight per data.paths entry, each a token folder; "
                            "each step's rows are drawn from the folders in these proportions, and validation "
                            "loss is reported per folder (default: empty, one source)", item=float, low=0)


# MoEConfig fields that change parameter shapes: a train.init_from checkpoint fixes them
SHAPE_FIELDS = ("hidden", "ffn", "num_experts", "shared_ffn", "shared_kind", "expert_kind")
FOLD_KEYS = ("world_size", "tp", "cp", "dp", "pp", "etp", "ep", "edp")
FOLD_RULE = Rule(int, "ranks, and the size of one fold dimension (dp and edp are derived when unset)", low=1)


def rules(section) -> dict[str, Rule]:
    """{key: Rule} of a settings dataclass (TrainSettings or DataSettings, or an instance)."""
    return {f.name: f.metadata["rule"] for f in dataclasses.fields(section)}


def _check_fields(section: str, values: dict, cls) -> None:
    """Types of [model] / [moe] overrides against the config dataclass's field annotations, so a
    string where a number belongs fails here, not as a TypeError inside a rank."""
    kinds = {"int": int, "float": float, "bool": bool, "str": str}
    for f in dataclasses.fields(cls):
        if f.name not in values:
            continue
        ann = str(f.type).replace(" ", "").split("|")
        optional = "None" in ann
        known = [kinds[a] for a in ann if a in kinds]
        if len(known) == 1:
            Rule(known[0], "", optional=optional).check(f"{section}.{f.name}", values[f.name])


@dataclass
class TrainConfig:
    model: dict = field(default_factory=lambda: {"name": "tiny-mixtral"})
    moe: dict = field(default_factory=lambda: {"aux_loss_coeff": 0.01})
    fold: dict = field(default_factory=lambda: {"world_size": 4, "tp": 2, "ep": 4})
    train: TrainSettings = field(default_factory=TrainSettings)
    data: DataSettings = field(default_factory=DataSettings)
    sparsity: dict = field(default_factory=dict)

    def check_types(self) -> None:
        """Every setting against its rule (type and range), in place; the first bad one raises."""
        for section in (self.train, self.data):
            name = "train" if section is self.train else "data"
            for key, rule in rules(section).items():
                setattr(section, key, rule.check(f"{name}.{key}", getattr(section, key)))
        for key, value in self.fold.items():
            if key in FOLD_KEYS:
                FOLD_RULE.check(f"fold.{key}", value)
        from meshfold.models.config import MoEConfig
        from meshfold.models.transformer import TransformerConfig

        _check_fields("model", self.model, TransformerConfig)
        _check_fields("moe", self.moe, MoEConfig)

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
        name = m.pop("name", "tiny-mixtral")
        base = get_config(name) if self.train.init_from is None else self._checkpoint_config(m)
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
            from meshfold.train.sparsity import ExpertSparsity

            sp = dict(self.sparsity)
            for key, example in (("tile", "[64, 64]"), ("schedule", "[0.25, 0.5]")):
                if key in sp and not isinstance(sp[key], (list, tuple)):
                    raise ValueError(f"sparsity.{key} = {sp[key]!r}; valid: a list, e.g. {key} = {example}")
                if key in sp:
                    sp[key] = tuple(sp[key])
            bad = sorted(set(sp) - {f.name for f in dataclasses.fields(ExpertSparsity)})
            if bad:
                raise ValueError(f"[sparsity] has no settings {bad}")
            try:
                moe = dataclasses.replace(moe, expert_sparsity=ExpertSparsity(**sp))
            except ValueError as err:
                raise ValueError(f"[sparsity] {err}") from None
        if moe is not None and "float64" in (self.train.dtype, self.train.master_dtype):
            import torch

            moe = dataclasses.replace(moe, router_dtype=torch.float64)  # no fp32 step in an fp64 run
        if moe is not None and "hidden" in m:
            moe = dataclasses.replace(moe, hidden=m["hidden"])  # the MoE layers follow the model
        bad = sorted(set(m) - {f.name for f in dataclasses.fields(base)})
        if bad:
            raise ValueError(f"[model] has no settings {bad}")
        return dataclasses.replace(base, moe=moe, **m)

    def _checkpoint_config(self, model_overrides: dict):
        """The TransformerConfig of ``train.init_from``'s config.json; [model] settings and [moe]
        settings that change shapes are refused, since the checkpoint's tensors fix them."""
        import json
        from pathlib import Path

        from meshfold.interop.hf import checkpoint_config, config_from_hf

        path = Path(self.train.init_from) / "config.json"
        if not path.is_file():
            raise ValueError(f"train.init_from = {self.train.init_from!r} is not a Hugging Face checkpoint "
                             f"folder (no config.json)")
        fixed = sorted(k for k in model_overrides if k not in ("max_seq", "mtp_loss_weight"))
        fixed += sorted(f"moe.{k}" for k in self.moe if k in SHAPE_FIELDS)
        if fixed:
            first = fixed[0] if fixed[0].startswith("moe.") else f"model.{fixed[0]}"
            raise ValueError(f"{first} with train.init_from: the checkpoint's config.json fixes the model's "
                             f"shape; drop that setting")
        try:
            hf = json.loads(path.read_text())
        except ValueError as err:
            raise ValueError(f"train.init_from {self.train.init_from}: {path} is not valid JSON ({err}); "
                             f"a Hugging Face checkpoint's config.json is a JSON object") from None
        try:
            config_from_hf(hf)  # before any tensor is looked at
            return checkpoint_config(self.train.init_from)
        except ValueError as err:
            raise ValueError(f"train.init_from {self.train.init_from}: {path}: {err}") from None

    def resolve(self) -> "Resolved":
        """These settings checked once (:meth:`validate`) and completed (``train.master_dtype``
        resolved), as a :class:`Resolved` copy the run reads and nothing rewrites; ``self`` is left
        as it was."""
        cfg = dataclasses.replace(self, model=dict(self.model), moe=dict(self.moe), fold=dict(self.fold),
                                  train=dataclasses.replace(self.train), data=dataclasses.replace(self.data),
                                  sparsity=dict(self.sparsity))
        cfg.check_types()
        cfg.train.master_dtype = master_dtype(cfg.train.dtype, cfg.train.master_dtype)  # the model config reads it
        spec, mcfg = cfg.validate()
        return Resolved(cfg, spec, mcfg)

    def validate(self):
        """Everything about the settings themselves that can be checked before any process starts
        (files and folders: meshfold.train.preflight); returns (spec, model cfg)."""
        self.check_types()
        master_dtype(self.train.dtype, self.train.master_dtype)  # a master dtype narrower than the compute one
        spec = self.fold_spec()
        cfg = self.model_config()
        t = self.train
        if t.batch % spec.dp:
            raise ValueError(f"train.batch = {t.batch} is not divisible by dp = {spec.dp} "
                             f"(valid batches: multiples of {spec.dp})")
        split = 2 * spec.cp * spec.tp if spec.cp > 1 else spec.tp
        if t.seq % split:
            raise ValueError(f"train.seq = {t.seq} is not divisible by {split} (cp = {spec.cp} "
                             f"gives 2*cp load-balanced chunks, each split over tp = {spec.tp})")
        if t.seq > cfg.max_seq:
            raise ValueError(f"train.seq = {t.seq} exceeds model max_seq = {cfg.max_seq}")
        if t.profile_steps is not None and not t.profile_steps[0] <= t.profile_steps[1] <= t.steps:
            raise ValueError(f"train.profile_steps = {t.profile_steps} must be [a, b] with a <= b <= train.steps "
                             f"= {t.steps}")
        if spec.pp == 1 and t.microbatches and (t.batch // spec.dp) % t.microbatches:
            raise ValueError(f"train.batch / dp = {t.batch // spec.dp} sequences per rank is not "
                             f"divisible by train.microbatches = {t.microbatches}")
        if t.init_from is not None and t.data_parallel != "fsdp":
            raise ValueError(f"train.data_parallel = {t.data_parallel!r} with train.init_from: a checkpoint is "
                             f"loaded into FSDP2's layout; valid: 'fsdp'")
        if spec.pp > 1 and t.init_from is not None:
            raise ValueError(f"train.init_from with fold.pp = {spec.pp}: pipeline stages do not load Hugging "
                             f"Face checkpoints yet; use pp = 1")
        if spec.pp > 1:
            from meshfold.parallel.pipeline import check_pipeline

            mb = t.microbatches or spec.pp
            try:
                check_pipeline(spec.pp, cfg, mb, t.schedule, t.virtual)
            except ValueError as err:
                raise ValueError(f"fold.pp = {spec.pp}: {err} (train.microbatches, train.schedule, "
                                 f"train.virtual)") from None
            if t.schedule in ZERO_BUBBLE and t.compile:
                raise ValueError(f"train.schedule = {t.schedule!r} with train.compile: torch splits the zero-bubble "
                                 f"schedules' backward into input and weight passes only outside torch.compile "
                                 f"regions; set compile = false, or use schedule 1f1b or interleaved-1f1b")
            if (t.batch // spec.dp) % mb:
                raise ValueError(f"train.batch / dp = {t.batch // spec.dp} sequences per rank is not "
                                 f"divisible by train.microbatches = {mb}")
            if self.sparsity:
                raise ValueError("[sparsity] with fold.pp > 1: the pruner's global threshold spans "
                                 "all layers, which pipeline stages hold apart; use pp = 1")
        if t.a2a_overlap:
            self._check_a2a_overlap(spec, cfg, t)
        mtp_moe = [i for i in range(cfg.layers, cfg.layers + cfg.mtp_depth) if cfg.is_moe_layer(i)]
        if mtp_moe and (t.expert_placement == "balanced" or self.sparsity):
            what = "train.expert_placement = 'balanced'" if t.expert_placement == "balanced" else "[sparsity]"
            raise ValueError(f"{what} with model.mtp_depth = {cfg.mtp_depth}: the multi-token-prediction blocks' "
                             f"MoE layers are not re-placed or pruned; use mtp_depth = 0 or drop {what}")
        if t.redundant_experts:
            self._check_replicas(t.redundant_experts, t.expert_placement, spec, cfg, bool(self.sparsity))
        if t.expert_placement == "balanced":
            why = ("the model has no MoE layers" if not cfg.moe_layer_ids else
                   f"fold.ep = {spec.ep}: one ep rank holds every expert" if spec.ep == 1 else
                   f"fold.pp = {spec.pp}: re-placement runs without pipeline stages" if spec.pp > 1 else
                   "[sparsity] tile masks are pruned in expert order on every rank" if self.sparsity else None)
            if why:
                raise ValueError(f"train.expert_placement = 'balanced' with {why}; valid: 'static', or "
                                 f"'balanced' with MoE layers, ep >= 2, pp = 1 and no [sparsity]")
        from meshfold.parallel.transformer_plan import check_fold

        check_fold(cfg, spec)  # the divisibility checks parallelize runs, before any process starts
        return spec, cfg

    @staticmethod
    def _check_a2a_overlap(spec, cfg, t) -> None:
        """Raise naming why ``train.a2a_overlap`` cannot run with these settings."""
        from meshfold.parallel.pipeline import check_a2a_overlap

        if cfg.moe is None or not cfg.moe_layer_ids:
            raise ValueError("train.a2a_overlap: the model has no MoE layers, so no all-to-all to overlap; "
                             "set a2a_overlap = false")
        if t.compile:
            raise ValueError("train.a2a_overlap with train.compile: compiled blocks are not run in turns; "
                             "set one of them to false")
        try:
            check_a2a_overlap(spec, t.microbatches or spec.pp, t.schedule)
        except ValueError as err:
            raise ValueError(f"train.{err} (train.microbatches, train.schedule, fold.ep)") from None

    @staticmethod
    def _check_replicas(R: int, placement: str, spec, cfg, sparsity: bool) -> None:
        """Raise naming why ``train.redundant_experts = R`` cannot run on this fold and model."""
        E = cfg.moe.num_experts if cfg.moe is not None and cfg.moe_layer_ids else 0
        why = ("the model has no MoE layers" if not E else
               f"train.expert_placement = '{placement}': copies are chosen at re-placements (valid: 'balanced')"
               if placement != "balanced" else
               f"fold.ep = {spec.ep}: one ep rank holds every expert (valid: ep >= 2)" if spec.ep == 1 else
               f"fold.pp = {spec.pp}: copies run without pipeline stages (valid: pp = 1)" if spec.pp > 1 else
               "[sparsity]: tile masks are not fetched with the copies" if sparsity else
               f"fold.ep = {spec.ep}: it is not a multiple of ep (valid: {spec.ep}, {2 * spec.ep}, ..)"
               if R % spec.ep else
               f"moe.num_experts = {E}: more copy slots than experts (valid: at most {E})" if R > E else
               f"moe.capacity_factor = {cfg.moe.capacity_factor}: copies need dropless routing"
               if cfg.moe.capacity_factor is not None else None)
        if why:
            raise ValueError(f"train.redundant_experts = {R} with {why}")


@dataclass(frozen=True)
class Resolved:
    """A run's settings, validated once: ``cfg`` (the settings, ``train.master_dtype`` resolved),
    ``spec`` (the fold) and ``model`` (the model config). Made by :meth:`TrainConfig.resolve`
    before any rank starts; the ranks, the build and the dry run read it and change nothing."""

    cfg: TrainConfig
    spec: FoldSpec
    model: Any
    train: TrainSettings = field(init=False, repr=False)  # cfg.train, the settings read most

    def __post_init__(self):
        object.__setattr__(self, "train", self.cfg.train)


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
        except IsADirectoryError:
            raise ValueError(f"--config {path} is a folder; give a TOML file") from None
        except OSError as err:
            raise ValueError(f"--config {path}: {err.strerror or err}") from None
        except UnicodeDecodeError as err:
            raise ValueError(f"--config {path}: not UTF-8 text (byte {err.object[err.start]:#04x} at offset "
                             f"{err.start}); a TOML file is UTF-8") from None
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

"""``meshfold dryrun``: one training step of an N-rank job, per representative rank, without
tensor data (see :mod:`meshfold.dryrun.engine` and docs/dryrun.md).

Layer: above ``meshfold.train`` (it runs train's step on fake tensors) and the planner
(:mod:`.check` compares the two); never testing or cli (``tests/test_layers.py``).
"""

from meshfold.dryrun.engine import RankReport, dry_run, dry_run_rank, record_block_counts, representative_ranks, step_report
from meshfold.dryrun.record import KINDS, CollectiveLog, HostReads, LivePeak, StepRecorder, dim_names, summary
from meshfold.dryrun.routing import Balanced, Replay, Zipf, parse_routing

__all__ = ["RankReport", "dry_run", "dry_run_rank", "record_block_counts", "representative_ranks", "step_report",
           "KINDS", "CollectiveLog", "HostReads", "LivePeak", "StepRecorder", "dim_names", "summary",
           "Balanced", "Replay", "Zipf", "parse_routing"]

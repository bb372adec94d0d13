"""Shared fixtures: one spawned gloo world per size, reused by every multi-rank check.

Starting a rank costs a torch import (seconds on two cores), so tests never spawn per check:
they ask ``worlds(n)`` for the session's n-rank world and ``run`` functions on it. Ranks fork from
a server that has imported torch and meshfold's parallel, training and dry-run code once
(``PRELOAD_MODULES``; the code cannot change while the session runs).

Hypothesis: every property states its example count (``@settings(max_examples=N)``). The ``ci``
profile (``.ci/run`` selects it: ``HYPOTHESIS_PROFILE=ci``, or ``CI`` set) draws the same examples
on every run and does not shrink: a failure prints the falsifying example and its
``@reproduce_failure`` blob to rerun and shrink locally, where ``default`` shrinks (cheaply: a
world whose ranks all finished a failing example stays up).
"""

import os

import pytest
from hypothesis import HealthCheck, Phase, settings

from meshfold.runtime import launch
from meshfold.runtime.launch import World

settings.register_profile(
    "default", max_examples=25, deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
settings.register_profile(
    "ci", parent=settings.get_profile("default"), derandomize=True, print_blob=True,
    phases=[p for p in Phase if p not in (Phase.shrink, Phase.explain)])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE") or ("ci" if os.environ.get("CI") else "default"))

PRELOAD_MODULES = ("meshfold.parallel.transformer", "meshfold.parallel.pipeline", "meshfold.train.loop",
                   "meshfold.testing.worlds", "meshfold.testing.references", "meshfold.dryrun")
launch.preload(*PRELOAD_MODULES)


@pytest.fixture(scope="session")
def worlds():
    """``worlds(n)`` returns a live n-rank :class:`meshfold.runtime.launch.World` shared by the session."""
    cache: dict[int, World] = {}

    def get(n: int) -> World:
        if n not in cache:
            cache[n] = World(n, timeout=60.0)
        return cache[n]

    yield get
    for w in cache.values():
        w.close()

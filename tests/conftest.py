"""Shared fixtures: one spawned gloo world per size, reused by every multi-rank check.

Starting a rank costs a torch import (seconds on two cores), so tests never spawn per check:
they ask ``worlds(n)`` for the session's n-rank world and ``run`` functions on it.
"""

import os

import pytest
from hypothesis import HealthCheck, settings

from meshfold.runtime.launch import World

settings.register_profile(
    "default", max_examples=25, deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
settings.register_profile(
    "ci", parent=settings.get_profile("default"), derandomize=True, print_blob=True)
settings.load_profile("ci" if os.environ.get("CI") else os.environ.get("HYPOTHESIS_PROFILE", "default"))


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

"""The model-based suite (see tests/model_based.py for the rules and the invariants it checks).

The CI profile runs a few seeds of 40 steps each in the default suite; ``-m slow`` adds the long profile.
``SA_OUTBOX_MODEL_SEEDS=7,8,9`` replays given seeds (a failure prints its seed and the last steps).
"""

from __future__ import annotations

import os
import time

import pytest
from sqlalchemy import Engine
from sqlalchemy.engine import URL

from .model_based import Profile, run_scenario

_given = os.environ.get("SA_OUTBOX_MODEL_SEEDS")
# Fixed seeds keep CI reproducible; one more from the clock explores new interleavings on every run.
SEEDS = [int(s) for s in _given.split(",")] if _given else [1, 2, 3, int(time.time()) % 100_000]


_FIXED = (1, 2, 3)
_sent_ahead: dict[int, int] = {}
_holds: dict[int, int] = {}


@pytest.mark.parametrize("seed", SEEDS)
def test_model_based_ci_profile(engine: Engine, async_url: URL, seed: int) -> None:
    scenario = run_scenario(seed, engine, async_url, Profile(steps=40))
    if not _given and seed in _FIXED:
        # Sync inline workers with instant handlers send their claims ahead of the jobs in hand (a burst rule
        # gives them jobs no other worker takes; when they run depends on timing, so coverage is checked over
        # the fixed seeds together): the invariants were checked with that path under terminations and stops.
        # Likewise a transaction held a running job's row past stale_after in one of them at least (I9).
        _sent_ahead[seed] = scenario.sent_ahead
        _holds[seed] = len(scenario.holds)
        if set(_sent_ahead) == set(_FIXED):
            assert sum(_sent_ahead.values()) > 0, f"no claim was sent ahead in seeds {_FIXED}"
            assert sum(_holds.values()) > 0, f"no job row was held past stale_after in seeds {_FIXED}"


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(100, 120))
def test_model_based_long_profile(engine: Engine, async_url: URL, seed: int) -> None:
    run_scenario(seed, engine, async_url, Profile(steps=250, max_dispatchers=4, max_workers=4))

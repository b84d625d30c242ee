"""The deterministic fault campaign (see ``fault_campaign.py``): a few hundred seeds of
simulated engines, network faults and restarts; every quiet moment, every source is its
engine's exact residency or visibly not live. ``bench/soak_faults.py`` runs 100,000+.

The named seeds below each broke the promise once (found by the campaign) and are kept
as regression tests of the rule that fixed them."""

from __future__ import annotations

import pytest

from tests.transport.fault_campaign import FAULTS, Stats, run_seed


def test_a_few_hundred_seeds_never_leave_a_source_live_and_wrong():
    total = Stats()
    for seed in range(300):
        total.add(run_seed(seed))
    assert total.silent_wrong == 0
    # The campaign really injects every kind of fault and checks many quiet moments.
    assert set(total.faults) == set(FAULTS), total.faults
    assert total.checks >= 1000 and total.states["live"] > total.states["stale"] > 0


@pytest.mark.parametrize("seed,case", [
    (9, "restart whose new batches are all lost: the reconnect verifies the anchor"),
    (291, "a burst lost whole while idle: periodic probes after the last one"),
    (20, "a probe timer that fired while a request was out is armed again"),
    (38, "a source joined with an empty buffer probes too (nothing live seen yet)"),
    (320, "live messages held across a restart: the reconnect drops them and verifies"),
    (931, "a reply without the anchor first is never yielded"),
    (525, "a reconnect right after a snapshot (anchor unknown) rebuilds"),
    (4659, "a snapshot tagged below a seq already seen live is another instance"),
    (247, "a probe that found a lost tail looks again soon"),
    (5389, "a probe is a short answer: vLLM's HWM cannot hole it"),
])
def test_regression_seed(seed, case):
    assert run_seed(seed).silent_wrong == 0, case

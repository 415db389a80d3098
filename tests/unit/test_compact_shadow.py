"""The compact index against the meta's own index, under the meta's own hypothesis
state machines (tests/unit/test_meta_state_machine.py: puts, commits, aborts,
leases, evictions, server restarts, session ends; test_meta_tiers_state_machine.py:
two tiers, demotions and their failures, promotions, NVMe eviction): after every
step a :class:`~tests.unit.compact_shadow.CompactShadow` applies what the step
changed through the compact index's API and checks that what it derived (children
and hot counts, which objects are evictable, each tier's LRU victim, prefixes,
objects detached while leased) is what the meta holds. The machines' own
invariants run as before."""

from __future__ import annotations

from hypothesis import settings
from hypothesis.stateful import invariant

from tests.unit.compact_shadow import CompactShadow
from tests.unit.test_meta_state_machine import MetaMachine
from tests.unit.test_meta_tiers_state_machine import TierMachine


class ShadowedMeta(MetaMachine):
    def __init__(self) -> None:
        super().__init__()
        self.shadow = CompactShadow(self.core)

    @invariant()
    def compact_index_agrees(self) -> None:
        self.shadow.sync()
        self.shadow.check()


class ShadowedTiers(TierMachine):
    def __init__(self) -> None:
        super().__init__()
        self.shadow = CompactShadow(self.core)

    @invariant()
    def compact_index_agrees(self) -> None:
        self.shadow.sync()
        self.shadow.check()


ShadowedMeta.TestCase.settings = settings(max_examples=100, stateful_step_count=40, deadline=None)
test_compact_follows_the_meta = ShadowedMeta.TestCase
ShadowedTiers.TestCase.settings = settings(max_examples=100, stateful_step_count=50, deadline=None)
test_compact_follows_the_meta_tiers = ShadowedTiers.TestCase

"""The decode plan cache (snapmla_cli/ops/decode_launch.py): dropping the plans of freed
work lists must never drop a live plan under a key that a freed list queued (another thread
may have stored a newer plan under that key between its queueing and the drain)."""

from __future__ import annotations

import weakref

import torch

from snapmla_cli.ops import decode_launch as dl


class _Plan:  # what _drop_freed reads of a plan: its weak reference to the work list
    def __init__(self, metadata):
        self.metadata = weakref.ref(metadata)


def test_a_queued_key_whose_plan_is_live_keeps_its_plan():
    dl.clear_plans()
    try:
        live = torch.zeros(4, dtype=torch.int32)
        dl._PLANS[("k",)] = _Plan(live)
        dl._FREED_KEYS.append(("k",))  # queued by a list freed earlier under the same key
        dl.store_plan(("other",), _Plan(live))  # (any first call drains the queue)
        assert ("k",) in dl._PLANS and not dl._FREED_KEYS
        dead = torch.zeros(4, dtype=torch.int32)
        dl._PLANS[("d",)] = _Plan(dead)
        dl._FREED_KEYS.append(("d",))
        del dead
        dl.store_plan(("other2",), _Plan(live))
        assert ("d",) not in dl._PLANS  # a dead plan goes
    finally:
        dl.clear_plans()

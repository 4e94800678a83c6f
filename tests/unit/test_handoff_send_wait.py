"""Sending a handed-off request waits for its own blocks only (services/worker/tier/
tcp_handoff.py, `flush_request`): the transfer thread takes a prefill worker's saves in order,
each waiting for its step on the device, so waiting for everything queued made a request's
handoff wait for the steps launched after its last one (a long prompt's: hundreds of ms).
Here a save stuck on its step (a stand-in for the device's event) holds back the requests
whose blocks it holds, and no other."""

from __future__ import annotations

import threading

import torch

from meshserve.services.worker.tier.kv_tier import SaveJob
from meshserve.services.worker.tier.tcp_blocks import BlockHolder
from meshserve.services.worker.tier.tcp_handoff import TcpTransfer

LAYERS, BLOCKS, BLOCK, HEADS, DIM = 2, 4, 2, 1, 4


class StuckStep:
    """A step's event that the device has not reached until `reach`."""

    def __init__(self) -> None:
        self._reached = threading.Event()

    def synchronize(self) -> None:
        assert self._reached.wait(10), "the test never let the step finish"

    def reach(self) -> None:
        self._reached.set()


def save(tag: int, owners: set[str], ready: object = None) -> SaveJob:
    data = torch.full((1, LAYERS, 2, BLOCK, HEADS, DIM), float(tag))
    return SaveJob(hashes=[bytes([tag]) * 32], parents=[b""], data=data,
                   ready=ready, owners=frozenset(owners))  # type: ignore[arg-type]


def test_a_request_waits_for_its_own_saves_not_for_later_steps() -> None:
    storage = torch.zeros(LAYERS, 2, BLOCKS, BLOCK, HEADS, DIM)
    transfer = TcpTransfer([(storage[i, 0], storage[i, 1]) for i in range(LAYERS)],
                           holder=BlockHolder(1 << 20, 60.0))
    transfer.start()
    step = StuckStep()
    try:
        transfer.submit(save(1, {"a"}))
        transfer.submit(save(2, {"b", "c#1"}, step))  # a later step, still on the device
        assert transfer.flush_request("a", 5.0), "a's blocks were held already"
        assert transfer.holder is not None
        assert transfer.holder.num_held([bytes([1]) * 32]) == 1
        assert transfer.flush_request("unknown", 0.0), "nothing of it is being saved"
        # Those of the stuck step wait for it: b, and c by its sibling sequence c#1.
        assert not transfer.flush_request("b", 0.2)
        assert not transfer.flush_request("c", 0.2)
        assert not transfer.flush(0.2), "waiting for everything waits for the step too"
        step.reach()
        assert transfer.flush_request("c", 5.0) and transfer.flush_request("b", 5.0)
        assert transfer.holder.num_held([bytes([2]) * 32]) == 1
    finally:
        step.reach()
        transfer.stop()

"""The host model's asynchronous bulk copies and mbarriers (ffi/cuda/host/runtime.h): a ring of copies
used right gives the data; each mistake a GPU would turn into stale data, a hang or a fault fails the
launch with its cause. The probe kernel is ffi/cuda/host/probes.cu's bulk_ring: 256 ints through a
two-stage ring, 16 a copy; its argument plants one mistake."""

from __future__ import annotations

import pytest
from helpers.cuda_host import module, needs_module

pytestmark = needs_module

MODES = ["none", "no_wait", "short_tx", "misaligned", "exit_in_flight", "overwrite", "wrong_parity", "only_one_waits"]
MISTAKES = {
    "no_wait": r"thread 0 \(warp 0, lane 0\): shared load at .*probes.cu:\d+ of bytes a bulk copy "
    r"\(issued at .*probes.cu:\d+\) writes while it is in flight",
    "only_one_waits": r"thread 1 \(warp 0, lane 1\): shared load at .*probes.cu:\d+ of bytes a bulk copy "
    r"\(issued at .*probes.cu:\d+\) writes, before this thread waited on its mbarrier",
    "short_tx": r"mbarrier wait at .*probes.cu:\d+ for the phase of parity 0 never ends: the mbarrier is in "
    r"phase 0 with 0 arrival\(s\) and 64 byte\(s\) pending",
    "misaligned": r"bulk copy at .*probes.cu:\d+ of 24 bytes: the size and both addresses must be multiples of 16",
    "exit_in_flight": r"block \(0, 0, 0\): the block exits with an asynchronous copy in flight",
    "overwrite": r"bulk copy at .*probes.cu:\d+ into bytes another copy in flight writes",
    "wrong_parity": r"shared load at .*probes.cu:\d+ of bytes a bulk copy .* while it is in flight",
}


def test_a_ring_of_bulk_copies_gives_the_data():
    out = module.probe("bulk_ring", 512, MODES.index("none"))
    assert out == list(range(256)) + [2 * i for i in range(256)]


@pytest.mark.parametrize("mistake", sorted(MISTAKES))
def test_each_mistake_fails_the_launch_with_its_cause(mistake):
    with pytest.raises(
        RuntimeError, match=r"probe launch failed: nvfp4 CUDA host model: kernel .*bulk_ring, .*" + MISTAKES[mistake]
    ):
        module.probe("bulk_ring", 512, MODES.index(mistake))
    assert module.probe("bulk_ring", 512, 0)[256:] == [2 * i for i in range(256)]  # the next launch runs

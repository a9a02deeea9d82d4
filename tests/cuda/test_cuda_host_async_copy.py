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


# Tensor copies: probes.cu's tensor_boxes copies 4 x 8 boxes of a [2, 5, 24] int tensor (values 1..240) at these
# (column, row, entry) coordinates, some past an edge; its argument plants one mistake.
BOXES_AT = [(0, 0, 0), (16, 1, 0), (20, 3, 1), (-4, -2, 1), (8, 4, 0), (0, 0, 2)]
TENSOR_MODES = ["none", "unencoded", "unaligned", "box_tx_short"]


def expected_boxes() -> list[int]:
    import numpy as np

    tensor = np.arange(1, 241).reshape(2, 5, 24)
    out = []
    for col, row, entry in BOXES_AT:
        box = np.zeros((4, 8), np.int64)
        for r in range(4):
            for c in range(8):
                b, i, j = entry, row + r, col + c
                if 0 <= b < 2 and 0 <= i < 5 and 0 <= j < 24:
                    box[r, c] = tensor[b, i, j]
        out += box.ravel().tolist()
    return out


def test_tensor_copies_give_their_boxes_with_zeros_outside_the_tensor():
    out = module.probe("tensor_boxes", 32 * len(BOXES_AT), TENSOR_MODES.index("none"))
    assert out == expected_boxes()
    assert out[32 * 3 : 32 * 4].count(0) == 24 and not any(out[32 * 5 :])  # the checks see the zero fill


TENSOR_MISTAKES = {
    "unencoded": r"tensor copy at .*probes.cu:\d+ through a map never encoded",
    "unaligned": r"tensor copy at .*probes.cu:\d+: its shared-memory destination must be 128-byte aligned",
    "box_tx_short": r"its copies completed more bytes than expect_tx announced",
}


@pytest.mark.parametrize("mistake", sorted(TENSOR_MISTAKES))
def test_each_tensor_copy_mistake_fails_the_launch(mistake):
    with pytest.raises(RuntimeError, match=r"probe launch failed: .*tensor_boxes, .*" + TENSOR_MISTAKES[mistake]):
        module.probe("tensor_boxes", 32 * len(BOXES_AT), TENSOR_MODES.index(mistake))


REFUSALS = {
    1: "the base is not 16-byte aligned",
    2: r"a dimension outside 1..2\^32",
    3: r"a stride not a multiple of 16 below 2\^40",
    4: "a stride below the extent of the dimension under it",
    5: "a box size outside 1..256",
    6: "the box's innermost size is not a multiple of 16 bytes",
}


@pytest.mark.parametrize("case", sorted(REFUSALS))
def test_the_model_refuses_the_tensor_maps_the_driver_refuses(case):
    module.probe("tensor_map_refusal", 0, 0)  # the probe's valid map encodes
    with pytest.raises(RuntimeError, match=REFUSALS[case]):
        module.probe("tensor_map_refusal", 0, case)

"""What a profiler would count for the CUDA quantize, dequantize and grouped quantize kernels, read from the host
model without a GPU (tests/helpers/counters.py): the code index each copy takes, bytes moved against the minimum,
coalescing of global accesses and bank conflicts in shared memory, held to budgets.

The inputs are N(0, 1) bfloat16 tensors of whole 64 x 256 tiles (the steady state of a large tensor);
the budgets are issue 48's where the kernel meets them, else today's figure with what misses named.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_same_tree, cuda_host, random_normal
from helpers.counters import (
    Launch,
    dequantize_launches,
    grouped_quantize_launches,
    only,
    quantize_launches,
    quantized_bytes,
    run_traced,
    traced,
)
from helpers.cuda_host import needs_module

import jax_nvfp4
from jax_nvfp4.core.spec import QuantizeSpec

pytestmark = needs_module

SHAPE = (128, 512)  # 2 x 2 tiles
KERNEL = "quantize_kernel"
SPECS = {
    "row+col 1x16": dict(columnwise=True),
    "row only": dict(),
    "col only": dict(rowwise=False, columnwise=True),
    "row+col 16x16": dict(columnwise=True, block_2d=True),
    "stochastic rounding": dict(columnwise=True, stochastic_rounding=True),
    "rht": dict(columnwise=True, rht=True),
}


def api_options(options) -> dict:
    """The quantize API's keywords for a spec of SPECS (stochastic rounding: a key)."""
    options = dict(options)
    if options.pop("stochastic_rounding", False):
        options["rng_key"] = jax.random.key(3)
    return options


def quantize_traced(x, sm: int = 90, **options) -> Launch:
    """The quantize kernel's launch of cuda_host.quantize(x, **options) (amax passes not counted)."""
    return only(quantize_launches(x, sm, **api_options(options))[1], KERNEL)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("block_2d", [False, True])
def test_nearest_rounding_takes_the_fast_index(dtype, block_2d):
    """Normal data takes the fast code index: the class table's plain index on sm_90, the E2M1 convert on
    sm_100a. (Every copy took a tie-safe index before the scale codes a copy cannot have were left out.)"""
    x = random_normal(SHAPE, 0, dtype)
    opts = dict(columnwise=True, block_2d=block_2d)
    hopper = quantize_traced(x, **opts).paths
    assert hopper.get("rowwise index: fast", 0) > 0, hopper
    assert not [p for p in hopper if "tie-safe" in p], hopper
    assert hopper.get("nearest8: class table", 0) > 0, hopper
    blackwell = quantize_traced(x, sm=100, **opts).paths
    assert blackwell.get("nearest8: E2M1 convert", 0) > 0, blackwell
    assert not [p for p in blackwell if "table" in p], blackwell


@pytest.mark.parametrize("sm", [90, 100])
@pytest.mark.parametrize("amax", [2688.0, -2688.0])
def test_a_possible_tie_takes_the_tie_safe_index_and_the_cpu_bytes(amax, sm):
    """With amax 2688 a block scale of 1.0 makes 0.25 a product that is a round-down tie: both copies take the
    tie-safe index (sm_90: the class table on tie-safe bits; sm_100a: the E2M1 convert, which rounds ties as
    the reference does, of x * enc + 0, and no table), and the bytes are the CPU kernel's. A negative amax
    (traced: a concrete one is refused) gives block scale codes with the sign bit, which then decide the
    index."""
    x = random_normal(SHAPE, 1, jnp.bfloat16).at[::7, ::5].set(0.25)
    a = jnp.float32(amax)

    def quantize(api):
        return lambda x, a: api.quantize(x, amax=a, columnwise=True)

    with cuda_host.emulating(sm):
        got, launches = run_traced(quantize(cuda_host), x, a)
    paths = only(launches, KERNEL).paths
    safe = "class tie-safe" if sm == 90 else "convert tie-safe"
    assert paths.get(f"rowwise index: {safe}", 0) > 0, paths
    assert paths.get(f"columnwise index: {safe}", 0) > 0, paths
    assert not [p for p in paths if p.endswith("index: fast")], paths
    if sm == 100:
        assert paths.get("nearest8: E2M1 convert, tie-safe", 0) > 0, paths
        assert not [p for p in paths if "table" in p], paths
    assert_same_tree(got, jax.jit(quantize(jax_nvfp4))(x, a))


def test_row_scaled_copies_take_a_tie_safe_index():
    paths = quantize_traced(random_normal(SHAPE, 2), columnwise=True, row_scaled=True).paths
    assert paths.get("rowwise index: class tie-safe", 0) > 0, paths


@pytest.mark.parametrize("name", list(SPECS))
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_each_input_byte_is_read_once_and_each_output_byte_written_once(name, dtype):
    options = SPECS[name]
    x = random_normal(SHAPE, 4, dtype)
    launch = quantize_traced(x, **options)
    loads = Launch.total([s for s in launch.select("global", "load") if s.size >= 8])  # the input's
    assert loads.bytes == x.nbytes
    assert Launch.total(launch.select("global", "store")).bytes == quantized_bytes(x, **api_options(options))


@pytest.mark.parametrize("name", list(SPECS))
def test_global_data_accesses_are_coalesced(name):
    """The input's 16-byte loads and the codes' 16-byte stores take no sector more than their bytes fill.
    Not held: the scales' stores (16 bytes a row, 4 bytes a column of a 64-row tile: 2x and 4x the fewest
    sectors) and float32 rows of fewer than 8 values."""
    launch = quantize_traced(random_normal(SHAPE, 5), **SPECS[name])
    data = [s for s in launch.select("global", size=16) if s.bytes >= launch.total(launch.select("global")).bytes / 8]
    assert data
    total = Launch.total(data)
    assert total.transactions <= 1.05 * total.ideal, data


def table_lookups(launch: Launch):
    return Launch.total(launch.select("shared", "load", file="e2m1_lut.cuh"))


@pytest.mark.parametrize(
    "options", [SPECS["row+col 1x16"], SPECS["row+col 16x16"], SPECS["rht"], dict(columnwise=True, row_scaled=True)]
)
def test_class_table_lookups_are_conflict_free(options):
    """N(0, 1) data: each lane reads its own copy of the sm_90 class table (bank = lane), so a warp's
    lookup takes one wavefront, fast and tie-safe index alike: issue 48's budget is 1.5. (The 64 KB pair
    table it replaced took 4.3 swizzled and 10.1 unswizzled: its bank followed the products' exponents.)"""
    launch = quantize_traced(random_normal(SHAPE, 6), **options)
    assert any("class table" in p for p in launch.paths), launch.paths
    lookups = table_lookups(launch)
    assert lookups.requests > 0
    assert lookups.per_request <= 1.0, lookups


@pytest.mark.parametrize("sm", [90, 100])
def test_stochastic_rounding_reads_no_table(sm):
    """Stochastic rounding's positions are float16 arithmetic, two values a word: no shared-memory lookup at all,
    which meets issue 48's budget of 1.5 wavefronts a lookup by having none (its 64 KB position table took 3.5 on
    N(0, 1) data: a table indexed by the data cannot get much below that)."""
    launch = quantize_traced(random_normal(SHAPE, 10), sm, **SPECS["stochastic rounding"])
    assert launch.paths.get("stochastic8: float16 pairs, fast", 0) > 0, launch.paths
    assert not launch.select("shared", "load", file="e2m1_lut.cuh")


@pytest.mark.parametrize("sm", [90, 100])
@pytest.mark.parametrize(
    "options",
    [dict(four_over_six_error="mse"), dict(four_over_six_error="mae", four_over_six_fast_math=True, e4m3_max=256)],
    ids=["mse", "mae fast 256"],
)
def test_four_over_six_lookups_take_about_two_wavefronts(options, sm):
    """4over6's 1x16 candidates look up each product's rounded value by its float16 class (four_over_six.cuh's
    rounded2: 1 KB, one float a class) and each block's scales by code. The value lookups are NOT at issue 48's
    1.5 wavefronts: 2.1 on N(0, 1) data, held here at 2.2, because a class and its negative share a bank (the
    sign is the class's top bit). Left so: 4over6 is compute-bound, and for 32 elements a warp issues 60-85
    instructions (15-21 multiprocessor clocks at 4 a clock) against two lookups at 2.1 wavefronts (4.2 clocks of
    the shared-memory pipe), so a swizzle's two instructions a lookup would cost more than the conflicts do.
    The scales' lookups (a pair of lanes reads one code) take one."""
    launch = only(quantize_launches(random_normal(SHAPE, 6), sm, columnwise=True, **options)[1], "4over6")
    lookups = launch.select("shared", "load", file="four_over_six.cuh")
    values = Launch.total([s for s in lookups if s.requests == max(t.requests for t in lookups)])
    scales = Launch.total([s for s in lookups if s.requests < max(t.requests for t in lookups)])
    assert values.requests > 0 and scales.requests > 0, lookups
    assert values.transactions <= 2.2 * values.requests, lookups
    assert scales.transactions == scales.requests, lookups


@pytest.mark.parametrize("name", ["row+col 1x16", "row+col 16x16", "stochastic rounding"])
def test_staging_in_shared_memory_is_nearly_conflict_free(name):
    """The staged outputs (stores of codes and scales, their reads for the 16-byte global stores) and the
    encode-scale table: at most 1.5 wavefronts over the fewest. Not held per site: the rowwise scales'
    byte stores and the columnwise codes' 8-byte stores are 2-way (a lane pair writes rows 8 apart)."""
    launch = quantize_traced(random_normal(SHAPE, 7), **SPECS[name])
    staging = Launch.total(launch.select("shared", file="quantize.cu"))
    assert staging.transactions <= 1.5 * staging.ideal, launch.select("shared", file="quantize.cu")


@pytest.mark.parametrize("out_dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("per_row", [False, True])
def test_dequantize_reads_codes_once_and_writes_whole_sectors(out_dtype, per_row):
    """The dequantize kernel of whole 16-value blocks: each code byte read once, each output byte written
    once, and every global access in the fewest sectors its bytes fill (issue 48's budget: 1.05). A thread
    takes the values of one 16-byte store, so a warp's stores fill 512 consecutive bytes; a block's pieces
    read its scale byte together (one sector for a warp's 16 or 8 scales). Before: a thread a block stored
    32 (bfloat16) or 64 (float32) bytes, each 16-byte store of a warp touching 32 half-filled sectors, 2.0."""
    x = random_normal(SHAPE, 9)
    t = jax_nvfp4.quantize(x, row_scaled=per_row)
    out, launches = dequantize_launches(t, out_dtype)
    assert_same_tree(out, jax_nvfp4.dequantize(t, out_dtype))
    launch = only(launches, "dequantize")
    pieces = 16 // jnp.dtype(out_dtype).itemsize  # values a thread stores
    (codes,) = launch.select("global", "load", size=pieces // 2)
    (scales,) = launch.select("global", "load", size=1)
    (stores,) = launch.select("global", "store")
    assert (codes.bytes, stores.bytes, stores.size) == (t.data.nbytes, out.nbytes, 16)
    assert scales.bytes == t.scale.nbytes * (16 // pieces)  # a block's pieces read its scale
    for site in (codes, scales, stores):
        assert site.transactions <= 1.05 * site.ideal, site


@pytest.mark.parametrize("load", ["direct", "ring"])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_grouped_quantize_reads_the_input_once(dtype, load, monkeypatch):
    """The grouped quantize (a mixture of experts' tokens, jax_nvfp4/ops/grouped.py) of rows in two groups and
    16 rows in none: one kernel reads each input byte once (a warp's 32 consecutive columns: the fewest sectors)
    and writes the grouped copy and the groups' rows' rowwise copy from it; the rows in no group are another
    kernel's, which reads nothing (their values are zeros). Its shared memory (the tile's values for the
    rowwise blocks, the grouped copy's staged codes and scales) takes the fewest wavefronts, and the rowwise
    codes the fewest sectors. The grouped copy's stores, staged 8 layout blocks of a line together (64 code
    bytes, 8 scale bytes) in lines of P = 17 blocks, not aligned to sectors: codes 1.5x the fewest sectors,
    scales under 3x (before: a thread a column stored 8 bytes and a byte P blocks apart, 4x and 32x). Not
    held, what misses: the rowwise scales (8 bytes a row of a 128-column tile: 4x). The same with the values
    loaded by the ring kernel (NVFP4_QUANTIZE_LOAD=ring): a bulk copy a row of the owner's, and the rowwise
    blocks' 16-byte reads of the stage rotated so that a row's 8 blocks fall on different banks."""
    monkeypatch.setenv("NVFP4_QUANTIZE_LOAD", load)
    x = random_normal((1, 256, 512), 11, dtype)
    sizes = np.array([[100, 140]], np.int32)
    _, launches = grouped_quantize_launches(x, sizes, QuantizeSpec(columnwise=True))
    tiles = only(launches, "grouped_ring_kernel" if load == "ring" else "grouped_tiles_kernel")
    rows = only(launches, "grouped_rows_kernel")
    (loads,) = tiles.select("global", "load")
    assert loads.bytes == x[:, :240].nbytes  # the rows in groups, once
    assert loads.transactions <= 1.05 * loads.ideal, loads
    assert sum(site.bytes for site in rows.select("global", "load")) == 0
    assert sum(site.bytes for site in rows.select("global", "store")) == 16 * (512 // 2 + 512 // 16)
    for site in tiles.select("shared"):
        assert site.transactions <= 1.05 * site.ideal, site
    blocks = x.shape[2] * (256 // 16 + 2 - 1)  # blocks of the grouped copy
    (row_codes,) = [s for s in tiles.select("global", "store", size=8) if s.bytes < blocks * 8]
    (codes,) = [s for s in tiles.select("global", "store", size=8) if s.bytes == blocks * 8]
    (scales,) = [s for s in tiles.select("global", "store", size=1) if s.bytes == blocks]
    assert row_codes.transactions <= 1.05 * row_codes.ideal, row_codes
    assert codes.transactions <= 1.55 * codes.ideal, codes
    assert scales.transactions <= 3 * scales.ideal, scales


def test_the_profiler_sees_element_loads_that_span_rows():
    """The counters themselves, on the kernel: the same quantize on a shape whose rows are not a multiple
    of 8 values loads element by element (2-byte loads of a warp span 16 rows: more sectors than bytes)."""
    x = random_normal((64, 250), 8)
    launch = quantize_traced(x)
    loads = Launch.total(launch.select("global", "load", size=2))
    assert loads.bytes == x.nbytes
    assert loads.transactions > 2 * loads.ideal


@pytest.mark.parametrize(("stride", "wavefronts"), [(0, 1), (1, 1), (2, 2), (8, 8), (32, 32), (33, 1)])
@pytest.mark.parametrize(("out_stride", "sectors"), [(1, 4), (2, 8), (8, 32)])
def test_the_profiler_counts_a_known_pattern(stride, wavefronts, out_stride, sectors):
    """A probe kernel (ffi/cuda/host/probes.cu): 32 lanes load shared words `stride` apart (a bank serves
    gcd(stride, 32) distinct words; one word for all is a broadcast) and store 4-byte ints `out_stride`
    apart (128 bytes fill 4 sectors); the predicated second store by the even lanes only counts their
    bytes and keeps the requests of the later lanes aligned."""
    with traced() as launches:
        out = cuda_host.module.probe("access_pattern", 32 * 8, stride, out_stride, mask=0x55555555)
    assert out[: 32 * out_stride : out_stride] == [lane * stride % 1024 for lane in range(32)]
    launch = only(launches, "access_pattern")
    (load,) = launch.select("shared", "load")
    assert (load.requests, load.transactions, load.ideal) == (1, wavefronts, 1)
    first, second = sorted(launch.select("global", "store"), key=lambda s: s.site)
    assert (first.requests, first.transactions, first.ideal, first.bytes) == (1, sectors, 4, 128)
    assert (second.requests, second.bytes) == (1, 64)

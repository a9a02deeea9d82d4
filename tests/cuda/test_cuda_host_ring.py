"""The quantize kernel's pipelined variant (ffi/cuda/quantize.cu, Load::kRing: asynchronous copies of the next
tiles into a ring of shared-memory stages, completing on mbarriers) gives the CPU kernels' bytes, on the
host model, which also checks every copy and wait (ffi/cuda/host/runtime.h). The environment switch
NVFP4_QUANTIZE_LOAD=ring picks it where it applies (inputs with rows of whole 16-byte chunks, every rounding mode:
nearest, stochastic and 4over6; float32's values are read from the stage itself), its stages filled by one tensor
copy a tile (a tensor map of the input, zeros past its edges); NVFP4_QUANTIZE_LOAD=ring-rows fills them by a bulk
copy a row. Elsewhere (other rows, float32 where two of its 64 KB stages do not fit) the direct kernel runs."""

from __future__ import annotations

import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import (
    GOLDEN_DIR,
    assert_golden,
    assert_same_tree,
    assert_sr_vector,
    cases,
    cuda_host,
    load,
    load_sr,
    option_cases,
    random_normal,
    sr_cases,
    sr_vector_run,
)
from helpers.counters import Launch, only, quantize_launches, run_traced
from helpers.cuda_host import needs_module

import jax_nvfp4

pytestmark = needs_module

OPTIONS = {
    "row+col": dict(columnwise=True),
    "row": dict(),
    "col": dict(rowwise=False, columnwise=True),
    "16x16": dict(columnwise=True, block_2d=True),
    "row-scaled": dict(columnwise=True, row_scaled=True),
    "rht": dict(columnwise=True, rht=True),
    "amax given": dict(columnwise=True, amax=jnp.float32(3.0)),
    "4over6": dict(columnwise=True, four_over_six_error="mse", e4m3_max=256),
}
# (shape): several tiles a block (the ring turns over), ragged rows and columns, batch entries.
SHAPES = [(256, 1024), (200, 520), (3, 72, 264), (16, 8)]


# NVFP4_QUANTIZE_LOAD's values for the ring and how each fills its stages (the kernel's path).
FILLS = {"ring": "stage fill: a tensor copy a tile", "ring-rows": "stage fill: a bulk copy a row"}


def quantize_asking_for_the_ring(x, sm, monkeypatch, fill="ring", **options):
    """cuda_host.quantize(x) with NVFP4_QUANTIZE_LOAD=fill: (result, the quantize kernel's launch)."""
    monkeypatch.setenv("NVFP4_QUANTIZE_LOAD", fill)
    got, launches = quantize_launches(x, sm, **options)
    (launch,) = [launch for launch in launches if "quantize" in launch.kernel]
    if "ring" in launch.kernel:
        assert {p for p in launch.paths if p.startswith("stage fill: ")} == {FILLS[fill]}
    return got, launch


# (fill, dtype, sm): the tensor copies on both targets and 16-bit dtypes; the fill by rows, the same on every
# target, on sm_90 and bfloat16; float32 (its values read from the stage, the rows past the input zeroed there
# where the fill by rows leaves them) with either fill.
FILL_CASES = [("ring", dtype, sm) for dtype in (jnp.bfloat16, jnp.float16) for sm in (90, 100)] + [
    ("ring-rows", jnp.bfloat16, 90),
    ("ring", jnp.float32, 90),
    ("ring-rows", jnp.float32, 100),
]


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("name", list(OPTIONS))
@pytest.mark.parametrize(("fill", "dtype", "sm"), FILL_CASES, ids=lambda v: getattr(v, "__name__", str(v)))
def test_the_ring_gives_the_cpu_bytes(fill, dtype, sm, name, shape, monkeypatch):
    options = OPTIONS[name]
    if options.get("rht") and shape[-2] % 16:
        pytest.skip("the RHT needs rows in whole 16-row blocks")
    x = random_normal(shape, 11, dtype)
    got, launch = quantize_asking_for_the_ring(x, sm, monkeypatch, fill, **options)
    assert "quantize_ring_kernel" in launch.kernel
    assert_same_tree(got, jax.jit(lambda x: jax_nvfp4.quantize(x, **options))(x))


def _takes_the_ring(name: str) -> bool:
    """Whether the ring applies to golden file ``name``: inputs in rows of whole 16-byte chunks."""
    g = np.load(GOLDEN_DIR / name)
    return g["x"].shape[-1] * np.dtype(str(g["input_dtype"])).itemsize % 16 == 0


# TransformerEngine's golden files and our stochastic-rounding vectors (tests/golden/sr_*.npz) that the ring takes.
RING_GOLDEN = [name for name in cases() + option_cases() if _takes_the_ring(name)]
RING_SR_VECTORS = [name for name in sr_cases() if _takes_the_ring(name)]


def test_the_ring_takes_most_golden_files():
    """1x16, 16x16, padded edges, edge values, the RHT and row-scaled copies, 4over6; stochastic rounding; float32
    too."""
    kinds = {n.split("_")[0] for n in RING_GOLDEN}
    assert kinds == {"1d", "2d", "edge", "rht", "rowscaled", "4o6", "4o6sel"}, RING_GOLDEN
    assert len(RING_GOLDEN) >= 52 and len(RING_SR_VECTORS) >= 5, (RING_GOLDEN, RING_SR_VECTORS)
    assert {"1d_128x256_fp32.npz", "2d_64x64_fp32.npz", "edge_ties_1d_16x64_fp32.npz"} <= set(RING_GOLDEN)
    assert {"sr_1d_32x64_fp32.npz", "sr_2d_64x64_fp32.npz"} <= set(RING_SR_VECTORS)


# (fill, golden file): both fills of each, but 4over6's (34 files, its fills the same as any spec's) by tensor copies
GOLDEN_FILLS = [(fill, name) for name in RING_GOLDEN for fill in FILLS if fill == "ring" or not name.startswith("4o6")]


@pytest.mark.parametrize("sm", [90, 100])
@pytest.mark.parametrize(("fill", "name"), GOLDEN_FILLS)
def test_the_ring_gives_the_golden_bytes(fill, name, sm, monkeypatch):
    g, x, options = load(name)
    t, launch = quantize_asking_for_the_ring(x, sm, monkeypatch, fill, **options)
    assert "quantize_ring_kernel" in launch.kernel
    assert_golden(g, options["columnwise"], t.data, t.scale, t.amax, t.data_t, t.scale_t, t.amax_t)


@pytest.mark.parametrize("sm", [90, 100])
@pytest.mark.parametrize("name", RING_SR_VECTORS)
@pytest.mark.parametrize("fill", list(FILLS))
def test_the_ring_gives_the_stochastic_rounding_vectors(fill, name, sm, monkeypatch):
    g, x, amax, amax_t, seed, spec = load_sr(name)
    monkeypatch.setenv("NVFP4_QUANTIZE_LOAD", fill)
    with cuda_host.emulating(sm):
        (amaxes, outs), launches = run_traced(sr_vector_run(cuda_host.BACKEND, spec), x, amax, amax_t, seed)
    launch = only(launches, "quantize")
    assert "quantize_ring_kernel" in launch.kernel and FILLS[fill] in launch.paths
    assert_sr_vector(g, amaxes, outs)


# Stochastic rounding: its own kernel (registers), the same ring.
MODES = {
    "stochastic": dict(columnwise=True, rng_key=jax.random.key(1)),
    "stochastic 16x16": dict(columnwise=True, block_2d=True, rng_key=jax.random.key(2)),
    "stochastic rht": dict(columnwise=True, rht=True, rng_key=jax.random.key(3)),
    "stochastic row-scaled": dict(columnwise=True, row_scaled=True, rng_key=jax.random.key(4)),
}


@pytest.mark.parametrize("sm", [90, 100])
@pytest.mark.parametrize("shape", [(256, 1024), (3, 80, 264)], ids=str)
@pytest.mark.parametrize("name", list(MODES))
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float32])
def test_stochastic_rounding_takes_the_ring(name, shape, dtype, sm, monkeypatch):
    options = MODES[name]
    x = random_normal(shape, 14, dtype)
    got, launch = quantize_asking_for_the_ring(x, sm, monkeypatch, **options)
    assert "quantize_ring_kernel" in launch.kernel
    assert_same_tree(got, jax.jit(lambda x: jax_nvfp4.quantize(x, **options))(x))


@pytest.mark.parametrize(
    ("sm", "name", "kernel", "depth", "dtype"),
    [
        (90, "row+col", "quantize_ring_kernel", "three stages", jnp.bfloat16),  # beside the 32 KB class table
        (90, "stochastic", "quantize_ring_kernel", "two stages", jnp.bfloat16),  # no table: two blocks of two
        (100, "stochastic", "quantize_ring_kernel", "two stages", jnp.bfloat16),
        (100, "row+col", "quantize_ring_kernel", "two stages", jnp.bfloat16),  # no class table: two blocks of two
        (120, "row+col", "quantize_ring_kernel", "two stages", jnp.bfloat16),  # 99 KB: two beside one staged tile
        (120, "stochastic", "quantize_ring_kernel", "two stages", jnp.bfloat16),
        # float32: 64 KB stages, two beside two staged tiles (three would take 228 KB), one block
        (90, "row+col", "quantize_ring_kernel", "two stages", jnp.float32),
        (100, "stochastic", "quantize_ring_kernel", "two stages", jnp.float32),
        (120, "row+col", "quantize_kernel", None, jnp.float32),  # 99 KB: no ring fits
        # 4over6: 2 KB more static tables; sm_90 beside the class table, sm_100a two blocks of two
        (90, "4over6", "quantize_ring_kernel", "three stages", jnp.bfloat16),
        (100, "4over6", "quantize_ring_kernel", "two stages", jnp.bfloat16),
        (90, "4over6", "quantize_ring_kernel", "two stages", jnp.float32),
    ],
    ids=lambda v: getattr(v, "__name__", str(v)),
)
def test_the_ring_is_as_deep_as_shared_memory_allows(sm, name, kernel, depth, dtype, monkeypatch):
    """The depth that keeps the most tiles' copies in flight a multiprocessor: three stages (two tiles ahead:
    64 KB of bf16 loads a block) where one block fits either way (sm_90's nearest rounding: the class table), two
    stages where that keeps two blocks (no table: sm_100a's nearest rounding, stochastic rounding since its
    positions are arithmetic; until then its 64 KB position table took three stages at one block, and none on
    sm_120) or three do not fit (sm_120's 99 KB). On 64 tiles, tens a block on the host model's small grid, so
    every stage is refilled and its barrier's phase turns many times; the same bytes either way."""
    options = {**OPTIONS, **MODES}[name]
    x = random_normal((256, 4096), 15, dtype)
    got, launch = quantize_asking_for_the_ring(x, sm, monkeypatch, **options)
    assert f"::{kernel}<" in launch.kernel
    rings = {path for path in launch.paths if path.startswith("ring: ")}
    assert rings == ({f"ring: {depth}"} if depth else set())
    assert_same_tree(got, jax.jit(lambda x: jax_nvfp4.quantize(x, **options))(x))


@pytest.mark.parametrize(
    ("dtype", "shape", "options", "sm"),
    [
        (jnp.float32, (256, 1024), {}, 120),  # two 64 KB stages do not fit sm_120's 99 KB
        (jnp.float32, (256, 1024), dict(rng_key=jax.random.key(1)), 120),
        (jnp.float32, (64, 250), {}, 90),  # rows of 1000 bytes: not whole 16-byte chunks
        (jnp.bfloat16, (64, 250), {}, 90),  # rows of 500 bytes
        (jnp.bfloat16, (64, 250), dict(four_over_six_error="mse", e4m3_max=256), 90),
    ],
    ids=["float32-sm120", "float32-stochastic-sm120", "float32-ragged-rows", "ragged-rows", "4over6-ragged-rows"],
)
def test_where_the_ring_does_not_apply_the_direct_kernel_runs(dtype, shape, options, sm, monkeypatch):
    x = random_normal(shape, 12, dtype)
    got, launch = quantize_asking_for_the_ring(x, sm, monkeypatch, **options)
    assert "ring" not in launch.kernel
    assert_same_tree(got, jax.jit(lambda x: jax_nvfp4.quantize(x, **options))(x))


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("fill", list(FILLS))
def test_the_ring_reads_each_input_byte_once(fill, dtype, monkeypatch):
    """Its copies read the input once (no thread loads it from global memory), in whole sectors: a tensor copy's
    box row by row (the host model's record of it), or a bulk copy a row (float32's a box row of 1024 bytes)."""
    x = random_normal((256, 1024), 13, dtype)
    monkeypatch.setenv("NVFP4_QUANTIZE_LOAD", fill)
    _, launches = quantize_launches(x, columnwise=True, amax=jnp.float32(4.0))
    launch = only(launches, "quantize_ring_kernel")
    loads = launch.select("global", "load", size=256 * x.dtype.itemsize)
    assert sum(s.bytes for s in loads) == x.nbytes
    assert sum(s.transactions for s in loads) == sum(s.ideal for s in loads) == x.nbytes // 32


@pytest.mark.parametrize("sm", [90, 100])
@pytest.mark.parametrize("name", ["row+col", "16x16", "stochastic"])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32], ids=["bfloat16", "float32"])
def test_the_rings_shared_memory_accesses_are_conflict_free(dtype, name, sm, monkeypatch):
    """N(0, 1) data: the 16-byte reads, the stages' (a warp reads 512 consecutive bytes of a stage row; float32's
    values, read from the stage twice, a row's quads turned on half the lanes) and the staged outputs', take the
    fewest wavefronts; sm_90's class table one a lookup (each lane reads its own copy); all the kernel's
    shared-memory accesses together at most 1.5 times the fewest (issue 48's budget; the rowwise scales' byte
    stores and the columnwise codes' 8-byte stores are 2-way, as in the direct kernel)."""
    x = random_normal((128, 512), 7, dtype)
    _, launch = quantize_asking_for_the_ring(x, sm, monkeypatch, **{**OPTIONS, **MODES}[name])
    reads = Launch.total(launch.select("shared", "load", file="quantize.cu", size=16))
    assert reads.bytes >= x.nbytes  # every input value is read from a stage
    assert reads.transactions == reads.ideal, launch.select("shared", "load", size=16)
    lookups = Launch.total(launch.select("shared", "load", file="e2m1_lut.cuh"))
    assert lookups.transactions == (lookups.requests if sm == 90 and name != "stochastic" else 0), lookups
    every = Launch.total(launch.select("shared"))
    assert every.transactions <= 1.5 * every.ideal, launch.select("shared")


def _values_read_sites() -> tuple[str, ...]:
    """The host model's names of the sites where a float32 kernel reads its values back (Values::quad and
    Values::turned_quad)."""
    source = pathlib.Path(__file__).resolve().parents[2] / "ffi" / "cuda" / "quantize.cu"
    text = source.read_text().splitlines()
    lines = [n for n, line in enumerate(text, 1) if "NVFP4_LDS(" in line and "q1 : q0)" in line]
    assert len(lines) == 2, lines
    return tuple(f"quantize.cu:{line}" for line in lines)


@pytest.mark.parametrize("name", ["row+col", "rht", "16x16", "stochastic", "4over6"])
def test_float32_values_are_read_from_the_stage(name, monkeypatch):
    """float32 (N(0, 1) data). The direct kernel loads a thread's values from global memory and copies its two
    16-byte quads of a row into shared memory with their order swapped on lanes with bit 2 set, so that a phase of
    8 lanes (32 bytes apart) spans the 32 banks: its copy and its reads take the fewest wavefronts. The ring reads
    the values where the stage's copy put them, in the tile's order, storing none, and takes a row's quads the
    other way round on those lanes (turned): the fewest wavefronts too, for the maxima and for the codes, whose
    columns it puts back. So its values' shared-memory traffic equals the direct kernel's (docs/kernels.md).
    4over6 reads its rows in order (its error sums are summed in column order): those reads are 2-way."""
    x = random_normal((128, 512), 7, jnp.float32)
    options = {**OPTIONS, **MODES}[name]
    values_sites = _values_read_sites()

    def values_accesses(fill):
        _, launch = quantize_asking_for_the_ring(x, 90, monkeypatch, fill, **options)
        sites = [s for s in launch.select("shared", file="quantize.cu", size=16) if s.bytes >= x.nbytes]
        loads = [s for s in sites if s.access == "load"]
        later = [s for s in loads if s.site.endswith(values_sites)]
        return launch, [s for s in sites if s.access == "store"], [s for s in loads if s not in later], later

    direct, (copy,), direct_first, direct_later = values_accesses("direct")
    ring, ring_stores, (maxima,), ring_later = values_accesses("ring")
    assert "ring" not in direct.kernel and "quantize_ring_kernel" in ring.kernel
    assert not ring_stores and not direct_first  # the direct kernel's first read is of global memory
    assert copy.bytes == maxima.bytes == x.nbytes and copy.transactions == copy.ideal == maxima.transactions, maxima
    direct_reads, ring_reads = Launch.total(direct_later), Launch.total(ring_later)
    assert direct_reads.transactions == direct_reads.ideal, direct_reads
    assert ring_reads.bytes == direct_reads.bytes, (ring_reads, direct_reads)
    if name == "4over6":
        in_order = [s for s in ring_later if s.transactions > s.ideal]
        assert in_order and all(s.transactions == 2 * s.ideal for s in in_order), ring_later
    else:
        assert ring_reads.transactions == ring_reads.ideal, ring_reads
        assert maxima.transactions + ring_reads.transactions == copy.transactions + direct_reads.transactions


def test_a_buffers_tensor_map_is_encoded_once(monkeypatch):
    """The handler keeps the tensor maps it encoded (the process's last 8, keyed by buffer and shape): calls on
    the same buffer and shape encode no new map, a new buffer or shape does (the host model counts the driver
    calls it stands for)."""
    monkeypatch.setenv("NVFP4_QUANTIZE_LOAD", "ring")
    x, y = random_normal((256, 1024), 16), random_normal((128, 512), 17)
    quantize = jax.jit(lambda x: cuda_host.quantize(x, columnwise=True))
    encodes = cuda_host.module.tensor_map_encodes

    def new_encodes(*arrays):
        before = encodes()
        for a in arrays:
            assert_same_tree(jax.block_until_ready(quantize(a)), jax_nvfp4.quantize(a, columnwise=True))
        return encodes() - before

    assert new_encodes(x) in (0, 1)  # x's map: new, or kept from an earlier test of this process
    assert new_encodes(x, x, x) == 0
    assert new_encodes(y) <= 1
    assert new_encodes(y, x, y, x) == 0


@pytest.mark.parametrize("name", ["row+col", "4over6"])
def test_float32_on_the_ring_takes_the_class_table_on_hopper(name, monkeypatch):
    """The direct float32 kernel keeps its values where sm_90's 32 KB class table would go, so it finds its codes
    by the code table's tie-safe index (every float32 copy is tie-safe: tie_possible), whose byte lookups take 2
    wavefronts on N(0, 1) data. On the ring the values are in the stages, and the table fits beside them (two
    64 KB stages, two staged tiles, the table: 196 KB): the class table's tie-safe index, a copy per lane, 1
    wavefront a lookup. The same bytes either way."""
    x = random_normal((128, 512), 7, jnp.float32)
    options = OPTIONS[name]
    index = {"direct": "code-table tie-safe", "ring": "class tie-safe"}
    for fill, wavefronts in (("direct", 2), ("ring", 1)):
        got, launch = quantize_asking_for_the_ring(x, 90, monkeypatch, fill, **options)
        assert ("ring" in launch.kernel) == (fill == "ring")
        assert launch.paths.get(f"rowwise index: {index[fill]}", 0) > 0, launch.paths
        lookups = Launch.total(launch.select("shared", "load", file="e2m1_lut.cuh"))
        assert lookups.requests and lookups.transactions == pytest.approx(wavefronts * lookups.requests, rel=0.1)
        assert_same_tree(got, jax.jit(lambda x: jax_nvfp4.quantize(x, **options))(x))

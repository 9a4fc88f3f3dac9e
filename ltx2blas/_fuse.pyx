"""Tile driver of the LoRA fuse: widen, multiply through the seam, round, store -- per output
tile, in parallel, with the GIL released.

Each output tile [mt x nt] is independent: its bytes depend only on the inputs, never on which
thread ran it or how many threads there were, so results are identical for any thread count.
Tiles are numbered row strip by row strip and handed to threads in contiguous runs (long ones
first, shorter ones as the call nears its end), so a thread rounds and widens each adapter's
bf16(B * s) rows once per strip it visits, not once per tile: that pass costs several times
more per element than widening A, which is redone per tile. For the dot-product kernel A is
packed in pairs once a call, before the tiles, every tile reading its columns' block (packed
per tile, A was repacked once per row strip: as many times over as there are strips).
"""
from cython.parallel cimport parallel, prange
from libc.stdint cimport int64_t, uint8_t, uint16_t, uint32_t, uint64_t
from libc.stdlib cimport free, malloc
from libc.string cimport memcpy, memset

from ._gemm cimport (continue_product, exact_product, exact_product_fused,
                     exact_product_fused_pairs, exact_product_pairs, exact_product_panel,
                     kernels)
from ._kernels cimport LTX_FP8_E4M3, LTX_FP8_E4M3_NAN, LTX_FP8_E5M2, ltx_kernels
from ._parallel cimport ltx_aligned_alloc, omp_get_thread_num, up64

import numpy as np


# The several-adapter rules (FusePlan's ``rule``); the names are the Python API's.
cdef enum:
    RULE_ONE = 0
    RULE_SUM = 1
    RULE_ADDMM = 2

RULES = {"one": RULE_ONE, "sum": RULE_SUM, "addmm": RULE_ADDMM}
KINDS = {"lora": KIND_LORA, "diff": KIND_DIFF, "lokr": KIND_LOKR, "loha_first": KIND_LOHA_FIRST,
         "loha": KIND_LOHA, "lokr_scaled": KIND_LOKR_SCALED}


# What an AdapterSpec is: a LoRA pair, a full-weight difference, a LoKr (its Kronecker
# factors, f32), or one of a LoHa's two low-rank pairs -- a LoHa is two specs in a row, the
# first's product held while the second's is computed, then the two multiplied.  A LoKr one
# of whose factors is a single value is KIND_LOKR_SCALED: its other factor, the weight's
# shape, taken tile by tile -- a pair's product as a LoHa pair's, or stored whole and widened
# -- times that value, so that no f32 copy of the whole factor is made.
cdef enum:
    KIND_LORA = 0
    KIND_DIFF = 1
    KIND_LOKR = 2
    KIND_LOHA_FIRST = 3
    KIND_LOHA = 4
    KIND_LOKR_SCALED = 5

# Bytes of an element of each FuseJob.fmt: bf16, F8_E4M3, F8_E5M2, the bare bf16 delta, the
# bare f32 product.
cdef Py_ssize_t[5] FORMAT_BYTES = [2, 1, 1, 2, 4]

# The most terms of a rank one pass over a tile takes: a larger rank is split into passes of
# this depth, each continuing the accumulation where the one before stopped (the textbook
# order still), so that no buffer grows with the rank.
cdef enum:
    PASS_DEPTH_C = 4096

PASS_DEPTH = PASS_DEPTH_C


cdef struct AdapterSpec:
    # One adapter (or a LoHa's pair) as the plan decided to run it.
    int kind                  # KIND_LORA, KIND_DIFF, KIND_LOKR, KIND_LOHA_FIRST or KIND_LOHA
    int adapter               # which adapter it is, in the rule's order
    bint unscaled             # B widened as stored: a later addmm term's, a LoHa pair's, a
                              # one-value LoKr's pair's
    const uint16_t *a         # [rank, cols] bf16, row stride cols; a difference: [rows, cols]
    const uint16_t *b         # [rows, rank] bf16 (NULL for a difference)
    const float *f1           # a LoKr's w1 [m1, n1] and w2 [m2, n2], f32, C order
    const float *f2
    Py_ssize_t n1, m2, n2
    float value               # KIND_LOKR_SCALED: the single-value factor, f32
    bint whole                # KIND_LOKR_SCALED: the other factor stored whole, as ``a``
    int rank
    float scale               # s of B * s; a LoKr's or LoHa's scale c (its second spec's)
    int depth[4]              # verified sgemm depth per tile shape class (see fuse_tile)
    bint pairs                # multiplied by the dot-product kernel on bf16 pairs, no sgemm
    Py_ssize_t bs_offset      # where its rows start in a thread's bs buffer
    Py_ssize_t panel_offset   # where its A panel starts in a thread's panel buffer
    Py_ssize_t pairs_offset   # where its bs pairs start in a thread's bs_pairs buffer
    uint32_t *a_pairs         # with pairs: A's rows in pairs, column tile by column tile (the
                              # block of the tile at column i0 at ceil(rank / 2) * i0, its
                              # rows nt pairs long), shared by the threads; else NULL


cdef struct FuseJob:
    const uint8_t *w          # the weight's bytes: bf16 (2 per element) or fp8 (1)
    uint8_t *out
    Py_ssize_t rows, cols
    int tile_rows, tile_cols
    Py_ssize_t tiles_n
    int rule                  # RULE_ONE, RULE_SUM or RULE_ADDMM (see FusePlan)
    bint dry_run              # compute and check, write nothing
    bint check                # record the first non-finite output per tile
    int fmt                   # 0: bf16, 1: F8_E4M3, 2: F8_E5M2, 3: the bare delta, 4: the bare
                              # f32 product of one unscaled LoRA-shaped pair (a LoKr factor)
    int fp8_kind              # fp8 only: the rounding store's ltx_fp8_kind (the overflow rule)
    bint stochastic           # fp8 only: stochastic rounding with random bits from key
    uint64_t key
    bint fused_pairs          # one bf16 adapter fused by the dot-product kernel, in one pass
    bint plus_zero            # one bf16 adapter under the several-adapter rule: -0.0 -> +0.0
    int count                 # adapters
    AdapterSpec *ad
    const ltx_kernels *kern


cdef struct TileBuffers:
    # One thread's buffers (64-byte aligned) and which row strip its bs rows hold.
    float *bs                 # every adapter's [mt, rank] = f32(bf16(B * s)) for the strip
    float *panels             # every adapter's without pairs: [rank, nt] = f32(A[:, tile
                              # columns])
    uint32_t *bs_pairs        # every adapter's with pairs: [mt, ceil(rank / 2)] pairs of the
                              # bs columns
    float *acc                # [mt, nt] product
    float *total              # [mt, nt] several-adapter sum
    float *held               # [mt, nt] a LoHa's first product, while its second is computed
    uint8_t *scratch          # [mt, nt] dry-run output
    Py_ssize_t strip          # row strip the bs rows hold, -1 for none


cdef inline void finish_bf16_tile(const FuseJob *job, uint16_t *tile, Py_ssize_t ldo, int mt,
                                  int nt, Py_ssize_t origin, int64_t *bad) noexcept nogil:
    """After a bf16 tile is stored: -0.0 made +0.0 for plus_zero, and with check, *bad set to
    the flat index of the tile's first inf or NaN, if any."""
    cdef Py_ssize_t r, q
    if job.plus_zero:
        job.kern.clear_negative_zero_bf16(tile, ldo, mt, nt)
    if not job.check:
        return
    for r in range(mt):
        q = job.kern.first_nonfinite_bf16(tile + r * ldo, nt)
        if q >= 0:
            bad[0] = origin + r * job.cols + q
            return


cdef inline void load_bs(const FuseJob *job, int a, Py_ssize_t o0, int mt, Py_ssize_t k0,
                         int kc, TileBuffers *buf) noexcept nogil:
    """Adapter a's B rows o0.., columns k0..k0+kc, widened into its place in the buf's bs
    buffer (row stride kc): f32(bf16(B * s)), or for a later addmm term f32(B) unscaled."""
    cdef const ltx_kernels *kern = job.kern
    cdef const AdapterSpec *ad = &job.ad[a]
    cdef float *dst = buf.bs + ad.bs_offset
    cdef const uint16_t *src = ad.b + o0 * ad.rank + k0
    cdef bint unscaled = ad.unscaled
    cdef Py_ssize_t r
    if kc == ad.rank:  # whole rows: one contiguous run
        if unscaled:
            kern.widen_bf16(src, dst, <Py_ssize_t>mt * kc)
        else:
            kern.scale_round_widen(src, ad.scale, dst, <Py_ssize_t>mt * kc)
        return
    for r in range(mt):
        if unscaled:
            kern.widen_bf16(src + r * ad.rank, dst + r * kc, kc)
        else:
            kern.scale_round_widen(src + r * ad.rank, ad.scale, dst + r * kc, kc)


cdef inline size_t a_pairs_bytes(Py_ssize_t rank, Py_ssize_t cols) noexcept nogil:
    """Bytes of one adapter's A in pairs, rank rows of cols (a_pairs), 64-byte rounded."""
    return up64(<size_t>((rank + 1) // 2) * cols * sizeof(uint32_t))


cdef inline uint32_t *a_pairs_block(const AdapterSpec *ad, Py_ssize_t i0) noexcept nogil:
    """An adapter's A in pairs for the tile whose columns start at i0 (row stride nt)."""
    return ad.a_pairs + <Py_ssize_t>((ad.rank + 1) // 2) * i0


cdef void pack_a_pairs(const FuseJob *job, Py_ssize_t tj) noexcept nogil:
    """Every pairs adapter's A, the columns of column tile tj, packed in pairs."""
    cdef Py_ssize_t i0 = tj * job.tile_cols
    cdef int nt = <int>min(<Py_ssize_t>job.tile_cols, job.cols - i0)
    cdef int a
    for a in range(job.count):
        if job.ad[a].a_pairs != NULL:
            job.kern.pack_pairs_rows(job.ad[a].a + i0, job.cols, a_pairs_block(&job.ad[a], i0),
                                     job.ad[a].rank, nt)


cdef void product_tile(const FuseJob *job, int a, Py_ssize_t o0, Py_ssize_t i0, int mt, int nt,
                       int shape, TileBuffers *buf, float *acc) noexcept nogil:
    """Spec a's low-rank product over the tile, f32 in the textbook order, into acc [mt, nt]:
    bf16(B * s) @ A, or B @ A for an unscaled spec; the bs rows of its strip are loaded."""
    cdef const ltx_kernels *kern = job.kern
    cdef const AdapterSpec *ad = &job.ad[a]
    cdef int rank = ad.rank, kc
    cdef Py_ssize_t k0
    cdef float *panel = buf.panels + ad.panel_offset
    cdef float *bs = buf.bs + ad.bs_offset
    if rank <= PASS_DEPTH_C:
        if ad.pairs:  # two terms per instruction, as the one-adapter fuse
            exact_product_pairs(kern, mt, nt, (rank + 1) // 2, buf.bs_pairs + ad.pairs_offset,
                                (rank + 1) // 2, a_pairs_block(ad, i0), acc)
        elif ad.depth[shape] == 0:
            kern.pack_fuse_panel(ad.a + i0, job.cols, panel, rank, nt)
            exact_product_panel(kern, mt, nt, rank, bs, rank, panel, acc)
        else:
            kern.widen_bf16_rows(ad.a + i0, job.cols, panel, nt, rank, nt)
            exact_product(kern, mt, nt, rank, bs, rank, panel, acc, ad.depth[shape])
        return
    # passes of PASS_DEPTH_C terms: sgemm (to its verified depth) in the first only, the
    # sequential kernel continuing each element's sum in the later ones
    k0 = 0
    while k0 < rank:
        kc = <int>min(<Py_ssize_t>PASS_DEPTH_C, rank - k0)
        load_bs(job, a, o0, mt, k0, kc, buf)
        kern.widen_bf16_rows(ad.a + k0 * job.cols + i0, job.cols, panel, nt, kc, nt)
        if k0 == 0:
            exact_product(kern, mt, nt, kc, bs, kc, panel, acc, ad.depth[shape])
        else:
            continue_product(kern, mt, nt, kc, bs, kc, panel, nt, acc, nt)
        k0 += kc


cdef void kron_tile(const ltx_kernels *kern, const AdapterSpec *ad, Py_ssize_t o0,
                    Py_ssize_t i0, int mt, int nt, float *acc) noexcept nogil:
    """A LoKr's Kronecker product over the tile, into acc [mt, nt]: element (p, q) is
    f32(w1[p div m2, q div n2] * w2[p mod m2, q mod n2]), taken in runs along a row of w2."""
    cdef Py_ssize_t r, p, q, run, end = i0 + nt
    cdef const float *row1
    cdef const float *row2
    for r in range(mt):
        p = o0 + r
        row1 = ad.f1 + (p // ad.m2) * ad.n1
        row2 = ad.f2 + (p % ad.m2) * ad.n2
        q = i0
        while q < end:
            run = min(ad.n2 - q % ad.n2, end - q)
            kern.scale_f32(row2 + q % ad.n2, row1[q // ad.n2], acc + r * nt + (q - i0), run)
            q += run


cdef void fuse_tile(const FuseJob *job, Py_ssize_t t, TileBuffers *buf,
                    int64_t *bad, int64_t *overflows, int64_t *firsts) noexcept nogil:
    """Tile t into the output (or a dry run's scratch); overflows[t] and firsts[t]: how many
    results overflowed (bf16: +-inf from a finite weight element; fp8: past the format's
    largest finite value from a finite sum) and the flat index of the first, else left as
    they are (0, -1)."""
    cdef Py_ssize_t ti = t // job.tiles_n, tj = t % job.tiles_n
    cdef Py_ssize_t o0 = ti * job.tile_rows, i0 = tj * job.tile_cols
    cdef int mt = <int>min(<Py_ssize_t>job.tile_rows, job.rows - o0)
    cdef int nt = <int>min(<Py_ssize_t>job.tile_cols, job.cols - i0)
    # Tile shape class (full or edge, per dimension): the depth was verified per class.
    cdef int shape = 2 * (mt != job.tile_rows) + (nt != job.tile_cols)
    cdef const ltx_kernels *kern = job.kern
    cdef const AdapterSpec *ad
    cdef Py_ssize_t q, r
    cdef int a, rank
    cdef bint later
    cdef const float *result = buf.acc
    cdef Py_ssize_t esize = FORMAT_BYTES[job.fmt]
    cdef Py_ssize_t origin = o0 * job.cols + i0   # the tile's first element in the weight
    cdef uint8_t *dst
    cdef Py_ssize_t ldo

    if buf.strip != ti:
        for a in range(job.count):
            ad = &job.ad[a]
            if ad.b != NULL and ad.rank <= PASS_DEPTH_C:
                load_bs(job, a, o0, mt, 0, ad.rank, buf)
                if ad.pairs:
                    kern.pack_pairs_cols(buf.bs + ad.bs_offset, ad.rank,
                                         buf.bs_pairs + ad.pairs_offset,
                                         (ad.rank + 1) // 2, mt, ad.rank)
        buf.strip = ti

    if job.dry_run:
        dst, ldo = buf.scratch, nt
    else:
        dst, ldo = job.out + origin * esize, job.cols

    ad = &job.ad[0]
    if job.fused_pairs or (job.count == 1 and job.fmt == 0 and job.rule == RULE_ONE
                           and ad.kind == KIND_LORA and ad.depth[shape] == 0
                           and ad.rank <= PASS_DEPTH_C):
        # No sgemm for this product: it is computed, rounded and added in one pass, with
        # pairs two terms per instruction. A rank past one pass has buffers for one pass
        # only, and goes the way of passes below whatever its depth.
        rank = ad.rank
        if job.fused_pairs:
            overflows[t] = exact_product_fused_pairs(
                kern, mt, nt, (rank + 1) // 2, buf.bs_pairs + ad.pairs_offset, (rank + 1) // 2,
                a_pairs_block(ad, i0), <const uint16_t *>(job.w + origin * esize), job.cols,
                <uint16_t *>dst, ldo, &q)
        else:
            kern.pack_fuse_panel(ad.a + i0, job.cols, buf.panels, rank, nt)
            overflows[t] = exact_product_fused(kern, mt, nt, rank, buf.bs, rank, buf.panels,
                                               <const uint16_t *>(job.w + origin * esize),
                                               job.cols, <uint16_t *>dst, ldo, &q)
        if q >= 0:  # the kernels' offsets are from the tile's weight, row stride job.cols
            firsts[t] = origin + q
        finish_bf16_tile(job, <uint16_t *>dst, ldo, mt, nt, origin, &bad[t])
        return

    if job.rule == RULE_SUM:
        memset(buf.total, 0, <size_t>mt * nt * sizeof(float))
    for a in range(job.count):
        ad = &job.ad[a]
        # A later addmm term leaves its scale to accumulate_addmm; every other term is scaled
        # here, before the rule rounds or adds it.
        later = job.rule == RULE_ADDMM and ad.adapter > 0
        if ad.kind == KIND_DIFF:
            # acc = f32(bf16(s * diff)), the difference's delta, or for a later addmm term
            # f32(diff)
            for r in range(mt):
                if later:
                    kern.widen_bf16(ad.a + origin + r * job.cols, buf.acc + r * nt, nt)
                else:
                    kern.scale_round_widen(ad.a + origin + r * job.cols, ad.scale,
                                           buf.acc + r * nt, nt)
        elif ad.kind == KIND_LOKR:
            kron_tile(kern, ad, o0, i0, mt, nt, buf.acc)
        elif ad.kind == KIND_LOKR_SCALED:
            # the Kronecker product with a [1, 1] factor: each element one f32 product of the
            # other factor's element and the value, as kron_tile takes it
            if ad.whole:
                for r in range(mt):
                    kern.widen_bf16(ad.a + origin + r * job.cols, buf.acc + r * nt, nt)
            else:
                product_tile(job, a, o0, i0, mt, nt, shape, buf, buf.acc)
            kern.scale_f32(buf.acc, ad.value, buf.acc, <Py_ssize_t>mt * nt)
        elif ad.kind == KIND_LOHA_FIRST:
            product_tile(job, a, o0, i0, mt, nt, shape, buf, buf.held)
            continue  # the rule takes the LoHa at its second spec
        else:
            product_tile(job, a, o0, i0, mt, nt, shape, buf, buf.acc)
            if ad.kind == KIND_LOHA:
                kern.multiply_f32(buf.held, buf.acc, buf.acc, <Py_ssize_t>mt * nt)
        if (ad.kind == KIND_LOKR or ad.kind == KIND_LOKR_SCALED or ad.kind == KIND_LOHA) \
                and not later:
            kern.scale_f32(buf.acc, ad.scale, buf.acc, <Py_ssize_t>mt * nt)
        if job.rule == RULE_SUM:
            kern.accumulate_rounded(buf.acc, buf.total, <Py_ssize_t>mt * nt)
        elif job.rule == RULE_ADDMM and not later:
            kern.round_bf16_f32(buf.acc, buf.total, <Py_ssize_t>mt * nt)
        elif job.rule == RULE_ADDMM:
            kern.accumulate_addmm(buf.acc, buf.total, ad.scale, <Py_ssize_t>mt * nt)
    if job.rule != RULE_ONE:
        result = buf.total

    if job.fmt == 4:
        for r in range(mt):
            memcpy(<float *>dst + r * ldo, result + r * nt, <size_t>nt * sizeof(float))
    elif job.fmt == 0:
        overflows[t] = kern.store_fused(result, <const uint16_t *>(job.w + origin * esize),
                                        job.cols, <uint16_t *>dst, ldo, mt, nt, &q)
        if q >= 0:
            firsts[t] = origin + q
        finish_bf16_tile(job, <uint16_t *>dst, ldo, mt, nt, origin, &bad[t])
    elif job.fmt == 3:
        kern.store_rounded(result, <uint16_t *>dst, ldo, mt, nt)
    else:
        overflows[t] = kern.store_fused_fp8(result, job.w + origin, job.cols, dst, ldo, mt, nt,
                                            job.fp8_kind, job.stochastic, job.key, origin,
                                            job.cols, &q)
        if q >= 0:
            firsts[t] = origin + q
            if job.check:
                bad[t] = origin + q


cdef (size_t, size_t, size_t, size_t, size_t, size_t) buffer_layout(
        int tile_rows, int tile_cols, Py_ssize_t width, Py_ssize_t panel_width, bint several,
        bint dry_run, Py_ssize_t pair_width, bint held) noexcept:
    """One thread's buffers: bs rows [tile_rows, width], A panels [panel_width, tile_cols],
    the product tile, the several-adapter total, a LoHa's held product (with ``held``), the
    dry run's scratch tile, the bs pairs [tile_rows, pair_width]; and their sum.  ``width`` is the sum over LoRAs of
    min(rank, PASS_DEPTH), ``panel_width`` the same over those not taking pairs (whose A is
    shared, see shared_buffer_bytes), ``pair_width`` of ceil(rank / 2) over those taking
    pairs."""
    cdef size_t bs_len = up64(<size_t>tile_rows * width * sizeof(float))
    cdef size_t panels_len = up64(<size_t>panel_width * tile_cols * sizeof(float))
    cdef size_t tile_len = up64(<size_t>tile_rows * tile_cols * sizeof(float))
    cdef size_t scratch_len = up64(<size_t>tile_rows * tile_cols * sizeof(uint16_t))
    cdef size_t pairs_len = up64(<size_t>tile_rows * pair_width * sizeof(uint32_t))
    return (bs_len, panels_len, tile_len, scratch_len, pairs_len,
            bs_len + panels_len + tile_len * (1 + several + held) + scratch_len * dry_run
            + pairs_len)


def takes_pairs(ranks, pairs):
    """Per LoRA, whether it takes the dot-product kernel where the kernel table has one:
    asked for (``pairs[a]``, default none) and one pass deep, as FusePlan takes them."""
    pairs = [False] * len(ranks) if pairs is None else pairs
    return [bool(p) and int(r) <= PASS_DEPTH_C for r, p in zip(ranks, pairs)]


def thread_buffer_bytes(int tile_rows, int tile_cols, ranks, bint several, pairs=None,
                        bint dry_run=False, bint held=False):
    """Bytes of one thread's buffers for low-rank pairs of ``ranks`` (a LoRA's, or each of a
    LoHa's two; what FusePlan allocates per thread); ``pairs[a]``: whether pair a takes the
    dot-product kernel (default none), whose A panels are shared (shared_buffer_bytes), not
    per thread; ``held``: a LoHa is among the adapters."""
    takes = takes_pairs(ranks, pairs)
    cdef Py_ssize_t width = sum(min(int(r), PASS_DEPTH_C) for r in ranks)
    cdef Py_ssize_t panel_width = sum(min(int(r), PASS_DEPTH_C)
                                      for r, p in zip(ranks, takes) if not p)
    cdef Py_ssize_t pair_width = sum((int(r) + 1) // 2 for r, p in zip(ranks, takes) if p)
    return buffer_layout(tile_rows, tile_cols, width, panel_width, several, dry_run,
                         pair_width, held)[5]


def shared_buffer_bytes(Py_ssize_t cols, ranks, pairs=None):
    """Bytes FusePlan allocates once a call, shared by its threads: the A of every LoRA
    taking the dot-product kernel, in pairs (its own size, rounded up to a row of pairs)."""
    return sum(a_pairs_bytes(int(r), cols) for r, p in zip(ranks, takes_pairs(ranks, pairs))
               if p)


#: What a plan says each adapter's product takes, by what it decided (FusePlan.routes).
ROUTE_NAMES = ("dot-product", "one-pass", "sgemm", "sgemm+sequential", "passes", "difference",
               "Kronecker")


cdef class FusePlan:
    """One fuse, decided: the weight and its output, each adapter's route (AdapterSpec: its
    rank, scale, verified sgemm depths, whether the dot-product kernel takes it), the rule, the
    tile, and the per-thread and shared buffers, allocated here so that a failure comes before
    any tile is written.  run() computes every tile in parallel -- a dry run (compute and check,
    write nothing) and the fuse itself from the same plan.

    The caller (ltx2blas.fuse) has validated every array and decided the route; the plan takes
    its decisions as they are:

    ``weight``, ``out`` (which may be ``weight``): their bytes, [rows, cols * element size];
    ``fmt`` 0 bf16, 1 F8_E4M3, 2 F8_E5M2, 3 the bare bf16 delta (``out = bf16(agg)``,
    ``weight`` not read), 4 the bare f32 product ``B @ A`` of one pair (``out`` f32, rule
    RULE_ONE).  ``adapters``: per spec (kind, a, b, scale, depths, pairs, adapter): KIND_LORA
    with A [rank, cols] and B [rows, rank]; KIND_DIFF with the difference [rows, cols] as ``a``
    and ``b`` None (its delta ``bf16(s * diff)``, a later addmm term ``f32(s * diff)``);
    KIND_LOKR with its f32 factors w1 [m1, n1] and w2 [m2, n2] as ``a`` and ``b`` (m1 m2 = rows,
    n1 n2 = cols; its term ``f32(c * f32(w1 (x) w2))``); KIND_LOKR_SCALED, a LoKr with a
    [1, 1] factor v, its other factor as a pair like a LoRA's taken unscaled, or stored whole
    [rows, cols] as ``a`` with ``b`` None, and v as an eighth item (its term
    ``f32(c * f32(v * w))``, the same); a LoHa as KIND_LOHA_FIRST then
    KIND_LOHA, each a pair like a LoRA's, taken unscaled (its term ``f32(c * f32(m1 * m2))``,
    ``c`` the second spec's scale); ``adapter``: the adapter's index in the rule's order, the
    same for a LoHa's two specs (a later addmm term adds ``f32(c * its product)``, unrounded);
    ``depths``: the verified sgemm depth for the tile shapes (full, full),
    (full, edge), (edge, full), (edge, edge) in (rows, cols); ``pairs``: the dot-product kernel
    gives its product's textbook bytes (fuse._pairs_exact; the kernel table has one).
    ``rule``: RULE_ONE (one adapter, ``W + delta``), RULE_SUM (``W + bf16(0 + d1 + d2 ...)``)
    or RULE_ADDMM (agg = d1, then ``bf16(agg + s_i * (B_i @ A_i))`` for each later adapter, B_i
    unscaled), as :func:`ltx2blas.reference.aggregate_delta` states them.  ``fused_pairs``: one
    bf16 adapter by the dot-product kernel, computed, rounded and added in one pass.
    ``plus_zero``: one bf16 adapter fused by the sum rule (``rule`` RULE_ONE): its result is
    the one-adapter result with -0.0 made +0.0, tile by tile.  ``fp8_nan_overflow``: an F8_E4M3
    value past 448 becomes NaN (torch's cast before 2.13) instead of saturating."""
    cdef FuseJob job
    cdef AdapterSpec *ad
    cdef TileBuffers *per_thread
    cdef char *buffers
    cdef char *shared
    cdef bint a_packed             # the shared A pairs packed (by the first run)
    cdef bint scratch              # the buffers hold a dry run's scratch tile
    cdef int threads
    cdef readonly Py_ssize_t tiles
    cdef readonly Py_ssize_t overflows  # values the last run() made overflow (run's docstring)
    cdef readonly Py_ssize_t first_overflow  # the flat index of the first of them, or -1
    cdef object keep

    def __init__(self, const uint8_t[:, ::1] weight, uint8_t[:, ::1] out, int fmt, list adapters,
                 int tile_rows, int tile_cols, int threads, bint allow_fma, int rule,
                 bint fused_pairs=False, bint plus_zero=False, bint stochastic=False,
                 uint64_t key=0, bint dry_run=False, bint fp8_nan_overflow=False):
        cdef Py_ssize_t esize = FORMAT_BYTES[fmt] if 0 <= fmt < 5 else 1
        cdef Py_ssize_t rows = weight.shape[0], cols = weight.shape[1] // esize
        cdef int count = len(adapters), a, s
        cdef Py_ssize_t rank_sum = 0, panel_sum = 0, pair_sum = 0
        cdef const uint16_t[:, ::1] view
        cdef const float[:, ::1] factor
        cdef bint held = False
        cdef size_t bs_len, panels_len, tile_len, scratch_len, pairs_len, buffer_len
        cdef size_t shared_len = 0
        cdef bint several = rule != RULE_ONE
        cdef char *base
        cdef AdapterSpec *ad
        if rule not in (RULE_ONE, RULE_SUM, RULE_ADDMM) or (
                rule == RULE_ONE and (count == 0 or any(spec[6] != 0 for spec in adapters))):
            raise ValueError(f"rule {rule} does not apply to these {count} specs")
        keep = [weight, out]  # the memoryviews whose pointers the C structs hold
        self.keep = keep
        self.threads = threads
        self.scratch = dry_run
        self.a_packed = False
        self.job.kern = kernels(allow_fma)
        self.job.w = &weight[0, 0] if weight.size else NULL
        self.job.out = &out[0, 0] if out.size else NULL
        self.job.rows, self.job.cols = rows, cols
        self.job.tile_rows, self.job.tile_cols = tile_rows, tile_cols
        self.job.tiles_n = (cols + tile_cols - 1) // tile_cols
        self.tiles = (rows + tile_rows - 1) // tile_rows * self.job.tiles_n
        self.job.rule, self.job.fmt = rule, fmt
        self.job.fp8_kind = (LTX_FP8_E5M2 if fmt == 2 else
                             LTX_FP8_E4M3_NAN if fp8_nan_overflow else LTX_FP8_E4M3)
        self.job.stochastic, self.job.key = stochastic, key
        self.job.fused_pairs, self.job.plus_zero = fused_pairs, plus_zero
        self.job.dry_run = self.job.check = False
        self.job.count = count
        self.ad = <AdapterSpec *>malloc(max(count, 1) * sizeof(AdapterSpec))
        if self.ad == NULL:
            raise MemoryError()
        self.job.ad = self.ad
        for a in range(count):
            kind, lora_a, lora_b, scale, depths, pairs, adapter = adapters[a][:7]
            ad = &self.ad[a]
            ad.kind, ad.adapter, ad.scale = kind, adapter, scale
            ad.unscaled = (kind == KIND_LOHA_FIRST or kind == KIND_LOHA or fmt == 4
                           or kind == KIND_LOKR_SCALED or (rule == RULE_ADDMM and adapter > 0))
            ad.value, ad.whole = 0.0, False
            if kind == KIND_LOKR_SCALED:
                ad.value, ad.whole = adapters[a][7], lora_b is None
            held = held or kind == KIND_LOHA_FIRST
            for s in range(4):
                ad.depth[s] = depths[s]
            ad.pairs, ad.a_pairs = pairs, NULL
            ad.bs_offset = rank_sum * tile_rows
            ad.pairs_offset = pair_sum * tile_rows
            ad.panel_offset = 0    # set below for a LoRA that takes A panels
            ad.a, ad.b, ad.f1, ad.f2, ad.rank = NULL, NULL, NULL, NULL, 0
            if kind == KIND_LOKR:
                factor = lora_a
                keep.append(factor)
                ad.f1, ad.n1 = &factor[0, 0], factor.shape[1]
                factor = lora_b
                keep.append(factor)
                ad.f2, ad.m2, ad.n2 = &factor[0, 0], factor.shape[0], factor.shape[1]
                continue
            view = lora_a
            keep.append(view)
            ad.a = &view[0, 0] if view.size else NULL
            if kind == KIND_DIFF or ad.whole:
                continue
            ad.rank = <int>view.shape[0]
            rank_sum += min(view.shape[0], PASS_DEPTH_C)
            if ad.pairs:  # one pass holds the whole rank, which the kernel takes at once
                pair_sum += (ad.rank + 1) // 2
                shared_len += a_pairs_bytes(ad.rank, cols)
            else:
                ad.panel_offset = panel_sum * tile_cols
                panel_sum += min(view.shape[0], PASS_DEPTH_C)
            view = lora_b
            keep.append(view)
            ad.b = &view[0, 0] if view.size else NULL

        # Per-thread buffers. Panel offsets are multiples of tile_cols floats; every part is
        # 64-byte aligned.
        bs_len, panels_len, tile_len, scratch_len, pairs_len, buffer_len = buffer_layout(
            tile_rows, tile_cols, rank_sum, panel_sum, several, dry_run, pair_sum, held)
        self.buffers = <char *>ltx_aligned_alloc(buffer_len * threads)
        self.per_thread = <TileBuffers *>malloc(threads * sizeof(TileBuffers))
        if self.buffers == NULL or self.per_thread == NULL:
            raise MemoryError(f"could not allocate {buffer_len * threads} bytes of tile buffers")
        if shared_len:
            self.shared = <char *>ltx_aligned_alloc(shared_len)
            if self.shared == NULL:
                raise MemoryError(f"could not allocate {shared_len} bytes for A in pairs")
            base = self.shared
            for a in range(count):
                if self.ad[a].pairs:
                    self.ad[a].a_pairs = <uint32_t *>base
                    base += a_pairs_bytes(self.ad[a].rank, cols)
        for s in range(threads):
            base = self.buffers + buffer_len * s
            self.per_thread[s].bs = <float *>base
            self.per_thread[s].panels = <float *>(base + bs_len)
            self.per_thread[s].acc = <float *>(base + bs_len + panels_len)
            self.per_thread[s].total = <float *>(base + bs_len + panels_len + tile_len)
            self.per_thread[s].held = <float *>(base + bs_len + panels_len
                                                + tile_len * (1 + several))
            self.per_thread[s].scratch = <uint8_t *>(base + bs_len + panels_len
                                                     + tile_len * (1 + several + held))
            self.per_thread[s].bs_pairs = <uint32_t *>(base + buffer_len - pairs_len)

    def __dealloc__(self):
        free(self.buffers)
        free(self.per_thread)
        free(self.shared)
        free(self.ad)

    def run(self, bint check=False, bint dry_run=False):
        """Every tile, in parallel; with ``dry_run`` each is computed and checked but nothing
        is written (the plan must have been made with dry_run).  Returns the flat index of the
        first non-finite (bf16) or overflowing (fp8) output, or -1, when ``check`` is set.  The
        count of results that overflowed is left in ``overflows`` -- a bf16 weight's results
        that are +-inf where its element was finite (kernels.h, LTX_BF16_OVERFLOW), an fp8
        weight's finite sums rounded past its largest finite value -- and the flat index of
        the first in ``first_overflow`` (-1 for none); the bare delta and product count none."""
        cdef Py_ssize_t t, tj
        cdef int s
        cdef int threads = <int>min(<Py_ssize_t>self.threads, self.tiles)
        if dry_run and not self.scratch:
            raise ValueError("a dry run needs a plan made for one (its scratch tiles)")
        self.overflows, self.first_overflow = 0, -1
        if self.tiles == 0 or self.job.count == 0 or threads < 1:
            return -1
        self.job.check, self.job.dry_run = check or dry_run, dry_run
        for s in range(self.threads):
            self.per_thread[s].strip = -1
        bad_array = np.full(self.tiles, -1, dtype=np.int64)
        cdef int64_t[::1] bad = bad_array
        over_array = np.zeros(self.tiles, dtype=np.int64)
        cdef int64_t[::1] over = over_array
        first_array = np.full(self.tiles, -1, dtype=np.int64)
        cdef int64_t[::1] first = first_array
        if self.shared != NULL and not self.a_packed:
            # a region of its own: every block is packed before any tile reads it
            with nogil, parallel(num_threads=threads):
                for tj in prange(self.job.tiles_n, schedule="dynamic"):
                    pack_a_pairs(&self.job, tj)
            self.a_packed = True
        # Guided: each thread starts on a long run of neighbouring tiles, as with a static
        # split, and the rest is shared out as threads come free, so that a thread that starts
        # late (an idle worker waking, a core busy with file I/O) does not hold up the call.
        with nogil, parallel(num_threads=threads):
            for t in prange(self.tiles, schedule="guided"):
                fuse_tile(&self.job, t, &self.per_thread[omp_get_thread_num()], &bad[0],
                          &over[0], &first[0])
        self.overflows = int(over_array.sum())
        firsts = first_array[first_array >= 0]
        self.first_overflow = int(firsts.min()) if firsts.size else -1
        hits = bad_array[bad_array >= 0]
        return int(hits.min()) if hits.size else -1

    @property
    def rule(self):
        return self.job.rule

    @property
    def plus_zero(self):
        return bool(self.job.plus_zero)

    @property
    def pairs(self):
        """Per adapter, whether the dot-product kernel takes its product."""
        return [bool(self.ad[a].pairs) for a in range(self.job.count)]

    @property
    def depths(self):
        """Per adapter, its verified sgemm depth for each tile shape class."""
        return np.array([[self.ad[a].depth[s] for s in range(4)] for a in range(self.job.count)],
                        dtype=np.intc).reshape(self.job.count, 4)

    def routes(self):
        """Per adapter, what takes its product on full tiles (ROUTE_NAMES): the dot-product
        kernel, the one-pass kernel (no sgemm), sgemm for every term, sgemm then the
        sequential kernel, passes past PASS_DEPTH terms, a difference's widening, or a LoKr's
        Kronecker product (a LoHa's two pairs each name their product's route)."""
        out = []
        cdef const AdapterSpec *ad
        for a in range(self.job.count):
            ad = &self.ad[a]
            if ad.kind == KIND_DIFF:
                out.append("difference")
            elif ad.kind == KIND_LOKR or (ad.kind == KIND_LOKR_SCALED and ad.whole):
                out.append("Kronecker")
            elif ad.pairs:
                out.append("dot-product")
            elif ad.rank > PASS_DEPTH_C:
                out.append("passes")
            elif ad.depth[0] == 0:
                out.append("one-pass")
            else:
                out.append("sgemm" if ad.depth[0] >= ad.rank else "sgemm+sequential")
        return out

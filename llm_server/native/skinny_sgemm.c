/* Float32 products for MLX's CPU backend on Linux (preloaded before BLIS; see blas.py).
 *
 * MLX runs every float32 matmul as cblas_sgemm. Decoding multiplies a few rows (one per batch
 * row) by every weight matrix, and BLIS's gemm reads the weights there at ~13-17 GB/s where the
 * memory allows ~45. This library exports cblas_sgemm and computes the row-major products with
 * an untransposed A itself, C = alpha * A * op(B) + beta * C:
 * - B stored [N, K] (`x @ weight.T`, every weight product): each output is a dot product over
 *   K; a tile of MT rows of A times NB rows of B keeps its MT * NB accumulators and the NB
 *   weight vectors in registers, so each weight row is read once from memory for MT rows
 *   (and from cache for the next MT). On a 2-core EPYC with SmolLM2's 211 matrices: 1 row
 *   ~19 ms vs BLIS ~31, 8 rows ~30 vs ~43, 128 rows ~210 vs ~250. A one-row product (a
 *   decode step of one request) runs NB1 weight rows side by side (`tile1`). With the weights
 *   in 2 MiB pages (blas.py's malloc tunables) this and `tile` beat reading the weight rows
 *   one after another, which did better in 4 KiB pages (on a 2-core EPYC, the 211 matrices at
 *   1 row: ~28 ms against ~30, at 2 rows ~35 against ~45).
 *   Products of 10 rows and up (prompt chunks, a turn's new tokens, speculative steps) with
 *   AVX-512 and K > 96 compute the same sums as outer products (`many_rows_packed`): a chunk
 *   of 64 weight rows is packed lane-major, so one lane's sums of 6 rows x 64 columns are 24
 *   accumulators fed by 4 vector loads and 6 broadcasts, with no reduction in the loop; the
 *   lanes are added afterwards in vsum's tree. On a 2-core EPYC (Zen 4), SmolLM2's
 *   128-2048-row products: ~95-140 GF/s -> ~180-200 (benchmark/gemm_rate.py, the old build
 *   alternated; OpenBLAS 164-191), the earlier dot-product tiles below (3 rows x 8 weight rows
 *   in L1) having lost to the 32 KiB L1 and the reductions. Products whose 64 weight rows fit
 *   L1 (K <= 96: attention scores) keep those tiles.
 * - B stored [K, N] (`probs @ values` in attention): tiles of 6 rows x 4 vectors of columns,
 *   summing k in order.
 * Every other product goes to the next cblas_sgemm in the link order (the preloaded BLAS).
 *
 * Each output element has one fixed arithmetic. B [N, K]: lane l of a VL-float accumulator (16
 * with AVX-512, 8 with AVX2) sums k = l, l+VL, ... with fused multiply-adds, the lanes are added
 * in a fixed tree, then the K % VL tail in order. B [K, N]: k = 0, 1, ... in order with fused
 * multiply-adds. The order depends on K alone, never on M, N, the tile, the block or the
 * thread, so a row's products are bit-identical alone, batched, or beside a prompt chunk
 * (ARCHITECTURE S10).
 *
 * Threads: a pool of LLM_SERVER_SKINNY_THREADS (default: BLIS_NUM_THREADS, else the CPU count)
 * and the caller each take a contiguous run of the product's chunks (64 columns; of a block of
 * rows too for many rows), then the chunks left in the others' runs (see "the pool"). Workers
 * spin briefly between products, then sleep. A second caller while the pool is busy computes
 * on its own thread.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <limits.h>
#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <unistd.h>
#if defined(__AVX512F__)
#include <immintrin.h>
#define VL 16 /* floats per vector */
#define NB 8  /* weight rows per tile */
#define MT 3  /* rows of A per tile: MT * NB accumulators + MT rows of A + 1 weight in 32 zmm */
typedef float vec __attribute__((vector_size(64), aligned(4)));
static inline vec vfma(vec a, vec b, vec c) {
    return (vec)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c);
}
#define PIN(v) __asm__("" : "+v"(v)) /* in a register: not re-read by every row's FMA */
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define VL 8
#define NB 1
/* 8 accumulators + 1 weight + 1 of A in 16 registers: in 2 MiB pages, 8 rows x 1 weight row
 * beat 2 x 4 by 10-16% at 5-8 rows (a decode step's weight row read from memory once, by one
 * tile) and tied at 2-4 and 16-64 rows (C harness over SmolLM2's 211 matrices) */
#define MT 8
typedef float vec __attribute__((vector_size(32), aligned(4)));
static inline vec vfma(vec a, vec b, vec c) {
    return (vec)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c);
}
#define PIN(v) ((void)0) /* (an asm pin spills 32-byte vectors to the stack) */
#else
#error "skinny products need AVX-512F, or AVX2 with FMA (blas.py then preloads the BLAS alone)"
#endif
#define CPU_RELAX() _mm_pause()

#define CHUNK_COLS 64 /* columns per chunk of a product: a multiple of 16, whole tiles */
#define X_BLOCK_BYTES (256 * 1024) /* rows of A per block: stay in L2 while weights pass */
/* weight rows per group that one tile of A's rows (in L1) passes before the next tile: products
 * of 32-128 rows (prompt chunks) ~20% faster than a group of one tile (C harness, SmolLM2's 211
 * matrices: 32 rows 126 -> 101 ms, 128 rows 482 -> 378); 16-128 KB were within 10% */
#define W_GROUP_BYTES (64 * 1024)
/* pauses (~25 us) a worker waits for the next product, then sleeps: a spinning worker takes a
 * core from the Python thread that builds the step's ops, and a late worker costs nothing now
 * that chunks are claimed (with 20000, ~0.5 ms, decode steps were 3-7% slower) */
#define SPIN 1000
#define MIN_WORK_PER_THREAD 65536   /* multiply-adds; below this one thread does the product */

enum { ROW_MAJOR = 101, NO_TRANS = 111, TRANS = 112 };

static inline vec vload(const float *p) {
#if VL == 16
    return (vec)_mm512_loadu_ps(p);
#else
    return (vec)_mm256_loadu_ps(p);
#endif
}

static inline float vsum(vec v) { /* a fixed tree: halves added until one lane is left */
    typedef float v4 __attribute__((vector_size(16)));
#if VL == 16
    typedef float v8 __attribute__((vector_size(32)));
    v8 a = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
           __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
#else
    vec a = v;
#endif
    v4 b = __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
    return (b[0] + b[2]) + (b[1] + b[3]);
}

typedef struct {
    int m, n, k, trans_b;
    float alpha, beta;
    const float *a, *b;
    float *c;
    int lda, ldb, ldc;
} product_t;

/* output (m, n): its accumulator's lanes added, then the K % VL tail in order, then stored */
static inline __attribute__((always_inline)) void finish(const product_t *p, int m, int n,
                                                         vec acc, int k) {
    const float *xr = p->a + (size_t)m * p->lda, *wr = p->b + (size_t)n * p->ldb;
    float s = vsum(acc);
    for (; k < p->k; k++) s = fmaf(xr[k], wr[k], s);
    float *out = p->c + (size_t)m * p->ldc + n;
    *out = p->beta == 0.0f ? p->alpha * s : p->alpha * s + p->beta * *out;
}

#if VL == 16
typedef float v8 __attribute__((vector_size(32), aligned(4)));
/* r[j] = vsum(v[j]) for 8 accumulators at once, with vsum's additions (the same two operands
 * for every sum; IEEE addition is commutative, so an operand pair in either order gives the
 * same bits): each level adds a blend of two vectors to their complementary shuffle */
static inline __attribute__((always_inline)) v8 reduce8(const vec v[8]) {
    vec a[4], b[2];
    for (int i = 0; i < 4; i++) /* a_j[l] = v_j[l] + v_j[l + 8]: [a_2i, a_2i+1] */
        a[i] = __builtin_shufflevector(v[2 * i], v[2 * i + 1], 0, 1, 2, 3, 4, 5, 6, 7, 24, 25,
                                       26, 27, 28, 29, 30, 31) +
               __builtin_shufflevector(v[2 * i], v[2 * i + 1], 8, 9, 10, 11, 12, 13, 14, 15, 16,
                                       17, 18, 19, 20, 21, 22, 23);
    for (int i = 0; i < 2; i++) /* b_j[l] = a_j[l] + a_j[l + 4]: blocks of 4 [b0, b2, b1, b3] */
        b[i] = __builtin_shufflevector(a[2 * i], a[2 * i + 1], 0, 1, 2, 3, 20, 21, 22, 23, 8, 9,
                                       10, 11, 28, 29, 30, 31) +
               __builtin_shufflevector(a[2 * i], a[2 * i + 1], 4, 5, 6, 7, 16, 17, 18, 19, 12, 13,
                                       14, 15, 24, 25, 26, 27);
    /* c_j[l] = b_j[l] + b_j[l + 2] in every block: [c_u0, c_u1, c_w0, c_w1] */
    vec c = __builtin_shufflevector(b[0], b[1], 0, 1, 18, 19, 4, 5, 22, 23, 8, 9, 26, 27, 12, 13,
                                    30, 31) +
            __builtin_shufflevector(b[0], b[1], 2, 3, 16, 17, 6, 7, 20, 21, 10, 11, 24, 25, 14,
                                    15, 28, 29);
    /* c_j[0] + c_j[1] at the even lanes: accumulators 0 4 2 6 1 5 3 7 */
    vec d = c + __builtin_shufflevector(c, c, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15,
                                        14);
    return __builtin_shufflevector(d, d, 0, 8, 4, 12, 2, 10, 6, 14);
}

/* outputs (m, n0 .. n0 + 7) from their 8 accumulators: as `finish` does for each */
static inline __attribute__((always_inline)) void finish8(const product_t *p, int m, int n0,
                                                          const vec acc[8], int k) {
    v8 s = reduce8(acc);
    if (k < p->k) { /* the K % VL tail, in order */
        const float *xr = p->a + (size_t)m * p->lda, *w = p->b + (size_t)n0 * p->ldb;
        for (int j = 0; j < 8; j++) {
            const float *wr = w + (size_t)j * p->ldb;
            float t = s[j];
            for (int kk = k; kk < p->k; kk++) t = fmaf(xr[kk], wr[kk], t);
            s[j] = t;
        }
    }
    float *out = p->c + (size_t)m * p->ldc + n0;
    v8 o = p->alpha * s;
    if (p->beta != 0.0f) {
        v8 old;
        __builtin_memcpy(&old, out, sizeof old);
        o = p->alpha * s + p->beta * old;
    }
    __builtin_memcpy(out, &o, sizeof o);
}
#define FINISH_ROW(p, m, n0, acc, cols, k) \
    do { \
        if ((cols) == 8) \
            finish8(p, m, n0, acc, k); \
        else \
            for (int j_ = 0; j_ < (cols); j_++) finish(p, m, (n0) + j_, (acc)[j_], k); \
    } while (0)
#else
#define FINISH_ROW(p, m, n0, acc, cols, k) \
    for (int j_ = 0; j_ < (cols); j_++) finish(p, m, (n0) + j_, (acc)[j_], k)
#endif

/* rows x cols outputs at (m0, n0); rows <= MT, cols <= NB (constants after inlining); `pf`: the
 * next tile's weight rows are prefetched. k in [kb, ke): from zero (kb == 0) or the sums saved
 * in `save` (rows x NB vectors), to the outputs (ke == K) or back into `save` (a vector stored
 * and loaded again is the same vector: the sums go on as without the break) */
static inline __attribute__((always_inline)) void tile(const product_t *p, int m0, int n0,
                                                       const int rows, const int cols,
                                                       const int pf, int kb, int ke, vec *save,
                                                       const float *pfrow) {
    const float *x = p->a + (size_t)m0 * p->lda, *w = p->b + (size_t)n0 * p->ldb;
    vec acc[MT][NB];
    for (int i = 0; i < rows; i++)
        for (int j = 0; j < cols; j++)
            acc[i][j] = save == NULL || kb == 0 ? (vec){0} : save[i * NB + j];
    int k = kb;
    for (; k + VL <= ke; k += VL) {
#if VL == 16 /* MT rows of A in registers, each weight vector loaded into one for MT rows */
        vec xv[MT];
        for (int i = 0; i < rows; i++) {
            xv[i] = vload(x + (size_t)i * p->lda + k);
            PIN(xv[i]);
        }
        for (int j = 0; j < cols; j++) {
            vec wv = vload(w + (size_t)j * p->ldb + k);
            /* the next tile's rows at this k: each of its row streams is warm when it starts
             * (5-8% at 4-8 rows in the harness; values unchanged) */
            if (pf) __builtin_prefetch(w + (size_t)(j + NB) * p->ldb + k);
            for (int i = 0; i < rows; i++) acc[i][j] = vfma(xv[i], wv, acc[i][j]);
        }
#else /* NB = 1 weight vector in a register, A's rows loaded one after another */
        vec wv = vload(w + k);
        if (pf) __builtin_prefetch(w + (size_t)NB * p->ldb + k);
        for (int i = 0; i < rows; i++)
            acc[i][0] = vfma(vload(x + (size_t)i * p->lda + k), wv, acc[i][0]);
#endif
        if (pfrow) __builtin_prefetch(pfrow + k);
    }
    if (save != NULL && ke < p->k) {
        for (int i = 0; i < rows; i++)
            for (int j = 0; j < cols; j++) save[i * NB + j] = acc[i][j];
        return;
    }
    for (int i = 0; i < rows; i++) FINISH_ROW(p, m0 + i, n0, acc[i], cols, k);
}

#define NB1 8 /* weight rows per tile of a one-row product: NB1 accumulators + 1 of A */
/* one row of A times NB1 weight rows: each weight vector goes from memory straight into its
 * multiply-add (no register to keep it for other rows), so NB1 accumulators' dependency chains
 * run interleaved */
static inline __attribute__((always_inline)) void tile1(const product_t *p, int m, int n0,
                                                        const int cols) {
    const float *x = p->a + (size_t)m * p->lda, *w = p->b + (size_t)n0 * p->ldb;
    vec acc[NB1];
    for (int j = 0; j < cols; j++) acc[j] = (vec){0};
    int k = 0;
    for (; k + VL <= p->k; k += VL) {
        vec xv = vload(x + k);
        for (int j = 0; j < cols; j++) {
            acc[j] = vfma(xv, vload(w + (size_t)j * p->ldb + k), acc[j]);
            __builtin_prefetch(w + (size_t)(j + NB1) * p->ldb + k);
        }
    }
    FINISH_ROW(p, m, n0, acc, cols, k);
}

/* B stored [K, N] (`x @ v`, attention's probabilities times values): each output element sums
 * k = 0, 1, ... in order with fused multiply-adds, VL columns to a vector, from A's value plus
 * zero (a -0 taken as +0, as the first version's broadcast `(vec){0} + x[k]` did) */
#define NV 4 /* vectors of columns per tile */
#if VL == 16
#define KN_ROWS 6 /* rows per tile: KN_ROWS * NV accumulators + NV of B in 32 registers */
static inline vec vbroadcast(const float *x) { return (vec)_mm512_set1_ps(*x); }
#else
#define KN_ROWS 2
static inline vec vbroadcast(const float *x) { return (vec)_mm256_set1_ps(*x); }
#endif
#define KN_KC 256 /* A's values per row taken (plus zero) at a time */
static inline __attribute__((always_inline)) void tile_kn(const product_t *p, int m0,
                                                          const int rows, int n0,
                                                          const int vecs) {
    vec acc[KN_ROWS][NV];
    for (int i = 0; i < rows; i++)
        for (int j = 0; j < vecs; j++) acc[i][j] = (vec){0};
    float xs[KN_ROWS][KN_KC]; /* broadcast from here: each B vector serves `rows` rows */
    for (int kb = 0; kb < p->k; kb += KN_KC) {
        const int kn = p->k - kb < KN_KC ? p->k - kb : KN_KC;
        for (int i = 0; i < rows; i++) {
            const float *x = p->a + (size_t)(m0 + i) * p->lda + kb;
            for (int kk = 0; kk < kn; kk++) xs[i][kk] = x[kk] + 0.0f;
        }
        for (int kk = 0; kk < kn; kk++) {
            const float *w = p->b + (size_t)(kb + kk) * p->ldb + n0;
            vec bv[NV];
            for (int j = 0; j < vecs; j++) bv[j] = vload(w + VL * j);
            for (int i = 0; i < rows; i++) {
                const vec xv = vbroadcast(&xs[i][kk]);
                for (int j = 0; j < vecs; j++) acc[i][j] = vfma(xv, bv[j], acc[i][j]);
            }
        }
    }
    for (int i = 0; i < rows; i++) {
        float *out = p->c + (size_t)(m0 + i) * p->ldc + n0;
        for (int j = 0; j < vecs; j++) {
            vec o = p->alpha * acc[i][j];
            if (p->beta != 0.0f) o = p->alpha * acc[i][j] + p->beta * vload(out + VL * j);
            __builtin_memcpy(out + VL * j, &o, sizeof o);
        }
    }
}

/* rows [m0, m1) of VL * vecs columns at n0, in tiles of KN_ROWS rows */
static inline __attribute__((always_inline)) void rows_kn(const product_t *p, int m0, int m1,
                                                          int n0, const int vecs) {
    int m = m0;
    for (; m + KN_ROWS <= m1; m += KN_ROWS) tile_kn(p, m, KN_ROWS, n0, vecs);
    switch (m1 - m) { /* < KN_ROWS <= 6 */
#define KN_REST(rr) \
    case rr: \
        if (rr < KN_ROWS) tile_kn(p, m, rr, n0, vecs); \
        break;
        KN_REST(5) KN_REST(4) KN_REST(3) KN_REST(2) KN_REST(1)
#undef KN_REST
    }
}

static void columns_kn(const product_t *p, int m0, int m1, int n0, int n1) {
    int n = n0;
    for (; n + VL * NV <= n1; n += VL * NV) rows_kn(p, m0, m1, n, NV);
    for (; n + VL <= n1; n += VL) rows_kn(p, m0, m1, n, 1);
    for (; n < n1; n++)
        for (int m = m0; m < m1; m++) {
            const float *x = p->a + (size_t)m * p->lda;
            float s = 0.0f;
            for (int k = 0; k < p->k; k++) s = fmaf(x[k], p->b[(size_t)k * p->ldb + n], s);
            float *o = p->c + (size_t)m * p->ldc + n;
            *o = p->beta == 0.0f ? p->alpha * s : p->alpha * s + p->beta * *o;
        }
}

/* many rows (prompt chunks): a weight tile stays in L1 while the tiles of a block of A's rows
 * (in L2) pass it; past K_BLOCK floats (a tile's weights over L1's half) in K blocks, the
 * block's sums kept in between */
#if VL == 16
#define MANY_ROWS 24
#else /* (not measured with AVX2: its products keep the tiles above) */
#define MANY_ROWS INT_MAX
#endif
#define K_BLOCK 768 /* a multiple of VL */
#define W_L1_BYTES (24 * 1024)
#define SAVE_ROWS (X_BLOCK_BYTES / (K_BLOCK * 4) + MT)
#define KN_BLOCK (16 * KN_ROWS) /* rows per chunk of a many-row product with B [K, N] */
#if VL == 16
/* Many rows, packed (prompt chunks whose weight tiles do not all fit L1): the same sums as
 * `tile`'s, computed as outer products. Lane l of output (m, n) sums a[m, l + VL j] *
 * b[n, l + VL j] over j in order, exactly what `tile`'s accumulator lane l does, so a pass
 * over one lane for a tile of PR rows x PC columns broadcasts a[m, l + VL j] against VL
 * columns' b[n, l + VL j] (the chunk's weights packed lane-major, `pack_lanes`): PR * PV
 * accumulators, PV vector loads and PR broadcasts per PR * PV multiply-adds, no reduction in
 * the loop. The 16 lanes' sums are then added in vsum's tree (pairs l, l + 8, then l, l + 4,
 * ...), the K % VL tail goes on in order, alpha and beta last: every output bit for bit the
 * other paths' (ARCHITECTURE S10). */
#define PR 6             /* rows of A per tile */
#define PV 4             /* vectors of columns per tile: PR * PV accumulators + PV of B */
#define PC (PV * VL)     /* columns per tile: CHUNK_COLS */
_Static_assert(PC == CHUNK_COLS, "a packed tile is a chunk's columns");

static __thread float *pack_buf;
static __thread size_t pack_cap;

static float *pack_buffer(size_t floats) {
    if (floats > pack_cap) {
        free(pack_buf);
        pack_buf = aligned_alloc(64, (floats * sizeof(float) + 63) / 64 * 64);
        pack_cap = pack_buf ? floats : 0;
    }
    return pack_buf;
}

/* a 16 x 16 transpose in four block swaps (8, 4, 2 and 1 lanes): r[i][l] becomes r[l][i].
 * For rows i and i + s (bit s of i clear), lane l of the new row i is x[l] where bit s of l is
 * clear, else y[l - s]; of the new row i + s, x[l + s], else y[l] (y's lanes are 16..31) */
#define LO(s, l) (((l) & (s)) ? 16 + (l) - (s) : (l))
#define HI(s, l) (((l) & (s)) ? 16 + (l) : (l) + (s))
#define LANES(F, s) F(s, 0), F(s, 1), F(s, 2), F(s, 3), F(s, 4), F(s, 5), F(s, 6), F(s, 7), \
    F(s, 8), F(s, 9), F(s, 10), F(s, 11), F(s, 12), F(s, 13), F(s, 14), F(s, 15)
#define SWAP(s) \
    for (int i = 0; i < 16; i++) \
        if (!(i & (s))) { \
            const vec x_ = r[i], y_ = r[i + (s)]; \
            r[i] = __builtin_shufflevector(x_, y_, LANES(LO, s)); \
            r[i + (s)] = __builtin_shufflevector(x_, y_, LANES(HI, s)); \
        }
static inline __attribute__((always_inline)) void transpose16(vec r[16]) {
    SWAP(8) SWAP(4) SWAP(2) SWAP(1)
}
#undef SWAP
#undef LANES
#undef HI
#undef LO

/* b[n0 .. n0 + cols) packed: bp[(l J + j) PC + c] = b[n0 + c, l + VL j] (J = K / VL), then the
 * tail bp[(VL J + t) PC + c] = b[n0 + c, VL J + t]; columns from `cols` to PC are zero. Whole
 * groups of 16 columns go 16 x 16 floats at a time through `transpose16` */
static void pack_lanes(const product_t *p, int n0, int cols, float *bp) {
    const int J = p->k / VL, tail = p->k - VL * J;
    int c = 0;
    for (; c + VL <= cols; c += VL) {
        const float *w = p->b + (size_t)(n0 + c) * p->ldb;
        for (int j = 0; j < J; j++) {
            vec r[16];
            for (int i = 0; i < 16; i++) r[i] = vload(w + (size_t)i * p->ldb + VL * j);
            transpose16(r);
            for (int l = 0; l < VL; l++)
                __builtin_memcpy(bp + ((size_t)l * J + j) * PC + c, &r[l], sizeof(vec));
        }
        for (int i = 0; i < VL; i++)
            for (int t = 0; t < tail; t++)
                bp[((size_t)VL * J + t) * PC + c + i] = w[(size_t)i * p->ldb + VL * J + t];
    }
    for (; c < PC; c++) {
        const float *w = p->b + (size_t)(n0 + c) * p->ldb;
        for (int j = 0; j < J; j++)
            for (int l = 0; l < VL; l++)
                bp[((size_t)l * J + j) * PC + c] = c < cols ? w[VL * j + l] : 0.0f;
        for (int t = 0; t < tail; t++)
            bp[((size_t)VL * J + t) * PC + c] = c < cols ? w[VL * J + t] : 0.0f;
    }
}

/* one lane's sums s of `rows` rows of A (x: the rows' lane l, lda apart) against the packed
 * columns (b: the lane's J >= 1 vectors of PC), from zero, stored to out[i * PV + v] as s,
 * first + s or pair + (first + s) (vsum's tree, a lane pair at a time: `packed_tile`). Its own
 * function, so the accumulators, the weight vectors and the rows' pointers are all that is
 * live in the loop: 24 + 4 + 1 vectors in registers (inlined into the tile's loops, the
 * compiler kept some on the stack: half the rate) */
static inline __attribute__((always_inline)) void lane_sums(const float *x, size_t lda,
                                                            const float *b, int J,
                                                            const int rows, const vec *first,
                                                            const vec *pair, vec *out) {
    vec acc[PR][PV];
    const float *xr[PR];
    for (int i = 0; i < rows; i++) {
        xr[i] = x + (size_t)i * lda;
        for (int v = 0; v < PV; v++) acc[i][v] = (vec){0};
    }
    if (J < 1) __builtin_unreachable(); /* (K > 96): no path around the loop keeps acc */
    for (int j = 0; j < J; j++, b += PC) {
        vec bv[PV];
        for (int v = 0; v < PV; v++) bv[v] = vload(b + VL * v);
        for (int i = 0; i < rows; i++) {
            const vec xv = vbroadcast(xr[i] + (size_t)VL * j);
            for (int v = 0; v < PV; v++) acc[i][v] = vfma(xv, bv[v], acc[i][v]);
        }
    }
#define EACH_ACC(stmt) \
    _Pragma("GCC unroll 24") for (int o = 0; o < rows * PV; o++) stmt
    if (first == NULL)
        EACH_ACC(out[o] = acc[o / PV][o % PV]);
    else if (pair == NULL)
        EACH_ACC(out[o] = first[o] + acc[o / PV][o % PV]);
    else
        EACH_ACC(out[o] = pair[o] + (first[o] + acc[o / PV][o % PV]));
#undef EACH_ACC
}

static __attribute__((noinline)) void lane_sums_full(const float *x, size_t lda,
                                                     const float *b, int J, const vec *first,
                                                     const vec *pair, vec *out) {
    lane_sums(x, lda, b, J, PR, first, pair, out);
}

static __attribute__((noinline)) void lane_sums_rest(const float *x, size_t lda,
                                                     const float *b, int J, int rows,
                                                     const vec *first, const vec *pair,
                                                     vec *out) {
    switch (rows) { /* < PR */
    case 5: lane_sums(x, lda, b, J, 5, first, pair, out); break;
    case 4: lane_sums(x, lda, b, J, 4, first, pair, out); break;
    case 3: lane_sums(x, lda, b, J, 3, first, pair, out); break;
    case 2: lane_sums(x, lda, b, J, 2, first, pair, out); break;
    case 1: lane_sums(x, lda, b, J, 1, first, pair, out); break;
    }
}

/* lane l's sums of rows m0 .. m0 + rows over the packed columns, into `out` (see lane_sums) */
static inline void lane_pass(const product_t *p, int m0, int rows, int l, const float *bp,
                             const vec *first, const vec *pair, vec *out) {
    const int J = p->k / VL;
    const float *x = p->a + (size_t)m0 * p->lda + l, *b = bp + (size_t)l * J * PC;
    if (rows == PR)
        lane_sums_full(x, p->lda, b, J, first, pair, out);
    else
        lane_sums_rest(x, p->lda, b, J, rows, first, pair, out);
}

#define EACH(rows, stmt) \
    for (int i = 0; i < (rows); i++) \
        for (int v = 0; v < PV; v++) stmt

static inline __attribute__((always_inline)) void packed_tile(const product_t *p, int m0,
                                                              const int rows, int n0, int cols,
                                                              const float *bp) {
    const int J = p->k / VL;
    vec s[PR][PV], first[PR][PV], pair[PR][PV], quad[4][PR][PV];
    for (int q = 0; q < 4; q++) { /* quad[q] = (s_q + s_q+8) + (s_q+4 + s_q+12) */
        lane_pass(p, m0, rows, q, bp, NULL, NULL, &first[0][0]);
        lane_pass(p, m0, rows, q + 8, bp, &first[0][0], NULL, &pair[0][0]);
        lane_pass(p, m0, rows, q + 4, bp, NULL, NULL, &first[0][0]);
        lane_pass(p, m0, rows, q + 12, bp, &first[0][0], &pair[0][0], &quad[q][0][0]);
    }
    EACH(rows, s[i][v] = (quad[0][i][v] + quad[2][i][v]) + (quad[1][i][v] + quad[3][i][v]));
    for (int k = VL * J; k < p->k; k++) { /* the tail, in order */
        const float *b = bp + (size_t)k * PC;
        for (int i = 0; i < rows; i++) {
            const vec xv = vbroadcast(p->a + (size_t)(m0 + i) * p->lda + k);
            for (int v = 0; v < PV; v++) s[i][v] = vfma(xv, vload(b + VL * v), s[i][v]);
        }
    }
    for (int i = 0; i < rows; i++) {
        float *out = p->c + (size_t)(m0 + i) * p->ldc + n0;
        for (int v = 0; v < PV && VL * v < cols; v++) {
            const int w = cols - VL * v < VL ? cols - VL * v : VL;
            vec o = p->alpha * s[i][v];
            if (p->beta != 0.0f) {
                vec old = {0};
                __builtin_memcpy(&old, out + VL * v, w * sizeof(float));
                o = p->alpha * s[i][v] + p->beta * old;
            }
            __builtin_memcpy(out + VL * v, &o, w * sizeof(float));
        }
    }
}

/* rows [m0, m1) x columns [n0, n1) in chunks of PC columns; false without a buffer */
static int many_rows_packed(const product_t *p, int m0, int m1, int n0, int n1) {
    float *bp = pack_buffer((size_t)PC * p->k);
    if (bp == NULL) return 0;
    for (int c0 = n0; c0 < n1; c0 += PC) {
        const int cols = n1 - c0 < PC ? n1 - c0 : PC;
        pack_lanes(p, c0, cols, bp);
        int m = m0;
        for (; m + PR <= m1; m += PR) packed_tile(p, m, PR, c0, cols, bp);
        switch (m1 - m) { /* < PR */
#define PR_REST(rr) \
    case rr: \
        packed_tile(p, m, rr, c0, cols, bp); \
        break;
            PR_REST(5) PR_REST(4) PR_REST(3) PR_REST(2) PR_REST(1)
#undef PR_REST
        }
    }
    return 1;
}
#undef EACH
#endif

#define PACK_ROWS 240 /* rows of A per chunk of a packed product, at most: the packing shared */
#if VL == 16
/* products that `many_rows` packs: B [N, K] whose chunk of columns does not fit L1 */
static int packed(const product_t *p) {
    return p->trans_b && (size_t)CHUNK_COLS * p->k * sizeof(float) > W_L1_BYTES;
}
#endif

/* products of enough rows for `many_rows`: a packed product from PACKED_MIN_ROWS (10-20 rows,
 * e.g. a conversation turn's new tokens or a speculative step's drafts: ~85-115 -> ~110-145
 * GF/s on SmolLM2's shapes on a 2-core EPYC, benchmark/gemm_rate; at 8 rows, a decode step of
 * 8 requests, no better than the tiles, which stream the weights at the memory's rate) */
#define PACKED_MIN_ROWS 10
static int many(const product_t *p) {
#if VL == 16
    if (packed(p)) return p->m >= PACKED_MIN_ROWS;
#endif
    return p->m >= MANY_ROWS;
}

static int x_block(const product_t *p) { /* rows of A in L2: a multiple of MT */
    int block = (int)(X_BLOCK_BYTES / ((size_t)p->k * sizeof(float))) / MT * MT;
    return block < MT ? MT : block;
}

static int row_block(const product_t *p) { /* rows of A per chunk */
    if (!p->trans_b) return KN_BLOCK;
#if VL == 16
    if (packed(p)) { /* blocks of equal rows, give or take a tile */
        const int blocks = (p->m + PACK_ROWS - 1) / PACK_ROWS;
        const int rows = (p->m + blocks - 1) / blocks;
        return (rows + PR - 1) / PR * PR;
    }
#endif
    return x_block(p);
}


static void many_rows(const product_t *p, int m0, int m1, int n0, int n1) {
#if VL == 16
    if (packed(p) && many_rows_packed(p, m0, m1, n0, n1)) return;
#endif
    const int block = x_block(p);
    const int full = n0 + (n1 - n0) / NB * NB;
    const int kblocks = (p->k + K_BLOCK - 1) / K_BLOCK;
    const int kc = (p->k / VL + kblocks - 1) / kblocks * VL; /* equal blocks of whole vectors */
    vec save[kblocks > 1 ? SAVE_ROWS * NB : 1];
    for (int b0 = m0; b0 < m1; b0 += block) {
        const int b1 = b0 + block < m1 ? b0 + block : m1;
        const int mfull = b0 + (b1 - b0) / MT * MT;
        if ((size_t)(full - n0) * p->k * sizeof(float) <= W_L1_BYTES) {
            /* all the weight tiles in L1 (attention's scores: K is a head's width): each tile
             * of A's rows passes them all, its outputs whole cache lines (rows of C a power of
             * two apart would share a few cache sets for a column of tiles) */
            int m = b0;
            for (; m < mfull; m += MT)
                for (int n = n0; n < full; n += NB) tile(p, m, n, MT, NB, 0, 0, p->k, NULL, NULL);
            for (; m < b1; m++)
                for (int n = n0; n < full; n += NB) tile(p, m, n, 1, NB, 0, 0, p->k, NULL, NULL);
        } else
        for (int n = n0; n < full; n += NB) {
            for (int kb = 0; kb < p->k; kb += kc) {
                const int ke = kb + kc < p->k && kblocks > 1 ? kb + kc : p->k;
                /* tile t of A's rows prefetches row t % NB of the next weight tile */
                const float *next = n + NB < full ? p->b + (size_t)(n + NB) * p->ldb : NULL;
                for (int m = b0; m < mfull; m += MT) {
                    const int t = (m - b0) / MT;
                    const float *pfrow = next && t < NB ? next + (size_t)t * p->ldb : NULL;
                    tile(p, m, n, MT, NB, 0, kb, ke, save + (m - b0) * NB, pfrow);
                }
                vec *rest = save + (mfull - b0) * NB;
                switch (b1 - mfull) {
                case 2: tile(p, mfull, n, 2, NB, 0, kb, ke, rest, NULL); break;
                case 1: tile(p, mfull, n, 1, NB, 0, kb, ke, rest, NULL); break;
                }
                if (ke == p->k) break;
            }
        }
        for (int n = full; n < n1; n++)
            for (int m = b0; m < b1; m++) tile(p, m, n, 1, 1, 0, 0, p->k, NULL, NULL);
    }
}

static void columns(const product_t *p, int n0, int n1) {
    if (!p->trans_b) {
        columns_kn(p, 0, p->m, n0, n1);
        return;
    }
    if (p->m == 1) {
        int n = n0;
        for (; n + NB1 <= n1; n += NB1) tile1(p, 0, n, NB1);
        for (; n < n1; n++) tile1(p, 0, n, 1);
        return;
    }
    if (many(p)) {
        many_rows(p, 0, p->m, n0, n1);
        return;
    }
    /* blocks of A's rows small enough to stay in L2 while every weight tile passes them */
    int block = (int)(X_BLOCK_BYTES / ((size_t)p->k * sizeof(float))) / MT * MT;
    if (block < MT) block = MT;
    for (int m0 = 0; m0 < p->m; m0 += block) {
        int m1 = m0 + block < p->m ? m0 + block : p->m;
        /* weight rows in groups of ~W_GROUP_BYTES: a tile of A's rows, read into L1 by the
         * group's first weight tile, serves the group's other tiles from there instead of from
         * L2 (a decode step's few rows are one tile: the same order as without groups; no
         * order changes any output's arithmetic) */
        int group = (int)(W_GROUP_BYTES / ((size_t)p->k * sizeof(float))) / NB * NB;
        if (group < NB) group = NB;
        const int full = n0 + (n1 - n0) / NB * NB;
        for (int g0 = n0; g0 < full; g0 += group) {
            const int g1 = g0 + group < full ? g0 + group : full;
            /* ceil(rows / MT) tiles of equal rows (sizes differing by one at most), in
             * constant shapes: 18 rows as 6 + 6 + 6, not 8 + 8 + 2, whose 2-row tile takes
             * nearly as long as a full one (C harness, SmolLM2's 211 matrices: 10-27 rows
             * 3-7% faster; 1-8 rows are one tile either way) */
            const int tiles = (m1 - m0 + MT - 1) / MT;
            int m = m0;
            for (int t = 0; t < tiles; t++) {
                const int r = (m1 - m) / (tiles - t) + ((m1 - m) % (tiles - t) != 0);
                switch (r) { /* r <= MT <= 8 */
#define ROWS(rr) \
    case rr: \
        if (rr <= MT) \
            for (int n = g0; n < g1; n += NB) tile(p, m, n, rr, NB, 1, 0, p->k, NULL, NULL); \
        break;
                    ROWS(8) ROWS(7) ROWS(6) ROWS(5) ROWS(4) ROWS(3) ROWS(2) ROWS(1)
#undef ROWS
                }
                m += r;
            }
        }
        for (int n = full; n < n1; n++)
            for (int m = m0; m < m1; m++) tile(p, m, n, 1, 1, 0, 0, p->k, NULL, NULL);
    }
}

/* ---- the pool ---- */
/* A product's columns are cut into chunks of CHUNK_COLS (of a block of rows each for many
 * rows: `chunk`). Each of the product's parts (the
 * caller and parts - 1 workers) owns a contiguous run of them and takes its own from the front;
 * a part whose run is done takes the other runs' chunks from their backs. Each thread so
 * streams one long stretch of the weights (the memory's prefetchers keep up: one-row products
 * over SmolLM2's 211 matrices ~5% faster than chunks handed out in turn, whose threads
 * alternate 147 KB stretches), and a thread the OS holds back (on 2 cores the Python thread
 * and MLX's stream thread share them with the pool) leaves its chunks to the others instead of
 * making the caller wait at a barrier. Which thread computes a column changes nothing in its
 * values. */
#define MAX_POOL 64
static pthread_once_t pool_once = PTHREAD_ONCE_INIT;
static pthread_mutex_t pool_busy = PTHREAD_MUTEX_INITIALIZER;
static pthread_mutex_t wake_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t wake_cv = PTHREAD_COND_INITIALIZER;
static int pool_threads = 1;
static product_t job;
static int job_parts;
static atomic_uint generation;
/* part r's unclaimed chunks [next, end) as (generation << 40) | (next << 20) | end: a claim is
 * valid for its generation only (24 bits of it), so a worker late for a product never takes a
 * chunk of the next one with the old one's sizes */
static _Atomic unsigned long long runs[MAX_POOL];
#define GEN_BITS 0xffffffull
#define IDX_BITS 0xfffffull /* chunks per product: at most 2^20 - 1 (67M columns) */
static atomic_int chunks_done;

/* a chunk of part r's run for generation gen, from the front (its own part) or the back;
 * -1 when the run is done */
static int take(int r, unsigned gen, int back) {
    unsigned long long v = atomic_load_explicit(&runs[r], memory_order_acquire);
    for (;;) {
        unsigned long long next = v >> 20 & IDX_BITS, end = v & IDX_BITS;
        if ((v >> 40 & GEN_BITS) != (gen & GEN_BITS) || next >= end) return -1;
        if (atomic_compare_exchange_weak_explicit(&runs[r], &v, back ? v - 1 : v + (1ull << 20),
                                                  memory_order_acq_rel, memory_order_acquire))
            return (int)(back ? end - 1 : next);
    }
}

/* chunks of many rows' products: CHUNK_COLS columns of a block of rows, the blocks of rows
 * outermost (a thread's run is a stretch of A's rows, each block in L2 while the weights pass) */
static int row_blocks(const product_t *p) {
    return many(p) ? (p->m + row_block(p) - 1) / row_block(p) : 1;
}

static int count_chunks(const product_t *p) {
    return (p->n + CHUNK_COLS - 1) / CHUNK_COLS * row_blocks(p);
}

static void chunk(const product_t *p, int c) {
    const int col_chunks = (p->n + CHUNK_COLS - 1) / CHUNK_COLS;
    const int n0 = c % col_chunks * CHUNK_COLS;
    const int n1 = n0 + CHUNK_COLS < p->n ? n0 + CHUNK_COLS : p->n;
    if (row_blocks(p) == 1) {
        columns(p, n0, n1);
        return;
    }
    const int block = row_block(p), m0 = c / col_chunks * block;
    const int m1 = m0 + block < p->m ? m0 + block : p->m;
    if (p->trans_b)
        many_rows(p, m0, m1, n0, n1);
    else
        columns_kn(p, m0, m1, n0, n1);
}

/* part t: its own run, then the others' */
static void run_chunks(unsigned gen, int t) {
    const int parts = job_parts; /* a late worker's stale value only finds other generations */
    for (int i = 0; i < parts; i++) {
        const int r = (t + i) % parts;
        for (int c; (c = take(r, gen, i != 0)) >= 0;) {
            /* claimed: the caller waits for this chunk, so `job` stays this generation's */
            chunk(&job, c);
            atomic_fetch_add_explicit(&chunks_done, 1, memory_order_acq_rel);
        }
    }
}

static void *worker(void *arg) {
    int t = (int)(long)arg;
    unsigned seen = 0;
    for (;;) {
        int spins = 0;
        while (atomic_load_explicit(&generation, memory_order_acquire) == seen) {
            if (++spins < SPIN) {
                CPU_RELAX();
                continue;
            }
            pthread_mutex_lock(&wake_mu);
            while (atomic_load_explicit(&generation, memory_order_acquire) == seen)
                pthread_cond_wait(&wake_cv, &wake_mu);
            pthread_mutex_unlock(&wake_mu);
        }
        seen = atomic_load_explicit(&generation, memory_order_acquire);
        if (t < job_parts) run_chunks(seen, t);
    }
    return NULL;
}

/* a forked child has none of the workers: it computes every product on its own thread */
static void forked_child(void) { pool_threads = 1; }

static void start_pool(void) {
    pthread_atfork(NULL, NULL, forked_child);
    const char *env = getenv("LLM_SERVER_SKINNY_THREADS");
    if (!env || !*env) env = getenv("BLIS_NUM_THREADS");
    long n = env && *env ? strtol(env, NULL, 10) : sysconf(_SC_NPROCESSORS_ONLN);
    pool_threads = n < 1 ? 1 : n > MAX_POOL ? MAX_POOL : (int)n;
    for (int t = 1; t < pool_threads; t++) {
        pthread_t th;
        if (pthread_create(&th, NULL, worker, (void *)(long)t) != 0) {
            pool_threads = t;
            break;
        }
        pthread_detach(th);
    }
}

static void skinny(const product_t *p) {
    pthread_once(&pool_once, start_pool);
    long long parts_wanted = (long long)p->m * p->n * p->k / MIN_WORK_PER_THREAD;
    int chunks = count_chunks(p);
    int parts = parts_wanted > pool_threads ? pool_threads : (int)parts_wanted;
    if (parts > chunks) parts = chunks;
    if (parts <= 1 || chunks > (int)IDX_BITS || pthread_mutex_trylock(&pool_busy) != 0) {
        columns(p, 0, p->n);
        return;
    }
    job = *p;
    job_parts = parts;
    atomic_store_explicit(&chunks_done, 0, memory_order_relaxed);
    unsigned gen = atomic_load_explicit(&generation, memory_order_relaxed) + 1;
    for (int r = 0; r < parts; r++) { /* runs of equal length, give or take one chunk */
        unsigned long long b = (unsigned long long)chunks * r / parts;
        unsigned long long e = (unsigned long long)chunks * (r + 1) / parts;
        atomic_store_explicit(&runs[r], (gen & GEN_BITS) << 40 | b << 20 | e,
                              memory_order_release);
    }
    pthread_mutex_lock(&wake_mu);
    atomic_store_explicit(&generation, gen, memory_order_release);
    pthread_cond_broadcast(&wake_cv);
    pthread_mutex_unlock(&wake_mu);
    run_chunks(gen, 0);
    /* every chunk is claimed: wait for those still computing on a worker */
    while (atomic_load_explicit(&chunks_done, memory_order_acquire) < chunks) CPU_RELAX();
    pthread_mutex_unlock(&pool_busy);
}

/* ---- the entry point ---- */
typedef void (*sgemm_fn)(int, int, int, int, int, int, float, const float *, int, const float *,
                         int, float, float *, int);
static sgemm_fn next_sgemm;
static pthread_once_t next_once = PTHREAD_ONCE_INIT;
static void find_next(void) { next_sgemm = (sgemm_fn)dlsym(RTLD_NEXT, "cblas_sgemm"); }

/* for tests and the benchmark: the pool's size, and the product alone */
int llm_skinny_threads(void) {
    pthread_once(&pool_once, start_pool);
    return pool_threads;
}
void llm_skinny_sgemm(int trans_b, int m, int n, int k, float alpha, const float *a, int lda,
                      const float *b, int ldb, float beta, float *c, int ldc) {
    product_t p = {m, n, k, trans_b != 0, alpha, beta, a, b, c, lda, ldb, ldc};
    if (m > 0 && n > 0) skinny(&p);
}

void cblas_sgemm(int order, int trans_a, int trans_b, int m, int n, int k, float alpha,
                 const float *a, int lda, const float *b, int ldb, float beta, float *c,
                 int ldc) {
    pthread_once(&next_once, find_next);
    int ours = order == ROW_MAJOR && trans_a == NO_TRANS && m > 0 && n > 0 && k > 0 &&
               lda >= k && ldc >= n && (trans_b == TRANS ? ldb >= k : trans_b == NO_TRANS && ldb >= n);
    if (ours) {
        llm_skinny_sgemm(trans_b == TRANS, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
        return;
    }
    if (next_sgemm != NULL) {
        next_sgemm(order, trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
        return;
    }
    /* no BLAS after us (not how blas.py preloads this library): a plain loop, right if slow */
    for (int i = 0; i < m; i++)
        for (int j = 0; j < n; j++) {
            float s = 0.0f;
            for (int l = 0; l < k; l++) {
                int ai = order == ROW_MAJOR ? (trans_a == NO_TRANS ? i * lda + l : l * lda + i)
                                            : (trans_a == NO_TRANS ? l * lda + i : i * lda + l);
                int bi = order == ROW_MAJOR ? (trans_b == NO_TRANS ? l * ldb + j : j * ldb + l)
                                            : (trans_b == NO_TRANS ? j * ldb + l : l * ldb + j);
                s += a[ai] * b[bi];
            }
            float *out = order == ROW_MAJOR ? c + i * ldc + j : c + j * ldc + i;
            *out = beta == 0.0f ? alpha * s : alpha * s + beta * *out;
        }
}

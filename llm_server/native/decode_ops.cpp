// Decode ops as MLX primitives for the CPU (attention, RMSNorm + products, whole layers) (built at run time: decode_ops.py).
//
// A decode step on the CPU pays per graph op (~3-7 us each, whatever its size), and the
// attention of one layer took ~22 of them: slices and reshapes of the stacked q/k/v product, the
// rotation (a roll and a fused kernel), two slice updates into the KV store, two reads of a span
// of it, the grouped products, the mask, the softmax's four kernels. Here a layer's attention is
// three ops:
//
//   keys'   = write_kv(keys,   qkv, rows, pos, cos2, sin2, rotate=true)   rotated keys written
//   values' = write_kv(values, qkv, rows, pos, ...,         rotate=false)
//   out     = attend(qkv, keys', values', rows, pos, cos2, sin2)          [N, H * Dh]
//
// qkv is the stacked product [N, (H + 2 KV) * Dh], N = B * q (row b's q new positions at
// pos[b] .. pos[b] + q - 1, written to store row rows[b]); stores are [R, KV, capacity, Dh].
// A store is written in place when MLX may donate it (nothing else holds it), else copied.
//
// One arithmetic per output, whatever the batch (ARCHITECTURE S10): query position p of row b
// attends to its row's positions 0..p in order; a score is a dot product over Dh with 8 lanes
// (lane l sums d = l, l + 8, ..., then a fixed tree, then the Dh % 8 tail in order), times the
// scale; softmax subtracts the max, takes this file's exp, sums in position order and divides;
// the output sums probability * value in position order. Nothing depends on B, on the other
// rows, on the store's capacity or on how work is split across threads, so a row's logits are
// the same alone, batched, in a mixed step or while a draft is verified. The rotation is
// x * cos2 + swap(x) * sin2 with separate roundings, as MLX computes it (-ffp-contract=off).
// Where the CPU has AVX-512 (-march=native), attention runs the same arithmetic on 16-float
// vectors (`attend_block16`, ~1.6x: a 512-position chunk over 7.5k keys 196 -> 124 ms on one
// core); tests/test_decode_ops.py pins it bit for bit against a numpy model and fixed digests.
#include <dlfcn.h>
#include <nanobind/nanobind.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>
#ifdef __AVX512F__
#include <immintrin.h>
#endif

#include "mlx/allocator.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/backend/cpu/unary_ops.h"
#include "mlx/mlx.h"
#include "mlx/primitives.h"

namespace nb = nanobind;
namespace mx = mlx::core;

namespace {

typedef float v8 __attribute__((vector_size(32)));

inline v8 load8(const float* p) {
  v8 v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

inline void store8(float* p, v8 v) { std::memcpy(p, &v, sizeof v); }

typedef float v4 __attribute__((vector_size(16)));
typedef float v2 __attribute__((vector_size(8)));
typedef int32_t v8i __attribute__((vector_size(32)));

inline v8 splat(float x) { return v8{x, x, x, x, x, x, x, x}; }

// the lanes' sum as a fixed tree: ((a0 + a4) + (a2 + a6)) + ((a1 + a5) + (a3 + a7))
inline float hsum(v8 a) {
  const v4 b = __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
  const v2 c = __builtin_shufflevector(b, b, 0, 1) + __builtin_shufflevector(b, b, 2, 3);
  return c[0] + c[1];
}

inline v8 vmax(v8 a, v8 b) { return a > b ? a : b; }

// exp(x) for x <= 0 (a softmax after its max is subtracted; -inf gives 0): Cody-Waite reduction
// and Cephes' polynomial, every step rounded on its own (-ffp-contract=off); lane by lane, so
// `exp_lanes<v16>` is two `exp8` side by side
template <class V, class VI>
inline V exp_lanes(V x) {
  const V lo = V{} - 87.0f;
  const V one = V{} + 1.0f;
  const V xc = x < lo ? lo : x;
  const V t = xc * 1.44269504088896341f + 0.5f;
  const V f = __builtin_convertvector(__builtin_convertvector(t, VI), V); // toward zero
  const V k = f > t ? f - one : f;                                         // floor(t)
  V r = xc - k * 0.693359375f;
  r = r - k * -2.12194440e-4f;
  V y = V{} + 1.9875691500e-4f;
  y = y * r + 1.3981999507e-3f;
  y = y * r + 8.3334519073e-3f;
  y = y * r + 4.1665795894e-2f;
  y = y * r + 1.6666665459e-1f;
  y = y * r + 5.0000001201e-1f;
  y = y * (r * r);
  y = y + r;
  y = y + one;
  const VI bits = (__builtin_convertvector(k, VI) + 127) << 23;
  V scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return x < lo ? V{} : y * scale;
}

inline v8 exp8(v8 x) { return exp_lanes<v8, v8i>(x); }

// score j of a query head: lane l of an 8-float accumulator sums q[d] * k[d] for d = l, l + 8,
// ... in order, the lanes are added as `hsum` does, times `scale`
template <int NV>
inline float score(const float* q, const float* k, int nv_runtime, float scale) {
  const int nv = NV ? NV : nv_runtime;
  v8 acc = splat(0.0f);
  for (int i = 0; i < nv; i++) {
    const v8 prod = load8(q + 8 * i) * load8(k + 8 * i);
    acc = acc + prod;
  }
  return hsum(acc) * scale;
}

// `score` of four consecutive keys (k, k + kstride, ...) into out[0..3], interleaved
template <int NV>
inline void score4(const float* q, const float* k, int64_t kstride, int nv_runtime, float scale,
                   float* out) {
  const int nv = NV ? NV : nv_runtime;
  v8 a0 = splat(0.0f), a1 = splat(0.0f), a2 = splat(0.0f), a3 = splat(0.0f);
  for (int i = 0; i < nv; i++) {
    const v8 x = load8(q + 8 * i);
    const v8 p0 = x * load8(k + 8 * i), p1 = x * load8(k + kstride + 8 * i);
    const v8 p2 = x * load8(k + 2 * kstride + 8 * i), p3 = x * load8(k + 3 * kstride + 8 * i);
    a0 = a0 + p0;
    a1 = a1 + p1;
    a2 = a2 + p2;
    a3 = a3 + p3;
  }
  out[0] = hsum(a0) * scale;
  out[1] = hsum(a1) * scale;
  out[2] = hsum(a2) * scale;
  out[3] = hsum(a3) * scale;
}

// scores sc[0 .. positions) -> probabilities, in place: the max over j (exact in any order);
// e_j = exp8(score_j - max); their sum: lane l sums j = l, l + 8, ... in order, then `hsum`;
// p_j = e_j / sum. `sc` holds round_up(positions, 8) floats (the tail is set to -inf, then 0).
inline void softmax_row(float* sc, int64_t positions) {
  const int64_t padded = (positions + 7) & ~int64_t{7};
  for (int64_t j = positions; j < padded; j++) sc[j] = -INFINITY;
  v8 top8 = load8(sc);
  for (int64_t j = 8; j < padded; j += 8) top8 = vmax(top8, load8(sc + j));
  float top = top8[0];
  for (int l = 1; l < 8; l++) top = top8[l] > top ? top8[l] : top;
  const v8 topv = splat(top);
  v8 sum8 = splat(0.0f);
  for (int64_t j = 0; j < padded; j += 8) {
    const v8 e = exp8(load8(sc + j) - topv);
    store8(sc + j, e);
    sum8 = sum8 + e;
  }
  const v8 total = splat(hsum(sum8));
  for (int64_t j = 0; j < padded; j += 8) store8(sc + j, load8(sc + j) / total);
}

// out[d] = acc[d] + sum of p_j * v_j[d] for j = j0 .. j1 - 1 in order (acc: `out` itself when
// `resume`, else 0): called on consecutive ranges it sums j = 0, 1, ... in order
template <int NV>
inline void weigh_values(const float* p, const float* vb, int64_t vstride, int64_t j0,
                         int64_t j1, int nv_runtime, bool resume, float* out) {
  const int nv = NV ? NV : nv_runtime;
  v8 acc[NV ? NV : 32];
  for (int i = 0; i < nv; i++) acc[i] = resume ? load8(out + 8 * i) : splat(0.0f);
  for (int64_t j = j0; j < j1; j++) {
    const v8 w = splat(p[j]);
    const float* v = vb + j * vstride;
    for (int i = 0; i < nv; i++) {
      const v8 t = w * load8(v + 8 * i);
      acc[i] = acc[i] + t;
    }
  }
  for (int i = 0; i < nv; i++) store8(out + 8 * i, acc[i]);
}

// Attention of the `rep` query heads of one KV head at one position over its row's first
// `positions` keys/values (head_dim = 8 * nv): `score` for each key, `softmax_row`, then
// `weigh_values` over j = 0, 1, ... `scores` holds rep * round_up(positions, 8) floats.
template <int NV>
inline void attend_group(const float* q, int rep, int nv_runtime, const float* kb,
                         int64_t kstride, const float* vb, int64_t vstride, int64_t positions,
                         float scale, float* scores, float* const* outs) {
  const int dh = 8 * (NV ? NV : nv_runtime);
  const int64_t padded = (positions + 7) & ~int64_t{7};
  for (int64_t j = 0; j < positions; j++) {
    const float* k = kb + j * kstride;
    for (int h = 0; h < rep; h++)
      scores[h * padded + j] = score<NV>(q + h * dh, k, nv_runtime, scale);
  }
  for (int h = 0; h < rep; h++) {
    softmax_row(scores + h * padded, positions);
    weigh_values<NV>(scores + h * padded, vb, vstride, 0, positions, nv_runtime, false, outs[h]);
  }
}

// keys (and values) of one pass of `attend_block`: 128 x Dh 64 = 32 KB, read from L1/L2 by
// every query of the block
constexpr int64_t kKeyTile = 128;

// `attend_group` for `count` positions of one row at once (query head h of position t at
// q + (t * rep + h) * dh, over positions[t] keys): the same arithmetic for every output,
// computed in passes over kKeyTile keys so that each key and value is read from memory once
// for the block rather than once per position (a 512-position chunk's attention over 7.5k
// cached positions was bound by re-reading K/V). `scores` holds count * rep * stride floats,
// stride >= round_up(max positions, 8).
template <int NV>
void attend_block(const float* q, int rep, int nv_runtime, int count, const int64_t* positions,
                  const float* kb, int64_t kstride, const float* vb, int64_t vstride,
                  float scale, float* scores, int64_t stride, float* const* outs) {
  const int dh = 8 * (NV ? NV : nv_runtime);
  int64_t last = 0;
  for (int t = 0; t < count; t++) last = std::max(last, positions[t]);
  for (int64_t j0 = 0; j0 < last; j0 += kKeyTile) {
    const int64_t j1 = std::min(last, j0 + kKeyTile);
    for (int t = 0; t < count; t++) {
      const int64_t end = std::min(j1, positions[t]);
      for (int h = 0; h < rep; h++) {
        const float* qh = q + (static_cast<int64_t>(t) * rep + h) * dh;
        float* sc = scores + (static_cast<int64_t>(t) * rep + h) * stride;
        int64_t j = j0;
        for (; j + 4 <= end; j += 4) // four keys at once: independent sums (`score`'s each)
          score4<NV>(qh, kb + j * kstride, kstride, nv_runtime, scale, sc + j);
        for (; j < end; j++) sc[j] = score<NV>(qh, kb + j * kstride, nv_runtime, scale);
      }
    }
  }
  for (int t = 0; t < count; t++)
    for (int h = 0; h < rep; h++)
      softmax_row(scores + (static_cast<int64_t>(t) * rep + h) * stride, positions[t]);
  for (int64_t j0 = 0; j0 < last; j0 += kKeyTile) {
    const int64_t j1 = std::min(last, j0 + kKeyTile);
    for (int t = 0; t < count; t++) {
      const int64_t end = std::min(j1, positions[t]);
      if (end <= j0) continue;
      for (int h = 0; h < rep; h++) {
        const int64_t n = static_cast<int64_t>(t) * rep + h;
        weigh_values<NV>(scores + n * stride, vb, vstride, j0, end, nv_runtime, j0 > 0,
                         outs[n]);
      }
    }
  }
}

#ifdef __AVX512F__
// ---- the same arithmetic on 16-float vectors (AVX-512): what `attend_rows` runs where the CPU
// has them. Lane for lane the products and sums above, in the same order: two query vectors
// share a 16-float vector (one 8-lane half each), 8 keys' accumulators are reduced at once by
// adding exactly `hsum`'s pairs, softmax's exp runs on 16 lanes, and values are weighed 16
// outputs per vector for two query vectors per loaded value.
typedef float v16 __attribute__((vector_size(64)));
typedef int32_t v16i __attribute__((vector_size(64)));

inline v16 load16(const float* p) {
  v16 v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

inline void store16(float* p, v16 v) { std::memcpy(p, &v, sizeof v); }
inline v16 splat16(float x) { return v16{x, x, x, x, x, x, x, x, x, x, x, x, x, x, x, x}; }
// 8 floats at p in both halves (one vbroadcastf64x4 from memory, no shuffle)
inline v16 twice(const float* p) {
  const __m256d x = _mm256_loadu_pd(reinterpret_cast<const double*>(p));
  const __m512d v = _mm512_broadcast_f64x4(x);
  return reinterpret_cast<v16>(_mm512_castpd_ps(v));
}
inline v8 low(v16 a) { return __builtin_shufflevector(a, a, 0, 1, 2, 3, 4, 5, 6, 7); }
inline v8 high(v16 a) { return __builtin_shufflevector(a, a, 8, 9, 10, 11, 12, 13, 14, 15); }

// `score` of two query vectors (qp: their floats by 8, A's d 0-7, B's 0-7, A's 8-15, ...) for
// the 8 keys k, k + kstride, ... -> a[0..7], b[0..7]. Lane l of accumulator m sums q[d] * k[d]
// for d = l, l + 8, ... as `score` does; the lanes are then added in `hsum`'s pairs for 8 keys
// at once: a_l + a_(l+4), then b_0 + b_2 and b_1 + b_3, then c_0 + c_1
template <int NV>
inline void score8x2(const float* qp, const float* k, int64_t kstride, int nv_runtime,
                     float scale, float* a, float* b) {
  const int nv = NV ? NV : nv_runtime;
  v16 m[8];
  for (int key = 0; key < 8; key++) m[key] = v16{};
  for (int i = 0; i < nv; i++) {
    const v16 x = load16(qp + 16 * i);
    for (int key = 0; key < 8; key++) {
      const v16 prod = x * twice(k + key * kstride + 8 * i);
      m[key] = m[key] + prod;
    }
  }
  // per 8-lane half (A's, B's): b4[u] = [b0..b3 of key 2u, of key 2u + 1] (b_l = a_l + a_(l+4)),
  // c2[u] = [c0 c1 of keys 4u .. 4u + 3] (c0 = b0 + b2, c1 = b1 + b3), sums = c0 + c1 by key
  v16 b4[4], c2[2];
  for (int u = 0; u < 4; u++)
    b4[u] = __builtin_shufflevector(m[2 * u], m[2 * u + 1], 0, 1, 2, 3, 16, 17, 18, 19, //
                                    8, 9, 10, 11, 24, 25, 26, 27) +
            __builtin_shufflevector(m[2 * u], m[2 * u + 1], 4, 5, 6, 7, 20, 21, 22, 23, //
                                    12, 13, 14, 15, 28, 29, 30, 31);
  for (int u = 0; u < 2; u++)
    c2[u] = __builtin_shufflevector(b4[2 * u], b4[2 * u + 1], 0, 1, 4, 5, 16, 17, 20, 21, //
                                    8, 9, 12, 13, 24, 25, 28, 29) +
            __builtin_shufflevector(b4[2 * u], b4[2 * u + 1], 2, 3, 6, 7, 18, 19, 22, 23, //
                                    10, 11, 14, 15, 26, 27, 30, 31);
  const v16 sums = __builtin_shufflevector(c2[0], c2[1], 0, 2, 4, 6, 16, 18, 20, 22, //
                                           8, 10, 12, 14, 24, 26, 28, 30) +
                   __builtin_shufflevector(c2[0], c2[1], 1, 3, 5, 7, 17, 19, 21, 23, //
                                           9, 11, 13, 15, 25, 27, 29, 31);
  const v16 s = sums * scale;
  store8(a, low(s));
  store8(b, high(s));
}

// `softmax_row` with exp on 16 lanes (the sum still adds 8 lanes at a time in position order)
inline void softmax_row16(float* sc, int64_t positions) {
  const int64_t padded = (positions + 7) & ~int64_t{7};
  for (int64_t j = positions; j < padded; j++) sc[j] = -INFINITY;
  v8 top8 = load8(sc);
  for (int64_t j = 8; j < padded; j += 8) top8 = vmax(top8, load8(sc + j));
  float top = top8[0];
  for (int l = 1; l < 8; l++) top = top8[l] > top ? top8[l] : top;
  v8 sum8 = splat(0.0f);
  int64_t j = 0;
  for (; j + 16 <= padded; j += 16) {
    const v16 e = exp_lanes<v16, v16i>(load16(sc + j) - top);
    store16(sc + j, e);
    sum8 = sum8 + low(e);
    sum8 = sum8 + high(e);
  }
  if (j < padded) {
    const v8 e = exp8(load8(sc + j) - splat(top));
    store8(sc + j, e);
    sum8 = sum8 + e;
  }
  const float total = hsum(sum8);
  for (j = 0; j + 16 <= padded; j += 16) store16(sc + j, load16(sc + j) / total);
  if (j < padded) store8(sc + j, load8(sc + j) / splat(total));
}

// `weigh_values` for Q query vectors at once (p[i] -> out[i]), 16 outputs per vector
template <int NV, int Q>
inline void weigh16(const float* const* p, const float* vb, int64_t vstride, int64_t j0,
                    int64_t j1, int nv_runtime, bool resume, float* const* out) {
  const int nv = NV ? NV : nv_runtime, n16 = nv / 2;
  const bool odd = nv % 2 != 0;
  v16 acc[Q][NV ? (NV > 1 ? NV / 2 : 1) : 16];
  v8 tail[Q];
  for (int q = 0; q < Q; q++) {
    for (int i = 0; i < n16; i++) acc[q][i] = resume ? load16(out[q] + 16 * i) : v16{};
    tail[q] = odd && resume ? load8(out[q] + 16 * n16) : splat(0.0f);
  }
  for (int64_t j = j0; j < j1; j++) {
    const float* v = vb + j * vstride;
    v16 w[Q];
    for (int q = 0; q < Q; q++) w[q] = splat16(p[q][j]);
    for (int i = 0; i < n16; i++) {
      const v16 x = load16(v + 16 * i);
      for (int q = 0; q < Q; q++) {
        const v16 t = w[q] * x;
        acc[q][i] = acc[q][i] + t;
      }
    }
    if (odd) {
      const v8 x = load8(v + 16 * n16);
      for (int q = 0; q < Q; q++) {
        const v8 t = low(w[q]) * x;
        tail[q] = tail[q] + t;
      }
    }
  }
  for (int q = 0; q < Q; q++) {
    for (int i = 0; i < n16; i++) store16(out[q] + 16 * i, acc[q][i]);
    if (odd) store8(out[q] + 16 * n16, tail[q]);
  }
}

// `attend_block` (count >= 1) on 16-float vectors: query vectors n = t * rep + h in pairs (an
// odd last one beside a copy of itself, whose scores go to the spare row count * rep), each
// pair's scores for its longer position count (the shorter's extra scores are past its
// positions: softmax_row16 never reads them). `scores` holds (count * rep + 1) * stride floats.
template <int NV>
void attend_block16(const float* q, int rep, int nv_runtime, int count, const int64_t* positions,
                    const float* kb, int64_t kstride, const float* vb, int64_t vstride,
                    float scale, float* scores, int64_t stride, float* const* outs) {
  const int dh = 8 * (NV ? NV : nv_runtime);
  const int nq = count * rep, pairs = (nq + 1) / 2;
  auto keys_of = [&](int n) { return n < nq ? positions[n / rep] : int64_t{0}; };
  thread_local std::vector<float> qp;
  qp.resize(static_cast<size_t>(pairs) * 2 * dh);
  for (int m = 0; m < pairs; m++) {
    const float* qa = q + static_cast<int64_t>(2 * m) * dh;
    const float* qb = q + static_cast<int64_t>(std::min(2 * m + 1, nq - 1)) * dh;
    float* dst = qp.data() + static_cast<int64_t>(m) * 2 * dh;
    for (int i = 0; i < dh / 8; i++) {
      std::memcpy(dst + 16 * i, qa + 8 * i, 8 * sizeof(float));
      std::memcpy(dst + 16 * i + 8, qb + 8 * i, 8 * sizeof(float));
    }
  }
  const int64_t last = *std::max_element(positions, positions + count);
  for (int64_t j0 = 0; j0 < last; j0 += kKeyTile) {
    const int64_t j1 = std::min(last, j0 + kKeyTile);
    for (int m = 0; m < pairs; m++) {
      const int na = 2 * m, nb = 2 * m + 1; // nb == nq: the spare row
      const int64_t end = std::min(j1, std::max(keys_of(na), keys_of(nb)));
      float* sa = scores + na * stride;
      float* sb = scores + nb * stride;
      const float* qm = qp.data() + static_cast<int64_t>(m) * 2 * dh;
      int64_t j = j0;
      for (; j + 8 <= end; j += 8)
        score8x2<NV>(qm, kb + j * kstride, kstride, nv_runtime, scale, sa + j, sb + j);
      for (; j < end; j++) {
        const float* k = kb + j * kstride;
        sa[j] = score<NV>(q + static_cast<int64_t>(na) * dh, k, nv_runtime, scale);
        if (nb < nq) sb[j] = score<NV>(q + static_cast<int64_t>(nb) * dh, k, nv_runtime, scale);
      }
    }
  }
  for (int n = 0; n < nq; n++) softmax_row16(scores + n * stride, keys_of(n));
  for (int64_t j0 = 0; j0 < last; j0 += kKeyTile) {
    const int64_t j1 = std::min(last, j0 + kKeyTile);
    for (int na = 0; na < nq; na += 2) {
      const int nb = na + 1;
      const int64_t ea = std::min(j1, keys_of(na)), eb = std::min(j1, keys_of(nb));
      const int64_t both = std::max(j0, std::min(ea, eb));
      const float* p[2] = {scores + na * stride, scores + nb * stride};
      if (both > j0) // an odd last query's partner (the spare row) has no keys: never both
        weigh16<NV, 2>(p, vb, vstride, j0, both, nv_runtime, j0 > 0, outs + na);
      const int longer = ea > eb ? 0 : 1;
      const int64_t rest = longer ? eb : ea;
      if (rest > both)
        weigh16<NV, 1>(p + longer, vb, vstride, both, rest, nv_runtime, both > 0,
                       outs + na + longer);
    }
  }
}
#endif

#ifdef __AVX512F__
template <int NV> constexpr auto kBlockKernel = attend_block16<NV>;
#else
template <int NV> constexpr auto kBlockKernel = attend_block<NV>;
#endif

// a small pool: `run(n, fn)` calls fn(i) for i in [0, n) on the caller and the workers
class Pool {
 public:
  static Pool& get() {
    static Pool* pool = new Pool(); // never destroyed: workers may outlive static teardown
    return *pool;
  }

  int threads() const { return static_cast<int>(workers_) + 1; }

  void run(int n, const std::function<void(int)>& fn) {
    if (workers_ == 0 || n < 2) {
      for (int i = 0; i < n; i++) fn(i);
      return;
    }
    std::unique_lock<std::mutex> caller(run_mutex_, std::try_to_lock);
    if (!caller.owns_lock()) { // another stream's attention holds the pool: compute here
      for (int i = 0; i < n; i++) fn(i);
      return;
    }
    {
      std::lock_guard<std::mutex> lock(mutex_);
      job_ = &fn;
      total_ = n;
      next_.store(0);
      pending_ = workers_;
      generation_++;
    }
    wake_.notify_all();
    work();
    std::unique_lock<std::mutex> lock(mutex_);
    done_.wait(lock, [this] { return pending_ == 0; });
    job_ = nullptr;
  }

 private:
  Pool() {
    int n = 0;
    if (const char* env = std::getenv("LLM_SERVER_ATTENTION_THREADS")) n = std::atoi(env);
    if (n <= 0) n = static_cast<int>(std::thread::hardware_concurrency());
    workers_ = static_cast<unsigned>(std::max(1, std::min(n, 64)) - 1);
    for (unsigned i = 0; i < workers_; i++) std::thread([this] { loop(); }).detach();
  }

  void work() {
    for (int i = next_.fetch_add(1); i < total_; i = next_.fetch_add(1)) (*job_)(i);
  }

  void loop() {
    unsigned long seen = 0;
    for (;;) {
      {
        std::unique_lock<std::mutex> lock(mutex_);
        wake_.wait(lock, [&] { return generation_ != seen; });
        seen = generation_;
      }
      work();
      std::lock_guard<std::mutex> lock(mutex_);
      if (--pending_ == 0) done_.notify_one();
    }
  }

  unsigned workers_ = 0;
  std::mutex run_mutex_, mutex_;
  std::condition_variable wake_, done_;
  const std::function<void(int)>* job_ = nullptr;
  int total_ = 0;
  std::atomic<int> next_{0};
  unsigned pending_ = 0;
  unsigned long generation_ = 0;
};

struct Geometry {
  int heads, kv_heads, head_dim, q;
  bool operator==(const Geometry&) const = default;
};

// a 2-D float32 array's element (n, f) by strides (qkv and the rotation tables)
struct Matrix {
  const float* data;
  int64_t s0, s1;
  explicit Matrix(const mx::array& a)
      : data(a.data<float>()), s0(a.strides()[0]), s1(a.strides()[1]) {}
  Matrix(const float* d, int64_t row_stride) : data(d), s0(row_stride), s1(1) {}
  const float* row(int64_t n) const { return data + n * s0; }
  float at(int64_t n, int64_t f) const { return data[n * s0 + f * s1]; }
};

struct Ints {
  const int32_t* data;
  int64_t s0;
  int64_t size;
  explicit Ints(const mx::array& a)
      : data(a.data<int32_t>()), s0(a.strides()[0]), size(static_cast<int64_t>(a.size())) {}
  int operator[](int64_t i) const { return data[i * s0]; }
};

// a KV store [R, KV, C, Dh] by strides
struct Store {
  const float* data;
  int64_t s0, s1, s2, rows, cap;
  Store(const float* d, const mx::array& like)
      : data(d), s0(like.strides()[0]), s1(like.strides()[1]), s2(like.strides()[2]),
        rows(like.shape(0)), cap(like.shape(2)) {}
};

// head `head` of position n of qkv, rotated at position p when `rotate` (into `out`, Dh floats)
inline void head_at(const Matrix& qkv, int64_t n, int64_t first, int dh, bool rotate,
                    const Matrix& cos2, const Matrix& sin2, int p, float* out) {
  const int half = dh / 2;
  for (int d = 0; d < dh; d++) {
    const float x = qkv.at(n, first + d);
    if (!rotate) {
      out[d] = x;
      continue;
    }
    const float swapped = qkv.at(n, first + (d < half ? d + half : d - half));
    const float a = x * cos2.at(p, d);
    const float b = swapped * sin2.at(p, d);
    out[d] = a + b;
  }
}

// a contiguous copy of a 4-D array (a store MLX cannot donate, or a strided one)
void copy_4d(const mx::array& in, float* dst) {
  const float* src = in.data<float>();
  const auto& sh = in.shape();
  const auto& st = in.strides();
  if (in.flags().row_contiguous) {
    std::memcpy(dst, src, in.nbytes());
    return;
  }
  for (int64_t a = 0; a < sh[0]; a++)
    for (int64_t b = 0; b < sh[1]; b++)
      for (int64_t c = 0; c < sh[2]; c++) {
        const float* s = src + a * st[0] + b * st[1] + c * st[2];
        for (int64_t d = 0; d < sh[3]; d++) *dst++ = s[d * st[3]];
      }
}

// `out` takes `in`'s buffer when MLX may donate it (updated in place), else a new one that the
// caller fills with a copy of `in`; true when donated
bool take_buffer(const mx::array& in, mx::array& out) {
  const bool donate = in.is_donatable() && in.flags().row_contiguous;
  if (donate)
    out.copy_shared_buffer(in);
  else
    out.set_data(mx::allocator::malloc(out.nbytes()));
  return donate;
}

// each row's new keys (rotated, `rotate`) or values of qkv written into the contiguous store
// `dst` [R, KV, C, Dh] at positions pos[b] .. pos[b] + q - 1 of store row rows[b]
void write_rows(float* dst, int64_t nrows, int64_t cap, Geometry g, bool rotate,
                const Matrix& x, const Ints& r, const Ints& at, const Matrix& c,
                const Matrix& s) {
  const int kv = g.kv_heads, dh = g.head_dim, q = g.q;
  const int64_t first = static_cast<int64_t>(rotate ? g.heads : g.heads + kv) * dh;
  for (int64_t b = 0; b < r.size; b++) {
    const int64_t row = r[b];
    for (int i = 0; i < q; i++) {
      const int64_t p = static_cast<int64_t>(at[b]) + i;
      if (row < 0 || row >= nrows || p < 0 || p >= cap) continue; // checked by the caller
      for (int h = 0; h < kv; h++)
        head_at(x, b * q + i, first + static_cast<int64_t>(h) * dh, dh, rotate, c, s,
                static_cast<int>(p), dst + ((row * kv + h) * cap + p) * dh);
    }
  }
}

constexpr int64_t kThreadedWork = 1 << 19; // attention below this: one thread is faster
// query positions per attention item: a 512-position prompt chunk's attention at position
// 2,500 (SmolLM2's 9 heads over 3 KV heads) 85-90 -> 67-78 ms on 2 threads, as 48 items
// rather than 3; 128 at 1,000 7.95 -> 6.51 ms
constexpr int kBlock = 32;

// each new position's rotated query heads over its row's positions 0..p -> dst [N, H * Dh]
void attend_rows(float* dst, Geometry g, float scale, const Matrix& x, const Store& keys,
                 const Store& values, const Ints& r, const Ints& at, const Matrix& c,
                 const Matrix& s) {
  const int heads = g.heads, kv = g.kv_heads, dh = g.head_dim, q = g.q;
  const int rep = heads / kv;
  const int64_t batch = r.size;
  int64_t work = 0; // multiply-adds, to decide whether threads pay
  for (int64_t b = 0; b < batch; b++) work += (static_cast<int64_t>(at[b]) + q) * q;
  work *= static_cast<int64_t>(heads) * dh * 2;
  // one item: one row's rep query heads of one KV head, over a block of `block` of its q
  // positions (a prompt chunk's positions spread over the threads; each position's arithmetic
  // is its own), the costliest (last) blocks first; a block of several positions reads its
  // row's keys and values once (attend_block), a lone decode position as attend_group (with
  // AVX-512 both as attend_block16)
  const int64_t heads_of_rows = batch * kv;
  // a short chunk over a long history (an agent's turn: 20 positions over 4k) would be one
  // block per KV head, 3 items for 2 threads: halve the blocks until every thread gets 4 items
  int block = kBlock;
  if (work >= kThreadedWork) {
    const int64_t want = 4 * static_cast<int64_t>(Pool::get().threads());
    while (block > 4 && (q + block - 1) / block * heads_of_rows < want) block = (block + 1) / 2;
  }
  const int blocks = (q + block - 1) / block;
  auto item = [&](int index) {
    const int blk = blocks - 1 - static_cast<int>(index / heads_of_rows);
    const int64_t b = (index % heads_of_rows) / kv;
    const int grp = static_cast<int>(index % kv);
    const int64_t row = r[b];
    thread_local std::vector<float> qrot, scores;
    thread_local std::vector<float*> outs;
    int64_t positions[kBlock];
    qrot.resize(static_cast<size_t>(kBlock) * rep * dh);
    outs.resize(static_cast<size_t>(kBlock) * rep);
    int count = 0; // the block's positions that attend (consecutive: p ascends with i)
    for (int i = blk * block; i < std::min(q, (blk + 1) * block); i++) {
      const int64_t n = b * q + i;
      const int64_t p = static_cast<int64_t>(at[b]) + i;
      float** o = outs.data() + static_cast<int64_t>(count) * rep;
      for (int h = 0; h < rep; h++)
        o[h] = dst + (n * heads + static_cast<int64_t>(grp) * rep + h) * dh;
      if (row < 0 || row >= keys.rows || p < 0 || p >= keys.cap) { // checked by the caller
        for (int h = 0; h < rep; h++) std::fill(o[h], o[h] + dh, 0.0f);
        continue;
      }
      for (int h = 0; h < rep; h++)
        head_at(x, n, (static_cast<int64_t>(grp) * rep + h) * dh, dh, true, c, s,
                static_cast<int>(p), qrot.data() + (static_cast<int64_t>(count) * rep + h) * dh);
      positions[count++] = p + 1;
    }
    if (count == 0) return;
    const float* kb = keys.data + row * keys.s0 + grp * keys.s1;
    const float* vb = values.data + row * values.s0 + grp * values.s1;
    const int64_t stride = (*std::max_element(positions, positions + count) + 7) & ~int64_t{7};
    scores.resize(static_cast<size_t>(count * rep + 1) * stride); // + attend_block16's spare row
    const int nv = dh / 8;
    auto run = [&](auto group, auto block) {
#ifdef __AVX512F__
      (void)group;
      block(qrot.data(), rep, nv, count, positions, kb, keys.s2, vb, values.s2, scale,
            scores.data(), stride, outs.data());
      return;
#endif
      if (count == 1) // a decode position: one pass over its keys
        group(qrot.data(), rep, nv, kb, keys.s2, vb, values.s2, positions[0], scale,
              scores.data(), outs.data());
      else
        block(qrot.data(), rep, nv, count, positions, kb, keys.s2, vb, values.s2, scale,
              scores.data(), stride, outs.data());
    };
    if (nv == 8)
      run(attend_group<8>, kBlockKernel<8>);
    else if (nv == 16)
      run(attend_group<16>, kBlockKernel<16>);
    else if (nv == 4)
      run(attend_group<4>, kBlockKernel<4>);
    else
      run(attend_group<0>, kBlockKernel<0>);
  };
  const int items = static_cast<int>(blocks * heads_of_rows);
  if (work < kThreadedWork) {
    for (int i = 0; i < items; i++) item(i);
  } else {
    Pool::get().run(items, item);
  }
}

// the ops' common base: MLX primitives with a CPU kernel only
class CpuPrimitive : public mx::UnaryPrimitive {
 public:
  using mx::UnaryPrimitive::UnaryPrimitive;
  void eval_gpu(const std::vector<mx::array>&, mx::array&) override {
    throw std::runtime_error("llm_server decode_ops: CPU only");
  }
};

class WriteKV : public CpuPrimitive {
 public:
  WriteKV(mx::Stream s, Geometry g, bool rotate) : CpuPrimitive(s), g_(g), rotate_(rotate) {}

  // inputs: store [R, KV, C, Dh], qkv [N, F], rows [B], pos [B], cos2 [P, Dh], sin2 [P, Dh]
  void eval_cpu(const std::vector<mx::array>& in, mx::array& out) override {
    const mx::array& store = in[0];
    const bool donate = take_buffer(store, out);
    auto& enc = mx::cpu::get_command_encoder(stream());
    // by value: the primitive may be gone by the time the stream runs the task
    enc.dispatch([donate, g = g_, rotate = rotate_, store = store, qkv = in[1], rows = in[2],
                  pos = in[3], cos2 = in[4], sin2 = in[5], dst = out.data<float>()]() {
      if (!donate) copy_4d(store, dst);
      write_rows(dst, store.shape(0), store.shape(2), g, rotate, Matrix(qkv), Ints(rows),
                 Ints(pos), Matrix(cos2), Matrix(sin2));
    });
  }

  const char* name() const override { return "LlmWriteKV"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    auto& o = static_cast<const WriteKV&>(other);
    return g_ == o.g_ && rotate_ == o.rotate_;
  }

 private:
  Geometry g_;
  bool rotate_;
};

class Attend : public CpuPrimitive {
 public:
  Attend(mx::Stream s, Geometry g, float scale) : CpuPrimitive(s), g_(g), scale_(scale) {}

  // inputs: qkv [N, F], keys [R, KV, C, Dh], values [R, KV, C, Dh], rows [B], pos [B],
  // cos2 [P, Dh], sin2 [P, Dh]; output [N, H * Dh]
  void eval_cpu(const std::vector<mx::array>& in, mx::array& out) override {
    out.set_data(mx::allocator::malloc(out.nbytes()));
    auto& enc = mx::cpu::get_command_encoder(stream());
    // by value: the primitive may be gone by the time the stream runs the task
    enc.dispatch([g = g_, scale = scale_, qkv = in[0], keys = in[1], values = in[2],
                  rows = in[3], pos = in[4], cos2 = in[5], sin2 = in[6],
                  dst = out.data<float>()]() {
      attend_rows(dst, g, scale, Matrix(qkv), Store(keys.data<float>(), keys),
                  Store(values.data<float>(), values), Ints(rows), Ints(pos), Matrix(cos2),
                  Matrix(sin2));
    });
  }

  const char* name() const override { return "LlmAttend"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    auto& o = static_cast<const Attend&>(other);
    return g_ == o.g_ && scale_ == o.scale_;
  }

 private:
  Geometry g_;
  float scale_;
};

// RMSNorm of n rows of d features with the arithmetic of MLX's CPU `mx.fast.rms_norm` (its
// fallback graph: the squares summed in order, times 1 / D, plus eps, 1 / sqrt, x * that,
// times the weight) -> dst [n, d] contiguous
void rms_norm_rows(const Matrix& m, int64_t n, int64_t d, const float* wd, int64_t ws, float eps,
                   float* dst) {
  const float inv = static_cast<float>(1.0 / static_cast<double>(d));
  for (int64_t i = 0; i < n; i++) {
    float sum = 0.0f;
    for (int64_t j = 0; j < d; j++) {
      const float v = m.at(i, j);
      const float sq = v * v;
      sum = sum + sq;
    }
    const float mean = sum * inv;
    const float r = 1.0f / std::sqrt(mean + eps);
    float* o = dst + i * d;
    for (int64_t j = 0; j < d; j++) {
      const float t = m.at(i, j) * r;
      o[j] = t * wd[j * ws];
    }
  }
}

// a primitive whose one attribute is its RMSNorm's epsilon (`Derived`: the primitive's class)
template <class Derived>
class EpsPrimitive : public CpuPrimitive {
 public:
  EpsPrimitive(mx::Stream s, float eps) : CpuPrimitive(s), eps_(eps) {}
  bool is_equivalent(const mx::Primitive& other) const override {
    return eps_ == static_cast<const Derived&>(other).eps_;
  }

 protected:
  float eps_;
};

// RMSNorm as `rms_norm_rows` computes it, one op instead of the ~4 of MLX's CPU fallback
// graph; `decode_ops._check` compares the two bit for bit at load.
class RmsNorm : public EpsPrimitive<RmsNorm> {
 public:
  using EpsPrimitive::EpsPrimitive;

  // inputs: x [N, D], weight [D]; output [N, D]
  void eval_cpu(const std::vector<mx::array>& in, mx::array& out) override {
    out.set_data(mx::allocator::malloc(out.nbytes()));
    auto& enc = mx::cpu::get_command_encoder(stream());
    enc.dispatch([eps = eps_, x = in[0], w = in[1], dst = out.data<float>()]() {
      rms_norm_rows(Matrix(x), x.shape(0), x.shape(1), w.data<float>(), w.strides()[0], eps,
                    dst);
    });
  }

  const char* name() const override { return "LlmRmsNorm"; }
};

// ---- a decode layer in four ops ----
// llm_skinny_sgemm of the preloaded skinny library (llm_server.native.skinny): the function
// MLX's float32 products reach through cblas_sgemm, so a product here is the product MLX's
// Matmul or AddMM computes, value for value
using Sgemm = void (*)(int trans_b, int m, int n, int k, float alpha, const float* a, int lda,
                       const float* b, int ldb, float beta, float* c, int ldc);

Sgemm skinny_sgemm() {
  static const Sgemm fn = reinterpret_cast<Sgemm>(dlsym(RTLD_DEFAULT, "llm_skinny_sgemm"));
  return fn;
}

// c [m, n] (row stride n) = a [m, k] (contiguous) @ w.T + beta * c, w [n, k]: MLX's `a @ w.T`
// (beta 0) or `mx.addmm(c, a, w.T)` (beta 1) as MLX's CPU matmul calls cblas_sgemm for it: b =
// w.T [k, n] row-contiguous as is, else w's rows contiguous (transposed b), else b copied
// row-contiguous (the model's weights are always the second case)
void product(const float* a, int64_t m, int k, const mx::array& w, float beta, float* c) {
  const float* wd = w.data<float>();
  const int64_t n = w.shape(0), s0 = w.strides()[0], s1 = w.strides()[1];
  const bool b_contiguous = s1 == n && s0 == 1;         // w.T as is: [k, n]
  const bool trans = !b_contiguous && s0 == k && s1 == 1; // w's rows, transposed
  const int64_t ld = trans ? k : n;
  thread_local std::vector<float> packed;
  if (!b_contiguous && !trans) {
    packed.resize(static_cast<size_t>(n) * k);
    for (int64_t j = 0; j < k; j++)
      for (int64_t i = 0; i < n; i++) packed[j * n + i] = wd[i * s0 + j * s1];
    wd = packed.data();
  }
  skinny_sgemm()(trans ? 1 : 0, static_cast<int>(m), static_cast<int>(n), k, 1.0f, a, k, wd,
                 static_cast<int>(ld), beta, c, static_cast<int>(n));
}

// a contiguous copy of a 2-D array (the residual addmm copies before adding the product to it)
void copy_rows(const mx::array& x, float* dst) {
  const Matrix m(x);
  const int64_t n = x.shape(0), d = x.shape(1);
  for (int64_t i = 0; i < n; i++)
    for (int64_t j = 0; j < d; j++) dst[i * d + j] = m.at(i, j);
}

// rms_norm(x, norm) @ weight.T: a layer's first two decode ops as one
class NormProduct : public EpsPrimitive<NormProduct> {
 public:
  using EpsPrimitive::EpsPrimitive;

  // inputs: x [B, D], norm [D], weight [F, D]; output [B, F]
  void eval_cpu(const std::vector<mx::array>& in, mx::array& out) override {
    out.set_data(mx::allocator::malloc(out.nbytes()));
    auto& enc = mx::cpu::get_command_encoder(stream());
    enc.dispatch([eps = eps_, x = in[0], norm = in[1], w = in[2], dst = out.data<float>()]() {
      const int64_t b = x.shape(0);
      const int d = x.shape(1);
      thread_local std::vector<float> h;
      h.resize(b * d);
      rms_norm_rows(Matrix(x), b, d, norm.data<float>(), norm.strides()[0], eps, h.data());
      product(h.data(), b, d, w, 0.0f, dst);
    });
  }

  const char* name() const override { return "LlmNormProduct"; }
};

struct LayerShape {
  Geometry g;
  float eps, scale;
  bool operator==(const LayerShape&) const = default;
};

// the rest of a decode layer once its keys and values are written: x [B, D] ->
// h = x + o(attention), then h + down(silu(gate) * up) of gate_up(rms_norm(h)). The same
// arithmetic as the compiled step's separate ops (Attend; `mx.addmm`; RmsNorm; the product and
// `mx.split`; MLX's compiled SiLU kernel, whose Sigmoid and Multiply come from MLX's CPU
// headers here; `mx.addmm`), as `decode_ops._check_layer` confirms bit for bit at load.
class LayerRest : public CpuPrimitive {
 public:
  LayerRest(mx::Stream s, LayerShape shape) : CpuPrimitive(s), shape_(shape) {}

  // inputs: x [B, D], qkv [B, F], keys and values [R, KV, C, Dh] (written), rows [B], pos [B],
  // cos2 [P, Dh], sin2 [P, Dh], o [D, H * Dh], norm_post [D], gate_up [2I, D], down [D, I];
  // output [B, D]
  void eval_cpu(const std::vector<mx::array>& in, mx::array& out) override {
    const bool donated = take_buffer(in[0], out);
    auto& enc = mx::cpu::get_command_encoder(stream());
    enc.dispatch([shape = shape_, in = in, donated, xo = out.data<float>()]() {
      if (!donated) copy_rows(in[0], xo);
      run(shape, in, xo);
    });
  }

  const char* name() const override { return "LlmLayerRest"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    return shape_ == static_cast<const LayerRest&>(other).shape_;
  }

 private:
  static void run(const LayerShape& sh, const std::vector<mx::array>& in, float* xo) {
    const Geometry g = sh.g;
    const mx::array &x = in[0], &keys = in[2], &values = in[3];
    const mx::array &o = in[8], &norm = in[9], &gate_up = in[10], &down = in[11];
    const int64_t b = x.shape(0);
    const int d = x.shape(1), inter = gate_up.shape(0) / 2, hd = g.heads * g.head_dim;
    thread_local std::vector<float> att, h, gu, act;
    att.resize(b * hd);
    h.resize(b * d);
    gu.resize(b * 2 * inter);
    act.resize(b * inter);
    attend_rows(att.data(), g, sh.scale, Matrix(in[1]), Store(keys.data<float>(), keys),
                Store(values.data<float>(), values), Ints(in[4]), Ints(in[5]), Matrix(in[6]),
                Matrix(in[7]));
    product(att.data(), b, hd, o, 1.0f, xo);
    rms_norm_rows(Matrix(xo, d), b, d, norm.data<float>(), norm.strides()[0], sh.eps, h.data());
    product(h.data(), b, d, gate_up, 0.0f, gu.data());
    mx::detail::Sigmoid sigmoid;
    for (int64_t i = 0; i < b; i++) {
      const float* gate = gu.data() + i * 2 * inter;
      const float* up = gate + inter;
      float* a = act.data() + i * inter;
      for (int j = 0; j < inter; j++) {
        const float t = gate[j] * sigmoid(gate[j]);
        a[j] = t * up[j];
      }
    }
    product(act.data(), b, inter, down, 1.0f, xo);
  }

  LayerShape shape_;
};

mx::Stream cpu_stream() {
  mx::Stream s = mx::default_stream(mx::default_device());
  if (s.device != mx::Device::cpu) throw std::invalid_argument("decode_ops run on the CPU only");
  return s;
}

void check(const mx::array& qkv, const mx::array& store, const mx::array& rows,
           const mx::array& pos, const mx::array& cos2, const mx::array& sin2, Geometry g) {
  if (g.heads <= 0 || g.kv_heads <= 0 || g.heads % g.kv_heads != 0 || g.head_dim <= 0 ||
      g.head_dim % 8 != 0 || g.head_dim > 256 || g.heads / g.kv_heads > 64 || g.q <= 0)
    throw std::invalid_argument(
        "decode_ops: bad head geometry (head_dim a multiple of 8 up to 256, at most 64 query "
        "heads per KV head)");
  for (const mx::array* a : {&qkv, &store, &cos2, &sin2})
    if (a->dtype() != mx::float32) throw std::invalid_argument("decode_ops: float32 only");
  if (rows.dtype() != mx::int32 || pos.dtype() != mx::int32 || rows.ndim() != 1 ||
      pos.ndim() != 1 || rows.size() != pos.size())
    throw std::invalid_argument("decode_ops: rows and pos must be int32 [B]");
  const int64_t width = static_cast<int64_t>(g.heads + 2 * g.kv_heads) * g.head_dim;
  if (qkv.ndim() != 2 || qkv.shape(1) != width ||
      qkv.shape(0) != static_cast<int64_t>(rows.size()) * g.q)
    throw std::invalid_argument("decode_ops: qkv must be [B * q, (H + 2 KV) * Dh]");
  if (store.ndim() != 4 || store.shape(1) != g.kv_heads || store.shape(3) != g.head_dim)
    throw std::invalid_argument("decode_ops: a store must be [rows, KV, capacity, Dh]");
  if (cos2.ndim() != 2 || cos2.shape(1) != g.head_dim || sin2.shape() != cos2.shape())
    throw std::invalid_argument("decode_ops: cos2/sin2 must be [positions, Dh]");
}

mx::array write_kv(const mx::array& store, const mx::array& qkv, const mx::array& rows,
                   const mx::array& pos, const mx::array& cos2, const mx::array& sin2,
                   int heads, int kv_heads, int head_dim, int q, bool rotate) {
  const Geometry g{heads, kv_heads, head_dim, q};
  check(qkv, store, rows, pos, cos2, sin2, g);
  return mx::array(store.shape(), mx::float32,
                   std::make_shared<WriteKV>(cpu_stream(), g, rotate),
                   {store, qkv, rows, pos, cos2, sin2});
}

mx::array attend(const mx::array& qkv, const mx::array& keys, const mx::array& values,
                 const mx::array& rows, const mx::array& pos, const mx::array& cos2,
                 const mx::array& sin2, int heads, int kv_heads, int head_dim, int q,
                 float scale) {
  const Geometry g{heads, kv_heads, head_dim, q};
  check(qkv, keys, rows, pos, cos2, sin2, g);
  if (values.shape() != keys.shape() || values.dtype() != mx::float32)
    throw std::invalid_argument("decode_ops: values must be shaped as keys");
  return mx::array({qkv.shape(0), static_cast<int>(heads) * head_dim}, mx::float32,
                   std::make_shared<Attend>(cpu_stream(), g, scale),
                   {qkv, keys, values, rows, pos, cos2, sin2});
}

mx::array rms_norm(const mx::array& x, const mx::array& weight, float eps) {
  if (x.dtype() != mx::float32 || weight.dtype() != mx::float32 || x.ndim() != 2 ||
      weight.ndim() != 1 || weight.shape(0) != x.shape(1))
    throw std::invalid_argument("decode_ops: rms_norm takes float32 x [N, D] and weight [D]");
  return mx::array(x.shape(), mx::float32, std::make_shared<RmsNorm>(cpu_stream(), eps),
                   {x, weight});
}

bool layer_ready() { return skinny_sgemm() != nullptr; }

// a weight [out, in] (the products read it as `x @ weight.T`)
void check_weight(const mx::array& w, int64_t cols, const char* what) {
  if (w.dtype() != mx::float32 || w.ndim() != 2 || w.shape(1) != cols)
    throw std::invalid_argument(std::string("decode_ops: ") + what +
                                " must be a float32 weight [out, in]");
}

void check_rows(const mx::array& x, const mx::array& norm) {
  if (x.dtype() != mx::float32 || x.ndim() != 2 || norm.dtype() != mx::float32 ||
      norm.ndim() != 1 || norm.shape(0) != x.shape(1))
    throw std::invalid_argument("decode_ops: x must be float32 [B, dim] and its norm [dim]");
  if (!layer_ready())
    throw std::invalid_argument("decode_ops: the skinny library is not loaded");
}

mx::array norm_product(const mx::array& x, const mx::array& norm, const mx::array& weight,
                       float eps) {
  check_rows(x, norm);
  check_weight(weight, x.shape(1), "weight");
  return mx::array({x.shape(0), weight.shape(0)}, mx::float32,
                   std::make_shared<NormProduct>(cpu_stream(), eps), {x, norm, weight});
}

mx::array layer_rest(const mx::array& x, const mx::array& qkv, const mx::array& keys,
                     const mx::array& values, const mx::array& rows, const mx::array& pos,
                     const mx::array& cos2, const mx::array& sin2, const mx::array& o,
                     const mx::array& norm_post, const mx::array& gate_up,
                     const mx::array& down, int heads, int kv_heads, int head_dim, float eps,
                     float scale) {
  const Geometry g{heads, kv_heads, head_dim, 1};
  check_rows(x, norm_post);
  check(qkv, keys, rows, pos, cos2, sin2, g);
  if (values.shape() != keys.shape() || values.dtype() != mx::float32)
    throw std::invalid_argument("decode_ops: values must be shaped as keys");
  if (qkv.shape(0) != x.shape(0))
    throw std::invalid_argument("decode_ops: x and qkv must have one row per step row");
  const int dim = x.shape(1);
  check_weight(o, static_cast<int64_t>(heads) * head_dim, "o");
  check_weight(gate_up, dim, "gate_up");
  check_weight(down, gate_up.shape(0) / 2, "down");
  if (o.shape(0) != dim || down.shape(0) != dim || gate_up.shape(0) % 2 != 0)
    throw std::invalid_argument("decode_ops: o and down must give [dim] rows, gate_up [2I, dim]");
  return mx::array(x.shape(), mx::float32,
                   std::make_shared<LayerRest>(cpu_stream(), LayerShape{g, eps, scale}),
                   {x, qkv, keys, values, rows, pos, cos2, sin2, o, norm_post, gate_up, down});
}

} // namespace

NB_MODULE(_llm_decode_ops, m) {
  m.doc() = "Decode attention primitives for MLX on the CPU (llm_server.native.decode_ops)";
  m.def("write_kv", &write_kv, nb::arg("store"), nb::arg("qkv"), nb::arg("rows"),
        nb::arg("pos"), nb::arg("cos2"), nb::arg("sin2"), nb::arg("heads"),
        nb::arg("kv_heads"), nb::arg("head_dim"), nb::arg("q"), nb::arg("rotate"));
  m.def("attend", &attend, nb::arg("qkv"), nb::arg("keys"), nb::arg("values"), nb::arg("rows"),
        nb::arg("pos"), nb::arg("cos2"), nb::arg("sin2"), nb::arg("heads"), nb::arg("kv_heads"),
        nb::arg("head_dim"), nb::arg("q"), nb::arg("scale"));
  m.def("rms_norm", &rms_norm, nb::arg("x"), nb::arg("weight"), nb::arg("eps"));
  m.def("norm_product", &norm_product, nb::arg("x"), nb::arg("norm"), nb::arg("weight"),
        nb::arg("eps"));
  m.def("layer_rest", &layer_rest, nb::arg("x"), nb::arg("qkv"), nb::arg("keys"),
        nb::arg("values"), nb::arg("rows"), nb::arg("pos"), nb::arg("cos2"), nb::arg("sin2"),
        nb::arg("o"), nb::arg("norm_post"), nb::arg("gate_up"), nb::arg("down"),
        nb::arg("heads"), nb::arg("kv_heads"), nb::arg("head_dim"), nb::arg("eps"),
        nb::arg("scale"));
  m.def("layer_ready", &layer_ready);
  m.def("threads", [] { return Pool::get().threads(); });
}

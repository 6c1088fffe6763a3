// CPU decode kernels, built and called by kernels/native.py:
// - paged_decode: attention over a paged KV cache, one query per sequence, read straight from
//   the pages (no gathered copy of the keys), fp32 accumulation, parallel over (sequence, KV
//   head); the contract of kernels/attention/torch.py's `paged_attention` for rows with one query.
// - delta_step: one KDA / GDN token per sequence with the recurrent states updated in place
//   in their slots (no gather / scatter of the states); kernels/kda/recurrent.py's rule.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include "../denormal.h"
#include "../matmul.h"
#include "../prefetch.h"
#include "../reduce.h"
#include "../widen.h"
#include "packed.h"
#include "shared_pages.h"

#if defined(__AVX512BF16__)
#include <immintrin.h>

#include "../gemm/dot.h"
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <array>
#include <bit>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>


namespace {

// rows [n] of D elements (row stride ld) as fp32 into dst [n, D]
template <typename T>
void widen(const T* src, int64_t ld, int64_t n, int64_t D, float* dst) {
  for (int64_t t = 0; t < n; ++t)
#pragma omp simd
    for (int64_t d = 0; d < D; ++d) dst[t * D + d] = as_float(src[t * ld + d]);
}

// q (fp32) . k (a cache row, read in place) over D channels
template <typename T>
inline float dot(const float* q, const T* k, int64_t D) {
  float s = 0.f;
#pragma omp simd reduction(+ : s)
  for (int64_t d = 0; d < D; ++d) s += q[d] * as_float(k[d]);
  return s;
}

// The online softmax of R query rows over one block of n keys whose scores are in p (rows of ld):
// running max m and sum l per row, the accumulator rows acc (Dv each) rescaled; p becomes the
// block's numerators.
inline void softmax_block(float* p, int64_t ld, int64_t rows, int64_t n, float* m, float* l, float* acc, int64_t Dv) {
  for (int64_t r = 0; r < rows; ++r) online_softmax_row(p + r * ld, n, m[r], l[r], acc + r * Dv, Dv);
}

#if defined(__AVX512BF16__)
// lane j: the sum of v[j]'s 16 lanes (three rounds of 128/256-bit shuffles and adds)
inline __m512 sum16(const __m512* v) {
  __m512 w[8], x[4];
  for (int i = 0; i < 8; ++i)  // v[i] | v[i + 8], 8 partial sums each
    w[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[i], v[i + 8], 0x44), _mm512_shuffle_f32x4(v[i], v[i + 8], 0xEE));
  for (int i = 0; i < 4; ++i)  // 128-bit lanes v[i] | v[i + 8] | v[i + 4] | v[i + 12], 4 partial sums each
    x[i] = _mm512_add_ps(_mm512_shuffle_f32x4(w[i], w[i + 4], 0x88), _mm512_shuffle_f32x4(w[i], w[i + 4], 0xDD));
  const __m512 y0 = _mm512_add_ps(_mm512_unpacklo_ps(x[0], x[1]), _mm512_unpackhi_ps(x[0], x[1]));
  const __m512 y1 = _mm512_add_ps(_mm512_unpacklo_ps(x[2], x[3]), _mm512_unpackhi_ps(x[2], x[3]));
  const __m512 z = _mm512_add_ps(_mm512_shuffle_ps(y0, y1, 0x44), _mm512_shuffle_ps(y0, y1, 0xEE));
  return _mm512_shuffle_f32x4(z, z, 0xD8);  // lanes 0-3 v0..v3, 4-7 v8..v11, ... into order
}

// 16 bf16 from p as fp32
inline __m512 widen16(const c10::BFloat16* p) {
  return _mm512_castsi512_ps(
      _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
}

// p[i] = scale * q . keys[i] for i < n <= 16 (Dk a multiple of 32; 16 rows readable at keys):
// vdpbf16ps products of the bf16 query and key rows, summed in fp32
inline void scores16(const c10::BFloat16* q, const c10::BFloat16* const* keys, int64_t n, int64_t Dk, float scale,
                     float* p) {
  __m512 acc[16];
  for (int j = 0; j < 16; ++j) acc[j] = _mm512_setzero_ps();
  for (int64_t c = 0; c < Dk; c += 32) {
    const __m512bh qc = (__m512bh)_mm512_loadu_si512(q + c);
    for (int j = 0; j < 16; ++j) acc[j] = _mm512_dpbf16_ps(acc[j], qc, (__m512bh)_mm512_loadu_si512(keys[j] + c));
  }
  _mm512_mask_storeu_ps(p, static_cast<__mmask16>((1u << n) - 1), _mm512_mul_ps(sum16(acc), _mm512_set1_ps(scale)));
}

// acc[r, 64 columns] += sum_i p[r, i] values[i][col, col + 64) for G rows (p rows ld apart, acc rows
// lda apart), the accumulators in registers over the n keys; with `ahead`, the row 16 keys on
// prefetched (values holds 16 rows past n)
template <int G>
void values64(const float* p, int64_t ld, const c10::BFloat16* const* values, int64_t col, int64_t n, float* acc,
              int64_t lda, bool ahead) {
  __m512 a[G][4];
  for (int r = 0; r < G; ++r)
    for (int c = 0; c < 4; ++c) a[r][c] = _mm512_loadu_ps(acc + r * lda + 16 * c);
  for (int64_t i = 0; i < n; ++i) {
    if (ahead) {
      __builtin_prefetch(values[i + 16] + col);
      __builtin_prefetch(values[i + 16] + col + 32);
    }
    __m512 v[4];
    for (int c = 0; c < 4; ++c) v[c] = widen16(values[i] + col + 16 * c);
    for (int r = 0; r < G; ++r) {
      const __m512 w = _mm512_set1_ps(p[r * ld + i]);
      for (int c = 0; c < 4; ++c) a[r][c] = _mm512_fmadd_ps(w, v[c], a[r][c]);
    }
  }
  for (int r = 0; r < G; ++r)
    for (int c = 0; c < 4; ++c) _mm512_storeu_ps(acc + r * lda + 16 * c, a[r][c]);
}
constexpr std::array VALUES64{values64<1>, values64<2>, values64<3>, values64<4>};  // [G - 1]
#endif

#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
// The own keys' loops with AVX2's 8-lane vectors (CPUs without AVX-512), where the scalar loops
// spent about a quarter of their samples reducing each key's dot product across lanes and as much
// loading and storing the accumulator rows at every key (perf on the MLA decode of the peer workload).

// 8 of p's elements as fp32 (bf16 widened)
template <typename T>
inline __m256 load8(const T* p) {
  if constexpr (std::is_same_v<T, float>) {
    return _mm256_loadu_ps(p);
  } else {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  }
}

// lane j: the sum of acc[j]'s 8 lanes, ((0 + 4) + (2 + 6)) + ((1 + 5) + (3 + 7)) for every j
inline __m256 sum8(const __m256* acc) {
  __m256 u[4];  // u[j]: [lanes 0-3 + lanes 4-7 of acc[j] | the same of acc[j + 4]]
  for (int j = 0; j < 4; ++j)
    u[j] = _mm256_add_ps(_mm256_permute2f128_ps(acc[j], acc[j + 4], 0x20), _mm256_permute2f128_ps(acc[j], acc[j + 4], 0x31));
  const __m256 a01 = _mm256_add_ps(_mm256_unpacklo_ps(u[0], u[1]), _mm256_unpackhi_ps(u[0], u[1]));
  const __m256 a23 = _mm256_add_ps(_mm256_unpacklo_ps(u[2], u[3]), _mm256_unpackhi_ps(u[2], u[3]));
  return _mm256_add_ps(_mm256_shuffle_ps(a01, a23, 0x44), _mm256_shuffle_ps(a01, a23, 0xEE));
}

// p[r * ld + i] = q_r . keys[i] for the R = 8 / J query rows q_r (fp32, Dk apart) and the keys
// i < n <= J (Dk a multiple of 8; J rows readable at keys): the 8 (key, row) pairs' lane sums
// reduced across lanes together (sum8), each key row widened once for all R rows. Every pair's
// sum is the one a pass per row would make, in the same order (the outputs move from the scalar
// loops' by fp32 rounding: 1e-7 at the peer workload's sizes).
template <int J, typename T>
inline void scores8(const float* q, int64_t Dk, const T* const* keys, int64_t n, float* p, int64_t ld) {
  constexpr int R = 8 / J;
  __m256 acc[8];
  for (int j = 0; j < 8; ++j) acc[j] = _mm256_setzero_ps();
  for (int64_t c = 0; c < Dk; c += 8) {
    __m256 qc[R];
    for (int r = 0; r < R; ++r) qc[r] = _mm256_loadu_ps(q + r * Dk + c);
    for (int i = 0; i < J; ++i) {
      const __m256 kc = load8(keys[i] + c);
      for (int r = 0; r < R; ++r) acc[i * R + r] = _mm256_fmadd_ps(qc[r], kc, acc[i * R + r]);
    }
  }
  alignas(32) float out[8];
  _mm256_store_ps(out, sum8(acc));
  for (int i = 0; i < n; ++i)
    for (int r = 0; r < R; ++r) p[r * ld + i] = out[i * R + r];
}

// acc[r, 16 columns] += sum_i p[r, i] values[i][col, col + 16) for G rows (p rows ld apart, acc rows
// lda apart), the accumulators in registers over the n keys
template <int G, typename T>
void values16(const float* p, int64_t ld, const T* const* values, int64_t col, int64_t n, float* acc, int64_t lda) {
  __m256 a[G][2];
  for (int r = 0; r < G; ++r)
    for (int c = 0; c < 2; ++c) a[r][c] = _mm256_loadu_ps(acc + r * lda + 8 * c);
  for (int64_t i = 0; i < n; ++i) {
    const __m256 v0 = load8(values[i] + col), v1 = load8(values[i] + col + 8);
    for (int r = 0; r < G; ++r) {
      const __m256 w = _mm256_broadcast_ss(p + r * ld + i);
      a[r][0] = _mm256_fmadd_ps(w, v0, a[r][0]);
      a[r][1] = _mm256_fmadd_ps(w, v1, a[r][1]);
    }
  }
  for (int r = 0; r < G; ++r)
    for (int c = 0; c < 2; ++c) _mm256_storeu_ps(acc + r * lda + 8 * c, a[r][c]);
}
template <typename T>
constexpr std::array VALUES16{values16<1, T>, values16<2, T>, values16<3, T>, values16<4, T>};  // [G - 1]
#endif

constexpr int64_t SHARED_ROWS = 128;  // query rows (sequences x R) per job over the shared pages
constexpr int64_t KEYS = 256;         // a sequence's own keys per step (whole pages, at least one)
constexpr int64_t AHEAD = 8;          // own keys: rows prefetched this many keys ahead
constexpr int64_t LEAD = 48;          // the same through AVX-512 BF16 (a multiple of 16)
constexpr int64_t FAR = 160;          // ... and into L2, key and value rows (a multiple of 16, >= LEAD)

// Decode attention, one query per sequence. The pages all sequences share come first, as
// matmuls: per (KV head, block of sequences), the block's R * rows queries against each step of
// up to KEYS shared keys (widened to fp32 once per job), so a prefix common to the batch costs a
// matmul instead of a pass per sequence. Then one job per (sequence, KV head) continues the same
// online softmax (running max and sum per query head, the accumulator rescaled) over its own
// pages in steps of up to KEYS keys: each key's R scores as dot products with its row read in
// place, the step's softmax, then each value row added into the R accumulators. (With R query
// rows a matmul is no better than these loops, and widening the step's rows to fp32 for it cost
// more than the products.) No score row of a whole sequence is kept.
// On AVX-512 BF16 CPUs, bf16 caches of model widths take faster forms of both phases:
// - the shared pages (without AMX, values a multiple of 32 wide): each step's keys and values
//   packed (packed.h) and the products run through dot_mm, as prefill_packed does (bf16
//   products, fp32 sums, numerators rounded to bf16 for the value product);
// - the own keys (keys a multiple of 32 wide, values of 64): scores 16 keys at a time as
//   vdpbf16ps products of the bf16 query and key rows (16 dot products summed together, sum16),
//   the scale applied to the sums; the value rows added into accumulators held in registers over
//   the step, 4 query heads by 64 columns at a time; the key rows LEAD keys on prefetched across
//   pages while scoring, each value row 16 keys before it is added (prefetched with the keys, they
//   were out of L1 by the time the step's values were added: 1.1-1.2x slower at 64 x 1,344 keys;
//   MLA's latent values are its key rows, not prefetched again).
// On AVX2 CPUs without AVX-512, the own keys of widths a multiple of 8 (values of 16) run 8
// (key, query head) scores at a time (scores8: a KV head's 4 or 2 query heads against 2 or 4 keys,
// each key row widened once for them; other group sizes 8 keys a head) and the value rows into
// accumulators held in registers over the step, 4 query heads by 16 columns at a time (values16):
// 0.71-0.86x the scalar loops' time per MLA decode call and 0.79-0.81x per bf16 GQA one at the
// peer workload's sizes, then the heads together 0.91-0.95x again on the built-in Kimi's calls.
template <typename T>
void decode(const at::Tensor& q, const at::Tensor& kc, const at::Tensor& vc, const at::Tensor& pages,
            const at::Tensor& lens, double scale, at::Tensor& out) {
  const int64_t N = q.size(0), H = q.size(1), Dk = q.size(2), Dv = out.size(2);
  const int64_t page_size = kc.size(1), Hkv = kc.size(2), R = H / Hkv, width = pages.size(1);
  const T* qp = q.data_ptr<T>();
  const T* kp = kc.data_ptr<T>();
  const T* vp = vc.data_ptr<T>();
  const int64_t* pp = pages.data_ptr<int64_t>();
  const int64_t* lp = lens.data_ptr<int64_t>();
  float* op = out.data_ptr<float>();  // the accumulators, [N, H, Dv]
  const int64_t k_page = kc.stride(0), k_row = kc.stride(1), k_head = kc.stride(2);
  const int64_t v_page = vc.stride(0), v_row = vc.stride(1), v_head = vc.stride(2);
  const float sc = static_cast<float>(scale);
  // MLA's latent layout: the values are the keys' first Dv channels, widened once with the keys
  const bool latent = vp == kp && v_page == k_page && v_row == k_row && v_head == k_head && Dv <= Dk;
  const int64_t ldv = latent ? Dk : Dv;  // row stride of the fp32 value rows
  // the AVX-512 BF16 forms, where the CPU and the widths allow: own keys through scores16 and
  // values64 (wide), the shared pages through dot_mm over packed key blocks, without AMX (packed)
  bool wide = false, packed = false;
#if defined(__AVX512BF16__)
  wide = std::is_same_v<T, c10::BFloat16> && Dk % 32 == 0 && Dv % 64 == 0;
  packed = std::is_same_v<T, c10::BFloat16> && !onednn_bf16() && Dk % 2 == 0 && Dv % DOT_COLS == 0;
#endif
  std::vector<float> m(N * H, -1e30f), l(N * H, 0.f);  // -1e30: finite, built with -ffast-math
  std::fill(op, op + N * H * Dv, 0.f);
  const int64_t shared = N > 1 ? shared_pages(pp, width, lp, N, page_size) : 0;
  const int64_t block = std::max(page_size, KEYS / page_size * page_size);  // keys per step (whole pages)
  const int64_t seqs = std::max<int64_t>(1, SHARED_ROWS / R), blocks = (N + seqs - 1) / seqs;
  const int64_t J1 = shared ? Hkv * blocks : 0, J2 = N * Hkv;
  const int64_t threads = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), std::max(J1, J2)));
#pragma omp parallel num_threads(threads)
  {
    FlushDenormals flush;
    const int64_t rows_max = std::max(seqs, int64_t{1}) * R;
    std::vector<float> qf(rows_max * Dk), p(rows_max * block), acc(rows_max * Dv);
    std::vector<float> kb(block * Dk), vb(block * Dv);  // a step's keys and values, fp32
    std::vector<const T*> krows(block + FAR + 16), vrows(block + FAR + 16);  // its key and value rows (wide own keys)
    // packed shared steps: the block's queries, the step's keys and values packed (block rounded up
    // to whole 32-column tiles), the numerators
    const int64_t tiles = packed ? (block + 31) / 32 * 32 : 0;
    std::vector<T> qb(packed ? rows_max * Dk : 0), num(rows_max * tiles);
    std::vector<uint32_t> kt(Dk / 2 * tiles), vt(tiles / 2 * Dv);
    std::vector<float> sp(rows_max * tiles);
    // f(i, key row, value row, run) for each page's run of the keys t0 + i .. t0 + i + run - 1 of
    // KV head g of the sequence with this page table (rows k_row and v_row apart)
    auto page_runs = [&](const int64_t* table, int64_t g, int64_t t0, int64_t cnt, auto f) {
      for (int64_t t = t0; t < t0 + cnt;) {
        const int64_t page = table[t / page_size], row = t % page_size;
        const int64_t run = std::min(page_size - row, t0 + cnt - t);
        f(t - t0, kp + page * k_page + row * k_row + g * k_head, vp + page * v_page + row * v_row + g * v_head, run);
        t += run;
      }
    };
    // keys t0 .. t0 + cnt - 1 into kb as fp32 rows (values into vb, unless they are the keys' first channels)
    auto widen_step = [&](const int64_t* table, int64_t g, int64_t t0, int64_t cnt) {
      page_runs(table, g, t0, cnt, [&](int64_t i, const T* key, const T* value, int64_t run) {
        widen(key, k_row, run, Dk, kb.data() + i * Dk);
        if (!latent) widen(value, v_row, run, Dv, vb.data() + i * Dv);
      });
    };
    const float* values = latent ? kb.data() : vb.data();
    // the addresses of the key and value rows of keys t0 .. t0 + cnt - 1 into krows, vrows
    [[maybe_unused]] auto gather_rows = [&](const int64_t* table, int64_t g, int64_t t0, int64_t cnt) {
      page_runs(table, g, t0, cnt, [&](int64_t i, const T* key, const T* value, int64_t run) {
        for (int64_t j = 0; j < run; ++j) krows[i + j] = key + j * k_row, vrows[i + j] = value + j * v_row;
      });
    };
    // visit(i, key row, value row) for the keys t0 + i, i < cnt, of KV head g, read in place
    auto each_key = [&](const int64_t* table, int64_t g, int64_t t0, int64_t cnt, auto visit) {
      page_runs(table, g, t0, cnt, [&](int64_t i0, const T* key, const T* v, int64_t run) {
        const T* value = latent ? key : v;
        const int64_t ld = latent ? k_row : v_row;
        for (int64_t i = 0; i < run; ++i) {
          if (i + AHEAD < run) {  // the rows AHEAD keys on
            prefetch_bytes(key + (i + AHEAD) * k_row, Dk * int64_t(sizeof(T)));  // a row is read whole
            if (!latent) prefetch_bytes(value + (i + AHEAD) * ld, Dv * int64_t(sizeof(T)));
          }
          visit(i0 + i, key + i * k_row, value + i * ld);
        }
      });
    };
#pragma omp for schedule(dynamic, 1)
    for (int64_t job = 0; job < J1; ++job) {  // the shared pages: rows (n, r) of one KV head at once
      const int64_t g = job % Hkv, n0 = job / Hkv * seqs, ns = std::min(seqs, N - n0), rows = ns * R;
      std::fill(acc.begin(), acc.begin() + rows * Dv, 0.f);
      float *mb = m.data() + n0 * H, *lb = l.data() + n0 * H;  // rows (n, r) of this block: see below
      std::vector<float> mr(rows, -1e30f), lr(rows, 0.f);
      const int64_t keys = shared * page_size;  // every row sees them all; the pages are sequence 0's as much as any other's
#if defined(__AVX512BF16__)
      if constexpr (std::is_same_v<T, c10::BFloat16>)
        if (packed) {  // as prefill_packed: bf16 products, fp32 sums, the numerators rounded to bf16
          for (int64_t i = 0; i < ns; ++i)  // the block's rows (i, r), R * Dk contiguous per sequence
            std::copy_n(qp + ((n0 + i) * H + g * R) * Dk, R * Dk, qb.begin() + i * R * Dk);
          for (int64_t t0 = 0; t0 < keys; t0 += block) {
            const int64_t cnt = std::min(block, keys - t0), w = (cnt + 31) / 32 * 32, last = keys - 1;
            gather_rows(pp, g, t0, cnt);
            pack_block([&](int64_t t) { return krows[t]; }, [&](int64_t t) { return vrows[t]; }, cnt, w, Dk, Dv,
                       kt.data(), vt.data());
            dot_mm(rows, w, Dk, qb.data(), Dk, reinterpret_cast<const T*>(kt.data()), 2 * w, sp.data(), w, false);
            numerators_bf16(sp.data(), num.data(), w, rows, 1, &last, t0, cnt, sc, mr.data(), lr.data(), acc.data(),
                            Dv);
            dot_mm(rows, Dv, w, num.data(), w, reinterpret_cast<const T*>(vt.data()), 2 * Dv, acc.data(), Dv, true);
          }
        }
#endif
      if (!packed) {
        for (int64_t i = 0; i < ns; ++i)
          for (int64_t d = 0; d < R * Dk; ++d) qf[i * R * Dk + d] = as_float(qp[((n0 + i) * H + g * R) * Dk + d]) * sc;
        for (int64_t t0 = 0; t0 < keys; t0 += block) {
          const int64_t cnt = std::min(block, keys - t0);
          widen_step(pp, g, t0, cnt);
          mm(false, true, rows, cnt, Dk, 1.f, qf.data(), Dk, kb.data(), Dk, 0.f, p.data(), block);
          softmax_block(p.data(), block, rows, cnt, mr.data(), lr.data(), acc.data(), Dv);
          mm(false, false, rows, Dv, cnt, 1.f, p.data(), block, values, ldv, 1.f, acc.data(), Dv);
        }
      }
      for (int64_t i = 0; i < ns; ++i)
        for (int64_t r = 0; r < R; ++r) {
          const int64_t row = i * R + r, h = g * R + r;
          mb[i * H + h] = mr[row];
          lb[i * H + h] = lr[row];
          std::copy(acc.begin() + row * Dv, acc.begin() + (row + 1) * Dv, op + ((n0 + i) * H + h) * Dv);
        }
    }
#pragma omp for schedule(dynamic, 4)
    for (int64_t job = 0; job < J2; ++job) {  // each sequence's own pages, from where the shared ones left off
      const int64_t n = job / Hkv, g = job % Hkv, L = lp[n];
      const int64_t* table = pp + n * width;
      float* a = op + (n * H + g * R) * Dv;  // query heads g * R .. g * R + R - 1
      float *mg = m.data() + n * H + g * R, *lg = l.data() + n * H + g * R;
      if (!wide)  // the scalar loops' fp32 query rows, scaled
        for (int64_t i = 0; i < R * Dk; ++i) qf[i] = as_float(qp[(n * H + g * R) * Dk + i]) * sc;
      for (int64_t t0 = shared * page_size; t0 < L; t0 += block) {
        const int64_t cnt = std::min(block, L - t0);
#if defined(__AVX512BF16__)
        if constexpr (std::is_same_v<T, c10::BFloat16>)
          if (wide) {  // the step's rows (and the next group's, prefetched), then scores, softmax, values
            const int64_t have = std::min(cnt + FAR, L - t0);
            gather_rows(table, g, t0, have);
            std::fill(krows.begin() + have, krows.begin() + cnt + FAR + 16, krows[have - 1]);
            std::fill(vrows.begin() + have, vrows.begin() + cnt + FAR + 16, vrows[have - 1]);
            for (int64_t i = 0; i < cnt; i += 16) {
              for (int64_t j = i + LEAD; j < std::min(i + LEAD + 16, have); ++j)
                prefetch_bytes(krows[j], Dk * int64_t(sizeof(T)));
              for (int64_t j = i + FAR; j < std::min(i + FAR + 16, have); ++j) {
                prefetch_l2_bytes(krows[j], Dk * int64_t(sizeof(T)));
                if (!latent) prefetch_l2_bytes(vrows[j], Dv * int64_t(sizeof(T)));
              }
              for (int64_t r = 0; r < R; ++r)
                scores16(qp + (n * H + g * R + r) * Dk, krows.data() + i, std::min<int64_t>(16, cnt - i), Dk, sc,
                         p.data() + r * block + i);
            }
            softmax_block(p.data(), block, R, cnt, mg, lg, a, Dv);
            for (int64_t r = 0; r < R; r += 4)
              for (int64_t c = 0; c < Dv; c += 64)
                VALUES64[std::min<int64_t>(4, R - r) - 1](p.data() + r * block, block, vrows.data(), c, cnt,
                                                          a + r * Dv + c, Dv, !latent);
            continue;
          }
#endif
#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
        if (Dk % 8 == 0 && Dv % 16 == 0) {  // 8 keys' scores at a time, the values into registers
          gather_rows(table, g, t0, cnt);
          std::fill(krows.begin() + cnt, krows.begin() + (cnt + 7) / 8 * 8, krows[cnt - 1]);
          for (int64_t i = 0; i < cnt; i += 8) {
            for (int64_t j = i + 2 * AHEAD; j < std::min(i + 3 * AHEAD, cnt); ++j)  // the group two on
              prefetch_bytes(krows[j], Dk * int64_t(sizeof(T)));
            const int64_t n8 = std::min<int64_t>(8, cnt - i);
            if (R == 4 || R == 2) {  // R query rows against 8 / R keys at a time
              const int64_t J = 8 / R;
              for (int64_t i0 = 0; i0 < n8; i0 += J)
                (R == 4 ? scores8<2, T> : scores8<4, T>)(qf.data(), Dk, krows.data() + i + i0,
                                                         std::min(J, n8 - i0), p.data() + i + i0, block);
            } else {
              for (int64_t r = 0; r < R; ++r)
                scores8<8, T>(qf.data() + r * Dk, Dk, krows.data() + i, n8, p.data() + r * block + i, block);
            }
          }
          softmax_block(p.data(), block, R, cnt, mg, lg, a, Dv);
          for (int64_t r = 0; r < R; r += 4)
            for (int64_t c = 0; c < Dv; c += 16)
              VALUES16<T>[std::min<int64_t>(4, R - r) - 1](p.data() + r * block, block, vrows.data(), c, cnt,
                                                          a + r * Dv + c, Dv);
          continue;
        }
#endif
        each_key(table, g, t0, cnt, [&](int64_t i, const T* key, const T*) {  // the R scores of each key
          for (int64_t r = 0; r < R; ++r) p[r * block + i] = dot(qf.data() + r * Dk, key, Dk);
        });
        softmax_block(p.data(), block, R, cnt, mg, lg, a, Dv);
        each_key(table, g, t0, cnt, [&](int64_t i, const T*, const T* value) {  // its value row, weighted
          for (int64_t r = 0; r < R; ++r) {
            const float w = p[r * block + i];
            float* ar = a + r * Dv;
#pragma omp simd
            for (int64_t d = 0; d < Dv; ++d) ar[d] += w * as_float(value[d]);
          }
        });
      }
      for (int64_t r = 0; r < R; ++r)
        for (int64_t d = 0; d < Dv; ++d) a[r * Dv + d] /= lg[r];
    }
  }
}

}  // namespace

// q [N, H, Dk]; k_cache [P, page_size, Hkv, >= Dk] and v_cache [P, page_size, Hkv, >= Dv] with
// unit stride in the last dim (a view of the k rows for the MLA latent layout); pages [N, W]
// int64 (entries past a sequence's keys are never read); lens [N] int64 keys per sequence.
// Returns o [N, H, Dv] fp32.
at::Tensor paged_decode(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                        const at::Tensor& pages, const at::Tensor& lens, double scale, int64_t dv) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && v_cache.dim() == 4, "q [N,H,Dk], caches [P,S,Hkv,D]");
  TORCH_CHECK(k_cache.stride(3) == 1 && v_cache.stride(3) == 1, "cache rows need unit stride");
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type() && k_cache.scalar_type() == v_cache.scalar_type(),
              "q and the caches share one dtype");
  TORCH_CHECK(q.size(1) % k_cache.size(2) == 0, "Hkv must divide H");
  auto qc = q.contiguous();
  auto pc = pages.contiguous();
  auto lc = lens.contiguous();
  auto out = at::empty({q.size(0), q.size(1), dv}, q.options().dtype(at::kFloat));
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, q.scalar_type(), "paged_decode",
                                 [&] { decode<scalar_t>(qc, k_cache, v_cache, pc, lc, scale, out); });
  return out;
}

// One delta-rule decode step (KDA / GDN) with the states updated in place in their slots:
// q, k [N, H, K], v [N, HV, V], g [N, HV, K or 1] log decays, beta [N, HV], all fp32;
// state [slots, HV, K, V] fp32 or bf16; slots [N] int64. Per (sequence, value head), with S the
// K x V state: S = exp(g) * S; S += k (beta (v - S^T k))^T; o = scale S^T q. Two passes over S,
// in place for fp32; a bf16 state is widened into an fp32 copy first and rounded back after
// (state_rows.h). Returns o [N, HV, V] fp32.
at::Tensor delta_step(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& g,
                      const at::Tensor& beta, at::Tensor& state, const at::Tensor& slots, double scale) {
  for (const at::Tensor* t : std::initializer_list<const at::Tensor*>{&q, &k, &v, &g, &beta})
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous(), "delta_step: contiguous fp32 inputs");
  TORCH_CHECK((state.scalar_type() == at::kFloat || state.scalar_type() == at::kBFloat16) && state.is_contiguous(),
              "delta_step: a contiguous fp32 or bf16 state");
  const int64_t N = q.size(0), H = q.size(1), K = q.size(2), HV = v.size(1), V = v.size(2);
  const int64_t R = HV / H, gK = g.size(2);
  TORCH_CHECK(state.size(1) == HV && state.size(2) == K && state.size(3) == V, "state [slots, HV, K, V]");
  auto sc = slots.contiguous();
  auto out = at::empty({N, HV, V}, v.options());
  const float *qp = q.data_ptr<float>(), *kp = k.data_ptr<float>(), *vp = v.data_ptr<float>();
  const float *gp = g.data_ptr<float>(), *bp = beta.data_ptr<float>();
  const int64_t* sp = sc.data_ptr<int64_t>();
  float* op = out.data_ptr<float>();
  const float fscale = static_cast<float>(scale);
  const auto step = [&](int64_t n, int64_t hv, float* S, float* err) {
    const int64_t h = hv / R;
    const float *kk = kp + (n * H + h) * K, *qq = qp + (n * H + h) * K, *gg = gp + (n * HV + hv) * gK;
    std::fill(err, err + V, 0.f);
    const float head_decay = std::exp(gg[0]);  // GDN: one decay for the whole state
    for (int64_t i = 0; i < K; ++i) {  // decay the state, accumulate S^T k
      const float d = gK == 1 ? head_decay : std::exp(gg[i]), ki = kk[i];
      float* row = S + i * V;
#pragma omp simd
      for (int64_t j = 0; j < V; ++j) {
        row[j] *= d;
        err[j] += row[j] * ki;
      }
    }
    const float b = bp[n * HV + hv];
    const float* vv = vp + (n * HV + hv) * V;
#pragma omp simd
    for (int64_t j = 0; j < V; ++j) err[j] = b * (vv[j] - err[j]);
    float* o = op + (n * HV + hv) * V;
    std::fill(o, o + V, 0.f);
    for (int64_t i = 0; i < K; ++i) {  // write, then read out with q
      const float ki = kk[i], qi = qq[i] * fscale;
      float* row = S + i * V;
#pragma omp simd
      for (int64_t j = 0; j < V; ++j) {
        row[j] += ki * err[j];
        o[j] += row[j] * qi;
      }
    }
  };
  const auto steps = [&]<typename S>(S* Sp) {
    at::parallel_for(0, N * HV, 1, [&](int64_t begin, int64_t end) {
      FlushDenormals flush;
      std::vector<float> err(V), wide(std::is_same_v<S, float> ? 0 : K * V);
      for (int64_t job = begin; job < end; ++job) {
        const int64_t n = job / HV, hv = job % HV;
        S* row = Sp + (sp[n] * HV + hv) * K * V;
        if constexpr (std::is_same_v<S, float>) {
          step(n, hv, row, err.data());
        } else {
          widen_state(row, wide.data(), K * V, false);
          step(n, hv, wide.data(), err.data());
          store_state(wide.data(), row, K * V);
        }
      }
    });
  };
  if (state.scalar_type() == at::kFloat)
    steps(state.data_ptr<float>());
  else
    steps(state.data_ptr<c10::BFloat16>());
  return out;
}

// The AVX-512 BF16 micro-kernel (vdpbf16ps) of the compiled CPU kernels, for CPUs where oneDNN
// has no bf16 micro-kernels (no AMX): the bf16 matmuls of gemm/cpu_gemm.cpp and the packed
// prefill attention of attention/cpu_prefill.cpp. B is read in VNNI pairs: pair p of k (k = 2p,
// 2p + 1) of 32 columns is 64 bf16 at b + p * ldb, column j's two values at 2j and 2j + 1 (ldb =
// 64 for one packed 32-column block [K / 2, 32, 2]; 2N for a whole [K / 2, N, 2] matrix, its
// column block j at b + 64j). Every output is one fp32 sum over k in a fixed order (within a
// pair as vdpbf16ps adds), whatever rows share the call. `onednn_bf16()`, which of the two runs,
// is here for both callers.
#pragma once
#include <ATen/native/CPUBlas.h>

namespace {

// oneDNN's bf16 micro-kernels run on this CPU (AMX); elsewhere the bf16 matmuls run dot_rows below
// (AVX-512 BF16) or gemm/cpu_gemm.cpp's AVX2 fma_rows.
inline bool onednn_bf16() {
  static const bool yes = at::native::cpublas::could_pack(at::kBFloat16);
  return yes;
}

}  // namespace

#if defined(__AVX512BF16__)
#include <immintrin.h>

#include <c10/util/BFloat16.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstring>
#include <utility>

namespace {

constexpr int64_t DOT_COLS = 32;  // columns a call
constexpr int DOT_ROWS = 8;       // rows a call: 16 accumulators

// R rows of A [R, K] bf16 (rows lda apart, K even) times 16 H columns of B (H = 2: 32; H = 1:
// the first 16 of a 32-column block) -> c [R, 16 H] fp32 (rows ldc apart), stored, or added to
// what c holds (add): per pair of k, each row's two values broadcast against the H x 16 columns.
// A column's sum is the same instructions in the same order whether H is 1 or 2.
template <int R, int H = 2>
void dot_rows(const c10::BFloat16* a, int64_t lda, int64_t K, const c10::BFloat16* b, int64_t ldb, float* c,
              int64_t ldc, bool add) {
  __m512 acc[R][H];
  for (int r = 0; r < R; ++r)
    for (int h = 0; h < H; ++h) acc[r][h] = add ? _mm512_loadu_ps(c + r * ldc + 16 * h) : _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += 2) {
    const c10::BFloat16* pair = b + k / 2 * ldb;
    __m512bh bh[H];
    for (int h = 0; h < H; ++h) bh[h] = (__m512bh)_mm512_loadu_si512(pair + h * DOT_COLS);
    for (int r = 0; r < R; ++r) {
      int32_t two;
      std::memcpy(&two, a + r * lda + k, sizeof(two));
      const __m512bh x = (__m512bh)_mm512_set1_epi32(two);
      for (int h = 0; h < H; ++h) acc[r][h] = _mm512_dpbf16_ps(acc[r][h], x, bh[h]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int h = 0; h < H; ++h) _mm512_storeu_ps(c + r * ldc + 16 * h, acc[r][h]);
}

template <int H, int... R>
constexpr auto dot_kernels(std::integer_sequence<int, R...>) {
  return std::array{dot_rows<R + 1, H>...};
}
constexpr auto DOT = dot_kernels<2>(std::make_integer_sequence<int, DOT_ROWS>{});    // DOT[r - 1]: r rows
constexpr auto DOT16 = dot_kernels<1>(std::make_integer_sequence<int, DOT_ROWS>{});  // the same, 16 columns

// C [m, n] fp32 (rows ldc apart) = (add: C +) A [m, K] bf16 (rows lda apart) times B [K, n] in
// VNNI pairs (ldb apart), n a multiple of 16: eight rows by 32 columns a call, a last 16 by 16
// (a router's few outputs in one 32-column block: half the products).
inline void dot_mm(int64_t m, int64_t n, int64_t K, const c10::BFloat16* A, int64_t lda, const c10::BFloat16* B,
                   int64_t ldb, float* C, int64_t ldc, bool add) {
  for (int64_t r = 0; r < m; r += DOT_ROWS) {
    const int64_t rows = std::min<int64_t>(DOT_ROWS, m - r) - 1;
    for (int64_t j = 0; j < n; j += DOT_COLS)
      (n - j >= DOT_COLS ? DOT : DOT16)[rows](A + r * lda, lda, K, B + 2 * j, ldb, C + r * ldc + j, ldc, add);
  }
}

}  // namespace
#endif

// The fp32 matmul of the compiled CPU kernels at the sizes they call it with (a chunk of 64
// tokens, a head of 64-128 channels, a block of 256 keys) on AVX-512 CPUs: C [M, N] = alpha op(A)
// op(B) + beta C, row-major, as mm() in matmul.h. RB rows by NB vectors of 16 columns of C stay in
// registers over all of K; each k loads NB vectors of op(B)'s row and broadcasts RB values of
// op(A). A transposed B is first copied to a [K, N] buffer so its rows are contiguous. At these
// sizes the BLAS spent as long packing and scaling as multiplying (perf on the delta-rule chunk);
// larger products go to it. AVX2 CPUs get the same tiles with 8-lane vectors.
#pragma once
#include <cstdint>

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>

#include <algorithm>
#include <vector>

// Whether small_mm takes a product of this size (on this CPU). AVX2's tiles hold 16 columns, so
// they broadcast each of A's values once per 16 columns of C: there they take the delta rule's
// products of a 64-token chunk and 64-channel heads (0.89x the time of its chunk calls on the
// Qwen3-Next peer workload) but not Mamba2's 128-token chunks, where the BLAS was faster (the SSD
// calls took 1.14x its time through these tiles).
inline bool small_mm_fits(int64_t M, int64_t N, int64_t K) {
#if defined(__AVX512F__)
  return M * N * K <= (int64_t{1} << 22) && K <= 1024;
#else
  return std::max({M, N, K}) <= 64;
#endif
}

namespace small_mm_detail {

// B [N, K] (rows ldb apart) transposed into this thread's buffer [K, N], 16 of B's rows at a time
// (whole vectors of it written)
inline const float* transposed(const float* B, int64_t ldb, int64_t N, int64_t K) {
  thread_local std::vector<float> bt;
  bt.resize(K * N);
  for (int64_t j0 = 0; j0 < N; j0 += 16)
    for (int64_t k = 0; k < K; ++k)
      for (int64_t j = j0; j < std::min(N, j0 + 16); ++j) bt[k * N + j] = B[j * ldb + k];
  return bt.data();
}

}  // namespace small_mm_detail
#endif

#if defined(__AVX512F__)
namespace small_mm_detail {

// RB rows [i0, i0 + RB) by columns [j0, j0 + 16 NB) of C, the last vector masked to `last`. op(A)'s
// row i, column k at A[i * ar + k * ak]; op(B)'s row k at B + k * ldb.
template <int RB, int NB>
void tile(int64_t K, const float* A, int64_t ar, int64_t ak, const float* B, int64_t ldb, float alpha, float beta,
          float* C, int64_t ldc, __mmask16 last) {
  __m512 acc[RB][NB];
  for (int r = 0; r < RB; ++r)
    for (int n = 0; n < NB; ++n) acc[r][n] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    const float* b = B + k * ldb;
    __m512 bv[NB];
    for (int n = 0; n < NB; ++n) bv[n] = n + 1 < NB ? _mm512_loadu_ps(b + 16 * n) : _mm512_maskz_loadu_ps(last, b + 16 * n);
    for (int r = 0; r < RB; ++r) {
      const __m512 a = _mm512_set1_ps(A[r * ar + k * ak]);
      for (int n = 0; n < NB; ++n) acc[r][n] = _mm512_fmadd_ps(a, bv[n], acc[r][n]);
    }
  }
  // fully unrolled with beta read as a mask (0: C not loaded), so that the accumulators stay in
  // registers: with a branch here GCC stored all of them to the stack at every k
  const __m512 va = _mm512_set1_ps(alpha), vb = _mm512_set1_ps(beta);
  const bool keep = beta != 0.f;
#pragma GCC unroll 32
  for (int r = 0; r < RB; ++r)
#pragma GCC unroll 32
    for (int n = 0; n < NB; ++n) {
      float* c = C + r * ldc + 16 * n;
      const __mmask16 m = n + 1 < NB ? __mmask16(0xFFFF) : last;
      const __m512 out = _mm512_mul_ps(va, acc[r][n]);
      _mm512_mask_storeu_ps(c, m, _mm512_fmadd_ps(vb, _mm512_maskz_loadu_ps(keep ? m : 0, c), out));
    }
}

// the last m < R rows of C by NB vectors of columns
template <int R, int NB>
void rest(int64_t m, int64_t K, const float* A, int64_t ar, int64_t ak, const float* B, int64_t ldb, float alpha,
          float beta, float* C, int64_t ldc, __mmask16 last) {
  if constexpr (R > 0) {
    if (m == R) return tile<R, NB>(K, A, ar, ak, B, ldb, alpha, beta, C, ldc, last);
    rest<R - 1, NB>(m, K, A, ar, ak, B, ldb, alpha, beta, C, ldc, last);
  }
}

// all rows of C by the columns of B's NB vectors, RB rows at a time
template <int NB>
void panel(int64_t M, int64_t K, const float* A, int64_t ar, int64_t ak, const float* B, int64_t ldb, float alpha,
           float beta, float* C, int64_t ldc, __mmask16 last) {
  constexpr int RB = NB <= 2 ? 8 : 6;  // accumulators and B's vectors within the 32 registers
  int64_t i = 0;
  for (; i + RB <= M; i += RB) tile<RB, NB>(K, A + i * ar, ar, ak, B, ldb, alpha, beta, C + i * ldc, ldc, last);
  rest<RB - 1, NB>(M - i, K, A + i * ar, ar, ak, B, ldb, alpha, beta, C + i * ldc, ldc, last);
}

}  // namespace small_mm_detail

inline void small_mm(bool ta, bool tb, int64_t M, int64_t N, int64_t K, float alpha, const float* A, int64_t lda,
                     const float* B, int64_t ldb, float beta, float* C, int64_t ldc) {
  using namespace small_mm_detail;
  if (tb) {  // B stored [N, K]: its transpose, [K, N], in this thread's buffer
    B = transposed(B, ldb, N, K);
    ldb = N;
  }
  const int64_t ar = ta ? 1 : lda, ak = ta ? lda : 1;
  for (int64_t j0 = 0; j0 < N; j0 += 64) {
    const int64_t n = std::min<int64_t>(64, N - j0), vecs = (n + 15) / 16;
    const __mmask16 last = static_cast<__mmask16>((1u << (n - 16 * (vecs - 1))) - 1u);
    const float* b = B + j0;
    float* c = C + j0;
    switch (vecs) {
      case 4: panel<4>(M, K, A, ar, ak, b, ldb, alpha, beta, c, ldc, last); break;
      case 3: panel<3>(M, K, A, ar, ak, b, ldb, alpha, beta, c, ldc, last); break;
      case 2: panel<2>(M, K, A, ar, ak, b, ldb, alpha, beta, c, ldc, last); break;
      default: panel<1>(M, K, A, ar, ak, b, ldb, alpha, beta, c, ldc, last); break;
    }
  }
}

#elif defined(__AVX2__) && defined(__FMA__)
// The same register tiles with AVX2's 8-lane vectors (16 registers): RB rows by NB <= 2 vectors of
// C, each output summed over k in order as above (the same bits as the AVX-512 tiles). Where the
// last vector is whole (`Full`), B's rows are plain loads and no mask takes a register: with one,
// 6 x 2 tiles had no register left for B's first vector and GCC loaded it again into each of the
// six FMAs that use it (13 loads a k for 12 FMAs, against 8).
namespace small_mm_detail {

inline __m256i first_lanes(int64_t n) {  // a mask of lanes 0..n-1
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(n)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

template <int RB, int NB, bool Full>
void tile8(int64_t K, const float* A, int64_t ar, int64_t ak, const float* B, int64_t ldb, float alpha, float beta,
           float* C, int64_t ldc, __m256i last) {
  __m256 acc[RB][NB];
  for (int r = 0; r < RB; ++r)
    for (int n = 0; n < NB; ++n) acc[r][n] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    const float* b = B + k * ldb;
    __m256 bv[NB];
    for (int n = 0; n < NB; ++n)
      bv[n] = Full || n + 1 < NB ? _mm256_loadu_ps(b + 8 * n) : _mm256_maskload_ps(b + 8 * n, last);
    for (int r = 0; r < RB; ++r) {
      const __m256 a = _mm256_broadcast_ss(A + r * ar + k * ak);
      for (int n = 0; n < NB; ++n) acc[r][n] = _mm256_fmadd_ps(a, bv[n], acc[r][n]);
    }
  }
  const __m256 va = _mm256_set1_ps(alpha), vb = _mm256_set1_ps(beta);
  const __m256i all = _mm256_set1_epi32(-1), none = _mm256_setzero_si256();
  const bool keep = beta != 0.f;
#pragma GCC unroll 32
  for (int r = 0; r < RB; ++r)
#pragma GCC unroll 32
    for (int n = 0; n < NB; ++n) {
      float* c = C + r * ldc + 8 * n;
      const __m256i m = Full || n + 1 < NB ? all : last;
      const __m256 out = _mm256_mul_ps(va, acc[r][n]);
      _mm256_maskstore_ps(c, m, _mm256_fmadd_ps(vb, _mm256_maskload_ps(c, keep ? m : none), out));
    }
}

template <int R, int NB, bool Full>
void rest8(int64_t m, int64_t K, const float* A, int64_t ar, int64_t ak, const float* B, int64_t ldb, float alpha,
           float beta, float* C, int64_t ldc, __m256i last) {
  if constexpr (R > 0) {
    if (m == R) return tile8<R, NB, Full>(K, A, ar, ak, B, ldb, alpha, beta, C, ldc, last);
    rest8<R - 1, NB, Full>(m, K, A, ar, ak, B, ldb, alpha, beta, C, ldc, last);
  }
}

template <int NB, bool Full>
void panel8(int64_t M, int64_t K, const float* A, int64_t ar, int64_t ak, const float* B, int64_t ldb, float alpha,
            float beta, float* C, int64_t ldc, __m256i last) {
  constexpr int RB = NB == 1 ? 8 : 6;  // accumulators, B's vectors, a broadcast and the mask in 16 registers
  int64_t i = 0;
  for (; i + RB <= M; i += RB)
    tile8<RB, NB, Full>(K, A + i * ar, ar, ak, B, ldb, alpha, beta, C + i * ldc, ldc, last);
  rest8<RB - 1, NB, Full>(M - i, K, A + i * ar, ar, ak, B, ldb, alpha, beta, C + i * ldc, ldc, last);
}

}  // namespace small_mm_detail

inline void small_mm(bool ta, bool tb, int64_t M, int64_t N, int64_t K, float alpha, const float* A, int64_t lda,
                     const float* B, int64_t ldb, float beta, float* C, int64_t ldc) {
  using namespace small_mm_detail;
  if (tb) {
    B = transposed(B, ldb, N, K);
    ldb = N;
  }
  const int64_t ar = ta ? 1 : lda, ak = ta ? lda : 1;
  for (int64_t j0 = 0; j0 < N; j0 += 16) {
    const int64_t n = std::min<int64_t>(16, N - j0);
    const float* b = B + j0;
    float* c = C + j0;
    if (n == 16)
      panel8<2, true>(M, K, A, ar, ak, b, ldb, alpha, beta, c, ldc, first_lanes(8));
    else if (n > 8)
      panel8<2, false>(M, K, A, ar, ak, b, ldb, alpha, beta, c, ldc, first_lanes(n - 8));
    else if (n == 8)
      panel8<1, true>(M, K, A, ar, ak, b, ldb, alpha, beta, c, ldc, first_lanes(8));
    else
      panel8<1, false>(M, K, A, ar, ak, b, ldb, alpha, beta, c, ldc, first_lanes(n));
  }
}

#else

inline bool small_mm_fits(int64_t, int64_t, int64_t) { return false; }
inline void small_mm(bool, bool, int64_t, int64_t, int64_t, float, const float*, int64_t, const float*, int64_t, float,
                     float*, int64_t) {}

#endif

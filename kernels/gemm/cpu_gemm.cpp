// bf16 matmuls on CPU through oneDNN's batch-reduce GEMM micro-kernels (torch's
// at::native::cpublas::brgemm, AMX tiles where the CPU has them), built and called by
// kernels/native.py. torch's own bf16 matmul goes through a oneDNN primitive made for each
// new input shape (3-6 ms at a few thousand rows; a serving engine's rounds change shape every
// time) and costs 25-50 us at decode sizes; these micro-kernels are made once per (rows <= BM,
// K) and run a decode projection in 4-10 us.
//
// The weights are packed once (`pack_bf16`): [N, K] -> [ceil(N / BN), K, BN] blocks, each in
// the VNNI layout the micro-kernel reads, the last block padded with zero columns. Every output
// is a fp32 sum over K in the micro-kernel's fixed order, rounded once to bf16: the same value
// whichever block or batch a column sits in (so fused and separate projections agree bit for
// bit).
//
// `linear_bf16`: x [M, K] @ w^T (+ bias) -> [M, N] bf16. At prefill sizes a work item is a row
// block: up to 16 column blocks into one fp32 buffer, then those columns of each row converted and
// written in one pass (1.1-1.5x the speed of writing each 32-column piece as it is made, at a few
// thousand rows). With fewer row blocks than threads can share, work items are (row block, column
// block) pairs.
//
// `heads_bf16`: one such matmul per head, x [T, H, K] against w [H, N, K], into a view (MLA's
// absorbed query and value projections, models/kimi_linear.py).
//
// CPUs without bf16 micro-kernels in oneDNN (no AMX) run the same drivers over a micro-kernel of
// our own. With AVX-512 BF16 (`dot_rows`, gemm/dot.h, e.g. AMD Zen 4) the packed blocks are in the same VNNI
// pairs [K / 2, BN, 2] and each step multiplies a pair of k for 16 columns in one instruction
// (vdpbf16ps), straight from the bf16 rows and block. With AVX2 only (`fma_rows`) the blocks are
// plain [K, BN] bf16; a call widens its rows and its block to fp32 and sums over K in order with
// FMAs. Either way every output is one fp32 sum in a fixed order rounded once to bf16, the same
// whichever rows or blocks share the call; that order is not oneDNN's, so an output can differ
// from torch's bf16 matmul by one bf16 step. torch's own bf16 matmul on such a CPU has no vector
// kernel and takes 4-9x as long (benchmarks/gemm.py).
//
// `moe_bf16`: the mixture of experts of models/layers/mlp.py run_experts for gated experts
// without biases: each (token, choice) row goes to its expert; per block of one expert's rows,
// gate and up (each rounded to bf16), act(gate) rounded, times up rounded, then down rounded;
// then each token's choices weighted and summed as moe_combine does. A shared expert (Qwen3-Next's
// sigmoid-gated one, Kimi Linear's ungated one) runs as one more expert on every token's row in
// place, and its output, times its gate, joins the sum in the same pass. No padding, no copies of
// the expert weights, one call per layer. `moe_f32` is the same driver for fp32 experts (plain
// blocks, the fp32 micro-kernel, nothing rounded between the steps) where `linear_f32` runs.
//
// `linear_f32`: the fp32 twin of linear_bf16 over the same drivers and blocks (plain fp32), on
// AVX-512 BF16 CPUs without AMX (small_mm's tile) and AVX2 CPUs without AVX-512 (fma_rows, the
// rows read as they are); elsewhere torch's fp32 matmul (MKL) runs. Every output is one fp32 sum
// over K in order, the same whichever rows share the call.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <ATen/native/CPUBlas.h>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

#include "../act.h"
#include "../denormal.h"
#include "../widen.h"
#include "dot.h"
#include "small.h"

#include <algorithm>
#include <array>
#include <atomic>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <utility>
#include <vector>

namespace {

using at::BFloat16;
namespace cpublas = at::native::cpublas;

constexpr int64_t BN = 32;  // columns per packed block
constexpr int64_t BM = 64;  // rows per micro-kernel call

#if defined(__AVX512BF16__)
constexpr bool PAIRS = true;  // dot_rows reads the blocks as VNNI pairs
#else
constexpr bool PAIRS = false;
#endif

// Pack w [N, K] (rows may be strided) into blocks [NB, K, BN] in place at out: in oneDNN's VNNI
// layout, in VNNI pairs [K / 2, BN, 2] for dot_rows, or plain row-major for fma_rows.
void pack_into(const BFloat16* w, int64_t ldw, int64_t N, int64_t K, BFloat16* out) {
  const int64_t NB = (N + BN - 1) / BN;
  std::vector<BFloat16> block(K * BN);
  for (int64_t b = 0; b < NB; ++b) {
    BFloat16* dst = onednn_bf16() ? block.data() : out + b * K * BN;
    for (int64_t k = 0; k < K; ++k)  // column n of the block is weight row b * BN + n
      for (int64_t n = 0; n < BN; ++n) {
        const int64_t at = PAIRS && !onednn_bf16() ? k / 2 * 2 * BN + n * 2 + k % 2 : k * BN + n;
        dst[at] = b * BN + n < N ? w[(b * BN + n) * ldw + k] : BFloat16(0.f);
      }
    if (onednn_bf16()) cpublas::pack(K, BN, BN, BN, at::kBFloat16, at::kBFloat16, block.data(), out + b * K * BN);
  }
}

// The fp32 twin: plain row-major blocks [NB, K, BN] for the fp32 micro-kernel, zero past N.
void pack_into(const float* w, int64_t ldw, int64_t N, int64_t K, float* out) {
  for (int64_t b = 0; b < (N + BN - 1) / BN; ++b)
    for (int64_t k = 0; k < K; ++k)
      for (int64_t n = 0; n < BN; ++n) out[(b * K + k) * BN + n] = b * BN + n < N ? w[(b * BN + n) * ldw + k] : 0.f;
}

#if defined(__AVX2__) && defined(__FMA__)
// R rows of a [R, K] fp32 (rows lda apart) times b [K, BN] fp32 -> c [R, BN] (rows BN apart): per
// 16 columns, R x 2 accumulators, each output summed over k in order.
template <int R>
void fma_rows(const float* a, int64_t lda, int64_t K, const float* b, float* c) {
  for (int64_t j = 0; j < BN; j += 16) {
    __m256 acc[R][2];
    for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    for (int64_t k = 0; k < K; ++k) {
      const __m256 b0 = _mm256_loadu_ps(b + k * BN + j), b1 = _mm256_loadu_ps(b + k * BN + j + 8);
      for (int r = 0; r < R; ++r) {
        const __m256 x = _mm256_broadcast_ss(a + r * lda + k);
        acc[r][0] = _mm256_fmadd_ps(x, b0, acc[r][0]);
        acc[r][1] = _mm256_fmadd_ps(x, b1, acc[r][1]);
      }
    }
    for (int r = 0; r < R; ++r) {
      _mm256_storeu_ps(c + r * BN + j, acc[r][0]);
      _mm256_storeu_ps(c + r * BN + j + 8, acc[r][1]);
    }
  }
}

// C [m, BN] = a [m, K] fp32 (rows lda apart) times b [K, BN] fp32, six rows at a time.
void fma_block(int64_t m, int64_t K, const float* a, int64_t lda, const float* b, float* C) {
  int64_t r = 0;
  for (; r + 6 <= m; r += 6) fma_rows<6>(a + r * lda, lda, K, b, C + r * BN);
  switch (m - r) {
    case 5: fma_rows<5>(a + r * lda, lda, K, b, C + r * BN); break;
    case 4: fma_rows<4>(a + r * lda, lda, K, b, C + r * BN); break;
    case 3: fma_rows<3>(a + r * lda, lda, K, b, C + r * BN); break;
    case 2: fma_rows<2>(a + r * lda, lda, K, b, C + r * BN); break;
    case 1: fma_rows<1>(a + r * lda, lda, K, b, C + r * BN); break;
    default: break;
  }
}
#endif

// With AVX2 only (fma_rows): the rows A [m, K] bf16 (lda apart) widened to fp32 once into this
// thread's buffer, for every column block the drivers multiply them by (widened in each call, the
// rows were two thirds of what a call widened, at 32 columns a block); null elsewhere, and for fp32.
template <typename T>
const float* widened(const T* A, int64_t lda, int64_t m, int64_t K) {
#if !defined(__AVX512BF16__) && defined(__AVX2__) && defined(__FMA__)
  if constexpr (std::is_same_v<T, BFloat16>) {
    if (!onednn_bf16()) {
      thread_local std::vector<float> a;
      a.resize(m * K);
      for (int64_t r = 0; r < m; ++r)
        for (int64_t k = 0; k < K; ++k) a[r * K + k] = as_float(A[r * lda + k]);
      return a.data();
    }
  }
#endif
  return nullptr;
}

// The micro-kernel call of the drivers below: C [m, BN] fp32 = A [m, K] bf16 (rows lda apart)
// times packed block B [K, BN], m <= BM; `live`: the block's columns that are outputs (the rest
// pad it). Without oneDNN's: dot_rows eight rows at a time (only the first 16 columns where no
// more are live), or (AVX2) both widened to fp32 in this thread's buffers (A's rows unless `wide`
// holds them already, from widened()), then six rows at a time.
void micro(int64_t m, int64_t K, const BFloat16* A, int64_t lda, const BFloat16* B, float* C, int64_t live = BN,
           [[maybe_unused]] const float* wide = nullptr) {
  if (onednn_bf16()) {
    cpublas::brgemm(m, BN, K, lda, BN, BN, false, A, B, C);
    return;
  }
#if defined(__AVX512BF16__)
  dot_mm(m, live > BN / 2 ? BN : BN / 2, K, A, lda, B, 2 * BN, C, BN, false);
#elif defined(__AVX2__) && defined(__FMA__)
  thread_local std::vector<float> b;
  b.resize(K * BN);
  for (int64_t i = 0; i < K * BN; ++i) b[i] = as_float(B[i]);
  fma_block(m, K, wide ? wide : widened(A, lda, m, K), K, b.data(), C);
#else
  TORCH_CHECK(false, "bf16 micro-kernels: neither oneDNN's nor AVX2 ones on this CPU");
#endif
}

// fp32: C [m, BN] = A [m, K] fp32 (rows lda apart) times plain block B [K, BN], m <= BM, every column (only
// where gemm_f32_supported()): small_mm's tile with AVX-512 BF16, else fma_rows.
void micro(int64_t m, int64_t K, const float* A, int64_t lda, const float* B, float* C, int64_t = BN,
           const float* = nullptr) {
#if defined(__AVX512BF16__)
  small_mm(false, false, m, BN, K, 1.f, A, lda, B, BN, 0.f, C, BN);  // each output summed over k in order
#elif defined(__AVX2__) && defined(__FMA__)
  fma_block(m, K, A, lda, B, C);
#else
  TORCH_CHECK(false, "fp32 micro-kernels: not built for this CPU");
#endif
}

// A thread's oneDNN micro-kernel state, released at the end of its work.
void release() {
  if (onednn_bf16()) cpublas::brgemm_release();
}

// C [m, BN] fp32 (rows BN apart) -> out rows (ld) bf16, the first n columns, plus bias (fp32) if given.
// Inlined, and a whole block's row converted at once with AVX-512 BF16 (1-3% off a prefill MoE or
// projection call against a call per row of 32, in isolation).
inline __attribute__((always_inline)) void store(const float* C, int64_t m, int64_t n, const float* bias, uint16_t* out, int64_t ld) {
  for (int64_t r = 0; r < m; ++r) {
    const float* c = C + r * BN;
    uint16_t* o = out + r * ld;
#if defined(__AVX512BF16__)
    if (n == BN) {  // vcvtne2ps2bf16 rounds to nearest even as bf16_bits does; it flushes denormals, but
                    // under FlushDenormals neither the products nor the bias sums are denormal
      __m512 lo = _mm512_loadu_ps(c), hi = _mm512_loadu_ps(c + 16);
      if (bias) {
        lo = _mm512_add_ps(lo, _mm512_loadu_ps(bias));
        hi = _mm512_add_ps(hi, _mm512_loadu_ps(bias + 16));
      }
      _mm512_storeu_si512(o, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
      continue;
    }
#endif
    if (bias) {
#pragma omp simd
      for (int64_t j = 0; j < n; ++j) o[j] = bf16_bits(c[j] + bias[j]);
    } else {
#pragma omp simd
      for (int64_t j = 0; j < n; ++j) o[j] = bf16_bits(c[j]);
    }
  }
}

// The same for fp32 outputs.
void store(const float* C, int64_t m, int64_t n, const float* bias, float* out, int64_t ld) {
  for (int64_t r = 0; r < m; ++r) {
    const float* c = C + r * BN;
    float* o = out + r * ld;
#pragma omp simd
    for (int64_t j = 0; j < n; ++j) o[j] = bias ? c[j] + bias[j] : c[j];
  }
}

// m rows of A [m, K] times every packed column block, GB blocks at a time into C [GB, BM, BN]
// fp32, then the group's columns of row r (plus bias) -> out_row(r), bf16. Writing each row's
// group of columns in one pass rather than 64-byte pieces block by block is what makes wide
// outputs cheap: a piece of a row that shares its cache lines with the neighbours' pieces costs
// the lines' read; GB bounds C (128 KB) so that it stays in cache.
constexpr int64_t GB = 16;

template <typename T, typename Row>
void row_block(const T* A, int64_t lda, int64_t m, int64_t K, const T* W, int64_t NB, int64_t N,
               const float* bias, float* C, Row out_row) {
  const float* wide = widened(A, lda, m, K);
  for (int64_t g = 0; g < NB; g += GB) {
    const int64_t nb = std::min(GB, NB - g);
    for (int64_t b = 0; b < nb; ++b)
      micro(m, K, A, lda, W + (g + b) * K * BN, C + b * BM * BN, N - (g + b) * BN, wide);
    for (int64_t r = 0; r < m; ++r) {
      auto* o = out_row(r) + g * BN;
      for (int64_t b = 0; b < nb; ++b) {
        const int64_t n0 = (g + b) * BN;
        store(C + b * BM * BN + r * BN, 1, std::min(BN, N - n0), bias ? bias + n0 : nullptr, o + b * BN, 0);
      }
    }
  }
}

}  // namespace

// Whether this CPU runs the bf16 micro-kernels: oneDNN's, or ours with AVX2 and FMA; elsewhere
// callers keep torch's matmul. gemm_bf16_onednn: whether they are oneDNN's (torch's bits).
bool gemm_bf16_supported() {
#if defined(__AVX2__) && defined(__FMA__)
  return true;
#else
  return onednn_bf16();
#endif
}
bool gemm_bf16_onednn() { return onednn_bf16(); }

// w [N, K] bf16 (K even) -> packed [ceil(N / BN), K, BN] bf16.
at::Tensor pack_bf16(const at::Tensor& w) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kBFloat16 && w.stride(1) == 1, "pack_bf16: bf16 w [N, K]");
  TORCH_CHECK(w.size(1) % 2 == 0, "pack_bf16: K must be even (VNNI pairs)");
  const int64_t N = w.size(0), K = w.size(1);
  auto out = at::empty({(N + BN - 1) / BN, K, BN}, w.options());
  pack_into(w.data_ptr<BFloat16>(), w.stride(0), N, K, out.data_ptr<BFloat16>());
  return out;
}

// The matmuls of linear_bf16 (H = 1) and heads_bf16: for each head h, rows X + t * xr + h * xh
// (T rows of K) against packed blocks W + h * NB * K * BN, plus bias, into rows O + t * orow + h * oh
// (N outputs). At prefill sizes a work item is (head, row block), its rows written whole; with
// fewer such items than four per thread, (head, row block, column block), column blocks fastest,
// so that every thread works. The same micro-kernel calls, sums and rounding either way.
// (E: BFloat16 with bf16 outputs as uint16_t bits, or float with fp32 outputs.)
template <typename E, typename Out>
static void matmul_rows(const E* X, int64_t T, int64_t H, int64_t K, int64_t xr, int64_t xh, const E* W,
                        int64_t NB, int64_t N, const float* bias, Out* O, int64_t orow, int64_t oh) {
  const int64_t MB = (T + BM - 1) / BM;
  if (H * MB >= 4 * at::get_num_threads()) {
    at::parallel_for(0, H * MB, 1, [&](int64_t begin, int64_t end) {
      FlushDenormals flush;
      std::vector<float> C(std::min(GB, NB) * BM * BN);
      for (int64_t i = begin; i < end; ++i) {
        const int64_t h = i / MB, m0 = i % MB * BM;
        row_block(X + m0 * xr + h * xh, xr, std::min(BM, T - m0), K, W + h * NB * K * BN, NB, N, bias, C.data(),
                  [&](int64_t r) { return O + (m0 + r) * orow + h * oh; });
      }
      release();
    });
    return;
  }
  at::parallel_for(0, H * MB * NB, 1, [&](int64_t begin, int64_t end) {
    FlushDenormals flush;
    alignas(64) float C[BM * BN];
    const float* wide = nullptr;  // the rows of item `rows`, widened once for its column blocks
    for (int64_t i = begin, rows = -1; i < end; ++i) {
      const int64_t h = i / (MB * NB), m0 = i / NB % MB * BM, nb = i % NB, n0 = nb * BN, m = std::min(BM, T - m0);
      if (i / NB != rows) {
        rows = i / NB;
        wide = widened(X + m0 * xr + h * xh, xr, m, K);
      }
      micro(m, K, X + m0 * xr + h * xh, xr, W + (h * NB + nb) * K * BN, C, N - n0, wide);
      store(C, m, std::min(BN, N - n0), bias ? bias + n0 : nullptr, O + m0 * orow + h * oh + n0, orow);
    }
    release();
  });
}

// x [M, K] bf16 with unit stride in K (rows any stride apart: a column range of a wider
// projection is read in place), packed from pack_bf16 of a [N, K] weight, bias [N] fp32 or empty.
at::Tensor linear_bf16(const at::Tensor& x, const at::Tensor& packed, int64_t N, const at::Tensor& bias) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.stride(1) == 1 && x.stride(0) >= x.size(1),
              "linear_bf16: bf16 x [M, K] with unit stride in K");
  const int64_t M = x.size(0), K = x.size(1), NB = packed.size(0);
  TORCH_CHECK(packed.dim() == 3 && packed.size(1) == K && packed.size(2) == BN && NB * BN >= N, "linear_bf16: packed weight");
  TORCH_CHECK(!bias.numel() || (bias.scalar_type() == at::kFloat && bias.numel() == N), "linear_bf16: bias [N] fp32");
  auto out = at::empty({M, N}, x.options());
  if (!M) return out;
  matmul_rows(x.data_ptr<BFloat16>(), M, 1, K, x.stride(0), 0, packed.data_ptr<BFloat16>(), NB, N,
              bias.numel() ? bias.data_ptr<float>() : nullptr, reinterpret_cast<uint16_t*>(out.data_ptr<BFloat16>()),
              N, 0);
  return out;
}

// Whether this CPU runs the fp32 micro-kernel: AVX-512 BF16 without AMX (small_mm's tile, where
// dot_rows runs) or AVX2 without AVX-512 (fma_rows); elsewhere callers keep torch's fp32 matmul
// (MKL's sgemm: with AMX or plain AVX-512 its vectors are twice fma_rows' width).
bool gemm_f32_supported() {
#if defined(__AVX512BF16__)
  return !onednn_bf16();
#elif defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
  return true;
#else
  return false;
#endif
}

// w [N, K] fp32 -> packed [ceil(N / BN), K, BN] fp32, plain blocks (column n of block b is row b * BN + n).
at::Tensor pack_f32(const at::Tensor& w) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kFloat && w.stride(1) == 1, "pack_f32: fp32 w [N, K]");
  const int64_t N = w.size(0), K = w.size(1);
  auto out = at::empty({(N + BN - 1) / BN, K, BN}, w.options());
  pack_into(w.data_ptr<float>(), w.stride(0), N, K, out.data_ptr<float>());
  return out;
}

// linear_bf16's twin for fp32 x [M, K] (unit stride in K, rows any stride apart) and a weight
// packed by pack_f32: every output one fp32 sum over K in order, the same whatever rows share the call.
at::Tensor linear_f32(const at::Tensor& x, const at::Tensor& packed, int64_t N, const at::Tensor& bias) {
  TORCH_CHECK(gemm_f32_supported(), "linear_f32: not built for this CPU");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.stride(1) == 1 && x.stride(0) >= x.size(1),
              "linear_f32: fp32 x [M, K] with unit stride in K");
  const int64_t M = x.size(0), K = x.size(1), NB = packed.size(0);
  TORCH_CHECK(packed.dim() == 3 && packed.scalar_type() == at::kFloat && packed.size(1) == K && packed.size(2) == BN &&
                  NB * BN >= N, "linear_f32: packed weight");
  TORCH_CHECK(!bias.numel() || (bias.scalar_type() == at::kFloat && bias.numel() == N), "linear_f32: bias [N] fp32");
  auto out = at::empty({M, N}, x.options());
  if (!M) return out;
  matmul_rows(x.data_ptr<float>(), M, 1, K, x.stride(0), 0, packed.data_ptr<float>(), NB, N,
              bias.numel() ? bias.data_ptr<float>() : nullptr, out.data_ptr<float>(), N, 0);
  return out;
}

// w [H, N, K] bf16 (unit stride in K) -> packed [H, ceil(N / BN), K, BN]: one pack_bf16 per head.
at::Tensor pack_heads_bf16(const at::Tensor& w) {
  TORCH_CHECK(w.dim() == 3 && w.scalar_type() == at::kBFloat16 && w.stride(2) == 1, "pack_heads_bf16: bf16 w [H, N, K]");
  TORCH_CHECK(w.size(2) % 2 == 0, "pack_heads_bf16: K must be even (VNNI pairs)");
  const int64_t H = w.size(0), N = w.size(1), K = w.size(2);
  auto out = at::empty({H, (N + BN - 1) / BN, K, BN}, w.options());
  for (int64_t h = 0; h < H; ++h)
    pack_into(w[h].data_ptr<BFloat16>(), w.stride(1), N, K, out[h].data_ptr<BFloat16>());
  return out;
}

// Per-head matmuls (MLA's absorbed projections): out[t, h, :N] = x[t, h] @ w[h]^T for x [T, H, K]
// bf16 and packed from pack_heads_bf16 of w [H, N, K], written into out [T, H, >= N] bf16 (a view:
// rows and heads any stride, unit stride in the last dim). Every output an fp32 sum rounded once,
// as linear_bf16's.
void heads_bf16(const at::Tensor& x, const at::Tensor& packed, int64_t N, at::Tensor& out) {
  TORCH_CHECK(x.dim() == 3 && x.scalar_type() == at::kBFloat16 && x.stride(2) == 1, "heads_bf16: bf16 x [T, H, K]");
  const int64_t T = x.size(0), H = x.size(1), K = x.size(2), NB = packed.size(1);
  TORCH_CHECK(packed.dim() == 4 && packed.size(0) == H && packed.size(2) == K && packed.size(3) == BN && NB * BN >= N,
              "heads_bf16: packed weights [H, NB, K, BN]");
  TORCH_CHECK(out.dim() == 3 && out.scalar_type() == at::kBFloat16 && out.size(0) == T && out.size(1) == H &&
                  out.size(2) >= N && out.stride(2) == 1, "heads_bf16: bf16 out [T, H, >= N]");
  if (!T) return;
  matmul_rows(x.data_ptr<BFloat16>(), T, H, K, x.stride(0), x.stride(1), packed.data_ptr<BFloat16>(), NB, N, nullptr,
              reinterpret_cast<uint16_t*>(out.data_ptr<BFloat16>()), out.stride(0), out.stride(1));
}

// gate_up [E, 2 * I, D] (gate rows, then up rows, per expert; rows may be strided) -> packed
// [E, 2, NI, D, BN] (gate blocks, then up blocks); down [E, D, I] -> [E, ND, I, BN]. bf16 blocks
// as pack_bf16 packs them (even D and I), fp32 ones as pack_f32.
template <typename T>
std::tuple<at::Tensor, at::Tensor> pack_experts(const at::Tensor& gate_up, const at::Tensor& down, const char* name) {
  const auto dtype = c10::CppTypeToScalarType<T>::value;
  TORCH_CHECK(gate_up.dim() == 3 && down.dim() == 3 && gate_up.scalar_type() == dtype && down.scalar_type() == dtype &&
                  gate_up.stride(2) == 1 && down.stride(2) == 1,
              name, ": gate_up [E, 2I, D] and down [E, D, I] in ", dtype);
  const int64_t E = gate_up.size(0), I = gate_up.size(1) / 2, D = gate_up.size(2);
  const bool pairs = std::is_same_v<T, BFloat16>;  // VNNI pairs of k
  TORCH_CHECK(down.size(0) == E && down.size(1) == D && down.size(2) == I && (!pairs || (D % 2 == 0 && I % 2 == 0)),
              name, ": shapes", pairs ? " (even D and I)" : "");
  const int64_t NI = (I + BN - 1) / BN, ND = (D + BN - 1) / BN;
  auto gu = at::empty({E, 2, NI, D, BN}, gate_up.options());
  auto dn = at::empty({E, ND, I, BN}, down.options());
  for (int64_t e = 0; e < E; ++e) {
    const T* g = gate_up[e].data_ptr<T>();
    const int64_t ld = gate_up.stride(1);
    pack_into(g, ld, I, D, gu[e][0].data_ptr<T>());
    pack_into(g + I * ld, ld, I, D, gu[e][1].data_ptr<T>());
    pack_into(down[e].data_ptr<T>(), down.stride(1), D, I, dn[e].data_ptr<T>());
  }
  return {gu, dn};
}

std::tuple<at::Tensor, at::Tensor> pack_experts_bf16(const at::Tensor& gate_up, const at::Tensor& down) {
  return pack_experts<BFloat16>(gate_up, down, "pack_experts_bf16");
}

std::tuple<at::Tensor, at::Tensor> pack_experts_f32(const at::Tensor& gate_up, const at::Tensor& down) {
  return pack_experts<float>(gate_up, down, "pack_experts_f32");
}

namespace {

// The pieces of moe() that differ by dtype. bf16: outputs held as bf16 bits (uint16_t), each step
// rounded as torch's bf16 ops round it; fp32: outputs as floats, no roundings between the steps.
inline float value(uint16_t bits) { return std::bit_cast<float>(static_cast<uint32_t>(bits) << 16); }
inline float value(float f) { return f; }
inline uint16_t* out_rows(at::Tensor& t, BFloat16) { return reinterpret_cast<uint16_t*>(t.data_ptr<BFloat16>()); }
inline float* out_rows(at::Tensor& t, float) { return t.data_ptr<float>(); }

// one row of BN: h = silu(gate) * up, for bf16 each step rounded (gate, up, silu, product)
inline void gated(const float* G, const float* U, BFloat16* out) {
  auto* h = reinterpret_cast<uint16_t*>(out);
#pragma omp simd
  for (int64_t j = 0; j < BN; ++j) {
    const float g = round_bf16(G[j]);
    h[j] = bf16_bits(round_bf16(act::silu(g)) * round_bf16(U[j]));
  }
}
inline void gated(const float* G, const float* U, float* h) {
#pragma omp simd
  for (int64_t j = 0; j < BN; ++j) h[j] = act::silu(G[j]) * U[j];
}

// a token's output from its choices' rows (weights wc in order) and, where there is one, its
// shared expert's row times st: bf16 as moe_combine and torch's mul and add round; fp32 plain
template <typename O>
void combine_row(const O* Y, const float* wc, int64_t k, const O* shared, float st, int64_t D, float* acc, O* out) {
  std::fill(acc, acc + D, 0.f);
  constexpr bool bf16 = std::is_same_v<O, uint16_t>;
  for (int64_t c = 0; c < k; ++c) {
    const O* row = Y + c * D;
#pragma omp simd
    for (int64_t d = 0; d < D; ++d) {
      const float p = value(row[d]) * wc[c];
      acc[d] += bf16 ? round_bf16(p) : p;
    }
  }
  if constexpr (bf16) {
    if (shared) {
#pragma omp simd
      for (int64_t d = 0; d < D; ++d) out[d] = bf16_bits(round_bf16(acc[d]) + round_bf16(st * value(shared[d])));
    } else {
#pragma omp simd
      for (int64_t d = 0; d < D; ++d) out[d] = bf16_bits(acc[d]);
    }
  } else {
#pragma omp simd
    for (int64_t d = 0; d < D; ++d) out[d] = shared ? acc[d] + st * shared[d] : acc[d];
  }
}

// m rows of one expert (a [m, D], rows D apart; m <= BM) through its packed gate and up blocks
// gate [2 NI, D, BN] (act(gate) * up into H, rows NI BN apart) and down [ND, I, BN], output row r
// to out_row(r). G, U [BM, BN] and C are the thread's scratch.
template <typename E, typename Row>
void expert_rows(const E* a, int64_t m, int64_t D, const E* gate, int64_t NI, const E* down, int64_t ND, int64_t I,
                 E* H, float* G, float* U, float* C, Row out_row) {
  const int64_t ld = NI * BN;
  const float* wide = widened(a, D, m, D);
  for (int64_t b = 0; b < NI; ++b) {  // h = act(gate) * up
    micro(m, D, a, D, gate + b * D * BN, G, BN, wide);
    micro(m, D, a, D, gate + (NI + b) * D * BN, U, BN, wide);
    for (int64_t r = 0; r < m; ++r) gated(G + r * BN, U + r * BN, &H[r * ld + b * BN]);
  }
  row_block(H, ld, m, I, down, ND, D, nullptr, C, out_row);
}

// Tokens per work item of moe()'s prefill path: the block's expert outputs (TB k rows), its
// shared expert's (TB rows) and its rows of x stay in L2 from the products to the combine.
constexpr int64_t TB = 128;

// moe_bf16 and moe_f32 (E: their dtype; their comment below): each (token, choice) row to its
// expert, then each token's choices combined. At decode sizes a work item is (expert, block of up
// to BM of its rows) over the whole batch, the combine a pass of its own; from 2 TB tokens a
// thread, a work item is a block of TB tokens run whole (its rows by expert, the shared expert,
// the combine), so no expert output leaves the cache. Each output row is the same micro-kernel
// sums and roundings either way: the same bits.
template <typename E>
at::Tensor moe(const at::Tensor& x, const at::Tensor& idx, const at::Tensor& weight, const at::Tensor& gate_up,
               const at::Tensor& down, const std::string& act, const at::Tensor& shared_gu,
               const at::Tensor& shared_dn, const at::Tensor& scale, const char* name) {
  using O = std::conditional_t<std::is_same_v<E, BFloat16>, uint16_t, float>;  // outputs as out_rows holds them
  const auto dtype = c10::CppTypeToScalarType<E>::value;
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == dtype && x.is_contiguous(), name, ": contiguous x [T, D] in ", dtype);
  TORCH_CHECK(act == "silu", name, ": act must be silu");
  const int64_t T = x.size(0), D = x.size(1), k = idx.size(1), E_ = gate_up.size(0);
  const int64_t ND = down.size(1);
  TORCH_CHECK(idx.size(0) == T && weight.sizes() == idx.sizes() && weight.scalar_type() == dtype,
              name, ": idx, weight [T, k]");
  TORCH_CHECK(gate_up.scalar_type() == dtype && gate_up.size(3) == D && ND * BN >= D && down.size(0) == E_,
              name, ": packed experts");
  const bool shared = shared_gu.numel() > 0;
  TORCH_CHECK(!shared || (shared_gu.size(0) == 1 && shared_gu.size(3) == D && shared_dn.size(0) == 1 &&
                          shared_dn.size(1) == ND), name, ": packed shared expert");
  TORCH_CHECK(!scale.numel() || (shared && scale.numel() == T && scale.scalar_type() == dtype && scale.is_contiguous()),
              name, ": scale [T], contiguous, in x's dtype, with a shared expert");
  auto id = idx.to(at::kLong).contiguous();
  auto w = weight.to(at::kFloat).contiguous();
  const int64_t* ip = id.data_ptr<int64_t>();
  for (int64_t f = 0; f < T * k; ++f) TORCH_CHECK(ip[f] >= 0 && ip[f] < E_, name, ": expert id out of range");
  const int64_t threads = at::get_num_threads();
  const bool blocks = T >= 2 * TB * threads;
  // rows of each expert in (token, choice) order: rows[start[e] ..] of tokens [t0, t1)
  auto by_expert = [&](int64_t t0, int64_t t1, int64_t* start, int64_t* rows) {
    std::fill(start, start + E_ + 1, 0);
    for (int64_t f = t0 * k; f < t1 * k; ++f) ++start[ip[f] + 1];
    for (int64_t e = 0; e < E_; ++e) start[e + 1] += start[e];
    for (int64_t f = t0 * k; f < t1 * k; ++f) rows[start[ip[f]]++] = f;
    for (int64_t e = E_; e > 0; --e) start[e] = start[e - 1];
    start[0] = 0;
  };
  // decode sizes: a work item is (expert, first row in `rows` or token for E_, rows), expert E_
  // the shared one (its rows the tokens); prefill: (first token of a block of TB)
  std::vector<int64_t> start(blocks ? 0 : E_ + 1), rows(blocks ? 0 : T * k);
  std::vector<std::array<int64_t, 3>> items;
  if (blocks) {
    for (int64_t t = 0; t < T; t += TB) items.push_back({-1, t, std::min(TB, T - t)});
  } else {
    by_expert(0, T, start.data(), rows.data());
    if (shared) {  // first: the shared expert's items are the largest, and threads take items in order
      // with fewer than BM tokens a thread (decode), the shared rows are split between the threads:
      // as one item, one thread ran the shared expert while the other ran every routed one
      const int64_t sb = T >= BM * threads ? BM : (T + threads - 1) / threads;
      for (int64_t r = 0; r < T; r += sb) items.push_back({E_, r, std::min(sb, T - r)});
    }
    for (int64_t e = 0; e < E_; ++e)
      for (int64_t r = start[e]; r < start[e + 1]; r += BM) items.push_back({e, r, std::min(BM, start[e + 1] - r)});
  }
  auto y = at::empty({blocks ? 0 : T * k, D}, x.options());  // expert output of each (token, choice)
  auto sy = shared && !blocks ? at::empty({T, D}, x.options()) : at::Tensor();  // the shared expert's, per token
  auto out = at::empty({T, D}, x.options());
  const E* X = x.data_ptr<E>();
  O *Y = out_rows(y, E()), *S = sy.defined() ? out_rows(sy, E()) : nullptr, *OUT = out_rows(out, E());
  const float* wp = w.data_ptr<float>();
  const E* sp = scale.numel() ? scale.data_ptr<E>() : nullptr;
  const int64_t IP = std::max(gate_up.size(2), shared ? shared_gu.size(2) : 0) * BN;  // widest I, whole blocks
  // items differ in cost (rows, expert widths): each thread takes the next one not taken
  std::atomic<int64_t> next{0};
  const int64_t n_items = static_cast<int64_t>(items.size());
  at::parallel_for(0, std::min<int64_t>(threads, n_items), 1, [&](int64_t, int64_t) {
    FlushDenormals flush;
    // this thread's buffers, kept from call to call (a decode step's call is ~0.2 ms: filling
    // fresh ones with zeros each time was a few percent of it)
    thread_local std::vector<E> A, H;
    thread_local std::vector<float> C;
    thread_local std::vector<O> YB, SB;  // a token block's expert and shared outputs
    A.resize(BM * D);
    H.resize(BM * IP);
    C.resize(std::min(GB, ND) * BM * BN);
    YB.resize(blocks ? TB * k * D : 0);
    SB.resize(blocks && shared ? TB * D : 0);
    alignas(64) float G[BM * BN], U[BM * BN];
    std::vector<int64_t> bstart(blocks ? E_ + 1 : 0), brows(blocks ? TB * k : 0);
    std::vector<float> acc(blocks ? D : 0);
    // rows rws[0 .. m) (token, choice) of routed expert e, or tokens r0 .. r0 + m of the shared one
    auto run = [&](int64_t e, const int64_t* rws, int64_t r0, int64_t m, auto out_row) {
      const bool own = e == E_;
      const at::Tensor& gu = own ? shared_gu : gate_up;
      const at::Tensor& dn = own ? shared_dn : down;
      const E* a = X + r0 * D;
      if (!own) {
        for (int64_t r = 0; r < m; ++r) std::memcpy(&A[r * D], X + rws[r] / k * D, D * sizeof(E));
        a = A.data();
      }
      expert_rows(a, m, D, gu.data_ptr<E>() + (own ? 0 : e) * 2 * gu.size(2) * D * BN, gu.size(2),
                  dn.data_ptr<E>() + (own ? 0 : e) * ND * dn.size(2) * BN, ND, dn.size(2), H.data(), G, U, C.data(),
                  out_row);
    };
    for (int64_t it; (it = next.fetch_add(1, std::memory_order_relaxed)) < n_items;) {
      const auto [e, r0, m] = items[it];
      if (!blocks) {
        if (e == E_)
          run(e, nullptr, r0, m, [&](int64_t r) { return S + (r0 + r) * D; });
        else
          run(e, &rows[r0], 0, m, [&](int64_t r) { return Y + rows[r0 + r] * D; });
        continue;
      }
      by_expert(r0, r0 + m, bstart.data(), brows.data());
      for (int64_t ex = 0; ex < E_; ++ex)
        for (int64_t b = bstart[ex]; b < bstart[ex + 1]; b += BM)
          run(ex, &brows[b], 0, std::min(BM, bstart[ex + 1] - b),
              [&](int64_t r) { return YB.data() + (brows[b + r] - r0 * k) * D; });
      if (shared)
        for (int64_t t = r0; t < r0 + m; t += BM)
          run(E_, nullptr, t, std::min(BM, r0 + m - t), [&](int64_t r) { return SB.data() + (t - r0 + r) * D; });
      for (int64_t t = r0; t < r0 + m; ++t)
        combine_row(YB.data() + (t - r0) * k * D, wp + t * k, k, shared ? SB.data() + (t - r0) * D : nullptr,
                    sp ? as_float(sp[t]) : 1.f, D, acc.data(), OUT + t * D);
    }
    release();
  });
  if (!blocks)
    at::parallel_for(0, T, 16, [&](int64_t begin, int64_t end) {
      std::vector<float> acc(D);
      for (int64_t t = begin; t < end; ++t)
        combine_row(Y + t * k * D, wp + t * k, k, shared ? S + t * D : nullptr, sp ? as_float(sp[t]) : 1.f, D,
                    acc.data(), OUT + t * D);
    });
  return out;
}

}  // namespace

// x [T, D] bf16 contiguous; idx [T, k] int64 experts; weight [T, k] bf16; gate_up, down packed by
// pack_experts_bf16; act "silu"; shared_gu, shared_dn: a shared expert every token runs (packed
// by pack_experts_bf16 as one expert; empty: none), scale [T] bf16 its gate (empty: 1). Returns
// [T, D] bf16. Per block of one expert's rows: gate and up (each rounded to bf16), act(gate)
// rounded, times up rounded, then down rounded; each token's choices weighted and summed as
// moe_combine does; the shared expert's output times scale added as torch's bf16 mul and add.
at::Tensor moe_bf16(const at::Tensor& x, const at::Tensor& idx, const at::Tensor& weight, const at::Tensor& gate_up,
                    const at::Tensor& down, const std::string& act, const at::Tensor& shared_gu,
                    const at::Tensor& shared_dn, const at::Tensor& scale) {
  return moe<BFloat16>(x, idx, weight, gate_up, down, act, shared_gu, shared_dn, scale, "moe_bf16");
}

// The same in fp32 (packed by pack_experts_f32; weight and scale fp32), on the CPUs where
// linear_f32 runs: every product an fp32 sum over its inputs in order (not MKL's order: within
// fp32 rounding of the torch path), nothing rounded between the steps.
at::Tensor moe_f32(const at::Tensor& x, const at::Tensor& idx, const at::Tensor& weight, const at::Tensor& gate_up,
                   const at::Tensor& down, const std::string& act, const at::Tensor& shared_gu,
                   const at::Tensor& shared_dn, const at::Tensor& scale) {
  TORCH_CHECK(gemm_f32_supported(), "moe_f32: not built for this CPU");
  return moe<float>(x, idx, weight, gate_up, down, act, shared_gu, shared_dn, scale, "moe_f32");
}

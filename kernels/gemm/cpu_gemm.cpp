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
// `linear_bf16`: x [M, K] @ w^T (+ bias) -> [M, N] bf16. Work items are (row block, column block)
// pairs, column blocks fastest, so a thread keeps its row block in cache.
//
// `moe_bf16`: the mixture of experts of models/layers/mlp.py run_experts for gated experts
// without biases: each (token, choice) row goes to its expert; per block of one expert's rows,
// gate and up (each rounded to bf16), act(gate) rounded, times up rounded, then down rounded;
// then each token's choices weighted and summed as moe_combine does. No padding, no copies of
// the expert weights, one call per layer.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <ATen/native/CPUBlas.h>

#include "../denormal.h"
#include "../widen.h"

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

using at::BFloat16;
namespace cpublas = at::native::cpublas;

constexpr int64_t BN = 32;  // columns per packed block
constexpr int64_t BM = 64;  // rows per micro-kernel call

// Pack w [N, K] (rows may be strided) into blocks [NB, K, BN] in place at out.
void pack_into(const BFloat16* w, int64_t ldw, int64_t N, int64_t K, BFloat16* out) {
  const int64_t NB = (N + BN - 1) / BN;
  std::vector<BFloat16> block(K * BN);
  for (int64_t b = 0; b < NB; ++b) {
    for (int64_t k = 0; k < K; ++k)  // [K, BN] row-major: column n of the block is weight row b * BN + n
      for (int64_t n = 0; n < BN; ++n)
        block[k * BN + n] = b * BN + n < N ? w[(b * BN + n) * ldw + k] : BFloat16(0.f);
    cpublas::pack(K, BN, BN, BN, at::kBFloat16, at::kBFloat16, block.data(), out + b * K * BN);
  }
}

// C [m, BN] fp32 -> out rows (ld) bf16, the first n columns, plus bias (fp32) if given.
void store(const float* C, int64_t m, int64_t n, const float* bias, uint16_t* out, int64_t ld) {
  for (int64_t r = 0; r < m; ++r) {
    const float* c = C + r * BN;
    uint16_t* o = out + r * ld;
    if (bias) {
#pragma omp simd
      for (int64_t j = 0; j < n; ++j) o[j] = bf16_bits(c[j] + bias[j]);
    } else {
#pragma omp simd
      for (int64_t j = 0; j < n; ++j) o[j] = bf16_bits(c[j]);
    }
  }
}

}  // namespace

// Whether this CPU runs the bf16 micro-kernels (AMX); elsewhere callers keep torch's matmul.
bool gemm_bf16_supported() { return cpublas::could_pack(at::kBFloat16); }

// w [N, K] bf16 (K even) -> packed [ceil(N / BN), K, BN] bf16.
at::Tensor pack_bf16(const at::Tensor& w) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kBFloat16 && w.stride(1) == 1, "pack_bf16: bf16 w [N, K]");
  TORCH_CHECK(w.size(1) % 2 == 0, "pack_bf16: K must be even (VNNI pairs)");
  const int64_t N = w.size(0), K = w.size(1);
  auto out = at::empty({(N + BN - 1) / BN, K, BN}, w.options());
  pack_into(w.data_ptr<BFloat16>(), w.stride(0), N, K, out.data_ptr<BFloat16>());
  return out;
}

// x [M, K] bf16 contiguous, packed from pack_bf16 of a [N, K] weight, bias [N] fp32 or empty.
at::Tensor linear_bf16(const at::Tensor& x, const at::Tensor& packed, int64_t N, const at::Tensor& bias) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.is_contiguous(), "linear_bf16: contiguous bf16 x [M, K]");
  const int64_t M = x.size(0), K = x.size(1), NB = packed.size(0);
  TORCH_CHECK(packed.dim() == 3 && packed.size(1) == K && packed.size(2) == BN && NB * BN >= N, "linear_bf16: packed weight");
  TORCH_CHECK(!bias.numel() || (bias.scalar_type() == at::kFloat && bias.numel() == N), "linear_bf16: bias [N] fp32");
  auto out = at::empty({M, N}, x.options());
  if (!M) return out;
  const BFloat16* X = x.data_ptr<BFloat16>();
  const BFloat16* W = packed.data_ptr<BFloat16>();
  const float* b = bias.numel() ? bias.data_ptr<float>() : nullptr;
  auto* O = reinterpret_cast<uint16_t*>(out.data_ptr<BFloat16>());
  const int64_t MB = (M + BM - 1) / BM;
  at::parallel_for(0, MB * NB, 1, [&](int64_t begin, int64_t end) {
    FlushDenormals flush;
    alignas(64) float C[BM * BN];
    for (int64_t i = begin; i < end; ++i) {
      const int64_t m0 = i / NB * BM, n0 = i % NB * BN, m = std::min(BM, M - m0);
      cpublas::brgemm(m, BN, K, K, BN, BN, false, X + m0 * K, W + i % NB * K * BN, C);
      store(C, m, std::min(BN, N - n0), b ? b + n0 : nullptr, O + m0 * N + n0, N);
    }
    cpublas::brgemm_release();
  });
  return out;
}

// gate_up [E, 2 * I, D] bf16 (gate rows, then up rows, per expert; rows may be strided) ->
// packed [E, 2, NI, D, BN] (gate blocks, then up blocks); down [E, D, I] -> [E, ND, I, BN].
std::tuple<at::Tensor, at::Tensor> pack_experts_bf16(const at::Tensor& gate_up, const at::Tensor& down) {
  TORCH_CHECK(gate_up.dim() == 3 && down.dim() == 3 && gate_up.scalar_type() == at::kBFloat16 &&
                  down.scalar_type() == at::kBFloat16 && gate_up.stride(2) == 1 && down.stride(2) == 1,
              "pack_experts_bf16: bf16 gate_up [E, 2I, D], down [E, D, I]");
  const int64_t E = gate_up.size(0), I = gate_up.size(1) / 2, D = gate_up.size(2);
  TORCH_CHECK(down.size(0) == E && down.size(1) == D && down.size(2) == I && D % 2 == 0 && I % 2 == 0,
              "pack_experts_bf16: shapes (even D and I)");
  const int64_t NI = (I + BN - 1) / BN, ND = (D + BN - 1) / BN;
  auto gu = at::empty({E, 2, NI, D, BN}, gate_up.options());
  auto dn = at::empty({E, ND, I, BN}, down.options());
  for (int64_t e = 0; e < E; ++e) {
    const BFloat16* g = gate_up[e].data_ptr<BFloat16>();
    const int64_t ld = gate_up.stride(1);
    pack_into(g, ld, I, D, gu[e][0].data_ptr<BFloat16>());
    pack_into(g + I * ld, ld, I, D, gu[e][1].data_ptr<BFloat16>());
    pack_into(down[e].data_ptr<BFloat16>(), down.stride(1), D, I, dn[e].data_ptr<BFloat16>());
  }
  return {gu, dn};
}

// x [T, D] bf16 contiguous; idx [T, k] int64 experts; weight [T, k] bf16; gate_up, down packed by
// pack_experts_bf16; act "silu". Returns [T, D] bf16.
at::Tensor moe_bf16(const at::Tensor& x, const at::Tensor& idx, const at::Tensor& weight, const at::Tensor& gate_up,
                    const at::Tensor& down, const std::string& act, const at::Tensor& scale, const at::Tensor& extra) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.is_contiguous(), "moe_bf16: contiguous bf16 x [T, D]");
  TORCH_CHECK(act == "silu", "moe_bf16: act must be silu");
  const int64_t T = x.size(0), D = x.size(1), k = idx.size(1), E = gate_up.size(0), NI = gate_up.size(2);
  const int64_t ND = down.size(1), I = down.size(2), IP = NI * BN;  // IP: I padded to whole blocks
  TORCH_CHECK(idx.size(0) == T && weight.sizes() == idx.sizes() && weight.scalar_type() == at::kBFloat16,
              "moe_bf16: idx, weight [T, k]");
  TORCH_CHECK(gate_up.size(3) == D && ND * BN >= D && down.size(0) == E, "moe_bf16: packed experts");
  const bool plus = extra.numel() > 0;
  TORCH_CHECK(!plus || (extra.sizes() == x.sizes() && extra.scalar_type() == at::kBFloat16 && extra.is_contiguous() &&
                        scale.numel() == T && scale.scalar_type() == at::kBFloat16 && scale.is_contiguous()),
              "moe_bf16: scale [T] and extra [T, D] bf16, contiguous");
  auto id = idx.to(at::kLong).contiguous();
  auto w = weight.contiguous();
  const int64_t* ip = id.data_ptr<int64_t>();
  // rows of each expert in (token, choice) order; a work item is (expert, block of BM of its rows)
  std::vector<int64_t> start(E + 1, 0), rows(T * k);
  for (int64_t f = 0; f < T * k; ++f) {
    TORCH_CHECK(ip[f] >= 0 && ip[f] < E, "moe_bf16: expert id out of range");
    ++start[ip[f] + 1];
  }
  for (int64_t e = 0; e < E; ++e) start[e + 1] += start[e];
  std::vector<int64_t> fill(start.begin(), start.end() - 1);
  for (int64_t f = 0; f < T * k; ++f) rows[fill[ip[f]]++] = f;
  std::vector<std::pair<int64_t, int64_t>> items;  // (expert, first row in `rows`)
  for (int64_t e = 0; e < E; ++e)
    for (int64_t r = start[e]; r < start[e + 1]; r += BM) items.emplace_back(e, r);

  auto y = at::empty({T * k, D}, x.options());  // expert output of each (token, choice)
  const BFloat16* X = x.data_ptr<BFloat16>();
  const BFloat16* GU = gate_up.data_ptr<BFloat16>();
  const BFloat16* DN = down.data_ptr<BFloat16>();
  auto* Y = reinterpret_cast<uint16_t*>(y.data_ptr<BFloat16>());
  at::parallel_for(0, static_cast<int64_t>(items.size()), 1, [&](int64_t begin, int64_t end) {
    FlushDenormals flush;
    std::vector<BFloat16> A(BM * D), H(BM * IP);
    alignas(64) float G[BM * BN], U[BM * BN];
    for (int64_t it = begin; it < end; ++it) {
      const auto [e, r0] = items[it];
      const int64_t m = std::min(BM, start[e + 1] - r0);
      for (int64_t r = 0; r < m; ++r) std::memcpy(&A[r * D], X + rows[r0 + r] / k * D, D * sizeof(BFloat16));
      const BFloat16* gate = GU + e * 2 * NI * D * BN;
      for (int64_t b = 0; b < NI; ++b) {  // h = act(gate) * up, each step rounded as torch rounds it
        cpublas::brgemm(m, BN, D, D, BN, BN, false, A.data(), gate + b * D * BN, G);
        cpublas::brgemm(m, BN, D, D, BN, BN, false, A.data(), gate + (NI + b) * D * BN, U);
        for (int64_t r = 0; r < m; ++r) {
          auto* h = reinterpret_cast<uint16_t*>(&H[r * IP + b * BN]);
#pragma omp simd
          for (int64_t j = 0; j < BN; ++j) {
            const float g = round_bf16(G[r * BN + j]);
            h[j] = bf16_bits(round_bf16(g / (1.f + std::exp(-g))) * round_bf16(U[r * BN + j]));
          }
        }
      }
      const BFloat16* dn = DN + e * ND * I * BN;
      for (int64_t b = 0; b < ND; ++b) {
        cpublas::brgemm(m, BN, I, IP, BN, BN, false, H.data(), dn + b * I * BN, G);
        const int64_t n = std::min(BN, D - b * BN);
        for (int64_t r = 0; r < m; ++r) store(G + r * BN, 1, n, nullptr, Y + rows[r0 + r] * D + b * BN, D);
      }
    }
    cpublas::brgemm_release();
  });
  // each token's choices: the product rounded, then summed in order (moe_combine's roundings);
  // with `extra`, the sum rounded plus scale * extra rounded (torch's bf16 mul and add)
  auto out = at::empty({T, D}, x.options());
  const BFloat16* wp = w.data_ptr<BFloat16>();
  const BFloat16* sp = plus ? scale.data_ptr<BFloat16>() : nullptr;
  const auto* xp = plus ? reinterpret_cast<const uint16_t*>(extra.data_ptr<BFloat16>()) : nullptr;
  auto* O = reinterpret_cast<uint16_t*>(out.data_ptr<BFloat16>());
  at::parallel_for(0, T, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> acc(D);
    for (int64_t t = begin; t < end; ++t) {
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t c = 0; c < k; ++c) {
        const uint16_t* row = Y + (t * k + c) * D;
        const float wc = as_float(wp[t * k + c]);
#pragma omp simd
        for (int64_t d = 0; d < D; ++d)
          acc[d] += round_bf16(std::bit_cast<float>(static_cast<uint32_t>(row[d]) << 16) * wc);
      }
      if (plus) {
        const float st = as_float(sp[t]);
        const uint16_t* e = xp + t * D;
#pragma omp simd
        for (int64_t d = 0; d < D; ++d)
          O[t * D + d] = bf16_bits(round_bf16(acc[d]) + round_bf16(st * std::bit_cast<float>(static_cast<uint32_t>(e[d]) << 16)));
      } else {
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) O[t * D + d] = bf16_bits(acc[d]);
      }
    }
  });
  return out;
}

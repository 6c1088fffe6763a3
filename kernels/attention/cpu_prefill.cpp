// Causal attention of packed query blocks over their sequences' paged KV (prefill, with or
// without a cached prefix), built and called by kernels/native.py; the contract of
// kernels/attention/torch.py's paged_attention. One job per (sequence, KV head, block of QB
// queries): the R query heads of the KV head are stacked into one [R * QB, Dk] block, key
// blocks are read from the pages into fp32 rows and the block's softmax runs online (running
// max and sum per row, the accumulator rescaled), so no [queries, keys] score matrix is kept.
// The score and value products go through mm (matmul.h). fp32 throughout; o is fp32. bf16
// queries and caches on CPUs with bf16 micro-kernels (AMX, or AVX-512 BF16) run prefill_packed
// instead: bf16 products over key blocks packed once.
// Pages cached before the queries of every sequence and shared by all of them (shared_pages.h)
// run first, for the whole batch at once (prefill_shared): there every query sees every key.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <ATen/native/CPUBlas.h>

#include "../denormal.h"
#include "../reduce.h"
#include "../widen.h"
#include "packed.h"
#include "shared_pages.h"

#include <algorithm>
#include <map>
#include <array>
#include <bit>
#include <cmath>
#include <cstdint>
#include <numeric>
#include <utility>
#include <vector>

#include "../gemm/dot.h"
#include "../matmul.h"

namespace {

constexpr int64_t QB = 64, KB = 256;  // queries per job block, keys per step
constexpr int64_t SQ = 256;           // query rows per job over the shared pages


struct Job {
  int64_t n, g, q0, rows;  // sequence, KV head, first query of the block (in its sequence), queries
  double cost;
};

// (sequence, KV head, block of QB queries) jobs, the most work first
std::vector<Job> make_jobs(const std::vector<int64_t>& cu, const std::vector<int64_t>& lens, int64_t Hkv) {
  std::vector<Job> jobs;
  for (int64_t n = 0; n < static_cast<int64_t>(lens.size()); ++n)
    for (int64_t q0 = 0; q0 < cu[n + 1] - cu[n]; q0 += QB) {
      const int64_t rows = std::min(QB, cu[n + 1] - cu[n] - q0);
      const int64_t keys = lens[n] - (cu[n + 1] - cu[n]) + q0 + rows;  // keys of its last query
      for (int64_t g = 0; g < Hkv; ++g) jobs.push_back({n, g, q0, rows, double(rows) * double(keys)});
    }
  std::stable_sort(jobs.begin(), jobs.end(), [](const Job& a, const Job& b) { return a.cost > b.cost; });
  return jobs;
}

// The queries and paged caches of one call: sizes, and the address of a query row or of the key
// or value row of a sequence's position, read in place from its page.
template <typename T>
struct Paged {
  int64_t H, Dk, Hkv, R, page_size, width, k_page, k_row, k_head, v_page, v_row, v_head;
  const T *qp, *kp, *vp;
  const int64_t* pp;
  Paged(const at::Tensor& q, const at::Tensor& kc, const at::Tensor& vc, const at::Tensor& pages)
      : H(q.size(1)), Dk(q.size(2)), Hkv(kc.size(2)), R(H / Hkv), page_size(kc.size(1)), width(pages.size(1)),
        k_page(kc.stride(0)), k_row(kc.stride(1)), k_head(kc.stride(2)), v_page(vc.stride(0)),
        v_row(vc.stride(1)), v_head(vc.stride(2)), qp(q.data_ptr<T>()), kp(kc.data_ptr<T>()),
        vp(vc.data_ptr<T>()), pp(pages.data_ptr<int64_t>()) {}
  const T* query(int64_t token, int64_t head) const { return qp + (token * H + head) * Dk; }
  const T* key(int64_t n, int64_t g, int64_t at) const {
    return kp + pp[n * width + at / page_size] * k_page + at % page_size * k_row + g * k_head;
  }
  const T* value(int64_t n, int64_t g, int64_t at) const {
    return vp + pp[n * width + at / page_size] * v_page + at % page_size * v_row + g * v_head;
  }
};

// A job's key positions (pos[i]: query i's) and its M rows' online softmax: fresh, or where the
// shared pages ran first (ms, ls: running max and sum per (token, head); the accumulators in o),
// carried on from there.
void start_job(const Job& job, const std::vector<int64_t>& cu, const std::vector<int64_t>& lens, int64_t M,
               int64_t R, int64_t H, int64_t Dv, const float* ms, const float* ls, const float* op, int64_t* pos,
               float* acc, float* m, float* l) {
  const int64_t first = lens[job.n] - (cu[job.n + 1] - cu[job.n]) + job.q0;  // cached keys before the block
  for (int64_t i = 0; i < job.rows; ++i) pos[i] = first + i;
  if (!ms) {
    std::fill(acc, acc + M * Dv, 0.f);
    std::fill(m, m + M, -1e30f);  // finite: built with -ffast-math
    std::fill(l, l + M, 0.f);
    return;
  }
  for (int64_t r = 0; r < R; ++r)  // row r * rows + i: query i of head g * R + r
    for (int64_t i = 0; i < job.rows; ++i) {
      const int64_t at = (cu[job.n] + job.q0 + i) * H + job.g * R + r, row = r * job.rows + i;
      m[row] = ms[at];
      l[row] = ls[at];
      std::copy(op + at * Dv, op + (at + 1) * Dv, acc + row * Dv);
    }
}

// The online softmax of M query rows (row r * rows + i: query i, at key position pos[i]) over
// the kb keys k0 .. k0 + kb - 1 whose scores are in S (rows of ld): running max m and sum l per
// row, the accumulator rows (Dv each) rescaled; S becomes the numerators, 0 for keys a query
// does not see.
void softmax_rows(float* S, int64_t ld, int64_t M, int64_t rows, const int64_t* pos, int64_t k0, int64_t kb,
                  float* m, float* l, float* acc, int64_t Dv) {
  for (int64_t row = 0; row < M; ++row) {
    const int64_t seen = std::max<int64_t>(0, std::min(kb, pos[row % rows] + 1 - k0));
    float* s = S + row * ld;
    online_softmax_row(s, seen, m[row], l[row], acc + row * Dv, Dv);
    std::fill(s + seen, s + kb, 0.f);  // keys after the query: masked
  }
}

// o rows of query i, head r: acc / l, into out + i * ld + r * Dv
void finish(const float* acc, const float* l, int64_t R, int64_t rows, int64_t Dv, float* out, int64_t ld) {
  for (int64_t r = 0; r < R; ++r)
    for (int64_t i = 0; i < rows; ++i) {
      const float inv = 1.f / l[r * rows + i];
      const float* a = acc + (r * rows + i) * Dv;
      float* dst = out + i * ld + r * Dv;
#pragma omp simd
      for (int64_t d = 0; d < Dv; ++d) dst[d] = a[d] * inv;
    }
}

// The key rows k0 .. k0 + kb - 1 of sequence n, KV head g, from their pages as fp32 rows
template <typename T>
void widen_keys(const Paged<T>& P, int64_t n, int64_t g, int64_t k0, int64_t kb, int64_t Dv, float* K, float* V) {
  for (int64_t t = 0; t < kb; ++t) {
    const T* ks = P.key(n, g, k0 + t);
    const T* vs = P.value(n, g, k0 + t);
    for (int64_t d = 0; d < P.Dk; ++d) K[t * P.Dk + d] = as_float(ks[d]);
    for (int64_t d = 0; d < Dv; ++d) V[t * Dv + d] = as_float(vs[d]);
  }
}

inline int64_t shared_tokens(int64_t R) { return std::max<int64_t>(1, SQ / R); }  // per prefill_shared job
// prefill_shared's jobs: (KV head, block of shared_tokens query tokens)
inline int64_t shared_jobs(int64_t T_, int64_t Hkv, int64_t R) {
  return Hkv * ((T_ + shared_tokens(R) - 1) / shared_tokens(R));
}

// The first `shared` keys (whole pages every sequence shares, before any of its queries) for
// every query: one job per (KV head, block of SQ query rows of the whole batch), each key block
// widened once for the block and multiplied with all its rows (no mask: every query sees these
// keys). Leaves each (token, head)'s running max and sum in ms, ls and its accumulator in o.
template <typename T>
void prefill_shared(const Paged<T>& P, int64_t T_, int64_t shared, float scale, int64_t Dv, float* ms, float* ls,
                    float* op, float* Q, float* K, float* V, float* S, float* acc, float* m, float* l) {
  const int64_t H = P.H, Dk = P.Dk, R = P.R, tokens = shared_tokens(R);
#pragma omp for schedule(dynamic, 1)
  for (int64_t job = 0; job < shared_jobs(T_, P.Hkv, R); ++job) {
    const int64_t g = job % P.Hkv, t0 = job / P.Hkv * tokens, t1 = std::min(T_, t0 + tokens), M = (t1 - t0) * R;
    for (int64_t t = t0; t < t1; ++t) {  // row (t - t0) * R + r: token t, head g * R + r
      const T* src = P.query(t, g * R);
      float* dst = Q + (t - t0) * R * Dk;
      for (int64_t d = 0; d < R * Dk; ++d) dst[d] = as_float(src[d]) * scale;
    }
    std::fill(acc, acc + M * Dv, 0.f);
    std::fill(m, m + M, -1e30f);
    std::fill(l, l + M, 0.f);
    for (int64_t k0 = 0; k0 < shared; k0 += KB) {
      const int64_t kb = std::min(KB, shared - k0);
      widen_keys(P, 0, g, k0, kb, Dv, K, V);  // the pages are sequence 0's as much as any other's
      mm(false, true, M, kb, Dk, 1.f, Q, Dk, K, Dk, 0.f, S, KB);
      for (int64_t row = 0; row < M; ++row) online_softmax_row(S + row * KB, kb, m[row], l[row], acc + row * Dv, Dv);
      mm(false, false, M, Dv, kb, 1.f, S, KB, V, Dv, 1.f, acc, Dv);
    }
    for (int64_t t = t0; t < t1; ++t)
      for (int64_t r = 0; r < R; ++r) {
        const int64_t row = (t - t0) * R + r, at = t * H + g * R + r;
        ms[at] = m[row];
        ls[at] = l[row];
        std::copy(acc + row * Dv, acc + (row + 1) * Dv, op + at * Dv);
      }
  }
}

template <typename T>
void prefill(const at::Tensor& q, const at::Tensor& kc, const at::Tensor& vc, const at::Tensor& pages,
             const std::vector<int64_t>& cu, const std::vector<int64_t>& lens, float scale, int64_t Dv, float* op) {
  const Paged<T> P(q, kc, vc, pages);
  const int64_t H = P.H, Dk = P.Dk, Hkv = P.Hkv, R = P.R, N = static_cast<int64_t>(lens.size()), T_ = cu[N];
  std::vector<int64_t> cached(N);  // keys before each sequence's first query
  for (int64_t n = 0; n < N; ++n) cached[n] = lens[n] - (cu[n + 1] - cu[n]);
  const int64_t shared = shared_pages(P.pp, P.width, cached.data(), N, P.page_size) * P.page_size;
  std::vector<float> ms(shared ? T_ * H : 0), ls(ms.size());  // the shared keys' softmax state per (token, head)
  const std::vector<Job> jobs = make_jobs(cu, lens, Hkv);
  const int64_t J = static_cast<int64_t>(jobs.size()), J1 = shared ? shared_jobs(T_, Hkv, R) : 0;
  const int64_t threads = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), std::max(J, J1)));
#pragma omp parallel num_threads(threads)
  {
    FlushDenormals flush;
    const int64_t rows_max = std::max(R * QB, shared_tokens(R) * R);
    std::vector<float> Q(rows_max * Dk), K(KB * Dk), V(KB * Dv), S(rows_max * KB), acc(rows_max * Dv), m(rows_max),
        l(rows_max);
    std::vector<int64_t> pos(QB);
    if (shared)  // then the implicit barrier: every job below resumes from it
      prefill_shared(P, T_, shared, scale, Dv, ms.data(), ls.data(), op, Q.data(), K.data(), V.data(), S.data(),
                     acc.data(), m.data(), l.data());
#pragma omp for schedule(dynamic, 1)
    for (int64_t j = 0; j < J; ++j) {
      const Job& job = jobs[j];
      const int64_t rows = job.rows, M = R * rows;
      start_job(job, cu, lens, M, R, H, Dv, shared ? ms.data() : nullptr, ls.data(), op, pos.data(), acc.data(),
                m.data(), l.data());
      for (int64_t r = 0; r < R; ++r)  // row r * rows + i: query i of head g * R + r
        for (int64_t i = 0; i < rows; ++i) {
          const T* src = P.query(cu[job.n] + job.q0 + i, job.g * R + r);
          float* dst = Q.data() + (r * rows + i) * Dk;
          for (int64_t d = 0; d < Dk; ++d) dst[d] = as_float(src[d]) * scale;
        }
      const int64_t last = pos[rows - 1];
      for (int64_t k0 = shared; k0 <= last; k0 += KB) {
        const int64_t kb = std::min(KB, last + 1 - k0);
        widen_keys(P, job.n, job.g, k0, kb, Dv, K.data(), V.data());
        mm(false, true, M, kb, Dk, 1.f, Q.data(), Dk, K.data(), Dk, 0.f, S.data(), KB);
        softmax_rows(S.data(), KB, M, rows, pos.data(), k0, kb, m.data(), l.data(), acc.data(), Dv);
        mm(false, false, M, Dv, kb, 1.f, S.data(), KB, V.data(), Dv, 1.f, acc.data(), Dv);
      }
      finish(acc.data(), l.data(), R, rows, Dv, op + ((cu[job.n] + job.q0) * H + job.g * R) * Dv, H * Dv);
    }
  }
}


constexpr int64_t AKB = 128, AM = 32;

// Whether bf16 prefill runs over packed key blocks on this CPU (prefill_packed), for dk and dv
bool packed_runs(int64_t dk, int64_t dv) {
  if (dk % 2 || dv % 2) return false;
#if defined(__AVX512BF16__)
  if (!onednn_bf16()) return dv % DOT_COLS == 0;
#endif
  return onednn_bf16();
}

// C [m, n] fp32 (rows ldc apart) = (add: C +) A [m, K] bf16 (rows lda apart) times the first n
// columns of B [K / 2, width, 2] (VNNI pairs): dot_mm, or oneDNN's micro-kernel (AMX), which is
// given the whole block (n = width and K its full depth; callers trim only for dot_mm, see trims())
void packed_mm(int64_t m, int64_t n, int64_t K, const c10::BFloat16* A, int64_t lda, const c10::BFloat16* B,
               int64_t width, float* C, int64_t ldc, bool add) {
#if defined(__AVX512BF16__)
  if (!onednn_bf16()) return dot_mm(m, n, K, A, lda, B, 2 * width, C, ldc, add);
#endif
  at::native::cpublas::brgemm(m, n, K, lda, width, ldc, add, A, B, C);
}

// The columns of a key block of kb keys that rows [m0, m1) of a job (row r * rows + i: query i,
// at key position pos[i]) see from key k0 on: the score product's columns (a multiple of 16) and
// the value product's depth (even). Past them a row's numerators are zeros, whose products add
// nothing: trimming them keeps every output's bits (dot_mm sums each column on its own, pair by
// pair in order). oneDNN's micro-kernels keep the whole block.
std::pair<int64_t, int64_t> trims(const int64_t* pos, int64_t rows, int64_t m0, int64_t m1, int64_t k0, int64_t kb) {
  if (onednn_bf16()) return {AKB, AKB};
  int64_t top = 0;  // the furthest query of the rows
  for (int64_t row = m0; row < m1; ++row) top = std::max(top, pos[row % rows]);
  const int64_t seen = std::clamp<int64_t>(top + 1 - k0, 0, kb);
  return {std::max<int64_t>(16, (seen + 15) / 16 * 16), std::max<int64_t>(2, (seen + 1) / 2 * 2)};
}

// bf16 over packed key blocks: first the keys and values of every (sequence, KV head) are laid
// out once per block of AKB keys, K^T and V each in VNNI pairs [K / 2, N, 2] (zero past the
// sequence's keys), one packed block for all the sequences whose block reads the same pages (a
// cached prefix shared by the batch is packed once, not once per sequence); then each job's
// scores and value products run on the packed blocks, queries AM rows per call, through oneDNN's
// micro-kernels (AMX) or dot_mm (gemm/dot.h: AVX-512 BF16), the softmax in fp32 as above and its
// numerators rounded to bf16 for the value product (as flash attention rounds them).
void prefill_packed(const at::Tensor& q, const at::Tensor& kc, const at::Tensor& vc, const at::Tensor& pages,
                 const std::vector<int64_t>& cu, const std::vector<int64_t>& lens, float scale, int64_t Dv, float* op) {
  using T = c10::BFloat16;
  namespace cpublas = at::native::cpublas;
  const Paged<T> P(q, kc, vc, pages);
  const int64_t H = P.H, Dk = P.Dk, Hkv = P.Hkv, R = P.R, N = static_cast<int64_t>(lens.size());
  // Blocks of AKB keys, each packed once: sequences that share a block's pages (a cached prefix)
  // and its key count share the packed block. slot[base[n * Hkv + g] + k0 / AKB] is its index.
  std::vector<int64_t> base(N * Hkv + 1, 0), slot;
  std::vector<std::array<int64_t, 3>> blocks;  // (n, g, first key) of each packed block
  std::map<std::vector<int64_t>, int64_t> seen;  // (g, keys, pages of the block) -> its index
  std::vector<int64_t> id;
  for (int64_t n = 0; n < N; ++n)
    for (int64_t g = 0; g < Hkv; ++g) {
      for (int64_t k0 = 0; k0 < lens[n]; k0 += AKB) {
        const int64_t cnt = std::min(AKB, lens[n] - k0);
        id.assign({g, cnt, k0 % P.page_size});
        for (int64_t p = k0 / P.page_size; p <= (k0 + cnt - 1) / P.page_size; ++p)
          id.push_back(P.pp[n * P.width + p]);
        const auto [it, fresh] = seen.try_emplace(id, static_cast<int64_t>(blocks.size()));
        if (fresh) blocks.push_back({n, g, k0});
        slot.push_back(it->second);
      }
      base[n * Hkv + g + 1] = static_cast<int64_t>(slot.size());
    }
  const int64_t B = static_cast<int64_t>(blocks.size());
  // The micro-kernels' B layout is [K / 2][N][2] (pairs along K): K^T's is the transpose of the key
  // rows in 32-bit units (a row's channel pairs), V's interleaves pairs of consecutive key rows.
  std::vector<uint32_t> kt(B * (Dk / 2) * AKB), vv(B * (AKB / 2) * Dv);
  at::parallel_for(0, B, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const auto [n, g, k0] = blocks[i];
      pack_block([&](int64_t t) { return P.key(n, g, k0 + t); }, [&](int64_t t) { return P.value(n, g, k0 + t); },
                 std::min(AKB, lens[n] - k0), AKB, Dk, Dv, kt.data() + i * (Dk / 2) * AKB,
                 vv.data() + i * (AKB / 2) * Dv);
    }
  });
  const std::vector<Job> jobs = make_jobs(cu, lens, Hkv);
  const int64_t J = static_cast<int64_t>(jobs.size());
  const int64_t threads = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), J));
#pragma omp parallel num_threads(threads)
  {
    FlushDenormals flush;
    std::vector<T> Q(R * QB * Dk), num(R * QB * AKB);
    std::vector<float> S(R * QB * AKB), acc(R * QB * Dv), m(R * QB), l(R * QB);
    std::vector<int64_t> pos(QB);
#pragma omp for schedule(dynamic, 1)
    for (int64_t j = 0; j < J; ++j) {
      const Job& job = jobs[j];
      const int64_t rows = job.rows, M = R * rows;
      start_job(job, cu, lens, M, R, H, Dv, nullptr, nullptr, op, pos.data(), acc.data(), m.data(), l.data());
      for (int64_t r = 0; r < R; ++r)  // row r * rows + i: query i of head g * R + r
        for (int64_t i = 0; i < rows; ++i) {
          const T* src = P.query(cu[job.n] + job.q0 + i, job.g * R + r);
          std::copy(src, src + Dk, Q.begin() + (r * rows + i) * Dk);
        }
      const int64_t last = pos[rows - 1], first = base[job.n * Hkv + job.g];
      for (int64_t k0 = 0; k0 <= last; k0 += AKB) {
        const int64_t kb = std::min(AKB, last + 1 - k0), blk = slot[first + k0 / AKB];
        const T* kblock = reinterpret_cast<const T*>(kt.data() + blk * (Dk / 2) * AKB);
        const T* vblock = reinterpret_cast<const T*>(vv.data() + blk * (AKB / 2) * Dv);
        for (int64_t m0 = 0; m0 < M; m0 += AM) {
          const int64_t am = std::min(AM, M - m0), cols = trims(pos.data(), rows, m0, m0 + am, k0, kb).first;
          packed_mm(am, cols, Dk, Q.data() + m0 * Dk, Dk, kblock, AKB, S.data() + m0 * AKB, AKB, false);
        }
        numerators_bf16(S.data(), num.data(), AKB, M, rows, pos.data(), k0, kb, scale, m.data(), l.data(), acc.data(),
                        Dv);
        for (int64_t m0 = 0; m0 < M; m0 += AM) {
          const int64_t am = std::min(AM, M - m0), depth = trims(pos.data(), rows, m0, m0 + am, k0, kb).second;
          packed_mm(am, Dv, depth, num.data() + m0 * AKB, AKB, vblock, Dv, acc.data() + m0 * Dv, Dv, true);
        }
      }
      finish(acc.data(), l.data(), R, rows, Dv, op + ((cu[job.n] + job.q0) * H + job.g * R) * Dv, H * Dv);
    }
    if (onednn_bf16()) cpublas::brgemm_release();
  }
}

}  // namespace

// Whether bf16 queries of dk channels and values of dv run prefill_packed on this CPU
bool paged_prefill_packed(int64_t dk, int64_t dv) { return packed_runs(dk, dv); }

// q [T, H, Dk] contiguous (fp32 or bf16); k_cache [P, page, Hkv, Dk] and v_cache [P, page, Hkv,
// >= dv] in q's dtype with contiguous last dims (v_cache may be k_cache itself: MLA latents);
// pages [N, width] int64; cu_seqlens [N+1] over the queries; seq_lens [N] keys per sequence
// (prefix + queries, the queries last). Query i of sequence n sees keys 0 .. seq_lens[n] -
// E_n + i. Returns o [T, H, dv] fp32.
at::Tensor paged_prefill(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                         const at::Tensor& pages, const at::Tensor& cu_seqlens, const at::Tensor& seq_lens,
                         double scale, int64_t dv) {
  TORCH_CHECK(q.dim() == 3 && q.is_contiguous(), "paged_prefill: contiguous q [T, H, Dk]");
  TORCH_CHECK(k_cache.scalar_type() == q.scalar_type() && v_cache.scalar_type() == q.scalar_type(),
              "paged_prefill: q, k_cache and v_cache of one dtype");
  TORCH_CHECK(k_cache.stride(3) == 1 && v_cache.stride(3) == 1, "paged_prefill: contiguous last dims");
  TORCH_CHECK(q.size(1) % k_cache.size(2) == 0, "paged_prefill: query heads a multiple of KV heads");
  auto cu_t = cu_seqlens.to(at::kLong).contiguous(), len_t = seq_lens.to(at::kLong).contiguous();
  std::vector<int64_t> cu(cu_t.data_ptr<int64_t>(), cu_t.data_ptr<int64_t>() + cu_t.numel());
  std::vector<int64_t> lens(len_t.data_ptr<int64_t>(), len_t.data_ptr<int64_t>() + len_t.numel());
  TORCH_CHECK(cu.size() == lens.size() + 1, "paged_prefill: cu_seqlens [N+1], seq_lens [N]");
  for (size_t n = 0; n < lens.size(); ++n)
    TORCH_CHECK(lens[n] >= cu[n + 1] - cu[n], "paged_prefill: seq_lens >= each sequence's queries");
  auto pages_c = pages.to(at::kLong).contiguous();
  auto out = at::empty({q.size(0), q.size(1), dv}, q.options().dtype(at::kFloat));
  if (q.scalar_type() == at::kBFloat16 && scale > 0 && packed_runs(q.size(2), dv)) {
    prefill_packed(q, k_cache, v_cache, pages_c, cu, lens, static_cast<float>(scale), dv, out.data_ptr<float>());
    return out;
  }
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, q.scalar_type(), "paged_prefill", [&] {
    prefill<scalar_t>(q, k_cache, v_cache, pages_c, cu, lens, static_cast<float>(scale), dv,
                      out.data_ptr<float>());
  });
  return out;
}

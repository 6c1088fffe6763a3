// The module of the compiled CPU kernels (kernels/native.py builds it from these sources).
#include <torch/extension.h>

at::Tensor paged_decode(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                        const at::Tensor& pages, const at::Tensor& lens, double scale, int64_t dv);
at::Tensor delta_step(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& g,
                      const at::Tensor& beta, at::Tensor& state, const at::Tensor& slots, double scale);
std::tuple<at::Tensor, at::Tensor> chunk_delta_rule(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                    const at::Tensor& g, const at::Tensor& beta, at::Tensor& state,
                                                    const at::Tensor& cu_seqlens, const at::Tensor& checkpoints,
                                                    double scale, double min_log_decay);
bool chunk_blas(bool on);
std::tuple<at::Tensor, at::Tensor> causal_conv1d(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias,
                                                 const at::Tensor& state, const at::Tensor& cu_seqlens,
                                                 const at::Tensor& at_rows, bool silu);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode", &paged_decode, "attention decode over paged KV (kernels/attention/cpu_decode.cpp)");
  m.def("delta_step", &delta_step, "KDA / GDN decode step, states in place (kernels/attention/cpu_decode.cpp)");
  m.def("chunk_delta_rule", &chunk_delta_rule, "KDA / GDN chunkwise prefill (kernels/kda/cpu_chunk.cpp)");
  m.def("causal_conv1d", &causal_conv1d, "causal depthwise conv1d prefill (kernels/conv1d/cpu_conv.cpp)");
  m.def("chunk_blas", &chunk_blas, "chunk_delta_rule's matmuls through torch's BLAS (true) or plain loops");
}

// The engine's CPU kernels as one extension module (rlhf/engine/native.py builds it).
#include <torch/extension.h>

at::Tensor paged_decode(at::Tensor q, at::Tensor k, at::Tensor v, at::Tensor tables, at::Tensor ctx,
                        double scale);
at::Tensor rms_norm(at::Tensor x, at::Tensor w, double eps);
at::Tensor silu_and_mul(at::Tensor gate_up);
at::Tensor rope_and_cache(at::Tensor qkv, at::Tensor cos, at::Tensor sin, at::Tensor k, at::Tensor v,
                          at::Tensor slots, int64_t q_per_kv);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode", &paged_decode, "decode attention over a paged KV cache (float32, CPU)");
  m.def("rms_norm", &rms_norm, "RMSNorm of [rows, hidden] float32 rows (CPU)");
  m.def("silu_and_mul", &silu_and_mul, "silu(gate) * up of fc1's float32 [rows, 2F] output (CPU)");
  m.def("rope_and_cache", &rope_and_cache, "RoPE on queries and keys, keys and values into the cache (CPU)");
}

// The engine's CPU kernels as one extension module (rlhf/engine/native.py builds it).
#include <torch/extension.h>

torch::Tensor paged_decode(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor tables,
                           torch::Tensor ctx, double scale);
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor w, double eps);
torch::Tensor silu_and_mul(torch::Tensor gate_up);
torch::Tensor rope_and_cache(torch::Tensor qkv, torch::Tensor cos, torch::Tensor sin, torch::Tensor k,
                             torch::Tensor v, torch::Tensor slots, int64_t q_per_kv);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode", &paged_decode, "decode attention over a paged KV cache (float32, CPU)");
  m.def("rms_norm", &rms_norm, "RMSNorm of [rows, hidden] float32 rows (CPU)");
  m.def("silu_and_mul", &silu_and_mul, "silu(gate) * up of fc1's float32 [rows, 2F] output (CPU)");
  m.def("rope_and_cache", &rope_and_cache, "RoPE on queries and keys, keys and values into the cache (CPU)");
}

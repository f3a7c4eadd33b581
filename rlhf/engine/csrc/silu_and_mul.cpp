// SwiGLU's elementwise half on the CPU in one pass: out = silu(gate) * up, from fc1's [rows, 2F] output
// [gate | up], with silu(g) = g / (1 + e^-g).
//
// torch runs it as a chunk, a silu and a multiply, each a parallel region over a few hundred KB; on a decode
// step their dispatch and thread wake-ups cost more than the arithmetic. Float32 only.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>

#include "vec8.h"

at::Tensor silu_and_mul(at::Tensor gate_up) {
  TORCH_CHECK(gate_up.scalar_type() == at::kFloat, "silu_and_mul: float32 tensors only");
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.size(1) % 2 == 0, "silu_and_mul: gate_up [rows, 2 * F]");
  gate_up = gate_up.contiguous();
  const int64_t rows = gate_up.size(0), f = gate_up.size(1) / 2, fv = f & ~int64_t(7);
  auto out = at::empty({rows, f}, gate_up.options());
  const float* xp = gate_up.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* g = xp + r * 2 * f;
      const float* u = g + f;
      float* y = op + r * f;
      for (int64_t c = 0; c < fv; c += 8) {
        const v8 gv = load8(g + c);
        store8(y + c, gv / (1.0f + exp8(-gv)) * load8(u + c));
      }
      for (int64_t c = fv; c < f; ++c) y[c] = g[c] / (1.0f + std::exp(-g[c])) * u[c];
    }
  });
  return out;
}

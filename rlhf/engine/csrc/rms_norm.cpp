// RMSNorm of a decode step's rows on the CPU in one pass per row: y = (x * rsqrt(mean(x^2) + eps)) * w.
//
// torch's CPU rms_norm runs it as five elementwise and reduction ops, each a parallel region over a
// [tokens, hidden] tensor of a few hundred KB: on a decode step their dispatch and thread wake-ups cost
// more than the arithmetic (about 200 us per call on 128 x 576 floats, 61 calls a step). Float32 only.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty_like.h>
#include <c10/util/Exception.h>

#include <cmath>

#include "vec8.h"

at::Tensor rms_norm(at::Tensor x, at::Tensor w, double eps) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && w.scalar_type() == at::kFloat,
              "rms_norm: float32 tensors only");
  TORCH_CHECK(x.dim() == 2 && w.dim() == 1 && x.size(1) == w.size(0), "rms_norm: x [rows, hidden], w [hidden]");
  x = x.contiguous();
  w = w.contiguous();
  const int64_t rows = x.size(0), h = x.size(1), hv = h & ~int64_t(7);
  auto out = at::empty_like(x);
  const float* xp = x.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const float e = static_cast<float>(eps);
  at::parallel_for(0, rows, 64, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* xr = xp + r * h;
      float* yr = op + r * h;
      v8 acc = {};
      for (int64_t c = 0; c < hv; c += 8) {
        const v8 v = load8(xr + c);
        acc += v * v;
      }
      float total = hsum(acc);
      for (int64_t c = hv; c < h; ++c) total += xr[c] * xr[c];
      const float inv = 1.f / std::sqrt(total / static_cast<float>(h) + e);
      for (int64_t c = 0; c < hv; c += 8) store8(yr + c, (load8(xr + c) * inv) * load8(wp + c));
      for (int64_t c = hv; c < h; ++c) yr[c] = (xr[c] * inv) * wp[c];
    }
  });
  return out;
}

// Decode attention over the paged KV cache on the CPU, reading each sequence's keys and values in place.
//
// The torch path (rlhf/engine/attention.py, TorchPagedAttention) gathers every sequence's blocks into a
// new tensor per layer and step, then runs batched matmuls of 3-row matrices; both cost memory traffic
// and per-matrix overhead. Here one task per (sequence, KV head) walks its block table: one pass over
// the keys computes the scores of the KV head's query heads, a softmax per query head (in float, with
// its maximum subtracted), one pass over the values accumulates the output. Float32 only.
//
//   q:      [N, kv_heads * q_per_kv, D]  the N decode rows' queries (query heads of a KV head adjacent)
//   k, v:   [kv_heads, num_blocks, block_size, D]  one layer's cache
//   tables: [N, width] int32 block ids;  ctx: [N] int32 visible keys (positions 0 .. ctx-1)
//   returns [N, kv_heads * q_per_kv, D]
#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <vector>

// a . b over n floats; the compiler vectorises the sum (reassociation is allowed: see rlhf/engine/native.py)
static inline float dot(const float* a, const float* b, int64_t n) {
  float acc = 0.f;
  for (int64_t i = 0; i < n; ++i) acc += a[i] * b[i];
  return acc;
}

// ask for the cache lines of the next block while this one is computed: blocks lie anywhere in the pool, so
// the hardware prefetcher cannot guess where the next one starts
static inline void prefetch(const float* x, int64_t n) {
  for (int64_t i = 0; i < n; i += 16) __builtin_prefetch(x + i);
}

// y += p * x over n floats
static inline void axpy(float p, const float* x, float* y, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] += p * x[i];
}

torch::Tensor paged_decode(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor tables,
                           torch::Tensor ctx, double scale) {
  TORCH_CHECK(q.scalar_type() == torch::kFloat && k.scalar_type() == torch::kFloat &&
              v.scalar_type() == torch::kFloat, "paged_decode: float32 tensors only");
  TORCH_CHECK(tables.scalar_type() == torch::kInt && ctx.scalar_type() == torch::kInt,
              "paged_decode: int32 block tables and context lengths");
  q = q.contiguous();
  k = k.contiguous();
  v = v.contiguous();
  tables = tables.contiguous();
  ctx = ctx.contiguous();
  const int64_t n = q.size(0), kv_heads = k.size(0), num_blocks = k.size(1), bs = k.size(2), d = k.size(3);
  const int64_t qpg = q.size(1) / kv_heads, width = tables.size(1);
  auto out = torch::empty_like(q);
  const float* qp = q.data_ptr<float>();
  const float* kp = k.data_ptr<float>();
  const float* vp = v.data_ptr<float>();
  const int32_t* tp = tables.data_ptr<int32_t>();
  const int32_t* cp = ctx.data_ptr<int32_t>();
  float* op = out.data_ptr<float>();
  const float sc = static_cast<float>(scale);
  at::parallel_for(0, n * kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t row = task / kv_heads, h = task % kv_heads, len = cp[row];
      const float* qh = qp + (row * kv_heads + h) * qpg * d;
      float* oh = op + (row * kv_heads + h) * qpg * d;
      const int32_t* table = tp + row * width;
      scores.resize(qpg * len);
      for (int64_t first = 0; first < len; first += bs) {  // scores[g * len + t] = q_g . k_t * scale
        const float* kb = kp + (h * num_blocks + table[first / bs]) * bs * d;
        const int64_t count = std::min(bs, len - first);
        if (first + bs < len) prefetch(kp + (h * num_blocks + table[first / bs + 1]) * bs * d, bs * d);
        for (int64_t j = 0; j < count; ++j) {
          for (int64_t g = 0; g < qpg; ++g) scores[g * len + first + j] = dot(qh + g * d, kb + j * d, d) * sc;
        }
      }
      for (int64_t g = 0; g < qpg; ++g) {  // softmax of each query head's row
        float* s = scores.data() + g * len;
        float top = s[0];
        for (int64_t t = 1; t < len; ++t) top = std::max(top, s[t]);
        float total = 0.f;
        for (int64_t t = 0; t < len; ++t) {
          s[t] = std::exp(s[t] - top);
          total += s[t];
        }
        const float inv = 1.f / total;
        for (int64_t t = 0; t < len; ++t) s[t] *= inv;
      }
      std::fill(oh, oh + qpg * d, 0.f);
      for (int64_t first = 0; first < len; first += bs) {  // out_g += p_g[t] * v_t
        const float* vb = vp + (h * num_blocks + table[first / bs]) * bs * d;
        const int64_t count = std::min(bs, len - first);
        if (first + bs < len) prefetch(vp + (h * num_blocks + table[first / bs + 1]) * bs * d, bs * d);
        for (int64_t j = 0; j < count; ++j) {
          for (int64_t g = 0; g < qpg; ++g) axpy(scores[g * len + first + j], vb + j * d, oh + g * d, d);
        }
      }
    }
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode", &paged_decode, "decode attention over a paged KV cache (float32, CPU)");
}

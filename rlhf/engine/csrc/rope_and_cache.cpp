// A layer's rotary embedding and K/V cache write on the CPU, in one pass over the fused QKV projection.
//
// For each token and KV group of [q_per_kv query heads | key | value] (head_dim floats each): the queries
// and the key rotate (non-interleaved, rotate-half RoPE: y = x cos + rotate_half(x) sin, rotate_half(x) =
// [-x2, x1]); the rotated queries go to the output, the rotated key and the value to the token's cache slot.
// torch runs it as a chunk, a cat, a negation, three elementwise ops and two index copies. Float32 only.
//
//   qkv:  [T, kv_heads * (q_per_kv + 2) * D]   cos, sin: [T, D] (the tokens' positions)
//   k, v: [kv_heads, slots, D]  one layer's cache (blocks flattened);  slots: [T] int64
//   returns the rotated queries [T, kv_heads * q_per_kv, D]
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>

#include <algorithm>

static inline void rotate(const float* x, const float* c, const float* s, int64_t d, float* y) {
  const int64_t h = d / 2;
  for (int64_t i = 0; i < h; ++i) y[i] = x[i] * c[i] + (-x[i + h]) * s[i];
  for (int64_t i = h; i < d; ++i) y[i] = x[i] * c[i] + x[i - h] * s[i];
}

at::Tensor rope_and_cache(at::Tensor qkv, at::Tensor cos, at::Tensor sin, at::Tensor k, at::Tensor v,
                          at::Tensor slots, int64_t q_per_kv) {
  TORCH_CHECK(qkv.scalar_type() == at::kFloat && cos.scalar_type() == at::kFloat &&
              sin.scalar_type() == at::kFloat && k.scalar_type() == at::kFloat &&
              v.scalar_type() == at::kFloat, "rope_and_cache: float32 tensors only");
  TORCH_CHECK(slots.scalar_type() == at::kLong, "rope_and_cache: int64 slots");
  TORCH_CHECK(k.is_contiguous() && v.is_contiguous(), "rope_and_cache: the cache is written in place");
  const int64_t t_count = qkv.size(0), kv_heads = k.size(0), num_slots = k.size(1), d = k.size(2);
  TORCH_CHECK(qkv.size(1) == kv_heads * (q_per_kv + 2) * d && cos.size(1) == d && d % 2 == 0,
              "rope_and_cache: qkv [T, kv_heads * (q_per_kv + 2) * head_dim], cos/sin [T, head_dim]");
  qkv = qkv.contiguous();
  cos = cos.contiguous();
  sin = sin.contiguous();
  slots = slots.contiguous();
  auto q = at::empty({t_count, kv_heads * q_per_kv, d}, qkv.options());
  const float* xp = qkv.data_ptr<float>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  const int64_t* slot = slots.data_ptr<int64_t>();
  float* kp = k.data_ptr<float>();
  float* vp = v.data_ptr<float>();
  float* qp = q.data_ptr<float>();
  for (int64_t t = 0; t < t_count; ++t) {
    TORCH_CHECK(slot[t] >= 0 && slot[t] < num_slots, "rope_and_cache: slot ", slot[t], " outside the cache");
  }
  at::parallel_for(0, t_count, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* c = cp + t * d;
      const float* s = sp + t * d;
      for (int64_t h = 0; h < kv_heads; ++h) {
        const float* group = xp + (t * kv_heads + h) * (q_per_kv + 2) * d;
        float* qh = qp + (t * kv_heads + h) * q_per_kv * d;
        for (int64_t g = 0; g < q_per_kv; ++g) rotate(group + g * d, c, s, d, qh + g * d);
        rotate(group + q_per_kv * d, c, s, d, kp + (h * num_slots + slot[t]) * d);
        std::copy(group + (q_per_kv + 1) * d, group + (q_per_kv + 2) * d, vp + (h * num_slots + slot[t]) * d);
      }
    }
  });
  return q;
}

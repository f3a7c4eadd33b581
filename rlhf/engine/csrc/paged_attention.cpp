// Decode attention over the paged KV cache on the CPU, reading each sequence's keys and values in place.
//
// The torch path (rlhf/engine/attention.py, TorchPagedAttention) gathers every sequence's blocks into a
// new tensor per layer and step, then runs batched matmuls of 3-row matrices; both cost memory traffic
// and per-matrix overhead. Here one task per (sequence, KV head) walks its block table: one pass over
// the keys computes the scores of the KV head's query heads, a softmax per query head (in float, with
// its maximum subtracted), one pass over the values accumulates the output. Float32 only.
//
// The loops are written on 8-float vectors (GCC/Clang vector extensions, lowered to the CPU's SIMD by
// -march=native): the scores of four keys at a time, so that four sums are in flight; the exponentials
// eight at a time (vec8.h); the output accumulated in registers over a block's values.
//
//   q:      [N, kv_heads * q_per_kv, D]  the N decode rows' queries (query heads of a KV head adjacent)
//   k, v:   [kv_heads, num_blocks, block_size, D]  one layer's cache
//   tables: [N, width] int32 block ids;  ctx: [N] int32 visible keys (positions 0 .. ctx-1)
//   returns [N, kv_heads * q_per_kv, D]
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty_like.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "vec8.h"

// ask for the cache lines of the next block while this one is computed: blocks lie anywhere in the pool, so
// the hardware prefetcher cannot guess where the next one starts
static inline void prefetch(const float* x, int64_t n) {
  for (int64_t i = 0; i < n; i += 16) __builtin_prefetch(x + i);
}

// s[j] = (q . k_j) * sc for the count keys of one block (rows of d floats)
static void block_scores(const float* q, const float* kb, int64_t count, int64_t d, float sc, float* s) {
  const int64_t dv = d & ~int64_t(7);
  int64_t j = 0;
  for (; j + 4 <= count; j += 4) {
    const float* k0 = kb + j * d;
    v8 a0 = {}, a1 = {}, a2 = {}, a3 = {};
    for (int64_t c = 0; c < dv; c += 8) {
      const v8 qv = load8(q + c);
      a0 += qv * load8(k0 + c);
      a1 += qv * load8(k0 + d + c);
      a2 += qv * load8(k0 + 2 * d + c);
      a3 += qv * load8(k0 + 3 * d + c);
    }
    float t0 = hsum(a0), t1 = hsum(a1), t2 = hsum(a2), t3 = hsum(a3);
    for (int64_t c = dv; c < d; ++c) {
      t0 += q[c] * k0[c];
      t1 += q[c] * k0[d + c];
      t2 += q[c] * k0[2 * d + c];
      t3 += q[c] * k0[3 * d + c];
    }
    s[j] = t0 * sc;
    s[j + 1] = t1 * sc;
    s[j + 2] = t2 * sc;
    s[j + 3] = t3 * sc;
  }
  for (; j < count; ++j) {
    const float* kj = kb + j * d;
    v8 a = {};
    for (int64_t c = 0; c < dv; c += 8) a += load8(q + c) * load8(kj + c);
    float t = hsum(a);
    for (int64_t c = dv; c < d; ++c) t += q[c] * kj[c];
    s[j] = t * sc;
  }
}

// s[0 : len] = softmax(s[0 : len]) in place
static void softmax(float* s, int64_t len) {
  const int64_t lv = len & ~int64_t(7);
  v8 tops = splat(s[0]);
  for (int64_t t = 0; t < lv; t += 8) {
    const v8 x = load8(s + t);
    tops = x > tops ? x : tops;
  }
  float top = tops[0];
  for (int i = 1; i < 8; ++i) top = std::max(top, tops[i]);
  for (int64_t t = lv; t < len; ++t) top = std::max(top, s[t]);
  v8 sums = {};
  for (int64_t t = 0; t < lv; t += 8) {
    const v8 e = exp8(load8(s + t) - top);
    store8(s + t, e);
    sums += e;
  }
  if (lv < len) {  // the tail through a padded vector, its padding e^-inf = 0
    v8 tail = splat(-INFINITY);
    for (int64_t t = lv; t < len; ++t) tail[t - lv] = s[t];
    const v8 e = exp8(tail - top);
    for (int64_t t = lv; t < len; ++t) s[t] = e[t - lv];
    sums += e;
  }
  const float inv = 1.f / hsum(sums);
  for (int64_t t = 0; t < len; ++t) s[t] *= inv;
}

// o[0 : 8 NV] += sum_j p[j] * v_j[0 : 8 NV], the accumulators held in registers over the block's values
template <int NV>
static void block_values(const float* p, const float* vb, int64_t count, int64_t d, float* o) {
  v8 acc[NV];
  for (int i = 0; i < NV; ++i) acc[i] = load8(o + 8 * i);
  for (int64_t j = 0; j < count; ++j) {
    const v8 pj = splat(p[j]);
    for (int i = 0; i < NV; ++i) acc[i] += pj * load8(vb + j * d + 8 * i);
  }
  for (int i = 0; i < NV; ++i) store8(o + 8 * i, acc[i]);
}

// o[0 : d] += sum_j p[j] * v_j: 64 floats at a time, the rest (d not a multiple of 8) one at a time
static void add_values(const float* p, const float* vb, int64_t count, int64_t d, float* o) {
  int64_t c0 = 0;
  for (; c0 + 8 <= d; c0 += 64) {
    switch (std::min<int64_t>(8, (d - c0) / 8)) {
      case 8: block_values<8>(p, vb + c0, count, d, o + c0); break;
      case 7: block_values<7>(p, vb + c0, count, d, o + c0); break;
      case 6: block_values<6>(p, vb + c0, count, d, o + c0); break;
      case 5: block_values<5>(p, vb + c0, count, d, o + c0); break;
      case 4: block_values<4>(p, vb + c0, count, d, o + c0); break;
      case 3: block_values<3>(p, vb + c0, count, d, o + c0); break;
      case 2: block_values<2>(p, vb + c0, count, d, o + c0); break;
      default: block_values<1>(p, vb + c0, count, d, o + c0); break;
    }
  }
  for (int64_t c = d & ~int64_t(7); c < d; ++c) {
    for (int64_t j = 0; j < count; ++j) o[c] += p[j] * vb[j * d + c];
  }
}

at::Tensor paged_decode(at::Tensor q, at::Tensor k, at::Tensor v, at::Tensor tables, at::Tensor ctx,
                        double scale) {
  TORCH_CHECK(q.scalar_type() == at::kFloat && k.scalar_type() == at::kFloat &&
              v.scalar_type() == at::kFloat, "paged_decode: float32 tensors only");
  TORCH_CHECK(tables.scalar_type() == at::kInt && ctx.scalar_type() == at::kInt,
              "paged_decode: int32 block tables and context lengths");
  q = q.contiguous();
  k = k.contiguous();
  v = v.contiguous();
  tables = tables.contiguous();
  ctx = ctx.contiguous();
  const int64_t n = q.size(0), kv_heads = k.size(0), num_blocks = k.size(1), bs = k.size(2), d = k.size(3);
  const int64_t qpg = q.size(1) / kv_heads, width = tables.size(1);
  auto out = at::empty_like(q);
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
        for (int64_t g = 0; g < qpg; ++g) block_scores(qh + g * d, kb, count, d, sc, scores.data() + g * len + first);
      }
      for (int64_t g = 0; g < qpg; ++g) softmax(scores.data() + g * len, len);
      std::fill(oh, oh + qpg * d, 0.f);
      for (int64_t first = 0; first < len; first += bs) {  // out_g += p_g[t] * v_t
        const float* vb = vp + (h * num_blocks + table[first / bs]) * bs * d;
        const int64_t count = std::min(bs, len - first);
        if (first + bs < len) prefetch(vp + (h * num_blocks + table[first / bs + 1]) * bs * d, bs * d);
        for (int64_t g = 0; g < qpg; ++g) add_values(scores.data() + g * len + first, vb, count, d, oh + g * d);
      }
    }
  });
  return out;
}

// 8-float vectors (GCC/Clang vector extensions; -march=native lowers them to the CPU's SIMD) and their loads,
// stores and sums, shared by the engine's CPU kernels.
#pragma once

#include <cstdint>

typedef float v8 __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));

static inline v8 load8(const float* p) {
  v8 x;
  __builtin_memcpy(&x, p, sizeof x);
  return x;
}

static inline void store8(float* p, v8 x) { __builtin_memcpy(p, &x, sizeof x); }

static inline v8 splat(float x) {
  v8 out = {};
  return out + x;
}

static inline float hsum(v8 x) { return ((x[0] + x[4]) + (x[1] + x[5])) + ((x[2] + x[6]) + (x[3] + x[7])); }

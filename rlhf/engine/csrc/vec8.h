// 8-float vectors (GCC/Clang vector extensions; -march=native lowers them to the CPU's SIMD) and their loads,
// stores and sums, shared by the engine's CPU kernels.
#pragma once

#include <cmath>
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

// e^x within 1 ulp of expf (compiled without reassociation): x = n ln2 + r with |r| <= ln2 / 2,
// e^r = 1 + r + r^2 P(r) with Cephes' minimax P of degree 5, 2^n put into the exponent bits; exactly 0 below
// -87 (where expf leaves the normal floats) and inf above 88
static inline v8 exp8(v8 x) {
  const v8 lo = splat(-87.0f), hi = splat(88.0f);
  const v8i under = x < lo, over = x > hi;
  x = x < lo ? lo : (x > hi ? hi : x);
  const v8 t = x * 1.44269504088896341f + 0.5f;
  v8i n = __builtin_convertvector(t, v8i);
  n += __builtin_convertvector(n, v8) > t;  // floor: the conversion truncates toward zero; true is -1
  const v8 nf = __builtin_convertvector(n, v8);
  const v8 r = (x - nf * 0.693359375f) + nf * 2.12194440e-4f;  // ln 2 in two parts
  v8 p = splat(1.9875691500e-4f);
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * (r * r) + r + 1.0f;
  const v8 e = (v8)(((v8i)p + (n << 23)) & ~under);
  return over ? splat(INFINITY) : e;
}

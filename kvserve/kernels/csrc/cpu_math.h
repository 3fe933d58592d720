// Scalar helpers the CPU kernels share, written so that `#pragma omp simd` loops vectorise them.
// The build passes -fno-trapping-math: without it GCC keeps a loop with a select (`x >= 0 ? x : x * e`)
// or nearbyint scalar ("control flow in loop"), one element at a time instead of a vector of them.
#pragma once

#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

namespace kvserve {

// exp(x) for x <= 0, vectorisable: x = n ln2 + r, |r| <= ln2/2, exp(r) by its degree-6 Taylor
// polynomial (relative error < 2e-7), 2^n through the exponent bits.
inline float exp_nonpos(float x) {
  x = std::max(x, -87.0f);
  const float n = std::nearbyint(x * 1.4426950408889634f);
  const float r = x - n * 0.693145751953125f - n * 1.428606765330187e-06f;
  float p = 1.f / 720;
  p = p * r + 1.f / 120;
  p = p * r + 1.f / 24;
  p = p * r + 1.f / 6;
  p = p * r + 0.5f;
  p = p * r + 1.f;
  p = p * r + 1.f;
  int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

// silu(g) = g / (1 + exp(-g)) through exp(-|g|) <= 1, so no exp overflows and the loop vectorises.
inline float silu(float g) {
  const float e = exp_nonpos(-std::fabs(g));
  return (g >= 0.f ? g : g * e) / (1.f + e);
}

// Element loads and stores: every kernel computes in float32; bfloat16 tensors are widened on
// load (exact) and rounded to nearest-even on store (c10::BFloat16's rule).
inline float to_float(float x) { return x; }
inline float to_float(c10::BFloat16 x) { return static_cast<float>(x); }
template <typename T> inline T from_float(float x) { return static_cast<T>(x); }

}  // namespace kvserve

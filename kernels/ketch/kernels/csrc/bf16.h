// bfloat16 <-> float32, shared by the ops that store bfloat16: the packed GEMM's weights
// (packed_gemm.cc) and the KV cache (paged_attention.cc). bfloat16 is the top half of a float32,
// so widening is exact (the 16 bits shifted into the top, zeros below) and narrowing rounds the
// dropped half away. The vector widenings live with the vector types (simd.h, Vec*::load).
#pragma once

#include <cstdint>
#include <cstring>

namespace ketch {

// float -> bfloat16 bits, rounded to nearest even (as torch's and paddle's casts); NaN -> the
// quiet 0x7fc0.
inline uint16_t RoundToBf16(float v) {
  uint32_t bits;
  std::memcpy(&bits, &v, sizeof bits);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;  // NaN: a quiet one, as torch
  // Adding 0x7fff plus the lowest kept bit carries into the kept half exactly when the dropped
  // half is over 0x8000, or equal to it with an odd kept half: round to nearest, ties to even.
  return static_cast<uint16_t>((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}

// bfloat16 bits -> the float they stand for (exact).
inline float Bf16ToFloat(uint16_t v) {
  const uint32_t bits = static_cast<uint32_t>(v) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

}  // namespace ketch

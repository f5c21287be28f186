// Vector types the attention kernel is written against, one per instruction set.
//
// Each type is defined inside a `#pragma GCC target` region, so this header compiles into a
// library built for the x86-64 baseline: AVX2/AVX-512 instructions appear only in functions of
// those regions, and only run when the caller chose that instruction set from the CPU's features.
// `exp` is Cephes' single-precision polynomial (about 1 ulp); `-inf` gives exactly 0.
#pragma once

#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <cstring>

#include "bf16.h"

// The vector primitives must melt into the kernels: a call per FMA would cost more than the FMA.
#define KETCH_INLINE inline __attribute__((always_inline))

namespace ketch {

namespace expf_consts {
constexpr float kHi = 88.3762626647949f;
constexpr float kLo = -88.3762626647949f;
constexpr float kLog2e = 1.44269504088896341f;
constexpr float kC1 = 0.693359375f;
constexpr float kC2 = -2.12194440e-4f;
constexpr float kP0 = 1.9875691500e-4f;
constexpr float kP1 = 1.3981999507e-3f;
constexpr float kP2 = 8.3334519073e-3f;
constexpr float kP3 = 4.1665795894e-2f;
constexpr float kP4 = 1.6666665459e-1f;
constexpr float kP5 = 5.0000001201e-1f;
}  // namespace expf_consts

// Scalar "vector" of width 1: the baseline path, for CPUs without AVX2+FMA.
struct VecScalar {
  using T = float;
  static constexpr int W = 1;
  KETCH_INLINE static T zero() { return 0.0f; }
  KETCH_INLINE static T set1(float x) { return x; }
  KETCH_INLINE static T load(const float* p) { return *p; }
  KETCH_INLINE static T load(const uint16_t* p) { return Bf16ToFloat(*p); }  // bfloat16 bits
  KETCH_INLINE static void store(float* p, T v) { *p = v; }
  KETCH_INLINE static T add(T a, T b) { return a + b; }
  KETCH_INLINE static T mul(T a, T b) { return a * b; }
  KETCH_INLINE static T max(T a, T b) { return a > b ? a : b; }
  KETCH_INLINE static T fmadd(T a, T b, T c) { return a * b + c; }
  static constexpr int kRows = 4;    // query rows per register block (score pass)
  static constexpr int kValueRows = 4;  // query rows per register block (value pass)
  static constexpr int kChunks = 4;  // vectors of a head per register block (value pass)
  KETCH_INLINE static float hsum(T v) { return v; }
  KETCH_INLINE static void hsum4(const T* v, float* out) {
    for (int i = 0; i < 4; ++i) out[i] = v[i];
  }
  KETCH_INLINE static float hmax(T v) { return v; }
  KETCH_INLINE static T exp(T x) {
    using namespace expf_consts;
    x = x < kLo ? kLo : (x > kHi ? kHi : x);
    float fx = std::floor(x * kLog2e + 0.5f);
    x = x - fx * kC1 - fx * kC2;
    float y = ((((kP0 * x + kP1) * x + kP2) * x + kP3) * x + kP4) * x + kP5;
    y = y * x * x + x + 1.0f;
    int bits = (static_cast<int>(fx) + 127) << 23;
    float scale;
    std::memcpy(&scale, &bits, sizeof scale);
    return y * scale;
  }
};

#pragma GCC push_options
#pragma GCC target("avx2,fma")
struct VecAvx2 {
  using T = __m256;
  static constexpr int W = 8;
  KETCH_INLINE static T zero() { return _mm256_setzero_ps(); }
  KETCH_INLINE static T set1(float x) { return _mm256_set1_ps(x); }
  KETCH_INLINE static T load(const float* p) { return _mm256_loadu_ps(p); }
  // 8 bfloat16s at p as floats: zero-extended to 32 bits and shifted into the top half.
  KETCH_INLINE static T load(const uint16_t* p) {
    const __m256i wide =
        _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
  }
  KETCH_INLINE static void store(float* p, T v) { _mm256_storeu_ps(p, v); }
  KETCH_INLINE static T add(T a, T b) { return _mm256_add_ps(a, b); }
  KETCH_INLINE static T mul(T a, T b) { return _mm256_mul_ps(a, b); }
  KETCH_INLINE static T max(T a, T b) { return _mm256_max_ps(a, b); }
  KETCH_INLINE static T fmadd(T a, T b, T c) { return _mm256_fmadd_ps(a, b, c); }
  // 16 registers: 2 rows x 4 keys of score accumulators, 4 rows x 2 vectors of outputs.
  static constexpr int kRows = 2;
  static constexpr int kValueRows = 4;
  static constexpr int kChunks = 2;
  // out[i] = sum of the lanes of v[i], for 4 registers at once.
  KETCH_INLINE static void hsum4(const T* v, float* out) {
    const T h = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
    _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1)));
  }
  KETCH_INLINE static float hsum(T v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
  }
  KETCH_INLINE static float hmax(T v) {
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    s = _mm_max_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
  }
  KETCH_INLINE static T exp(T x) {
    using namespace expf_consts;
    x = _mm256_min_ps(_mm256_max_ps(x, set1(kLo)), set1(kHi));
    T fx = _mm256_floor_ps(fmadd(x, set1(kLog2e), set1(0.5f)));
    x = _mm256_fnmadd_ps(fx, set1(kC1), x);
    x = _mm256_fnmadd_ps(fx, set1(kC2), x);
    T y = fmadd(set1(kP0), x, set1(kP1));
    y = fmadd(y, x, set1(kP2));
    y = fmadd(y, x, set1(kP3));
    y = fmadd(y, x, set1(kP4));
    y = fmadd(y, x, set1(kP5));
    y = fmadd(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, set1(1.0f)));
    __m256i bits = _mm256_slli_epi32(
        _mm256_add_epi32(_mm256_cvtps_epi32(fx), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(y, _mm256_castsi256_ps(bits));
  }
};
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx512f,avx2,fma")
struct VecAvx512 {
  using T = __m512;
  static constexpr int W = 16;
  KETCH_INLINE static T zero() { return _mm512_setzero_ps(); }
  KETCH_INLINE static T set1(float x) { return _mm512_set1_ps(x); }
  KETCH_INLINE static T load(const float* p) { return _mm512_loadu_ps(p); }
  // 16 bfloat16s at p as floats (widened as VecAvx2's).
  KETCH_INLINE static T load(const uint16_t* p) {
    const __m512i wide =
        _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
  }
  KETCH_INLINE static void store(float* p, T v) { _mm512_storeu_ps(p, v); }
  KETCH_INLINE static T add(T a, T b) { return _mm512_add_ps(a, b); }
  KETCH_INLINE static T mul(T a, T b) { return _mm512_mul_ps(a, b); }
  KETCH_INLINE static T max(T a, T b) { return _mm512_max_ps(a, b); }
  KETCH_INLINE static T fmadd(T a, T b, T c) { return _mm512_fmadd_ps(a, b, c); }
  static constexpr int kRows = 4;
  static constexpr int kValueRows = 4;
  static constexpr int kChunks = 4;
  KETCH_INLINE static void hsum4(const T* v, float* out) {
    __m256 half[4];
    for (int i = 0; i < 4; ++i)
      half[i] = _mm256_add_ps(_mm512_castps512_ps256(v[i]),
                              _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v[i]), 1)));
    VecAvx2::hsum4(half, out);
  }
  KETCH_INLINE static float hsum(T v) { return _mm512_reduce_add_ps(v); }
  KETCH_INLINE static float hmax(T v) { return _mm512_reduce_max_ps(v); }
  KETCH_INLINE static T exp(T x) {
    using namespace expf_consts;
    x = _mm512_min_ps(_mm512_max_ps(x, set1(kLo)), set1(kHi));
    T fx = _mm512_roundscale_ps(fmadd(x, set1(kLog2e), set1(0.5f)),
                                _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    x = _mm512_fnmadd_ps(fx, set1(kC1), x);
    x = _mm512_fnmadd_ps(fx, set1(kC2), x);
    T y = fmadd(set1(kP0), x, set1(kP1));
    y = fmadd(y, x, set1(kP2));
    y = fmadd(y, x, set1(kP3));
    y = fmadd(y, x, set1(kP4));
    y = fmadd(y, x, set1(kP5));
    y = fmadd(y, _mm512_mul_ps(x, x), _mm512_add_ps(x, set1(1.0f)));
    __m512i bits = _mm512_slli_epi32(
        _mm512_add_epi32(_mm512_cvtps_epi32(fx), _mm512_set1_epi32(127)), 23);
    return _mm512_mul_ps(y, _mm512_castsi512_ps(bits));
  }
};
#pragma GCC pop_options

}  // namespace ketch

// The vector operations int8_matvec.cpp is written with, on the two instruction sets it is built for:
// AVX512-VNNI (16 float lanes, the tile of bubo/kernels/codes.py on such a CPU) and AVX2 with FMA and F16C
// (8 lanes). Only the byte dot products differ in substance: vpdpbusd sums four byte products into a
// 32-bit lane; AVX2's vpmaddubsw sums two into int16, and the kernels keep those int16 sums through a
// sub-block and widen them once, with vpmaddwd against the sub-block's scale, as llama.cpp's AVX2 kernels
// do. No int16 sum saturates (`Products`); Q8's codes, stored plus 128, take `dot_bytes`, which splits off
// their top bit.
#pragma once

#include <immintrin.h>

#include <cstdint>

namespace vec {

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)

constexpr int64_t kLanes = 16;
using Int = __m512i;
using Float = __m512;

inline Int load_int(const int32_t* p) { return _mm512_loadu_si512(p); }
inline Float load_float(const float* p) { return _mm512_loadu_ps(p); }
inline Float load_half(const void* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(static_cast<const __m256i*>(p))); }
inline void store(float* p, Float v) { _mm512_storeu_ps(p, v); }
inline Int splat(int32_t v) { return _mm512_set1_epi32(v); }
inline Float splat(float v) { return _mm512_set1_ps(v); }
inline Int zero_int() { return _mm512_setzero_si512(); }
inline Float zero_float() { return _mm512_setzero_ps(); }
inline Int and_bits(Int a, Int b) { return _mm512_and_si512(a, b); }
inline Int or_bits(Int a, Int b) { return _mm512_or_si512(a, b); }
inline Int add(Int a, Int b) { return _mm512_add_epi32(a, b); }
inline Int mul(Int a, Int b) { return _mm512_mullo_epi32(a, b); }
inline Int shift_right(Int a, int n) { return _mm512_srli_epi32(a, n); }
inline Int shift_left(Int a, int n) { return _mm512_slli_epi32(a, n); }
inline Int shift_right_signed(Int a, int n) { return _mm512_srai_epi32(a, n); }
inline Float to_float(Int a) { return _mm512_cvtepi32_ps(a); }
inline Float as_float(Int a) { return _mm512_castsi512_ps(a); }
inline Float mul(Float a, Float b) { return _mm512_mul_ps(a, b); }
inline Float fmadd(Float a, Float b, Float c) { return _mm512_fmadd_ps(a, b, c); }
inline Float fnmadd(Float a, Float b, Float c) { return _mm512_fnmadd_ps(a, b, c); }

// acc + per 32-bit lane the four products of `codes`' bytes (unsigned, up to 127) and x's (signed).
inline Int dot(Int acc, Int codes, int32_t x) { return _mm512_dpbusd_epi32(acc, codes, _mm512_set1_epi32(x)); }
// The same for codes up to 255 (Q8's, stored plus 128).
inline Int dot_bytes(Int acc, Int codes, int32_t x) { return dot(acc, codes, x); }

// A sub-block's byte products as the inner loops gather them before scaling (AVX2 keeps int16 pairs).
using Products = Int;
inline Products no_products() { return zero_int(); }
inline Products dot_products(Products acc, Int codes, int32_t x) { return dot(acc, codes, x); }
// (a's products + b's) * scale, per lane.
inline Int scaled_sum(Products a, Products b, Int scale) { return mul(add(a, b), scale); }

// The 32 floats at x as int8 in -127..127 (x / d rounded to nearest even, d = max |x| / 127): the bytes in
// input order to `q`, the sums of the first and last 16 values to `sums`; returns d.
inline float quantize_block(const float* x, int8_t* q, int32_t* sums) {
  const __m512 sign = _mm512_set1_ps(-0.f);
  const __m512 x0 = _mm512_loadu_ps(x), x1 = _mm512_loadu_ps(x + 16);
  const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_andnot_ps(sign, x0), _mm512_andnot_ps(sign, x1)));
  const float d = amax / 127.f;
  const __m512 id = _mm512_set1_ps(d > 0.f ? 1.f / d : 0.f);
  // cvtps rounds to nearest, ties to even (the default MXCSR mode), as std::nearbyint does.
  const __m512i q0 = _mm512_cvtps_epi32(_mm512_mul_ps(x0, id)), q1 = _mm512_cvtps_epi32(_mm512_mul_ps(x1, id));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(q), _mm512_cvtepi32_epi8(q0));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 16), _mm512_cvtepi32_epi8(q1));
  sums[0] = _mm512_reduce_add_epi32(q0);
  sums[1] = _mm512_reduce_add_epi32(q1);
  return d;
}

#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)

constexpr int64_t kLanes = 8;
using Int = __m256i;
using Float = __m256;

inline Int load_int(const int32_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
inline Float load_float(const float* p) { return _mm256_loadu_ps(p); }
inline Float load_half(const void* p) { return _mm256_cvtph_ps(_mm_loadu_si128(static_cast<const __m128i*>(p))); }
inline void store(float* p, Float v) { _mm256_storeu_ps(p, v); }
inline Int splat(int32_t v) { return _mm256_set1_epi32(v); }
inline Float splat(float v) { return _mm256_set1_ps(v); }
inline Int zero_int() { return _mm256_setzero_si256(); }
inline Float zero_float() { return _mm256_setzero_ps(); }
inline Int and_bits(Int a, Int b) { return _mm256_and_si256(a, b); }
inline Int or_bits(Int a, Int b) { return _mm256_or_si256(a, b); }
inline Int add(Int a, Int b) { return _mm256_add_epi32(a, b); }
inline Int mul(Int a, Int b) { return _mm256_mullo_epi32(a, b); }
inline Int shift_right(Int a, int n) { return _mm256_srli_epi32(a, n); }
inline Int shift_left(Int a, int n) { return _mm256_slli_epi32(a, n); }
inline Int shift_right_signed(Int a, int n) { return _mm256_srai_epi32(a, n); }
inline Float to_float(Int a) { return _mm256_cvtepi32_ps(a); }
inline Float as_float(Int a) { return _mm256_castsi256_ps(a); }
inline Float mul(Float a, Float b) { return _mm256_mul_ps(a, b); }
inline Float fmadd(Float a, Float b, Float c) { return _mm256_fmadd_ps(a, b, c); }
inline Float fnmadd(Float a, Float b, Float c) { return _mm256_fnmadd_ps(a, b, c); }

inline Int pairs_to_int32(Int pairs) { return _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)); }

inline Int dot(Int acc, Int codes, int32_t x) {
  return add(acc, pairs_to_int32(_mm256_maddubs_epi16(codes, _mm256_set1_epi32(x))));
}

// Byte products kept as vpmaddubsw leaves them, two int16 sums a lane, and widened once a sub-block by
// vpmaddwd against the scale: at most 32767 / (2 * 127 * code) dots of one accumulator (8 of 4-bit codes).
using Products = __m256i;
inline Products no_products() { return _mm256_setzero_si256(); }
inline Products dot_products(Products acc, Int codes, int32_t x) {
  return _mm256_add_epi16(acc, _mm256_maddubs_epi16(codes, _mm256_set1_epi32(x)));
}
inline Int scaled_sum(Products a, Products b, Int scale) {
  // The scale (at most 63) in both int16 halves of its lane.
  const Int pairs = or_bits(scale, shift_left(scale, 16));
  return add(_mm256_madd_epi16(a, pairs), _mm256_madd_epi16(b, pairs));
}

// The top bit of each byte apart: 127 * 127 and 128 * 127 pairs both fit int16.
inline Int dot_bytes(Int acc, Int codes, int32_t x) {
  const Int top = splat(static_cast<int32_t>(0x80808080u)), xs = _mm256_set1_epi32(x);
  const Int low = pairs_to_int32(_mm256_maddubs_epi16(_mm256_andnot_si256(top, codes), xs));
  const Int high = pairs_to_int32(_mm256_maddubs_epi16(and_bits(codes, top), xs));
  return add(acc, add(low, high));
}

inline int32_t sum_lanes(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
  return _mm_cvtsi128_si32(s);
}

inline float quantize_block(const float* x, int8_t* q, int32_t* sums) {
  const __m256 sign = _mm256_set1_ps(-0.f);
  __m256 v[4];
  for (int i = 0; i < 4; ++i) v[i] = _mm256_loadu_ps(x + 8 * i);
  const __m256 m = _mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(sign, v[0]), _mm256_andnot_ps(sign, v[1])),
                                 _mm256_max_ps(_mm256_andnot_ps(sign, v[2]), _mm256_andnot_ps(sign, v[3])));
  __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
  m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
  m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
  const float d = _mm_cvtss_f32(m4) / 127.f;
  const __m256 id = _mm256_set1_ps(d > 0.f ? 1.f / d : 0.f);
  __m256i i[4];
  for (int k = 0; k < 4; ++k) i[k] = _mm256_cvtps_epi32(_mm256_mul_ps(v[k], id));
  sums[0] = sum_lanes(_mm256_add_epi32(i[0], i[1]));
  sums[1] = sum_lanes(_mm256_add_epi32(i[2], i[3]));
  // The packs interleave 128-bit halves: dword k of the result holds values 4k..4k+3 after this permute.
  const __m256i packed = _mm256_packs_epi16(_mm256_packs_epi32(i[0], i[1]), _mm256_packs_epi32(i[2], i[3]));
  const __m256i ordered = _mm256_permutevar8x32_epi32(packed, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(q), ordered);
  return d;
}

#else
#error "int8_matvec.cpp is built for AVX512-VNNI or for AVX2 with FMA and F16C"
#endif

}  // namespace vec

// exp(x) as a short polynomial, scalar and on 16 AVX-512 lanes: used by decode attention's
// softmax (paged_decode.h) and the SiLU (activation.h), where libm's scalar expf was a
// quarter of the kernel's time (one call per element).
//
// Range reduction by powers of two and Cephes' expf coefficients: within 2 ulp of expf.
// Inputs below `lowest` are clamped to it (the callers pick a bound where the result no
// longer matters and 2^n stays a normal number); overflow gives inf, as expf does.
#pragma once

#include <cmath>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace baton {

inline float exp_poly(float x, float lowest) {
  x = x < lowest ? lowest : x;
  const float n = std::floor(x * 1.44269504088896341f + 0.5f);
  const float r = (x - n * 0.693359375f) + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const float y = p * r * r + r + 1.0f;
  return std::ldexp(y, static_cast<int>(n));
}

#if defined(__AVX512F__)
// The same on 16 lanes, with fused multiply-adds and scalef doing the 2^n.
inline __m512 exp_poly16(__m512 x, float lowest) {
  x = _mm512_max_ps(x, _mm512_set1_ps(lowest));
  const __m512 n = _mm512_roundscale_ps(
      _mm512_fmadd_ps(x, _mm512_set1_ps(1.44269504088896341f), _mm512_set1_ps(0.5f)),
      _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fmadd_ps(n, _mm512_set1_ps(2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  const __m512 y = _mm512_add_ps(_mm512_fmadd_ps(_mm512_mul_ps(p, r), r, r), _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(y, n);
}
#endif

}  // namespace baton

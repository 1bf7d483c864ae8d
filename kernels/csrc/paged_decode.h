// Decode attention straight over the paged KV cache, on CPU (kernels/cpu_paged_decode.py; built into the
// module of kernels/csrc/cpu_kernels.cpp).
//
// Why: the PyTorch reference (kernels/paged_attention.py) first copies every block a
// decode reads into a padded buffer (index_select) and then reads that copy with bmm, so
// each K/V byte crosses memory three times. Here each is read once, in place, through the
// block table: one pass over K for the scores, one over V for the output.
//
// Layouts (strides taken from the tensors, so the layer view of the whole cache works):
//   query           [N, Hq, D]
//   kv_cache_layer  [num_blocks, 2, Hkv, block_size, D]   (K at index 0 of dim 1)
//   block_tables    [N, max_blocks] int32
//   seq_lens        [N] int32: context length of each decode, the new token included
//   returns         [N, Hq, D]
// Query head h reads KV head h / (Hq / Hkv). One work item per (decode, KV head, chunk of
// 256 positions): its G query heads share every K/V row it reads. Scores and sums are
// float32 whatever the cache dtype; each softmax subtracts its maximum first, as
// torch.softmax does, and the chunks are merged by rescaling to the overall maximum.
// A decode of length 0 gets zeros.
//
// An FP8 cache (kernels/fp8_kv.py: uint8, rows of D float8_e4m3fn bytes then a float32
// scale) is read the same way, a quarter of the bytes of float32: each block's rows of one
// head are dequantized into a small float tile (fp8 * scale rounded to the query's dtype,
// as the reference's dequantize_rows computes it) that the float code then reads from L1.
#pragma once

#include <torch/extension.h>

#include <ATen/record_function.h>
#include <c10/util/Float8_e4m3fn.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>

#include "exp_poly.h"

#if defined(__AVX512F__)
#include <immintrin.h>
#endif
#include <limits>
#include <vector>

namespace baton {
namespace paged_decode_detail {

// Positions per work item: long contexts are split so that one decode still keeps every
// thread busy (flash-decoding); the chunks' partial softmaxes are merged at the end.
constexpr int64_t kChunk = 256;
// How many blocks ahead to prefetch: 1 to 4 measured the same on the 2-core VM (batch 1 at
// 2048 tokens, batch 32 at 512); 1 keeps the tail of a chunk simplest.
constexpr int64_t kAhead = 1;

// Ask for the next block's rows of this head (block_size x head_dim, contiguous) while the
// current block is computed: a decode's blocks lie a whole all-layer block apart (737 KB
// for SmolLM2-135M), so the hardware prefetcher stops at every block boundary.
template <typename scalar_t>
inline void prefetch_rows(const scalar_t* rows, int64_t count) {
  const char* p = reinterpret_cast<const char*>(rows);
  const int64_t bytes = count * static_cast<int64_t>(sizeof(scalar_t));
  for (int64_t off = 0; off < bytes; off += 64) __builtin_prefetch(p + off, 0, 0);
}

// Bytes of an FP8 row's scale, after its head_dim values (kernels/fp8_kv.py SCALE_BYTES).
constexpr int64_t kScaleBytes = 4;

// rows packed FP8 rows (row_stride bytes apart) -> out [rows, head_dim] float, each value
// fp8 * scale rounded to scalar_t as kernels/fp8_kv.py dequantize_rows rounds it.
template <typename scalar_t>
inline void dequantize_fp8_rows(const uint8_t* __restrict src, int64_t rows, int64_t row_stride,
                                int64_t head_dim, float* __restrict out) {
  for (int64_t r = 0; r < rows; ++r) {
    const uint8_t* row = src + r * row_stride;
    float* __restrict o = out + r * head_dim;
    float scale;
    std::memcpy(&scale, row + head_dim, sizeof(float));
    int64_t d = 0;
#if defined(__AVX512F__)
    if constexpr (std::is_same_v<scalar_t, float>) {
      // e4m3 -> half by moving the bits (sign to bit 15, exponent and mantissa up by 7):
      // the half is exactly the fp8 value / 2^8 (subnormals too, the exponent biases
      // being 7 and 15), and vcvtph2ps is exact. Times 2^8 * scale (exact: a power of
      // two) the product is the same real number as fp8 * scale, so it rounds the same.
      const __m512 s = _mm512_set1_ps(scale * 256.0f);
      const __m512i sign = _mm512_set1_epi32(0x80), magnitude = _mm512_set1_epi32(0x7F);
      for (; d + 16 <= head_dim; d += 16) {
        const __m512i w = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + d)));
        const __m512i half = _mm512_or_si512(_mm512_slli_epi32(_mm512_and_si512(w, sign), 8),
                                             _mm512_slli_epi32(_mm512_and_si512(w, magnitude), 7));
        _mm512_storeu_ps(o + d, _mm512_mul_ps(_mm512_cvtph_ps(_mm512_cvtepi32_epi16(half)), s));
      }
    }
#endif
    for (; d < head_dim; ++d) {
      const float v = static_cast<float>(c10::Float8_e4m3fn(row[d], c10::Float8_e4m3fn::from_bits()));
      o[d] = static_cast<float>(static_cast<scalar_t>(v * scale));
    }
  }
}

// Below e^-80 a softmax weight adds nothing to a float32 sum that holds e^0 = 1.
constexpr float kLowestScore = -80.0f;

// s[0..n) = exp(s[i] - peak); returns their sum.
inline float exp_shifted(float* __restrict s, int64_t n, float peak) {
  int64_t i = 0;
  float total = 0.0f;
#if defined(__AVX512F__)
  const __m512 shift = _mm512_set1_ps(peak);
  __m512 sum = _mm512_setzero_ps();
  for (; i + 16 <= n; i += 16) {
    const __m512 e = exp_poly16(_mm512_sub_ps(_mm512_loadu_ps(s + i), shift), kLowestScore);
    _mm512_storeu_ps(s + i, e);
    sum = _mm512_add_ps(sum, e);
  }
  total = _mm512_reduce_add_ps(sum);
#endif
  for (; i < n; ++i) {
    s[i] = exp_poly(s[i] - peak, kLowestScore);
    total += s[i];
  }
  return total;
}

#if defined(__AVX512F__)
// 16 values of a K/V row as float32: a float row as it is, a bfloat16 row widened exactly
// (its bits are a float's top half), so both dtypes take the vector paths below.
template <typename scalar_t>
constexpr bool kVectorRow = std::is_same_v<scalar_t, float> || std::is_same_v<scalar_t, c10::BFloat16>;

template <typename scalar_t>
inline __m512 load16(const scalar_t* p) {
  if constexpr (std::is_same_v<scalar_t, float>) {
    return _mm512_loadu_ps(p);
  } else {
    const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
  }
}
#endif

// Scores of one K row against the G query rows q [G, kD] (float32, AVX-512 when built
// for it): the row is loaded once into registers and reused by every head of the group.
template <typename scalar_t, int kD>
inline void score_row(const float* __restrict q, const scalar_t* __restrict kr, int64_t group,
                      int64_t head_dim, float* __restrict out, int64_t out_stride) {
#if defined(__AVX512F__)
  if constexpr (kVectorRow<scalar_t> && kD > 0 && kD % 16 == 0) {
    __m512 k[kD / 16];
    for (int j = 0; j < kD / 16; ++j) k[j] = load16(kr + 16 * j);
    for (int64_t g = 0; g < group; ++g) {
      const float* qg = q + g * kD;
      __m512 acc = _mm512_mul_ps(_mm512_loadu_ps(qg), k[0]);
      for (int j = 1; j < kD / 16; ++j) acc = _mm512_fmadd_ps(_mm512_loadu_ps(qg + 16 * j), k[j], acc);
      out[g * out_stride] = _mm512_reduce_add_ps(acc);
    }
    return;
  }
#endif
  for (int64_t g = 0; g < group; ++g) {
    const float* __restrict qg = q + g * head_dim;
    float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
    for (int64_t d = 0; d < head_dim; ++d) dot += qg[d] * static_cast<float>(kr[d]);
    out[g * out_stride] = dot;
  }
}

// a[kD] += sum over the block's rows r of p[r] * v[r] (rows cs3 apart), accumulators in
// registers for the whole block when built for AVX-512.
template <typename scalar_t, int kD>
inline void accumulate_rows(float* __restrict a, const float* __restrict p,
                            const scalar_t* __restrict v, int64_t rows, int64_t row_stride,
                            int64_t head_dim) {
#if defined(__AVX512F__)
  if constexpr (kVectorRow<scalar_t> && kD > 0 && kD % 16 == 0) {
    __m512 acc[kD / 16];
    for (int j = 0; j < kD / 16; ++j) acc[j] = _mm512_loadu_ps(a + 16 * j);
    for (int64_t r = 0; r < rows; ++r) {
      const __m512 pr = _mm512_set1_ps(p[r]);
      const scalar_t* vr = v + r * row_stride;
      for (int j = 0; j < kD / 16; ++j) acc[j] = _mm512_fmadd_ps(pr, load16(vr + 16 * j), acc[j]);
    }
    for (int j = 0; j < kD / 16; ++j) _mm512_storeu_ps(a + 16 * j, acc[j]);
    return;
  }
#endif
  for (int64_t r = 0; r < rows; ++r) {
    const float pr = p[r];
    const scalar_t* __restrict vr = v + r * row_stride;
#pragma omp simd
    for (int64_t d = 0; d < head_dim; ++d) a[d] += pr * static_cast<float>(vr[d]);
  }
}

// kD: head_dim when it is one of the common sizes (a compile-time trip count lets the
// compiler keep each row in vector registers), 0 for any other, read at run time.
// kFp8: the cache is packed FP8 rows (uint8) rather than scalar_t.
template <typename scalar_t, int kD, bool kFp8>
void decode_kernel(const torch::Tensor& query, const torch::Tensor& cache,
                   const torch::Tensor& block_tables, const torch::Tensor& seq_lens,
                   double scale, torch::Tensor& out) {
  const int64_t num_seqs = query.size(0), num_heads = query.size(1);
  const int64_t head_dim = kD > 0 ? kD : query.size(2);
  const int64_t num_kv_heads = cache.size(2), block_size = cache.size(3);
  const int64_t group = num_heads / num_kv_heads;
  const scalar_t* q_ptr = query.data_ptr<scalar_t>();
  using cache_t = std::conditional_t<kFp8, uint8_t, scalar_t>;
  const cache_t* c_ptr = cache.data_ptr<cache_t>();
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  scalar_t* o_ptr = out.data_ptr<scalar_t>();
  const int64_t qs0 = query.stride(0), qs1 = query.stride(1);
  const int64_t cs0 = cache.stride(0), cs1 = cache.stride(1), cs2 = cache.stride(2),
                cs3 = cache.stride(3);
  const int64_t ts0 = block_tables.stride(0);
  const int64_t os0 = out.stride(0), os1 = out.stride(1);
  const float fscale = static_cast<float>(scale);

  // Work items: (decode, KV head, chunk of positions); first_chunk[seq] numbers them.
  std::vector<int64_t> first_chunk(num_seqs + 1, 0);
  for (int64_t seq = 0; seq < num_seqs; ++seq) {
    const int64_t len = lens[seq] > 0 ? lens[seq] : 0;
    first_chunk[seq + 1] = first_chunk[seq] + (len + kChunk - 1) / kChunk;
  }
  const int64_t num_chunks = first_chunk[num_seqs];
  // Per (chunk, KV head): the running max and sum of each of its G query heads, and
  // their unnormalized output rows.
  std::vector<float> part_max(num_chunks * num_kv_heads * group);
  std::vector<float> part_sum(num_chunks * num_kv_heads * group);
  std::vector<float> part_acc(num_chunks * num_kv_heads * group * head_dim);

  at::parallel_for(0, num_chunks * num_kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> q_buf(group * head_dim), score_buf(group * kChunk);
    std::vector<float> tile_buf(kFp8 ? block_size * head_dim : 0);  // one block's rows, dequantized
    float* __restrict q = q_buf.data();
    float* __restrict scores = score_buf.data();
    float* __restrict tile = tile_buf.data();
    int64_t seq = 0;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t chunk = item / num_kv_heads, kvh = item % num_kv_heads;
      while (first_chunk[seq + 1] <= chunk) ++seq;
      const int64_t lo = (chunk - first_chunk[seq]) * kChunk;
      const int64_t hi = std::min<int64_t>(lo + kChunk, lens[seq]);
      const int64_t n = hi - lo;
      const int32_t* table = tables + seq * ts0;
      for (int64_t g = 0; g < group; ++g) {
        const scalar_t* src = q_ptr + seq * qs0 + (kvh * group + g) * qs1;
        for (int64_t d = 0; d < head_dim; ++d) q[g * head_dim + d] = static_cast<float>(src[d]) * fscale;
      }
      const int64_t block_rows = block_size * cs3;  // one head's rows of a block, in cache_t
      // Pass 1: scores against K, block by block, each row read once for all G heads.
      for (int64_t pos = lo; pos < hi;) {
        const int64_t b = pos / block_size, off = pos % block_size;
        const int64_t rows = std::min(block_size - off, hi - pos);
        if (pos + rows + (kAhead - 1) * block_size < hi)
          prefetch_rows(c_ptr + table[b + kAhead] * cs0 + kvh * cs2, block_rows);
        const cache_t* k = c_ptr + table[b] * cs0 + kvh * cs2 + off * cs3;
        if constexpr (kFp8) {
          dequantize_fp8_rows<scalar_t>(k, rows, cs3, head_dim, tile);
          for (int64_t r = 0; r < rows; ++r)
            score_row<float, kD>(q, tile + r * head_dim, group, head_dim, scores + pos - lo + r, kChunk);
        } else {
          for (int64_t r = 0; r < rows; ++r)
            score_row<scalar_t, kD>(q, k + r * cs3, group, head_dim, scores + pos - lo + r, kChunk);
        }
        pos += rows;
      }
      const int64_t slot = item * group;  // == (chunk * num_kv_heads + kvh) * group
      for (int64_t g = 0; g < group; ++g) {
        float* __restrict s = scores + g * kChunk;
        float peak = -std::numeric_limits<float>::infinity();
        for (int64_t i = 0; i < n; ++i) peak = s[i] > peak ? s[i] : peak;
        const float total = exp_shifted(s, n, peak);
        part_max[slot + g] = peak;
        part_sum[slot + g] = total;
      }
      // Pass 2: the weighted sum of V, block by block (a block's rows stay in L1 while
      // each of the G heads accumulates over them).
      float* __restrict acc = part_acc.data() + slot * head_dim;
      std::fill(acc, acc + group * head_dim, 0.0f);
      for (int64_t pos = lo; pos < hi;) {
        const int64_t b = pos / block_size, off = pos % block_size;
        const int64_t rows = std::min(block_size - off, hi - pos);
        if (pos + rows + (kAhead - 1) * block_size < hi)
          prefetch_rows(c_ptr + table[b + kAhead] * cs0 + cs1 + kvh * cs2, block_rows);
        const cache_t* v = c_ptr + table[b] * cs0 + cs1 + kvh * cs2 + off * cs3;
        if constexpr (kFp8) {
          dequantize_fp8_rows<scalar_t>(v, rows, cs3, head_dim, tile);
          for (int64_t g = 0; g < group; ++g)
            accumulate_rows<float, kD>(acc + g * head_dim, scores + g * kChunk + pos - lo, tile, rows,
                                       head_dim, head_dim);
        } else {
          for (int64_t g = 0; g < group; ++g)
            accumulate_rows<scalar_t, kD>(acc + g * head_dim, scores + g * kChunk + pos - lo, v, rows,
                                          cs3, head_dim);
        }
        pos += rows;
      }
    }
  });

  // Merge each decode's chunks: rescale to the overall max, sum, normalize.
  at::parallel_for(0, num_seqs * num_kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> row(head_dim);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t seq = item / num_kv_heads, kvh = item % num_kv_heads;
      for (int64_t g = 0; g < group; ++g) {
        scalar_t* dst = o_ptr + seq * os0 + (kvh * group + g) * os1;
        float peak = -std::numeric_limits<float>::infinity();
        for (int64_t c = first_chunk[seq]; c < first_chunk[seq + 1]; ++c)
          peak = std::max(peak, part_max[(c * num_kv_heads + kvh) * group + g]);
        float total = 0.0f;
        std::fill(row.begin(), row.end(), 0.0f);
        for (int64_t c = first_chunk[seq]; c < first_chunk[seq + 1]; ++c) {
          const int64_t slot = (c * num_kv_heads + kvh) * group + g;
          const float w = std::exp(part_max[slot] - peak);
          total += w * part_sum[slot];
          const float* a = part_acc.data() + slot * head_dim;
          for (int64_t d = 0; d < head_dim; ++d) row[d] += w * a[d];
        }
        const float inv = total > 0.0f ? 1.0f / total : 0.0f;
        for (int64_t d = 0; d < head_dim; ++d) dst[d] = static_cast<scalar_t>(row[d] * inv);
      }
    }
  });
}

}  // namespace paged_decode_detail

inline torch::Tensor paged_decode(const torch::Tensor& query, const torch::Tensor& kv_cache_layer,
                           const torch::Tensor& block_tables, const torch::Tensor& seq_lens,
                           double scale) {
  TORCH_CHECK(query.dim() == 3 && kv_cache_layer.dim() == 5, "query [N, Hq, D], cache [nb, 2, Hkv, bs, D]");
  const bool fp8 = kv_cache_layer.scalar_type() == at::kByte;
  TORCH_CHECK(fp8 || query.scalar_type() == kv_cache_layer.scalar_type(), "query and cache dtypes differ");
  TORCH_CHECK(query.stride(2) == 1 && kv_cache_layer.stride(4) == 1, "head_dim must be contiguous");
  TORCH_CHECK(query.size(2) + (fp8 ? paged_decode_detail::kScaleBytes : 0) == kv_cache_layer.size(4),
              fp8 ? "an FP8 cache's rows must be the query's head_dim + 4 bytes"
                  : "query and cache head_dim differ");
  TORCH_CHECK(query.size(1) % kv_cache_layer.size(2) == 0, "num_heads must be a multiple of num_kv_heads");
  TORCH_CHECK(block_tables.scalar_type() == torch::kInt32 && seq_lens.scalar_type() == torch::kInt32,
              "block_tables and seq_lens must be int32");
  TORCH_CHECK(block_tables.size(0) >= query.size(0) && seq_lens.size(0) >= query.size(0),
              "one block table and one length per decode");
  // A named scope for torch's profiler (bench/profile_step.py): nearly free when it is off.
  RECORD_FUNCTION("baton::paged_decode", std::vector<c10::IValue>());
  auto tables = block_tables.stride(1) == 1 ? block_tables : block_tables.contiguous();
  auto lens = seq_lens.contiguous();
  auto out = torch::empty_like(query);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::ScalarType::BFloat16, at::ScalarType::Half, query.scalar_type(),
                                  "paged_decode", [&] {
    using namespace paged_decode_detail;
    const auto run = [&](auto fp8_tag) {
      constexpr bool kFp8 = decltype(fp8_tag)::value;
      switch (query.size(2)) {
        case 64: decode_kernel<scalar_t, 64, kFp8>(query, kv_cache_layer, tables, lens, scale, out); break;
        case 128: decode_kernel<scalar_t, 128, kFp8>(query, kv_cache_layer, tables, lens, scale, out); break;
        default: decode_kernel<scalar_t, 0, kFp8>(query, kv_cache_layer, tables, lens, scale, out);
      }
    };
    if (fp8) run(std::true_type{}); else run(std::false_type{});
  });
  return out;
}

}  // namespace baton

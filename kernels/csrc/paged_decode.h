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
#pragma once

#include <torch/extension.h>

#include <ATen/record_function.h>

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

// Scores of one K row against the G query rows q [G, kD] (float32, AVX-512 when built
// for it): the row is loaded once into registers and reused by every head of the group.
template <typename scalar_t, int kD>
inline void score_row(const float* __restrict q, const scalar_t* __restrict kr, int64_t group,
                      int64_t head_dim, float* __restrict out, int64_t out_stride) {
#if defined(__AVX512F__)
  if constexpr (std::is_same_v<scalar_t, float> && kD > 0 && kD % 16 == 0) {
    __m512 k[kD / 16];
    for (int j = 0; j < kD / 16; ++j) k[j] = _mm512_loadu_ps(kr + 16 * j);
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
  if constexpr (std::is_same_v<scalar_t, float> && kD > 0 && kD % 16 == 0) {
    __m512 acc[kD / 16];
    for (int j = 0; j < kD / 16; ++j) acc[j] = _mm512_loadu_ps(a + 16 * j);
    for (int64_t r = 0; r < rows; ++r) {
      const __m512 pr = _mm512_set1_ps(p[r]);
      const float* vr = v + r * row_stride;
      for (int j = 0; j < kD / 16; ++j) acc[j] = _mm512_fmadd_ps(pr, _mm512_loadu_ps(vr + 16 * j), acc[j]);
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
template <typename scalar_t, int kD>
void decode_kernel(const torch::Tensor& query, const torch::Tensor& cache,
                   const torch::Tensor& block_tables, const torch::Tensor& seq_lens,
                   double scale, torch::Tensor& out) {
  const int64_t num_seqs = query.size(0), num_heads = query.size(1);
  const int64_t head_dim = kD > 0 ? kD : query.size(2);
  const int64_t num_kv_heads = cache.size(2), block_size = cache.size(3);
  const int64_t group = num_heads / num_kv_heads;
  const scalar_t* q_ptr = query.data_ptr<scalar_t>();
  const scalar_t* c_ptr = cache.data_ptr<scalar_t>();
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
    float* __restrict q = q_buf.data();
    float* __restrict scores = score_buf.data();
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
      const int64_t block_rows = block_size * head_dim;
      // Pass 1: scores against K, block by block, each row read once for all G heads.
      for (int64_t pos = lo; pos < hi;) {
        const int64_t b = pos / block_size, off = pos % block_size;
        const int64_t rows = std::min(block_size - off, hi - pos);
        if (pos + rows + (kAhead - 1) * block_size < hi)
          prefetch_rows(c_ptr + table[b + kAhead] * cs0 + kvh * cs2, block_rows);
        const scalar_t* k = c_ptr + table[b] * cs0 + kvh * cs2 + off * cs3;
        for (int64_t r = 0; r < rows; ++r)
          score_row<scalar_t, kD>(q, k + r * cs3, group, head_dim, scores + pos - lo + r, kChunk);
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
        const scalar_t* v = c_ptr + table[b] * cs0 + cs1 + kvh * cs2 + off * cs3;
        for (int64_t g = 0; g < group; ++g)
          accumulate_rows<scalar_t, kD>(acc + g * head_dim, scores + g * kChunk + pos - lo, v, rows,
                                        cs3, head_dim);
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
  TORCH_CHECK(query.scalar_type() == kv_cache_layer.scalar_type(), "query and cache dtypes differ");
  TORCH_CHECK(query.stride(2) == 1 && kv_cache_layer.stride(4) == 1, "head_dim must be contiguous");
  TORCH_CHECK(query.size(2) == kv_cache_layer.size(4), "query and cache head_dim differ");
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
                                    switch (query.size(2)) {
                                      case 64: paged_decode_detail::decode_kernel<scalar_t, 64>(query, kv_cache_layer, tables, lens, scale, out); break;
                                      case 128: paged_decode_detail::decode_kernel<scalar_t, 128>(query, kv_cache_layer, tables, lens, scale, out); break;
                                      default: paged_decode_detail::decode_kernel<scalar_t, 0>(query, kv_cache_layer, tables, lens, scale, out);
                                    }
                                  });
  return out;
}

}  // namespace baton


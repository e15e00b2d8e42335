// quantkit's one-token CPU kernels (built on first use by quantkit/kernels/native.py, with -march=native).
//
// gemv_bf16:  y[n] = sum_k W[n, k] x[k], W bf16 [N, K] row-major, x bf16 [K]; float32 sums, y bf16 (rounded
//             to nearest even once, at the end), as F.linear's dtype.
// int4_gemv:  the same for a weight in the layout torch's `_convert_weight_to_int4pack_for_cpu` writes on an
//             AVX-512 CPU (rows in blocks of 64; for each block and input column k, 32 bytes: byte j holds
//             row j's code in its low nibble and row j + 32's in its high nibble; on AVX2 blocks of 32 rows and
//             16 bytes, rows j and j + 16), with the scales and zeros
//             that op reads (bf16 [K / group, N_pad, 2]): W[n, k] = (u - 8) * scale + zero. Each group's
//             sum over u * x is kept in float32 and scaled once per group:
//             y[n] = sum_g scale[g, n] * sum_{k in g} u[n, k] x[k] + (zero[g, n] - 8 scale[g, n]) * sum_{k in g} x[k].
// Both split the rows over torch's own threads (at::parallel_for), so no second thread pool competes.

#include "native_cpu.h"

#include <ATen/Parallel.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

namespace {

inline float bf16_to_float(uint16_t v) {
  uint32_t bits = static_cast<uint32_t>(v) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

inline uint16_t float_to_bf16(float f) {  // round to nearest even, NaN kept a NaN
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x40);
  bits += 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>(bits >> 16);
}

#if defined(__AVX512F__)
inline __m512 load_bf16x16(const uint16_t* p) {
  __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
#endif

// 16 (AVX-512) or 8 (AVX2) values of a float32 or bf16 row widened to float32 lanes; sum8: an AVX2 vector's lanes added
#if defined(__AVX512F__)
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const uint16_t* p) { return load_bf16x16(p); }
#elif defined(__AVX2__) && defined(__FMA__)
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const uint16_t* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
inline float sum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_hadd_ps(s, s);
  return _mm_cvtss_f32(_mm_hadd_ps(s, s));
}
#endif

float dot_bf16(const uint16_t* w, const uint16_t* x, int64_t k) {
  int64_t i = 0;
  float sum = 0.f;
#if defined(__AVX512BF16__) && defined(__AVX512F__)
  __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps();
  for (; i + 64 <= k; i += 64) {
    a0 = _mm512_dpbf16_ps(a0, (__m512bh)_mm512_loadu_si512(w + i), (__m512bh)_mm512_loadu_si512(x + i));
    a1 = _mm512_dpbf16_ps(a1, (__m512bh)_mm512_loadu_si512(w + i + 32), (__m512bh)_mm512_loadu_si512(x + i + 32));
  }
  sum = _mm512_reduce_add_ps(_mm512_add_ps(a0, a1));
#elif defined(__AVX512F__)
  __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps();
  for (; i + 32 <= k; i += 32) {
    a0 = _mm512_fmadd_ps(load_bf16x16(w + i), load_bf16x16(x + i), a0);
    a1 = _mm512_fmadd_ps(load_bf16x16(w + i + 16), load_bf16x16(x + i + 16), a1);
  }
  sum = _mm512_reduce_add_ps(_mm512_add_ps(a0, a1));
#elif defined(__AVX2__) && defined(__FMA__)
  __m256 a0 = _mm256_setzero_ps();
  for (; i + 8 <= k; i += 8) a0 = _mm256_fmadd_ps(load8(w + i), load8(x + i), a0);
  sum = sum8(a0);
#endif
  for (; i < k; ++i) sum += bf16_to_float(w[i]) * bf16_to_float(x[i]);
  return sum;
}

void check_bf16(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == torch::kBFloat16 && t.is_contiguous(),
              name, " must be a contiguous bfloat16 CPU tensor");
}

}  // namespace

torch::Tensor gemv_bf16(const torch::Tensor& weight, const torch::Tensor& x) {
  check_bf16(weight, "weight");
  check_bf16(x, "x");
  TORCH_CHECK(weight.dim() == 2 && x.numel() == weight.size(1), "gemv_bf16: x must have weight.size(1) values");
  const int64_t n = weight.size(0), k = weight.size(1);
  auto y = torch::empty({n}, x.options());
  const auto* w = reinterpret_cast<const uint16_t*>(weight.data_ptr());
  const auto* xv = reinterpret_cast<const uint16_t*>(x.data_ptr());
  auto* out = reinterpret_cast<uint16_t*>(y.data_ptr());
  const int64_t grain = std::max<int64_t>(16, (1 << 16) / std::max<int64_t>(k, 1));
  at::parallel_for(0, n, grain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) out[r] = float_to_bf16(dot_bf16(w + r * k, xv, k));
  });
  return y;
}

// Whether int4_gemv reads the layout with `block_rows` rows per block (64: the op's AVX-512 layout, 32: AVX2's).
bool int4_available(int64_t block_rows) {
#if defined(__AVX512F__)
  if (block_rows == 64) return true;
#endif
#if defined(__AVX2__) && defined(__FMA__)
  if (block_rows == 32) return true;
#endif
  return false;
}

namespace {
constexpr int64_t kPrefetch = 1024;  // bytes ahead of the columns being read
constexpr int kHighHalf = static_cast<int>(0xffff0000u);  // a scale / zero word's zero: its high 16 bits

#if defined(__AVX2__) && defined(__FMA__)
// One block of 32 rows of the op's AVX2 layout (for each column, 16 bytes: byte j holds row j's code in its low
// nibble and row j + 16's in its high nibble), over every group, by float32 FMAs: out[0..31].
void int4_block32(const uint8_t* packed, const uint32_t* sz, const float* x, const float* xsum, int64_t k,
                  int64_t group, int64_t n_pad, int64_t block, float* out) {
  __m256 y[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
  const __m128i low = _mm_set1_epi8(0x0f);
  const uint8_t* p = packed + block * k * 16;
  for (int64_t g = 0; g * group < k; ++g) {
    __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
    const int64_t k_end = std::min(k, (g + 1) * group);
    for (int64_t c = g * group; c < k_end; ++c) {
      _mm_prefetch(reinterpret_cast<const char*>(p + c * 16 + kPrefetch), _MM_HINT_T0);
      const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + c * 16));
      const __m128i lo = _mm_and_si128(bytes, low), hi = _mm_and_si128(_mm_srli_epi16(bytes, 4), low);
      const __m256 xc = _mm256_set1_ps(x[c]);
      acc[0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo)), xc, acc[0]);
      acc[1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8))), xc, acc[1]);
      acc[2] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi)), xc, acc[2]);
      acc[3] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8))), xc, acc[3]);
    }
    const uint32_t* row_sz = sz + g * n_pad + block * 32;
    const __m256 sx = _mm256_set1_ps(xsum[g]);
    for (int q = 0; q < 4; ++q) {
      const __m256i words = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row_sz + 8 * q));
      const __m256 scale = _mm256_castsi256_ps(_mm256_slli_epi32(words, 16));
      const __m256 zero = _mm256_castsi256_ps(_mm256_and_si256(words, _mm256_set1_epi32(kHighHalf)));
      y[q] = _mm256_fmadd_ps(scale, acc[q], y[q]);
      y[q] = _mm256_fmadd_ps(_mm256_fnmadd_ps(_mm256_set1_ps(8.f), scale, zero), sx, y[q]);
    }
  }
  for (int q = 0; q < 4; ++q) _mm256_storeu_ps(out + 8 * q, y[q]);
}
#endif
}  // namespace

#if defined(__AVX512F__)
namespace {

constexpr int64_t kBlock = 64;  // rows per block of the op's AVX-512 layout

// One group's sums of a 64-row block into its outputs: y[q] += scale * acc[q] + (zero - offset * scale) * sum_x for
// rows 16 q .. 16 q + 15, whose scale / zero words (scale in the low half, zero in the high) start at row_sz;
// offset is what the block's codes carry beyond the weight's (8: u - 8; 8 + 128 where each code was read as 128 + u).
inline void scale_group(__m512 y[4], const __m512 acc[4], const uint32_t* row_sz, float sum_x, float offset) {
  const __m512 sx = _mm512_set1_ps(sum_x), off = _mm512_set1_ps(offset);
  for (int q = 0; q < 4; ++q) {
    const __m512i words = _mm512_loadu_si512(row_sz + 16 * q);
    const __m512 scale = _mm512_castsi512_ps(_mm512_slli_epi32(words, 16));
    const __m512 zero = _mm512_castsi512_ps(_mm512_and_si512(words, _mm512_set1_epi32(kHighHalf)));
    y[q] = _mm512_fmadd_ps(scale, acc[q], y[q]);
    y[q] = _mm512_fmadd_ps(_mm512_fnmadd_ps(off, scale, zero), sx, y[q]);
  }
}

// One block of 64 rows over every group: out[0..63] in float32.
void int4_block(const uint8_t* packed, const uint32_t* sz, const float* x, const float* xsum, int64_t k,
                int64_t group, int64_t n_pad, int64_t block, float* out) {
  __m512 y[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
  const __m256i low = _mm256_set1_epi8(0x0f);
  const uint8_t* p = packed + block * k * 32;
  for (int64_t g = 0; g * group < k; ++g) {
    __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
    const int64_t k_end = std::min(k, (g + 1) * group);
    for (int64_t c = g * group; c < k_end; ++c) {
      const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + c * 32));
      const __m256i lo = _mm256_and_si256(bytes, low);
      const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), low);
      const __m512 xc = _mm512_set1_ps(x[c]);
      acc[0] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm256_castsi256_si128(lo))), xc, acc[0]);
      acc[1] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm256_extracti128_si256(lo, 1))), xc, acc[1]);
      acc[2] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm256_castsi256_si128(hi))), xc, acc[2]);
      acc[3] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm256_extracti128_si256(hi, 1))), xc, acc[3]);
    }
    scale_group(y, acc, sz + g * n_pad + block * kBlock, xsum[g], 8.f);
  }
  for (int q = 0; q < 4; ++q) _mm512_storeu_ps(out + 16 * q, y[q]);
}

#if defined(__AVX512BF16__) && defined(__AVX512VBMI__)
// The same with two input columns per step. One 64-byte load holds columns c and c + 1 (32 bytes each); a byte
// permute (vpermb, zeroing every other byte) puts row r's bytes of both columns into one 32-bit lane, 16 rows
// a register; masking a nibble and setting the exponent bits 0x4300 makes each 16-bit half the exact bf16 of
// 128 + u; vdpbf16ps multiplies the pair with (x[c], x[c + 1]) and adds both products: a quarter of the
// instructions of `int4_block` per weight, no table lookups. The 128 * sum(x) this adds per group is taken
// back with the zero term: y += scale * acc + (zero - (8 + 128) * scale) * sum_{k in g} x[k].
void int4_block_bf16(const uint8_t* packed, const uint32_t* sz, const uint16_t* xb, const float* xsum,
                     int64_t k, int64_t group, int64_t n_pad, int64_t block, float* out) {
  __m512 y[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
  // lane r of `first`: bytes r and 32 + r (rows r of columns c and c + 1), of `second`: 16 + r and 48 + r
  alignas(64) uint8_t index_first[64], index_second[64];
  for (int r = 0; r < 16; ++r) {
    index_first[4 * r] = static_cast<uint8_t>(r), index_first[4 * r + 2] = static_cast<uint8_t>(32 + r);
    index_second[4 * r] = static_cast<uint8_t>(16 + r), index_second[4 * r + 2] = static_cast<uint8_t>(48 + r);
    index_first[4 * r + 1] = index_first[4 * r + 3] = index_second[4 * r + 1] = index_second[4 * r + 3] = 0;
  }
  const __m512i first = _mm512_load_si512(index_first), second = _mm512_load_si512(index_second);
  const __mmask64 keep = 0x5555555555555555ull;  // bytes 0 and 2 of every 32-bit lane; 1 and 3 zeroed
  const __m512i nibble = _mm512_set1_epi32(0x000f000f), exponent = _mm512_set1_epi32(0x43004300);
  const uint8_t* p = packed + block * k * 32;
  for (int64_t g = 0; g * group < k; ++g) {
    // acc[0]: rows 0-15 (low nibbles of bytes 0-15), [1]: rows 16-31, [2]: 32-47 (high nibbles), [3]: 48-63
    __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
    const int64_t k_end = std::min(k, (g + 1) * group);
    for (int64_t c = g * group; c < k_end; c += 2) {
      _mm_prefetch(reinterpret_cast<const char*>(p + c * 32 + kPrefetch), _MM_HINT_T0);
      const __m512i both = _mm512_loadu_si512(p + c * 32);
      int32_t pair;  // (x[c], x[c + 1]) as they lie in memory: the low and high halves of one 32-bit word
      std::memcpy(&pair, xb + c, 4);
      const __m512bh xp = (__m512bh)_mm512_set1_epi32(pair);
      const __m512i a = _mm512_maskz_permutexvar_epi8(keep, first, both);
      const __m512i b = _mm512_maskz_permutexvar_epi8(keep, second, both);
      // (v & nibble) | exponent: ternary-logic table 0xEA
      acc[0] = _mm512_dpbf16_ps(acc[0], (__m512bh)_mm512_ternarylogic_epi32(a, nibble, exponent, 0xEA), xp);
      acc[1] = _mm512_dpbf16_ps(acc[1], (__m512bh)_mm512_ternarylogic_epi32(b, nibble, exponent, 0xEA), xp);
      acc[2] = _mm512_dpbf16_ps(acc[2], (__m512bh)_mm512_ternarylogic_epi32(_mm512_srli_epi32(a, 4), nibble,
                                                                            exponent, 0xEA), xp);
      acc[3] = _mm512_dpbf16_ps(acc[3], (__m512bh)_mm512_ternarylogic_epi32(_mm512_srli_epi32(b, 4), nibble,
                                                                            exponent, 0xEA), xp);
    }
    scale_group(y, acc, sz + g * n_pad + block * kBlock, xsum[g], 136.f);
  }
  for (int q = 0; q < 4; ++q) _mm512_storeu_ps(out + 16 * q, y[q]);
}
#endif

}  // namespace
#endif

namespace {

// One block of `block_rows` rows into rows[], by the best kernel this build has for the layout.
void int4_rows(int64_t block_rows, const uint8_t* p, const uint32_t* sz, const float* xf, const uint16_t* xb,
               const float* xsum, int64_t k, int64_t group, int64_t n_pad, int64_t b, float* rows) {
#if defined(__AVX512BF16__) && defined(__AVX512VBMI__)
  if (block_rows == 64 && group % 2 == 0) return int4_block_bf16(p, sz, xb, xsum, k, group, n_pad, b, rows);
#endif
#if defined(__AVX512F__)
  if (block_rows == 64) return int4_block(p, sz, xf, xsum, k, group, n_pad, b, rows);
#endif
#if defined(__AVX2__) && defined(__FMA__)
  if (block_rows == 32) return int4_block32(p, sz, xf, xsum, k, group, n_pad, b, rows);
#endif
  TORCH_CHECK(false, "int4_gemv: this build cannot read blocks of ", block_rows, " rows");
}

}  // namespace

namespace {

// x (bf16, k values) widened to float32 into xf, and each group's sum into xsum (16 lanes a step where the group
// allows; no integer division per value: that alone cost more than the GEMV at K = 16384)
void widen_and_sum(const uint16_t* xb, int64_t k, int64_t group, float* xf, float* xsum) {
  for (int64_t g = 0; g * group < k; ++g) {
    const int64_t begin = g * group, end = begin + group;
    int64_t c = begin;
    float sum = 0.f;
#if defined(__AVX512F__)
    __m512 acc = _mm512_setzero_ps();
    for (; c + 16 <= end; c += 16) {
      const __m512 v = load_bf16x16(xb + c);
      _mm512_storeu_ps(xf + c, v);
      acc = _mm512_add_ps(acc, v);
    }
    sum = _mm512_reduce_add_ps(acc);
#elif defined(__AVX2__) && defined(__FMA__)
    __m256 acc = _mm256_setzero_ps();
    for (; c + 8 <= end; c += 8) {
      const __m256 v = load8(xb + c);
      _mm256_storeu_ps(xf + c, v);
      acc = _mm256_add_ps(acc, v);
    }
    sum = sum8(acc);
#endif
    for (; c < end; ++c) {
      xf[c] = bf16_to_float(xb[c]);
      sum += xf[c];
    }
    xsum[g] = sum;
  }
}

}  // namespace

torch::Tensor int4_gemv(const torch::Tensor& packed, const torch::Tensor& scale_zeros, const torch::Tensor& x,
                        int64_t group, int64_t out_features, int64_t block_rows) {
  TORCH_CHECK(int4_available(block_rows), "int4_gemv: this build cannot read blocks of ", block_rows, " rows");
  check_bf16(scale_zeros, "scale_zeros");
  check_bf16(x, "x");
  TORCH_CHECK(packed.scalar_type() == torch::kUInt8 && packed.is_contiguous() && packed.dim() == 2,
              "int4_gemv: packed must be the op's contiguous uint8 [N_pad, K / 2] layout");
  const int64_t n_pad = packed.size(0), k = packed.size(1) * 2;
  TORCH_CHECK(n_pad % block_rows == 0 && x.numel() == k && group > 0 && k % group == 0 && out_features <= n_pad,
              "int4_gemv: rows must come in whole blocks and x must have K values in whole groups");
  TORCH_CHECK(scale_zeros.dim() == 3 && scale_zeros.size(0) == k / group && scale_zeros.size(1) == n_pad,
              "int4_gemv: scale_zeros must be [K / group, N_pad, 2]");
  const auto* xb = reinterpret_cast<const uint16_t*>(x.data_ptr());
  std::vector<float> xf(k), xsum(k / group);
  widen_and_sum(xb, k, group, xf.data(), xsum.data());
  auto y = torch::empty({out_features}, x.options());
  auto* out = reinterpret_cast<uint16_t*>(y.data_ptr());
  const auto* p = packed.data_ptr<uint8_t>();
  const auto* sz = reinterpret_cast<const uint32_t*>(scale_zeros.data_ptr());
  at::parallel_for(0, n_pad / block_rows, 1, [&](int64_t begin, int64_t end) {
    float rows[64];
    for (int64_t b = begin; b < end; ++b) {
      int4_rows(block_rows, p, sz, xf.data(), xb, xsum.data(), k, group, n_pad, b, rows);
      for (int64_t r = 0; r < block_rows && b * block_rows + r < out_features; ++r)
        out[b * block_rows + r] = float_to_bf16(rows[r]);
    }
  });
  return y;
}

namespace {

// One query's attention over `length` cached positions of one kv head, for the `group` query heads that share
// it: scores in float32, a softmax, the weighted sum of values; T is element type of q, keys and values.
template <typename T>
float widen(T v);
template <>
inline float widen<float>(float v) { return v; }
template <>
inline float widen<uint16_t>(uint16_t v) { return bf16_to_float(v); }


// dot(qf, k) over dim values, qf already float32
template <typename T>
inline float dot_row(const float* qf, const T* k, int64_t dim) {
  int64_t d = 0;
  float sum = 0.f;
#if defined(__AVX512F__)
  __m512 acc = _mm512_setzero_ps();
  for (; d + 16 <= dim; d += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(qf + d), load16(k + d), acc);
  sum = _mm512_reduce_add_ps(acc);
#elif defined(__AVX2__) && defined(__FMA__)
  __m256 acc = _mm256_setzero_ps();
  for (; d + 8 <= dim; d += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(qf + d), load8(k + d), acc);
  sum = sum8(acc);
#endif
  for (; d < dim; ++d) sum += qf[d] * widen<T>(k[d]);
  return sum;
}

// acc += p * v over dim values
template <typename T>
inline void add_row(float* acc, float p, const T* v, int64_t dim) {
  int64_t d = 0;
#if defined(__AVX512F__)
  const __m512 pv = _mm512_set1_ps(p);
  for (; d + 16 <= dim; d += 16)
    _mm512_storeu_ps(acc + d, _mm512_fmadd_ps(pv, load16(v + d), _mm512_loadu_ps(acc + d)));
#elif defined(__AVX2__) && defined(__FMA__)
  const __m256 pv = _mm256_set1_ps(p);
  for (; d + 8 <= dim; d += 8) _mm256_storeu_ps(acc + d, _mm256_fmadd_ps(pv, load8(v + d), _mm256_loadu_ps(acc + d)));
#endif
  for (; d < dim; ++d) acc[d] += p * widen<T>(v[d]);
}

// one kv head's cached rows: position t's `dim` values start at base + t * stride
template <typename T>
struct Rows {
  const T* base;
  int64_t stride;
  const T* at(int64_t t) const { return base + t * stride; }
};

// The `group` query heads that share one kv head: scores (float32, the mask added), a softmax per head, the
// weighted sum of values; each key and value row is read once for the whole group.
template <typename T>
void attend_group(const T* q, Rows<T> keys, Rows<T> values, const float* mask, int64_t length, int64_t dim,
                  int64_t group, float scale, float* qf, float* scores, float* acc, T* out) {
  for (int64_t i = 0; i < group * dim; ++i) qf[i] = widen<T>(q[i]);
  for (int64_t t = 0; t < length; ++t) {
    const T* kt = keys.at(t);
    for (int64_t h = 0; h < group; ++h)
      scores[h * length + t] = dot_row<T>(qf + h * dim, kt, dim) * scale + (mask ? mask[t] : 0.f);
  }
  std::vector<float> inv(group);
  for (int64_t h = 0; h < group; ++h) {
    float* sh = scores + h * length;
    float best = -INFINITY, total = 0.f;
    for (int64_t t = 0; t < length; ++t) best = std::max(best, sh[t]);
    for (int64_t t = 0; t < length; ++t) {
      sh[t] = best == -INFINITY ? 0.f : std::exp(sh[t] - best);
      total += sh[t];
    }
    inv[h] = total > 0.f ? 1.f / total : 0.f;
  }
  std::fill(acc, acc + group * dim, 0.f);
  for (int64_t t = 0; t < length; ++t) {
    const T* vt = values.at(t);
    for (int64_t h = 0; h < group; ++h) add_row<T>(acc + h * dim, scores[h * length + t], vt, dim);
  }
  for (int64_t h = 0; h < group; ++h) {
    for (int64_t d = 0; d < dim; ++d) {
      const float v = acc[h * dim + d] * inv[h];
      if constexpr (std::is_same<T, float>::value) {
        out[h * dim + d] = v;
      } else {
        out[h * dim + d] = float_to_bf16(v);
      }
    }
  }
}

// Every (sequence, kv head) pair over torch's threads: q [B, H, D] contiguous, out [B, H, D].
template <typename T>
void attend_parallel(const T* q, const torch::Tensor& keys, const torch::Tensor& values, const float* mask,
                     int64_t length, float scale, int64_t batch, int64_t heads, T* out) {
  const int64_t kv_heads = keys.size(1), dim = keys.size(3), group = heads / kv_heads;
  const T* kp = reinterpret_cast<const T*>(keys.data_ptr());
  const T* vp = reinterpret_cast<const T*>(values.data_ptr());
  at::parallel_for(0, batch * kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(group * dim), scores(group * length), acc(group * dim);
    for (int64_t i = begin; i < end; ++i) {
      const int64_t b = i / kv_heads, kv = i % kv_heads, head0 = kv * group;
      const Rows<T> k_rows{kp + b * keys.stride(0) + kv * keys.stride(1), keys.stride(2)};
      const Rows<T> v_rows{vp + b * values.stride(0) + kv * values.stride(1), values.stride(2)};
      attend_group<T>(q + (b * heads + head0) * dim, k_rows, v_rows, mask ? mask + b * length : nullptr, length,
                      dim, group, scale, qf.data(), scores.data(), acc.data(), out + (b * heads + head0) * dim);
    }
  });
}

template <typename T>
void attend_all(const torch::Tensor& q, const torch::Tensor& keys, const torch::Tensor& values,
                const c10::optional<torch::Tensor>& mask, int64_t length, double scale, torch::Tensor& out) {
  attend_parallel<T>(reinterpret_cast<const T*>(q.data_ptr()), keys, values, mask ? mask->data_ptr<float>() : nullptr,
                     length, static_cast<float>(scale), q.size(0), q.size(1), reinterpret_cast<T*>(out.data_ptr()));
}

}  // namespace

// One query per sequence: q [B, H, D]; keys / values [B, H_kv, S, D] (a static cache, S slots, or a view of a
// gathered paged context: any strides over B, H_kv and S, rows of D contiguous) of which the
// first `length` are read; mask [B, length] float32, added to the scores (or None). Returns [B, H, D].
torch::Tensor attend_one(const torch::Tensor& q, const torch::Tensor& keys, const torch::Tensor& values,
                         const c10::optional<torch::Tensor>& mask, int64_t length, double scale) {
  TORCH_CHECK(q.dim() == 3 && keys.dim() == 4 && values.sizes() == keys.sizes() && q.is_contiguous() &&
              keys.stride(3) == 1 && values.stride(3) == 1, "attend_one: contiguous q [B, H, D]; cache [B, Hkv, S, D] "
              "with contiguous rows (any strides over batch, heads and positions)");
  TORCH_CHECK(q.scalar_type() == keys.scalar_type() && q.scalar_type() == values.scalar_type() &&
              (q.scalar_type() == torch::kBFloat16 || q.scalar_type() == torch::kFloat32),
              "attend_one: bf16 or float32");
  TORCH_CHECK(q.size(0) == keys.size(0) && q.size(2) == keys.size(3) && q.size(1) % keys.size(1) == 0 &&
              length >= 1 && length <= keys.size(2), "attend_one: shapes of q and the cache disagree");
  TORCH_CHECK(!mask || (mask->scalar_type() == torch::kFloat32 && mask->is_contiguous() && mask->dim() == 2 &&
              mask->size(0) == q.size(0) && mask->size(1) == length), "attend_one: mask must be float32 [B, length]");
  auto out = torch::empty_like(q);
  if (q.scalar_type() == torch::kFloat32) {
    attend_all<float>(q, keys, values, mask, length, scale, out);
  } else {
    attend_all<uint16_t>(q, keys, values, mask, length, scale, out);
  }
  return out;
}

namespace {

// sum of squares of n values, widened to float32 (16 lanes, then the lanes added)
template <typename T>
float sum_squares(const T* x, int64_t n) {
  int64_t i = 0;
  float sum = 0.f;
#if defined(__AVX512F__)
  __m512 acc = _mm512_setzero_ps();
  for (; i + 16 <= n; i += 16) {
    const __m512 v = load16(x + i);
    acc = _mm512_fmadd_ps(v, v, acc);
  }
  sum = _mm512_reduce_add_ps(acc);
#elif defined(__AVX2__) && defined(__FMA__)
  __m256 acc = _mm256_setzero_ps();
  for (; i + 8 <= n; i += 8) {
    const __m256 v = load8(x + i);
    acc = _mm256_fmadd_ps(v, v, acc);
  }
  sum = sum8(acc);
#endif
  for (; i < n; ++i) sum += widen<T>(x[i]) * widen<T>(x[i]);
  return sum;
}

// one row of an RMSNorm as its module computes it. llama's: normalized in float32, then (16-bit input) rounded to
// the input's dtype and multiplied by the weight in it, or (float32) multiplied in float32. Gemma's (plus_one):
// normalized and multiplied by 1 + weight in float32, rounded to the input's dtype once.
template <typename T>
void rms_row(const T* x, const T* weight, T* out, int64_t n, float eps, bool plus_one) {
  const float r = 1.f / std::sqrt(sum_squares<T>(x, n) / static_cast<float>(n) + eps);
  for (int64_t i = 0; i < n; ++i) {
    if (plus_one) {
      const float v = (widen<T>(x[i]) * r) * (1.f + widen<T>(weight[i]));
      if constexpr (std::is_same<T, float>::value) {
        out[i] = v;
      } else {
        out[i] = float_to_bf16(v);
      }
    } else if constexpr (std::is_same<T, float>::value) {
      out[i] = weight[i] * (x[i] * r);
    } else {
      out[i] = float_to_bf16(bf16_to_float(weight[i]) * bf16_to_float(float_to_bf16(bf16_to_float(x[i]) * r)));
    }
  }
}

}  // namespace

// x [R, H] (bf16 or float32, contiguous), weight [H] of its dtype: each row RMS-normalized and weighted
// (plus_one: Gemma's norm, by 1 + weight).
torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& weight, double eps, bool plus_one) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && weight.is_contiguous() && weight.numel() == x.size(1) &&
              weight.scalar_type() == x.scalar_type() &&
              (x.scalar_type() == torch::kBFloat16 || x.scalar_type() == torch::kFloat32),
              "rms_norm: contiguous x [R, H] and weight [H] of one dtype, bf16 or float32");
  auto out = torch::empty_like(x);
  const int64_t rows = x.size(0), n = x.size(1);
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      if (x.scalar_type() == torch::kFloat32) {
        rms_row<float>(x.data_ptr<float>() + r * n, weight.data_ptr<float>(), out.data_ptr<float>() + r * n, n,
                       static_cast<float>(eps), plus_one);
      } else {
        rms_row<uint16_t>(reinterpret_cast<const uint16_t*>(x.data_ptr()) + r * n,
                          reinterpret_cast<const uint16_t*>(weight.data_ptr()),
                          reinterpret_cast<uint16_t*>(out.data_ptr()) + r * n, n, static_cast<float>(eps), plus_one);
      }
    }
  });
  return out;
}

namespace {

// x * cos + rotate_half(x) * sin over one head of `dim` values, in T's arithmetic (bf16: each product and the sum
// rounded, as torch computes x * cos + x.roll(dim / 2) * signed_sin); signed_sin: sin with its first half negated
template <typename T>
void rope_head(const T* x, const T* cos, const T* signed_sin, int64_t dim, T* out) {
  const int64_t half = dim / 2;
  for (int64_t i = 0; i < dim; ++i) {
    const T rolled = x[(i + half) % dim];
    if constexpr (std::is_same<T, float>::value) {
      out[i] = x[i] * cos[i] + rolled * signed_sin[i];
    } else {
      const float a = bf16_to_float(float_to_bf16(bf16_to_float(x[i]) * bf16_to_float(cos[i])));
      const float b = bf16_to_float(float_to_bf16(bf16_to_float(rolled) * bf16_to_float(signed_sin[i])));
      out[i] = float_to_bf16(a + b);
    }
  }
}

template <typename T>
void rope_store_attend_all(const torch::Tensor& qkv, const torch::Tensor& cos, const torch::Tensor& signed_sin,
                           torch::Tensor& keys, torch::Tensor& values, int64_t slot,
                           const c10::optional<torch::Tensor>& mask, double scale, int64_t heads, torch::Tensor& out) {
  const int64_t batch = qkv.size(0), kv_heads = keys.size(1), dim = keys.size(3);
  const int64_t width = qkv.size(1), length = slot + 1;
  const T* y = reinterpret_cast<const T*>(qkv.data_ptr());
  const T* c = reinterpret_cast<const T*>(cos.data_ptr());
  const T* ss = reinterpret_cast<const T*>(signed_sin.data_ptr());
  T* kp = reinterpret_cast<T*>(keys.data_ptr());
  T* vp = reinterpret_cast<T*>(values.data_ptr());
  std::vector<T> q(batch * heads * dim);
  for (int64_t b = 0; b < batch; ++b) {  // RoPE on q and k; k and v written into the cache at `slot`
    const T* row = y + b * width;
    for (int64_t h = 0; h < heads; ++h)
      rope_head<T>(row + h * dim, c + b * dim, ss + b * dim, dim, &q[(b * heads + h) * dim]);
    for (int64_t h = 0; h < kv_heads; ++h) {
      T* kt = kp + b * keys.stride(0) + h * keys.stride(1) + slot * keys.stride(2);
      T* vt = vp + b * values.stride(0) + h * values.stride(1) + slot * values.stride(2);
      rope_head<T>(row + (heads + h) * dim, c + b * dim, ss + b * dim, dim, kt);
      std::memcpy(vt, row + (heads + kv_heads + h) * dim, dim * sizeof(T));
    }
  }
  attend_parallel<T>(q.data(), keys, values, mask ? mask->data_ptr<float>() : nullptr, length,
                     static_cast<float>(scale), batch, heads, reinterpret_cast<T*>(out.data_ptr()));
}

}  // namespace

// One decode step's attention for a llama-family layer from its fused q/k/v output qkv [B, (H + 2 H_kv) D]:
// RoPE (cos, signed_sin [B, D]) on the q and k heads, k and v written into the static cache at `slot`, the
// queries attending to slots 0..slot (mask [B, slot + 1] float32 added, or None). Returns [B, H D].
torch::Tensor rope_store_attend(const torch::Tensor& qkv, const torch::Tensor& cos, const torch::Tensor& signed_sin,
                                torch::Tensor keys, torch::Tensor values, int64_t slot,
                                const c10::optional<torch::Tensor>& mask, double scale, int64_t heads) {
  const auto dtype = qkv.scalar_type();
  TORCH_CHECK((dtype == torch::kBFloat16 || dtype == torch::kFloat32) && cos.scalar_type() == dtype &&
              signed_sin.scalar_type() == dtype && keys.scalar_type() == dtype && values.scalar_type() == dtype,
              "rope_store_attend: one dtype, bf16 or float32");
  TORCH_CHECK(qkv.dim() == 2 && qkv.is_contiguous() && cos.is_contiguous() && signed_sin.is_contiguous() &&
              keys.dim() == 4 && values.sizes() == keys.sizes() && keys.stride(3) == 1 && values.stride(3) == 1,
              "rope_store_attend: contiguous qkv [B, W], cos / sin [B, D]; cache [B, Hkv, S, D]");
  const int64_t dim = keys.size(3), kv_heads = keys.size(1);
  TORCH_CHECK(dim % 2 == 0 && heads % kv_heads == 0 && qkv.size(1) == (heads + 2 * kv_heads) * dim &&
              cos.size(0) == qkv.size(0) && cos.size(1) == dim && keys.size(0) == qkv.size(0) && slot >= 0 &&
              slot < keys.size(2), "rope_store_attend: shapes of qkv, cos and the cache disagree");
  TORCH_CHECK(!mask || (mask->scalar_type() == torch::kFloat32 && mask->is_contiguous() &&
              mask->size(0) == qkv.size(0) && mask->size(1) == slot + 1),
              "rope_store_attend: mask [B, slot + 1] float32");
  auto out = torch::empty({qkv.size(0), heads * dim}, qkv.options());
  if (dtype == torch::kFloat32) {
    rope_store_attend_all<float>(qkv, cos, signed_sin, keys, values, slot, mask, scale, heads, out);
  } else {
    rope_store_attend_all<uint16_t>(qkv, cos, signed_sin, keys, values, slot, mask, scale, heads, out);
  }
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("rope_store_attend", &rope_store_attend, "RoPE, cache write and one-query attention of a decode step",
        py::arg("qkv"), py::arg("cos"), py::arg("signed_sin"), py::arg("keys"), py::arg("values"), py::arg("slot"),
        py::arg("mask"), py::arg("scale"), py::arg("heads"));
  m.def("rms_norm", &rms_norm, "an RMSNorm over rows (llama's, or Gemma's with plus_one)", py::arg("x"),
        py::arg("weight"), py::arg("eps"), py::arg("plus_one") = false);
  m.def("attend_one", &attend_one, "one query's attention per sequence over a static KV cache",
        py::arg("q"), py::arg("keys"), py::arg("values"), py::arg("mask"), py::arg("length"), py::arg("scale"));
  m.def("gemv_bf16", &gemv_bf16, "one-token bf16 linear (no bias), bf16 out");
  m.def("int4_gemv", &int4_gemv, "one-token linear over the CPU int4 op's layout (blocks of 64 or 32 rows), bf16",
        py::arg("packed"), py::arg("scale_zeros"), py::arg("x"), py::arg("group"), py::arg("out_features"),
        py::arg("block_rows"));
  m.def("int4_available", &int4_available, "whether int4_gemv reads blocks of block_rows rows in this build",
        py::arg("block_rows"));
  bind_decode_stack(m);
}

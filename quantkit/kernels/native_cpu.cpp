// quantkit's one-token CPU kernels (built on first use by quantkit/kernels/native.py, with -march=native).
//
// gemv_bf16:  y[n] = sum_k W[n, k] x[k], W bf16 [N, K] row-major, x bf16 [K]; float32 sums, y bf16 (rounded
//             to nearest even once, at the end), as F.linear's dtype.
// int4_gemv:  the same for a weight in the layout torch's `_convert_weight_to_int4pack_for_cpu` writes on an
//             AVX-512 CPU (rows in blocks of 64; for each block and input column k, 32 bytes: byte j holds
//             row j's code in its low nibble and row j + 32's in its high nibble), with the scales and zeros
//             that op reads (bf16 [K / group, N_pad, 2]): W[n, k] = (u - 8) * scale + zero. Each group's
//             sum over u * x is kept in float32 and scaled once per group:
//             y[n] = sum_g scale[g, n] * sum_{k in g} u[n, k] x[k] + (zero[g, n] - 8 scale[g, n]) * sum_{k in g} x[k].
// Both split the rows over torch's own threads (at::parallel_for), so no second thread pool competes.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cstdint>
#include <cstring>
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
  for (; i + 8 <= k; i += 8) {
    __m128i wh = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w + i));
    __m128i xh = _mm_loadu_si128(reinterpret_cast<const __m128i*>(x + i));
    __m256 wf = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(wh), 16));
    __m256 xf = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(xh), 16));
    a0 = _mm256_fmadd_ps(wf, xf, a0);
  }
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(a0), _mm256_extractf128_ps(a0, 1));
  s = _mm_hadd_ps(s, s);
  s = _mm_hadd_ps(s, s);
  sum = _mm_cvtss_f32(s);
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

bool int4_available() {
#if defined(__AVX512F__)
  return true;
#else
  return false;
#endif
}

#if defined(__AVX512F__)
namespace {

constexpr int64_t kBlock = 64;  // rows per block of the op's AVX-512 layout
constexpr int64_t kPrefetch = 1024;  // bytes ahead of the columns being read

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
    // scale and zero of rows block*64 + 16 q .. + 15: one 32-bit word each, scale in the low half, zero in the high
    const uint32_t* row_sz = sz + g * n_pad + block * kBlock;
    const __m512 sx = _mm512_set1_ps(xsum[g]);
    const __m512 eight = _mm512_set1_ps(8.f);
    for (int q = 0; q < 4; ++q) {
      const __m512i words = _mm512_loadu_si512(row_sz + 16 * q);
      const __m512 scale = _mm512_castsi512_ps(_mm512_slli_epi32(words, 16));
      const __m512 zero = _mm512_castsi512_ps(_mm512_and_si512(words, _mm512_set1_epi32(static_cast<int>(0xffff0000u))));
      y[q] = _mm512_fmadd_ps(scale, acc[q], y[q]);
      y[q] = _mm512_fmadd_ps(_mm512_fnmadd_ps(eight, scale, zero), sx, y[q]);
    }
  }
  for (int q = 0; q < 4; ++q) _mm512_storeu_ps(out + 16 * q, y[q]);
}

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
// The same with two input columns per step: the 64 rows' nibbles of columns c and c + 1 interleaved byte by
// byte (unpack within 128-bit lanes: pairs of rows 0-7, 16-23 from the low halves, 8-15, 24-31 from the high),
// widened to 16 bits, turned into exact bf16 values 0..15 by a table lookup and multiplied with the pair
// (x[c], x[c + 1]) by vdpbf16ps: half the instructions of `int4_block`. The four accumulators hold rows in
// the order {0-7, 16-23}, {8-15, 24-31} and the same + 32; scales are permuted alike and the sums put back.
void int4_block_bf16(const uint8_t* packed, const uint32_t* sz, const uint32_t* xpairs, const float* xsum,
                     int64_t k, int64_t group, int64_t n_pad, int64_t block, float* out) {
  __m512 y[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
  const __m512i table = _mm512_set_epi16(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,
      0x4170, 0x4160, 0x4150, 0x4140, 0x4130, 0x4120, 0x4110, 0x4100,
      0x40e0, 0x40c0, 0x40a0, 0x4080, 0x4040, 0x4000, 0x3f80, 0x0000);  // bf16 of 15 .. 0
  const __m512i nibble = _mm512_set1_epi16(0x0f);
  const __m512i first = _mm512_set_epi32(23, 22, 21, 20, 19, 18, 17, 16, 7, 6, 5, 4, 3, 2, 1, 0);
  const __m512i second = _mm512_set_epi32(31, 30, 29, 28, 27, 26, 25, 24, 15, 14, 13, 12, 11, 10, 9, 8);
  const uint8_t* p = packed + block * k * 32;
  for (int64_t g = 0; g * group < k; ++g) {
    __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
    const int64_t k_end = std::min(k, (g + 1) * group);
    for (int64_t c = g * group; c < k_end; c += 2) {
      _mm_prefetch(reinterpret_cast<const char*>(p + c * 32 + kPrefetch), _MM_HINT_T0);
      const __m256i b0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + c * 32));
      const __m256i b1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + c * 32 + 32));
      const __m512bh xp = (__m512bh)_mm512_set1_epi32(static_cast<int>(xpairs[c / 2]));
      const __m512i u = _mm512_cvtepu8_epi16(_mm256_unpacklo_epi8(b0, b1));
      const __m512i v = _mm512_cvtepu8_epi16(_mm256_unpackhi_epi8(b0, b1));
      acc[0] = _mm512_dpbf16_ps(acc[0], (__m512bh)_mm512_permutexvar_epi16(_mm512_and_si512(u, nibble), table), xp);
      acc[1] = _mm512_dpbf16_ps(acc[1], (__m512bh)_mm512_permutexvar_epi16(_mm512_and_si512(v, nibble), table), xp);
      acc[2] = _mm512_dpbf16_ps(acc[2], (__m512bh)_mm512_permutexvar_epi16(_mm512_srli_epi16(u, 4), table), xp);
      acc[3] = _mm512_dpbf16_ps(acc[3], (__m512bh)_mm512_permutexvar_epi16(_mm512_srli_epi16(v, 4), table), xp);
    }
    const uint32_t* row_sz = sz + g * n_pad + block * kBlock;
    const __m512 sx = _mm512_set1_ps(xsum[g]);
    for (int half = 0; half < 2; ++half) {  // rows 0-31, then 32-63
      const __m512i a = _mm512_loadu_si512(row_sz + 32 * half), b = _mm512_loadu_si512(row_sz + 32 * half + 16);
      const __m512i words[2] = {_mm512_permutex2var_epi32(a, first, b), _mm512_permutex2var_epi32(a, second, b)};
      for (int j = 0; j < 2; ++j) {
        const __m512 scale = _mm512_castsi512_ps(_mm512_slli_epi32(words[j], 16));
        const __m512 zero = _mm512_castsi512_ps(_mm512_and_si512(words[j], _mm512_set1_epi32(static_cast<int>(0xffff0000u))));
        const int q = 2 * half + j;
        y[q] = _mm512_fmadd_ps(scale, acc[q], y[q]);
        y[q] = _mm512_fmadd_ps(_mm512_fnmadd_ps(_mm512_set1_ps(8.f), scale, zero), sx, y[q]);
      }
    }
  }
  for (int half = 0; half < 2; ++half) {  // back to row order: {0-7, 16-23} and {8-15, 24-31} -> 0-15, 16-31
    const __m512i to_first = _mm512_set_epi32(23, 22, 21, 20, 19, 18, 17, 16, 7, 6, 5, 4, 3, 2, 1, 0);
    const __m512i to_second = _mm512_set_epi32(31, 30, 29, 28, 27, 26, 25, 24, 15, 14, 13, 12, 11, 10, 9, 8);
    _mm512_storeu_ps(out + 32 * half, _mm512_permutex2var_ps(y[2 * half], to_first, y[2 * half + 1]));
    _mm512_storeu_ps(out + 32 * half + 16, _mm512_permutex2var_ps(y[2 * half], to_second, y[2 * half + 1]));
  }
}
#endif

}  // namespace
#endif

torch::Tensor int4_gemv(const torch::Tensor& packed, const torch::Tensor& scale_zeros, const torch::Tensor& x,
                        int64_t group, int64_t out_features) {
#if defined(__AVX512F__)
  check_bf16(scale_zeros, "scale_zeros");
  check_bf16(x, "x");
  TORCH_CHECK(packed.scalar_type() == torch::kUInt8 && packed.is_contiguous() && packed.dim() == 2,
              "int4_gemv: packed must be the op's contiguous uint8 [N_pad, K / 2] layout");
  const int64_t n_pad = packed.size(0), k = packed.size(1) * 2;
  TORCH_CHECK(n_pad % kBlock == 0 && x.numel() == k && group > 0 && k % group == 0 && out_features <= n_pad,
              "int4_gemv: rows must come in blocks of 64 and x must have K values in whole groups");
  TORCH_CHECK(scale_zeros.dim() == 3 && scale_zeros.size(0) == k / group && scale_zeros.size(1) == n_pad,
              "int4_gemv: scale_zeros must be [K / group, N_pad, 2]");
  const auto* xb = reinterpret_cast<const uint16_t*>(x.data_ptr());
  std::vector<float> xf(k), xsum(k / group, 0.f);
  std::vector<uint32_t> xpairs(k / 2);
  for (int64_t c = 0; c < k; ++c) {
    xf[c] = bf16_to_float(xb[c]);
    xsum[c / group] += xf[c];
  }
  for (int64_t c = 0; c + 1 < k; c += 2) xpairs[c / 2] = static_cast<uint32_t>(xb[c]) | (static_cast<uint32_t>(xb[c + 1]) << 16);
  auto y = torch::empty({out_features}, x.options());
  auto* out = reinterpret_cast<uint16_t*>(y.data_ptr());
  const auto* p = packed.data_ptr<uint8_t>();
  const auto* sz = reinterpret_cast<const uint32_t*>(scale_zeros.data_ptr());
  at::parallel_for(0, n_pad / kBlock, 1, [&](int64_t begin, int64_t end) {
    float rows[kBlock];
    for (int64_t b = begin; b < end; ++b) {
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
      if (group % 2 == 0) {
        int4_block_bf16(p, sz, xpairs.data(), xsum.data(), k, group, n_pad, b, rows);
      } else {
        int4_block(p, sz, xf.data(), xsum.data(), k, group, n_pad, b, rows);
      }
#else
      int4_block(p, sz, xf.data(), xsum.data(), k, group, n_pad, b, rows);
#endif
      for (int64_t r = 0; r < kBlock && b * kBlock + r < out_features; ++r) out[b * kBlock + r] = float_to_bf16(rows[r]);
    }
  });
  return y;
#else
  TORCH_CHECK(false, "int4_gemv needs AVX-512 (this build has none)");
  return x;
#endif
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("gemv_bf16", &gemv_bf16, "one-token bf16 linear (no bias), bf16 out");
  m.def("int4_gemv", &int4_gemv, "one-token linear of the CPU int4 op's AVX-512 layout, bf16 in and out");
  m.def("int4_available", &int4_available, "whether int4_gemv was built (AVX-512)");
}

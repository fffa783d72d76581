// laserlm's block-quantized matrix kernels (CPU): y = x @ W.T with W in blocks of 32 weights along K.
// (quant.cpp binds them to torch and builds the whole-layer kernel on them.)
//
// Block formats (the semantics and sizes of GGUF's; GGUF Q4_0 becomes Q4_1 with m = -8 d, exactly):
//   Q4_1  20 bytes per block: 32 x 4-bit q, fp16 d, fp16 m     w = d * q + m,  q in 0..15
//   Q8_0  34 bytes per block: 32 x int8 q, fp16 d              w = d * q
//   Q6_K  210 bytes per super-block of 256 weights (GGUF's): 256 x 6-bit q, 16 int8 scales sc (one per 16 weights),
//         fp16 d                                              w = d * sc[k / 16] * (q - 32),  q in 0..63
//   Q4_K  144 bytes per super-block of 256 weights (GGUF's): 256 x 4-bit q, 8 6-bit scales sc and mins m (one per 32
//         weights), fp16 d and dmin                           w = (d * sc[k / 32]) * q - dmin * m[k / 32]
//
// Kernel layout ("groups of 16 rows"): the N rows of W are taken 16 at a time (G = ceil(N / 16) groups; rows past N
// are zero). Group g is one contiguous run of nb = K / 32 block regions (K / 256 for Q6_K and Q4_K, whose regions
// hold 8 blocks); the region of block b holds the 16 rows' block b, column-interleaved so that one 64-byte vector holds the same few weights of all 16 rows (one 32-bit lane
// per row: lane c = row 16 g + c):
//   Q4_1 region, 320 bytes: 4 chunks of 64 bytes, then 16 fp16 d, then 16 fp16 m.
//        chunk h (weights 8h .. 8h + 7 of the block): byte j (0..3) of lane c = q[8h + j] | q[8h + 4 + j] << 4
//   Q8_0 region, 544 bytes: 8 chunks of 64 bytes, then 16 fp16 d.
//        chunk h (weights 4h .. 4h + 3): byte j of lane c = q[4h + j]
//   Q6_K  takes 8 blocks (one super-block) per region: 3,360 bytes per 256 weights of 16 rows (420 per 32, the bytes of
//        GGUF's Q6_K exactly): 16 sub-block records of 192 bytes, then 16 x 16 int8 sc (byte 16 s + c: sub-block s of
//        lane c), then 16 fp16 d. Record s (weights 16 s .. 16 s + 15): two chunks of 64 bytes in Q4_1's form holding
//        the low 4 bits (chunk e: byte j of lane c = low(q[16 s + 8 e + j]) | low(q[16 s + 8 e + 4 + j]) << 4), then
//        64 bytes of high bits (byte j of lane c, bits 2 i .. 2 i + 1 = q[16 s + 4 i + j] >> 4).
//   Q4_K  takes 8 blocks per region too: 2,368 bytes per 256 weights of 16 rows (296 per 32; GGUF's Q4_K has 288, as it
//        packs the scales in 6 bits): the 8 blocks' quants in Q4_1's form (256 bytes each), then 8 x 16 uint8 sc
//        (byte 16 b + c), 8 x 16 uint8 m, 16 fp16 d, 16 fp16 dmin. A block is computed as Q4_1 with d_w = d * sc and
//        m_w = -(dmin * m), both exact in float32.
// A matrix is a uint8 tensor [G, K / 32 * region_bytes(fmt)]. This is llama.cpp's idea of interleaved repacks
// (block_q4_0x8 and its GEMV / GEMM split) taken to 16 rows: a vector multiply-add computes one partial dot product
// per row, so a block's 16 dot products need no horizontal reduction, and each weight vector, unpacked once, serves
// every activation row of the call.
//
// Activations are quantized per 32-block to int16 (d_x = max|x_b| / 32767, q_x = round(x / d_x); the scheme of
// llama.cpp's Q8_0 / Q8_1 activation blocks with 16-bit values: the rounding error is 1/256 of int8 activations,
// which matters on small models whose hidden states have large outlier channels). Each block dot product is then an
// exact integer sum(q_w q_x), and every output is accumulated in float, block by block in order:
//   acc = fma(float(sum_b q_w q_x), d_w * d_x, acc)        (Q4_1 also: acc = fma(m_w, sum_b x, acc))
// (Q6_K: one such step per 16-weight sub-block, with the exact integer sum(q_w q_x) - 32 sum(q_x) and the scale
// (d_w * sc) * d_x, sub-blocks in order.)
// so a row's result does not depend on how many rows share the call, on the tile that computed it, on the thread
// split, or on the instruction set. Three variants compute the same integer sums, picked at run time:
//   avx512: AVX512-VNNI (Zen 4 / Zen 5, Xeon Ice Lake and later): 16 rows per zmm, x = 256 hi + lo with lo in
//           0..255 and hi in -128..127, two vpdpbusd per 4 weights (u8 x s8 -> int32: lo x q and q x hi for Q4_1;
//           lo x q and (hi + 128) x q for Q8_0, whose excess 128 sum(q) per block is subtracted);
//   avx2:   8 rows per ymm, vpmaddwd on int16 pairs (vpdpwssd where the CPU has AVX-VNNI);
//   scalar: plain C++ (CPUs without AVX2; also the tests' independent reference for the other two).
#pragma once
#ifdef LASERLM_STANDALONE  // benchmarks/kernels: the kernels without torch (a serial parallel_for)
#include "standalone.h"
#else
#include <torch/extension.h>
#include <ATen/Parallel.h>
#endif
#include <immintrin.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define LASERLM_AVX2 1
#else
#define LASERLM_AVX2 0
#endif

#if defined(__GNUC__) && (defined(__x86_64__) || defined(__i386__))
#define LASERLM_X86 1
#define LASERLM_TARGET_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")))
#define LASERLM_TARGET_AVX2 __attribute__((target("avx2,fma,f16c")))
#else
#define LASERLM_X86 0
#endif

namespace {

constexpr int QK = 32;
constexpr int GR = 16;  // rows per group
enum Fmt : int64_t { Q4_1 = 3, Q8_0 = 8, Q4_K = 12, Q6_K = 14 };  // GGML type ids of the semantics
constexpr int64_t Q4K_REGION = 2368;  // one Q4_K region: 16 rows x 256 weights
constexpr int64_t Q4K_SC = 2048, Q4K_M = 2176, Q4K_D = 2304, Q4K_DMIN = 2336;  // offsets in a region
constexpr int64_t Q6K_REGION = 3360;  // one Q6_K region: 16 rows x 256 weights
constexpr int64_t Q6K_SUB = 192;      // one sub-block record of a Q6_K region (16 rows x 16 weights)
constexpr int64_t Q6K_SC = 16 * Q6K_SUB, Q6K_D = Q6K_SC + 256;  // offsets of the scales and of d in a region

// bytes of 16 rows x 32 weights (a Q6_K region covers 8 such blocks)
inline int64_t region_bytes(int64_t fmt) {
  switch (fmt) {
    case Q4_1: return GR * 20;
    case Q8_0: return GR * 34;
    case Q6_K: return Q6K_REGION / 8;
    case Q4_K: return Q4K_REGION / 8;
  }
  TORCH_CHECK(false, "laserlm kernels: unsupported block format ", fmt);
}
inline int64_t block_weights(int64_t fmt) { return fmt == Q6_K || fmt == Q4_K ? 256 : QK; }  // K: a multiple of this
// Where block b's quants start in a group, and (super-block formats) its region.
inline const uint8_t* block_quants(int64_t fmt, const uint8_t* gw, int64_t b) {
  return fmt == Q4_K ? gw + (b / 8) * Q4K_REGION + (b % 8) * 256 : gw + b * region_bytes(fmt);
}
inline int64_t quant_bytes(int64_t fmt) { return fmt == Q8_0 ? 512 : 256; }  // per region, before the scales
inline int64_t n_groups(int64_t N) { return (N + GR - 1) / GR; }

inline float fp16_to_fp32(uint16_t h) {
#if defined(__F16C__)
  return _cvtsh_ss(h);
#else
  return static_cast<float>(c10::Half(h, c10::Half::from_bits()));
#endif
}

// Q4_K: lane c's d_w = d * sc and m_w = dmin * m (to be negated) of block b
inline void q4k_scales(const uint8_t* gw, int64_t b, int c, float* dw, float* mw) {
  const uint8_t* r = gw + (b / 8) * Q4K_REGION;
  const int bb = static_cast<int>(b % 8);
  *dw = fp16_to_fp32(reinterpret_cast<const uint16_t*>(r + Q4K_D)[c]) * static_cast<float>(r[Q4K_SC + 16 * bb + c]);
  *mw = fp16_to_fp32(reinterpret_cast<const uint16_t*>(r + Q4K_DMIN)[c]) * static_cast<float>(r[Q4K_M + 16 * bb + c]);
}

// ---- instruction set ----------------------------------------------------------------------------------------------
enum Isa : int { SCALAR = 0, AVX2 = 1, AVX512 = 2 };
const char* isa_name(int i) { return i == AVX512 ? "avx512" : i == AVX2 ? "avx2" : "scalar"; }

int detect_isa() {
#if LASERLM_X86
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
      __builtin_cpu_supports("avx512vnni"))
    return AVX512;
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return AVX2;
#endif
  return SCALAR;
}

int parse_isa(const std::string& s) {
  if (s == "avx512") return AVX512;
  if (s == "avx2") return AVX2;
  if (s == "scalar") return SCALAR;
  TORCH_CHECK(false, "unknown kernel variant '", s, "'; expected avx512, avx2 or scalar");
}

// the best variant of this CPU, or the one LASERLM_KERNEL_ISA names (never one the CPU lacks)
int initial_isa() {
  const int best = detect_isa();
  const char* env = std::getenv("LASERLM_KERNEL_ISA");
  if (env == nullptr || *env == 0) return best;
  return std::min(best, parse_isa(env));
}
int g_isa = initial_isa();

// ---- activations --------------------------------------------------------------------------------------------------
// x [T, K] float32 -> per 32-block scale d [T, nb] and float sum s [T, nb], and the int16 values in the variant's form:
//   avx512: lo [T, K] uint8 (q & 255) and hi [T, K] (q >> 8: int8 for Q4_1, uint8 hi + 128 for Q8_0), natural order;
//   avx2 / scalar: q16 [T, K] int16, each run of 4 values in the order (0, 2, 1, 3) (the pairs the avx2 kernel
//   unpacks from one 32-bit lane of weights: (q0, q2) and (q1, q3)).
struct Acts {
  int64_t T = 0, K = 0, nb = 0;
  std::vector<uint8_t> lo, hi;
  std::vector<int16_t> q16;
  std::vector<float> d, s;
  std::vector<int32_t> s16;  // Q6_K: the integer sum of each run of 16 values [T, K / 16]
};

// Sum of a block's 32 values in a fixed order that vector code reproduces exactly: p[l] = x[l] + x[l + 16] for 16
// lanes, then lanes l and l + w added for w = 8, 4, 2, 1.
inline float block_sum(const float* x) {
  float p[16];
  for (int l = 0; l < 16; ++l) p[l] = x[l] + x[l + 16];
  for (int w = 8; w >= 1; w /= 2)
    for (int l = 0; l < w; ++l) p[l] = p[l] + p[l + w];
  return p[0];
}

#if LASERLM_X86
// The avx512 form of one block of quantize_acts (the same d, sum and bytes).
LASERLM_TARGET_AVX512 inline void quantize_block_avx512(const float* xb, uint8_t hi_bias, float* d, float* s,
                                                        uint8_t* lo, uint8_t* hi, int32_t* s16) {
  const __m512 x0 = _mm512_loadu_ps(xb), x1 = _mm512_loadu_ps(xb + 16);
  const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(x0), _mm512_abs_ps(x1)));
  const __m512 p = _mm512_add_ps(x0, x1);
  __m256 h = _mm256_add_ps(_mm512_castps512_ps256(p), _mm512_extractf32x8_ps(p, 1));
  __m128 q4 = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
  q4 = _mm_add_ps(q4, _mm_movehl_ps(q4, q4));
  q4 = _mm_add_ss(q4, _mm_shuffle_ps(q4, q4, 1));
  const float dd = amax / 32767.f;
  const float id = dd != 0.f ? 1.f / dd : 0.f;
  *d = dd;
  *s = _mm_cvtss_f32(q4);
  const __m512 vid = _mm512_set1_ps(id);
  const __m512i q0 = _mm512_cvtps_epi32(_mm512_mul_ps(x0, vid)), q1 = _mm512_cvtps_epi32(_mm512_mul_ps(x1, vid));
  if (s16 != nullptr) {
    s16[0] = _mm512_reduce_add_epi32(q0);
    s16[1] = _mm512_reduce_add_epi32(q1);
  }
  _mm_storeu_si128(reinterpret_cast<__m128i*>(lo), _mm512_cvtepi32_epi8(q0));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(lo + 16), _mm512_cvtepi32_epi8(q1));
  const __m128i bias = _mm_set1_epi8(static_cast<char>(hi_bias));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(hi), _mm_xor_si128(_mm512_cvtepi32_epi8(_mm512_srai_epi32(q0, 8)), bias));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(hi + 16),
                   _mm_xor_si128(_mm512_cvtepi32_epi8(_mm512_srai_epi32(q1, 8)), bias));
}
#endif

void quantize_acts(const float* x, int64_t T, int64_t K, int64_t fmt, int isa, Acts& a) {
  const int64_t nb = K / QK;
  a.T = T;
  a.K = K;
  a.nb = nb;
  a.d.resize(T * nb);
  a.s.resize(T * nb);
  const bool bytes = isa == AVX512;
  if (bytes) {
    a.lo.resize(T * K);
    a.hi.resize(T * K);
  } else {
    a.q16.resize(T * K);
  }
  const uint8_t hi_bias = fmt == Q8_0 ? 0x80 : 0;
  const bool sums16 = fmt == Q6_K;
  if (sums16) a.s16.resize(T * nb * 2);
  at::parallel_for(0, T * nb, 256, [&](int64_t b0, int64_t b1) {
    for (int64_t i = b0; i < b1; ++i) {
      const float* xb = x + i * QK;  // row t = i / nb, block b = i % nb: x is [T, K] with K = nb * 32
#if LASERLM_X86
      if (bytes) {
        quantize_block_avx512(xb, hi_bias, &a.d[i], &a.s[i], &a.lo[i * QK], &a.hi[i * QK],
                              sums16 ? &a.s16[2 * i] : nullptr);
        continue;
      }
#endif
      int32_t qs[2] = {0, 0};
      float amax = 0.f;
      for (int j = 0; j < QK; ++j) amax = std::max(amax, std::fabs(xb[j]));
      const float dd = amax / 32767.f;
      const float id = dd != 0.f ? 1.f / dd : 0.f;
      a.d[i] = dd;
      a.s[i] = block_sum(xb);
      for (int j = 0; j < QK; ++j) {
        const int q = static_cast<int>(std::nearbyint(xb[j] * id));
        qs[j / 16] += q;
        if (bytes) {
          a.lo[i * QK + j] = static_cast<uint8_t>(q & 0xFF);
          a.hi[i * QK + j] = static_cast<uint8_t>(static_cast<uint8_t>((q >> 8) & 0xFF) ^ hi_bias);
        } else {
          static constexpr int slot[4] = {0, 2, 1, 3};
          a.q16[i * QK + (j & ~3) + slot[j & 3]] = static_cast<int16_t>(q);
        }
      }
      if (sums16) {
        a.s16[2 * i] = qs[0];
        a.s16[2 * i + 1] = qs[1];
      }
    }
  });
}

// ---- scalar variant -----------------------------------------------------------------------------------------------
// Weight k (0..255) of lane c in the Q6_K region r: q in 0..63 (w = d * sc * (q - 32)).
inline int q6k_q(const uint8_t* r, int c, int k) {
  const uint8_t* rec = r + (k / 16) * Q6K_SUB;
  const int e = (k % 16) / 8, i = (k % 16) / 4, j = k % 4;
  const uint8_t lo = rec[e * 64 + c * 4 + j];
  const int low = (k % 8) < 4 ? (lo & 0x0F) : (lo >> 4);
  return low | ((rec[128 + c * 4 + j] >> (2 * i)) & 3) << 4;
}

void group_scalar_q6k(const uint8_t* gw, int64_t nb, const Acts& a, int64_t t0, int64_t TN, float* out, int64_t ldo) {
  static constexpr int slot[4] = {0, 2, 1, 3};
  for (int64_t t = 0; t < TN; ++t) {
    const int16_t* xq = a.q16.data() + (t0 + t) * a.K;
    const float* xd = a.d.data() + (t0 + t) * nb;
    const int32_t* xs16 = a.s16.data() + (t0 + t) * nb * 2;
    for (int c = 0; c < GR; ++c) {
      float acc = 0.f;
      for (int64_t sb = 0; sb < nb / 8; ++sb) {
        const uint8_t* r = gw + sb * Q6K_REGION;
        const float d = fp16_to_fp32(reinterpret_cast<const uint16_t*>(r + Q6K_D)[c]);
        for (int s = 0; s < 16; ++s) {
          int32_t isum = 0;
          for (int kk = 0; kk < 16; ++kk) {
            const int k = 16 * s + kk;
            const int64_t kg = sb * 256 + k;
            isum += q6k_q(r, c, k) * xq[(kg & ~3) + slot[kg & 3]];
          }
          isum -= 32 * xs16[sb * 16 + s];
          const float dsc = d * static_cast<float>(static_cast<int8_t>(r[Q6K_SC + 16 * s + c]));
          acc = std::fma(static_cast<float>(isum), dsc * xd[sb * 8 + s / 2], acc);
        }
      }
      out[t * ldo + c] = acc;
    }
  }
}

// One group, rows [0, TN) of the activations given: out [TN, 16] (row stride ldo).
void group_scalar(int64_t fmt, const uint8_t* gw, int64_t nb, const Acts& a, int64_t t0, int64_t TN, float* out,
                  int64_t ldo) {
  if (fmt == Q6_K) return group_scalar_q6k(gw, nb, a, t0, TN, out, ldo);
  const int64_t qb = quant_bytes(fmt);
  for (int64_t t = 0; t < TN; ++t) {
    const int16_t* xq = a.q16.data() + (t0 + t) * a.K;
    const float* xd = a.d.data() + (t0 + t) * nb;
    const float* xs = a.s.data() + (t0 + t) * nb;
    for (int c = 0; c < GR; ++c) {
      float acc = 0.f;
      for (int64_t b = 0; b < nb; ++b) {
        const uint8_t* r = block_quants(fmt, gw, b);
        const int16_t* xb = xq + b * QK;
        int32_t isum = 0;
        for (int k = 0; k < QK; ++k) {
          int w;
          if (fmt == Q4_1 || fmt == Q4_K) {
            const uint8_t byte = r[(k / 8) * 64 + c * 4 + (k % 4)];
            w = (k % 8) < 4 ? (byte & 0x0F) : (byte >> 4);
          } else {
            w = static_cast<int8_t>(r[(k / 4) * 64 + c * 4 + (k % 4)]);
          }
          static constexpr int slot[4] = {0, 2, 1, 3};
          isum += w * xb[(k & ~3) + slot[k & 3]];
        }
        if (fmt == Q4_K) {
          float dw, mw;
          q4k_scales(gw, b, c, &dw, &mw);
          acc = std::fma(static_cast<float>(isum), dw * xd[b], acc);
          acc = std::fma(-mw, xs[b], acc);
          continue;
        }
        const uint16_t* dh = reinterpret_cast<const uint16_t*>(r + qb);
        acc = std::fma(static_cast<float>(isum), fp16_to_fp32(dh[c]) * xd[b], acc);
        if (fmt == Q4_1) acc = std::fma(fp16_to_fp32(dh[GR + c]), xs[b], acc);
      }
      out[t * ldo + c] = acc;
    }
  }
}

#if LASERLM_X86
// ---- avx2 variant: a tile of TN activation rows x CU units of 8 rows of W ------------------------------------------
// unit u: group g(u) = first group + u / 2, half (u % 2): the 32 bytes of each chunk holding lanes 8 half .. +7.
LASERLM_TARGET_AVX2 inline __m256i madd_add2(__m256i acc, __m256i a, __m256i b) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpwssd_epi32(acc, a, b);
#elif defined(__AVXVNNI__)
  return _mm256_dpwssd_avx_epi32(acc, a, b);
#else
  return _mm256_add_epi32(acc, _mm256_madd_epi16(a, b));
#endif
}

template <int FMT, int TN, int CU>
LASERLM_TARGET_AVX2 void tile_avx2(const uint8_t* gw, int64_t gbytes, int64_t nb, const Acts& a, int64_t t0,
                                   float* out, int64_t ldo) {
  constexpr bool AFF = FMT == Q4_1 || FMT == Q4_K;  // 4-bit affine: d_w q + m_w
  constexpr int64_t QB = FMT == Q4_1 ? 256 : 512;
  __m256 facc[TN][CU];
  for (int t = 0; t < TN; ++t)
    for (int u = 0; u < CU; ++u) facc[t][u] = _mm256_setzero_ps();
  const __m256i m4 = _mm256_set1_epi32(0x000F000F);
  const int16_t* xq = a.q16.data() + t0 * a.K;
  for (int64_t b = 0; b < nb; ++b) {
    __m256i acc[TN][CU];
    for (int t = 0; t < TN; ++t)
      for (int u = 0; u < CU; ++u) acc[t][u] = _mm256_setzero_si256();
    const uint8_t* reg[CU];
    for (int u = 0; u < CU; ++u) reg[u] = block_quants(FMT, gw + (u / 2) * gbytes, b) + (u % 2) * 32;
    if (AFF) {
      for (int h = 0; h < 4; ++h) {
        for (int u = 0; u < CU; ++u) {
          const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(reg[u] + h * 64));
          const __m256i w02 = _mm256_and_si256(v, m4);  // (q0, q2) of each lane as int16, then (q1, q3), ...
          const __m256i w13 = _mm256_and_si256(_mm256_srli_epi32(v, 8), m4);
          const __m256i w46 = _mm256_and_si256(_mm256_srli_epi32(v, 4), m4);
          const __m256i w57 = _mm256_and_si256(_mm256_srli_epi32(v, 12), m4);
          for (int t = 0; t < TN; ++t) {
            const int32_t* p = reinterpret_cast<const int32_t*>(xq + t * a.K + b * QK + h * 8);
            acc[t][u] = madd_add2(acc[t][u], w02, _mm256_set1_epi32(p[0]));
            acc[t][u] = madd_add2(acc[t][u], w13, _mm256_set1_epi32(p[1]));
            acc[t][u] = madd_add2(acc[t][u], w46, _mm256_set1_epi32(p[2]));
            acc[t][u] = madd_add2(acc[t][u], w57, _mm256_set1_epi32(p[3]));
          }
        }
      }
    } else {
      for (int h = 0; h < 8; ++h) {
        for (int u = 0; u < CU; ++u) {
          const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(reg[u] + h * 64));
          const __m256i w02 = _mm256_srai_epi16(_mm256_slli_epi16(v, 8), 8);  // (q0, q2) of each lane, int16
          const __m256i w13 = _mm256_srai_epi16(v, 8);                         // (q1, q3)
          for (int t = 0; t < TN; ++t) {
            const int32_t* p = reinterpret_cast<const int32_t*>(xq + t * a.K + b * QK + h * 4);
            acc[t][u] = madd_add2(acc[t][u], w02, _mm256_set1_epi32(p[0]));
            acc[t][u] = madd_add2(acc[t][u], w13, _mm256_set1_epi32(p[1]));
          }
        }
      }
    }
    for (int u = 0; u < CU; ++u) {
      const int half = u % 2;
      __m256 dw, mw = _mm256_setzero_ps();
      if (FMT == Q4_K) {  // d * sc and dmin * m, subtracted below
        const uint8_t* r = gw + (u / 2) * gbytes + (b / 8) * Q4K_REGION;
        const int64_t o = 16 * (b % 8) + half * 8;
        const auto u8f = [](const uint8_t* p) {
          return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
        };
        dw = _mm256_mul_ps(_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(r + Q4K_D + half * 16))),
                           u8f(r + Q4K_SC + o));
        mw = _mm256_mul_ps(_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(r + Q4K_DMIN + half * 16))),
                           u8f(r + Q4K_M + o));
      } else {
        dw = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(reg[u] - half * 32 + QB + half * 16)));
        if (FMT == Q4_1)
          mw = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(reg[u] - half * 32 + QB + 32 + half * 16)));
      }
      for (int t = 0; t < TN; ++t) {
        const int64_t i = (t0 + t) * nb + b;
        const __m256 sc = _mm256_mul_ps(dw, _mm256_set1_ps(a.d[i]));
        facc[t][u] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[t][u]), sc, facc[t][u]);
        if (FMT == Q4_1) facc[t][u] = _mm256_fmadd_ps(mw, _mm256_set1_ps(a.s[i]), facc[t][u]);
        if (FMT == Q4_K) facc[t][u] = _mm256_fnmadd_ps(mw, _mm256_set1_ps(a.s[i]), facc[t][u]);
      }
    }
  }
  for (int t = 0; t < TN; ++t)
    for (int u = 0; u < CU; ++u) _mm256_storeu_ps(out + t * ldo + u * 8, facc[t][u]);
}

// Q6_K (see the layout at the top): per sub-block s, the 16 weights of each lane unpacked to bytes 0..63 (low 4 bits
// from the two Q4_1-form chunks, bits 4-5 from the high-bit chunk), then as Q4_1's pairs of int16.
template <int TN, int CU>
LASERLM_TARGET_AVX2 void tile_avx2_q6k(const uint8_t* gw, int64_t gbytes, int64_t nb, const Acts& a, int64_t t0,
                                       float* out, int64_t ldo) {
  __m256 facc[TN][CU];
  for (int t = 0; t < TN; ++t)
    for (int u = 0; u < CU; ++u) facc[t][u] = _mm256_setzero_ps();
  const __m256i m4 = _mm256_set1_epi8(0x0F), m30 = _mm256_set1_epi8(0x30), mlo = _mm256_set1_epi32(0x00FF00FF);
  const int16_t* xq = a.q16.data() + t0 * a.K;
  for (int64_t sb = 0; sb < nb / 8; ++sb) {
    const uint8_t* reg[CU];
    __m256 dw[CU];
    for (int u = 0; u < CU; ++u) {
      reg[u] = gw + (u / 2) * gbytes + sb * Q6K_REGION;
      dw[u] = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(reg[u] + Q6K_D + (u % 2) * 16)));
    }
    for (int s = 0; s < 16; ++s) {
      __m256i acc[TN][CU];
      for (int t = 0; t < TN; ++t)
        for (int u = 0; u < CU; ++u) acc[t][u] = _mm256_setzero_si256();
      for (int e = 0; e < 2; ++e) {
        for (int u = 0; u < CU; ++u) {
          const uint8_t* rec = reg[u] + s * Q6K_SUB + (u % 2) * 32;
          const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rec + e * 64));
          const __m256i v2 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rec + 128));
          const __m256i hl = _mm256_and_si256(e == 0 ? _mm256_slli_epi16(v2, 4) : v2, m30);
          const __m256i hh = _mm256_and_si256(e == 0 ? _mm256_slli_epi16(v2, 2) : _mm256_srli_epi16(v2, 2), m30);
          const __m256i wl = _mm256_or_si256(_mm256_and_si256(v, m4), hl);
          const __m256i wh = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(v, 4), m4), hh);
          const __m256i w02 = _mm256_and_si256(wl, mlo), w13 = _mm256_srli_epi16(wl, 8);
          const __m256i w46 = _mm256_and_si256(wh, mlo), w57 = _mm256_srli_epi16(wh, 8);
          for (int t = 0; t < TN; ++t) {
            const int32_t* p = reinterpret_cast<const int32_t*>(xq + t * a.K + sb * 256 + s * 16 + e * 8);
            acc[t][u] = madd_add2(acc[t][u], w02, _mm256_set1_epi32(p[0]));
            acc[t][u] = madd_add2(acc[t][u], w13, _mm256_set1_epi32(p[1]));
            acc[t][u] = madd_add2(acc[t][u], w46, _mm256_set1_epi32(p[2]));
            acc[t][u] = madd_add2(acc[t][u], w57, _mm256_set1_epi32(p[3]));
          }
        }
      }
      for (int u = 0; u < CU; ++u) {
        const __m128i sc8 = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(reg[u] + Q6K_SC + 16 * s + (u % 2) * 8));
        const __m256 dsc = _mm256_mul_ps(dw[u], _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(sc8)));
        for (int t = 0; t < TN; ++t) {
          const int64_t row = t0 + t;
          const __m256i isum = _mm256_sub_epi32(acc[t][u], _mm256_set1_epi32(32 * a.s16[row * nb * 2 + sb * 16 + s]));
          const __m256 sc = _mm256_mul_ps(dsc, _mm256_set1_ps(a.d[row * nb + sb * 8 + s / 2]));
          facc[t][u] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), sc, facc[t][u]);
        }
      }
    }
  }
  for (int t = 0; t < TN; ++t)
    for (int u = 0; u < CU; ++u) _mm256_storeu_ps(out + t * ldo + u * 8, facc[t][u]);
}

// ---- avx512 variant: a tile of TN activation rows x CG groups ------------------------------------------------------
// Four activation bytes p[0..3] in every 32-bit lane: the operand one vpdpbusd pairs with 4 weights of each row.
LASERLM_TARGET_AVX512 inline __m512i bcast4(const uint8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm512_set1_epi32(v);
}

template <int FMT, int TN, int CG>
LASERLM_TARGET_AVX512 void tile_avx512(const uint8_t* gw, int64_t gbytes, int64_t nb, const Acts& a, int64_t t0,
                                       float* out, int64_t ldo) {
  constexpr bool AFF = FMT == Q4_1 || FMT == Q4_K;  // 4-bit affine: d_w q + m_w
  constexpr int64_t QB = FMT == Q4_1 ? 256 : 512;
  __m512 facc[TN][CG];
  for (int t = 0; t < TN; ++t)
    for (int c = 0; c < CG; ++c) facc[t][c] = _mm512_setzero_ps();
  const __m512i m4 = _mm512_set1_epi8(0x0F);
  const __m512i ones = _mm512_set1_epi8(1);
  const uint8_t* xl = a.lo.data() + t0 * a.K;
  const uint8_t* xh = a.hi.data() + t0 * a.K;
  for (int64_t b = 0; b < nb; ++b) {
    // small tiles keep two accumulators per product (even and odd 4-weight steps): vpdpbusd needs about a dozen
    // independent chains to issue two per cycle
    constexpr bool SPLIT = TN * CG < 6;
    __m512i al[TN][CG], ah[TN][CG], al2_[TN][CG], ah2_[TN][CG];
    __m512i (&al2)[TN][CG] = SPLIT ? al2_ : al;
    __m512i (&ah2)[TN][CG] = SPLIT ? ah2_ : ah;
    __m512i ws[CG];  // Q8_0: the block's weight sums
    for (int t = 0; t < TN; ++t)
      for (int c = 0; c < CG; ++c) al[t][c] = ah[t][c] = al2[t][c] = ah2[t][c] = _mm512_setzero_si512();
    for (int c = 0; c < CG; ++c) ws[c] = _mm512_setzero_si512();
    const uint8_t* reg[CG];
    for (int c = 0; c < CG; ++c) reg[c] = block_quants(FMT, gw + c * gbytes, b);
    if (AFF) {
      for (int h = 0; h < 4; ++h) {
        __m512i wl[CG], wh[CG];  // weights 8h .. 8h + 3 and 8h + 4 .. 8h + 7 of the block, one byte each
        for (int c = 0; c < CG; ++c) {
          const __m512i v = _mm512_loadu_si512(reg[c] + h * 64);
          wl[c] = _mm512_and_si512(v, m4);
          wh[c] = _mm512_and_si512(_mm512_srli_epi16(v, 4), m4);
        }
        for (int t = 0; t < TN; ++t) {
          const int64_t o = t * a.K + b * QK + h * 8;
          const __m512i bl0 = bcast4(xl + o), bl1 = bcast4(xl + o + 4);
          const __m512i bh0 = bcast4(xh + o), bh1 = bcast4(xh + o + 4);
          for (int c = 0; c < CG; ++c) {
            al[t][c] = _mm512_dpbusd_epi32(al[t][c], bl0, wl[c]);  // lo (u8) x w (0..15 as s8)
            al2[t][c] = _mm512_dpbusd_epi32(al2[t][c], bl1, wh[c]);
            ah[t][c] = _mm512_dpbusd_epi32(ah[t][c], wl[c], bh0);  // w (u8) x hi (s8)
            ah2[t][c] = _mm512_dpbusd_epi32(ah2[t][c], wh[c], bh1);
          }
        }
      }
    } else {
#pragma GCC unroll 8
      for (int h = 0; h < 8; ++h) {
        __m512i wv[CG];  // weights 4h .. 4h + 3 of the block, int8
        for (int c = 0; c < CG; ++c) {
          wv[c] = _mm512_loadu_si512(reg[c] + h * 64);
          ws[c] = _mm512_dpbusd_epi32(ws[c], ones, wv[c]);
        }
        for (int t = 0; t < TN; ++t) {
          const int64_t o = t * a.K + b * QK + h * 4;
          const __m512i bl0 = bcast4(xl + o), bh0 = bcast4(xh + o);
          for (int c = 0; c < CG; ++c) {
            if (h % 2 == 0) {
              al[t][c] = _mm512_dpbusd_epi32(al[t][c], bl0, wv[c]);  // lo (u8) x w (s8)
              ah[t][c] = _mm512_dpbusd_epi32(ah[t][c], bh0, wv[c]);  // (hi + 128) (u8) x w (s8)
            } else {
              al2[t][c] = _mm512_dpbusd_epi32(al2[t][c], bl0, wv[c]);
              ah2[t][c] = _mm512_dpbusd_epi32(ah2[t][c], bh0, wv[c]);
            }
          }
        }
      }
    }
    for (int c = 0; c < CG; ++c) {
      __m512 dw, mw = _mm512_setzero_ps();
      if (FMT == Q4_K) {  // d * sc and dmin * m, subtracted below
        const uint8_t* r = gw + c * gbytes + (b / 8) * Q4K_REGION;
        const auto u8f = [](const uint8_t* p) {
          return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
        };
        dw = _mm512_mul_ps(_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(r + Q4K_D))),
                           u8f(r + Q4K_SC + 16 * (b % 8)));
        mw = _mm512_mul_ps(_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(r + Q4K_DMIN))),
                           u8f(r + Q4K_M + 16 * (b % 8)));
      } else {
        dw = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(reg[c] + QB)));
        if (FMT == Q4_1) mw = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(reg[c] + QB + 32)));
      }
      for (int t = 0; t < TN; ++t) {
        const int64_t i = (t0 + t) * nb + b;
        __m512i hi = SPLIT ? _mm512_add_epi32(ah[t][c], ah2[t][c]) : ah[t][c];
        if (FMT == Q8_0) hi = _mm512_sub_epi32(hi, _mm512_slli_epi32(ws[c], 7));  // what hi + 128 added
        const __m512i lo = SPLIT ? _mm512_add_epi32(al[t][c], al2[t][c]) : al[t][c];
        const __m512i isum = _mm512_add_epi32(_mm512_slli_epi32(hi, 8), lo);
        const __m512 sc = _mm512_mul_ps(dw, _mm512_set1_ps(a.d[i]));
        facc[t][c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), sc, facc[t][c]);
        if (FMT == Q4_1) facc[t][c] = _mm512_fmadd_ps(mw, _mm512_set1_ps(a.s[i]), facc[t][c]);
        if (FMT == Q4_K) facc[t][c] = _mm512_fnmadd_ps(mw, _mm512_set1_ps(a.s[i]), facc[t][c]);
      }
    }
  }
  for (int t = 0; t < TN; ++t)
    for (int c = 0; c < CG; ++c) _mm512_storeu_ps(out + t * ldo + c * 16, facc[t][c]);
}
#endif  // LASERLM_X86 (avx512 Q4_1 / Q8_0)

#if LASERLM_X86
// Q6_K: per sub-block s of 16 weights, Q4_1's products (lo (u8) x w and w (u8) x hi) on the weights unpacked to bytes
// 0..63, then the exact sum(q_w q_x) - 32 sum(q_x) per lane.
template <int TN, int CG>
LASERLM_TARGET_AVX512 void tile_avx512_q6k(const uint8_t* gw, int64_t gbytes, int64_t nb, const Acts& a, int64_t t0,
                                           float* out, int64_t ldo) {
  __m512 facc[TN][CG];
  for (int t = 0; t < TN; ++t)
    for (int c = 0; c < CG; ++c) facc[t][c] = _mm512_setzero_ps();
  const __m512i m4 = _mm512_set1_epi8(0x0F), m30 = _mm512_set1_epi8(0x30);
  const uint8_t* xl = a.lo.data() + t0 * a.K;
  const uint8_t* xh = a.hi.data() + t0 * a.K;
  for (int64_t sb = 0; sb < nb / 8; ++sb) {
    const uint8_t* reg[CG];
    __m512 dw[CG];
    for (int c = 0; c < CG; ++c) {
      reg[c] = gw + c * gbytes + sb * Q6K_REGION;
      dw[c] = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(reg[c] + Q6K_D)));
    }
    for (int s = 0; s < 16; ++s) {
      // lo starts at -32 sum(q_x): the sub-block's sum(q_w q_x) - 32 sum(q_x) = 256 hi + lo
      __m512i al[TN][CG], ah[TN][CG];
      for (int t = 0; t < TN; ++t) {
        const __m512i s0 = _mm512_set1_epi32(-32 * a.s16[(t0 + t) * nb * 2 + sb * 16 + s]);
        for (int c = 0; c < CG; ++c) {
          al[t][c] = s0;
          ah[t][c] = _mm512_setzero_si512();
        }
      }
#pragma GCC unroll 2
      for (int e = 0; e < 2; ++e) {
        __m512i wl[CG], wh[CG];  // weights 16 s + 8 e + 0..3 and + 4..7 of each lane, one byte each (0..63)
        for (int c = 0; c < CG; ++c) {
          const uint8_t* rec = reg[c] + s * Q6K_SUB;
          const __m512i v = _mm512_loadu_si512(rec + e * 64);
          const __m512i v2 = _mm512_loadu_si512(rec + 128);
          const __m512i hl = _mm512_and_si512(e == 0 ? _mm512_slli_epi16(v2, 4) : v2, m30);
          const __m512i hh = _mm512_and_si512(e == 0 ? _mm512_slli_epi16(v2, 2) : _mm512_srli_epi16(v2, 2), m30);
          wl[c] = _mm512_or_si512(_mm512_and_si512(v, m4), hl);
          wh[c] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(v, 4), m4), hh);
        }
        for (int t = 0; t < TN; ++t) {
          const int64_t o = t * a.K + sb * 256 + s * 16 + e * 8;
          const __m512i bl0 = bcast4(xl + o), bl1 = bcast4(xl + o + 4);
          const __m512i bh0 = bcast4(xh + o), bh1 = bcast4(xh + o + 4);
          for (int c = 0; c < CG; ++c) {
            al[t][c] = _mm512_dpbusd_epi32(al[t][c], bl0, wl[c]);
            ah[t][c] = _mm512_dpbusd_epi32(ah[t][c], wl[c], bh0);
            al[t][c] = _mm512_dpbusd_epi32(al[t][c], bl1, wh[c]);
            ah[t][c] = _mm512_dpbusd_epi32(ah[t][c], wh[c], bh1);
          }
        }
      }
      for (int c = 0; c < CG; ++c) {
        const __m128i sc8 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(reg[c] + Q6K_SC + 16 * s));
        const __m512 dsc = _mm512_mul_ps(dw[c], _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(sc8)));
        for (int t = 0; t < TN; ++t) {
          const int64_t row = t0 + t;
          const __m512i isum = _mm512_add_epi32(_mm512_slli_epi32(ah[t][c], 8), al[t][c]);
          const __m512 sc = _mm512_mul_ps(dsc, _mm512_set1_ps(a.d[row * nb + sb * 8 + s / 2]));
          facc[t][c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), sc, facc[t][c]);
        }
      }
    }
  }
  for (int t = 0; t < TN; ++t)
    for (int c = 0; c < CG; ++c) _mm512_storeu_ps(out + t * ldo + c * 16, facc[t][c]);
}
#endif  // LASERLM_X86

#if LASERLM_AVX2
inline float hsum(__m256 v) {
  __m128 r = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  r = _mm_add_ps(r, _mm_movehl_ps(r, r));
  r = _mm_add_ss(r, _mm_movehdup_ps(r));
  return _mm_cvtss_f32(r);
}
#endif

constexpr int64_t L1_BUDGET = 24576;  // bytes of weights a pass over many rows keeps in L1

// ---- driver -------------------------------------------------------------------------------------------------------
// One tile: TN rows (from t0) x CG groups (from group g), written to out [TN, CG * 16] (row stride ldo).
template <int FMT, int TN, int CG>
void run_tile(int isa, const uint8_t* gw, int64_t gbytes, int64_t nb, const Acts& a, int64_t t0, float* out,
              int64_t ldo) {
#if LASERLM_X86
  if constexpr (FMT == Q6_K) {
    if (isa == AVX512) return tile_avx512_q6k<TN, CG>(gw, gbytes, nb, a, t0, out, ldo);
    if (isa == AVX2) return tile_avx2_q6k<TN, 2 * CG>(gw, gbytes, nb, a, t0, out, ldo);
  } else {
    if (isa == AVX512) return tile_avx512<FMT, TN, CG>(gw, gbytes, nb, a, t0, out, ldo);
    if (isa == AVX2) return tile_avx2<FMT, TN, 2 * CG>(gw, gbytes, nb, a, t0, out, ldo);
  }
#endif
  for (int c = 0; c < CG; ++c) group_scalar(FMT, gw + c * gbytes, nb, a, t0, TN, out + c * GR, ldo);
}

// Rows [t0, t0 + TN) over groups [g0, g1): CG groups per tile where they fit, then one at a time. Columns past N (the
// last group's padding rows) go through a scratch tile.
template <int FMT, int TN, int CG>
void run_rows_cg(int isa, const uint8_t* w, int64_t gbytes, int64_t nb, int64_t N, const Acts& a, int64_t t0,
                 int64_t g0, int64_t g1, float* y, int64_t ldy) {
  float scratch[TN * GR];
  int64_t g = g0;
  for (; g + CG <= g1 && (g + CG) * GR <= N; g += CG)
    run_tile<FMT, TN, CG>(isa, w + g * gbytes, gbytes, nb, a, t0, y + t0 * ldy + g * GR, ldy);
  for (; g < g1; ++g) {
    if ((g + 1) * GR <= N) {
      run_tile<FMT, TN, 1>(isa, w + g * gbytes, gbytes, nb, a, t0, y + t0 * ldy + g * GR, ldy);
    } else {
      run_tile<FMT, TN, 1>(isa, w + g * gbytes, gbytes, nb, a, t0, scratch, GR);
      for (int t = 0; t < TN; ++t)
        for (int64_t c = 0; c < N - g * GR; ++c) y[(t0 + t) * ldy + g * GR + c] = scratch[t * GR + c];
    }
  }
}

// Register tiles (activation rows x groups). A pass that streams the weights from memory takes one group at a time
// (one sequential read stream: measured on Zen 5, tiles of 2-4 groups read 20-60 % slower from DRAM); passes over
// spans already in L1 take two groups per tile when the rows are few, so that each broadcast activation serves two
// vpdpbusd and the tile has about a dozen independent accumulator chains (8 chains issue 5.5 vpdpbusd per ns, 12
// chains 7.2). The accumulators must fit the vector registers (32 for avx512, 16 for avx2).
template <int FMT, int TN, bool CACHED>
void run_rows(int isa, const uint8_t* w, int64_t gbytes, int64_t nb, int64_t N, const Acts& a, int64_t t0, int64_t g0,
              int64_t g1, float* y, int64_t ldy) {
  constexpr int CG = CACHED && TN == 2 ? 2 : 1;
  run_rows_cg<FMT, TN, CG>(isa, w, gbytes, nb, N, a, t0, g0, g1, y, ldy);
}

template <int FMT, bool CACHED>
void run_rows_n(int isa, int64_t tn, const uint8_t* w, int64_t gbytes, int64_t nb, int64_t N, const Acts& a,
                int64_t t0, int64_t g0, int64_t g1, float* y, int64_t ldy) {
  switch (tn) {
    case 1: return run_rows<FMT, 1, CACHED>(isa, w, gbytes, nb, N, a, t0, g0, g1, y, ldy);
    case 2: return run_rows<FMT, 2, CACHED>(isa, w, gbytes, nb, N, a, t0, g0, g1, y, ldy);
    case 3: return run_rows<FMT, 3, CACHED>(isa, w, gbytes, nb, N, a, t0, g0, g1, y, ldy);
    case 4: return run_rows<FMT, 4, CACHED>(isa, w, gbytes, nb, N, a, t0, g0, g1, y, ldy);
    case 5: return run_rows<FMT, 5, CACHED>(isa, w, gbytes, nb, N, a, t0, g0, g1, y, ldy);
    case 6: return run_rows<FMT, 6, CACHED>(isa, w, gbytes, nb, N, a, t0, g0, g1, y, ldy);
    case 7: return run_rows<FMT, 7, CACHED>(isa, w, gbytes, nb, N, a, t0, g0, g1, y, ldy);
    case 8: return run_rows<FMT, 8, CACHED>(isa, w, gbytes, nb, N, a, t0, g0, g1, y, ldy);
  }
  TORCH_CHECK(false, "no row tile of ", tn, " rows");
}

// How the rows of a call are taken: up to `single` rows run in one pass over the weights (every row in registers
// while the weights stream from memory, so such a step costs about one weight read); more rows run in passes of
// `pass` rows over spans of groups that stay in L1. Measured on Zen 5 (benchmarks/kernels): Q4_1 keeps 6 rows in one
// pass and 2 per pass beyond (its unpacked weights take registers), Q8_0 keeps 8.
struct RowPlan {
  int single, pass;
};
RowPlan row_plan(int isa, int64_t fmt) {
  if (isa == AVX512) return fmt == Q8_0 ? RowPlan{8, 8} : RowPlan{6, 2};
  if (isa == AVX2) return RowPlan{4, 2};
  return RowPlan{4, 4};
}

template <int FMT>
void run_span(int isa, RowPlan plan, int64_t T, const uint8_t* w, int64_t gbytes, int64_t nb, int64_t N,
              const Acts& a, int64_t gs, int64_t ge, float* y, int64_t ldy) {
  if (T <= plan.single) return run_rows_n<FMT, false>(isa, T, w, gbytes, nb, N, a, 0, gs, ge, y, ldy);
  run_rows_n<FMT, false>(isa, plan.pass, w, gbytes, nb, N, a, 0, gs, ge, y, ldy);  // streams the span into L1
  int64_t t = plan.pass;
  for (; t + plan.pass <= T; t += plan.pass)
    run_rows_n<FMT, true>(isa, plan.pass, w, gbytes, nb, N, a, t, gs, ge, y, ldy);
  if (t < T) run_rows_n<FMT, true>(isa, T - t, w, gbytes, nb, N, a, t, gs, ge, y, ldy);
}

// y [T, N] (row stride ldy) = x [T, K] @ W.T, W in the kernel layout. Threads split the groups (output columns); each
// takes its groups a span at a time and runs every tile of activation rows over the span while it is in cache.
void matmul_blocks(const float* x, int64_t T, int64_t K, const uint8_t* w, int64_t N, int64_t fmt, float* y,
                   int64_t ldy) {
  const int isa = g_isa;
  const int64_t nb = K / QK, gbytes = nb * region_bytes(fmt), G = n_groups(N);
  const RowPlan plan = row_plan(isa, fmt);
  Acts a;
  quantize_acts(x, T, K, fmt, isa, a);
  const int64_t grain = std::max<int64_t>(4, 256 / std::max<int64_t>(nb, 1));
  at::parallel_for(0, G, grain, [&](int64_t g0, int64_t g1) {
    // groups per span: all of them for one pass; for several, as many as keep their weights within L1_BUDGET (an even
    // count, for the tiles of two groups), so that every pass after the first reads them from L1
    const int64_t GT = T <= plan.single ? g1 - g0 : std::max<int64_t>(2, L1_BUDGET / gbytes / 2 * 2);
    for (int64_t gs = g0; gs < g1; gs += GT) {
      const int64_t ge = std::min(g1, gs + GT);
      if (fmt == Q4_1) run_span<Q4_1>(isa, plan, T, w, gbytes, nb, N, a, gs, ge, y, ldy);
      else if (fmt == Q4_K) run_span<Q4_K>(isa, plan, T, w, gbytes, nb, N, a, gs, ge, y, ldy);
      else if (fmt == Q6_K) run_span<Q6_K>(isa, plan, T, w, gbytes, nb, N, a, gs, ge, y, ldy);
      else run_span<Q8_0>(isa, plan, T, w, gbytes, nb, N, a, gs, ge, y, ldy);
    }
  });
}

}  // namespace

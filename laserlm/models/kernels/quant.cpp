// laserlm's block-quantized matrix kernels (CPU): y = x @ W.T with W stored in blocks of 32 weights.
//
// In-memory layout of one row of W (K/32 = nb blocks), "structure of arrays" so that scales are converted
// and multiplied eight blocks at a time:
//   Q4_1  [nb x 16 bytes of nibbles][nb x fp16 d][nb x fp16 m]     w = d * q + m,  q in 0..15
//   Q8_0  [nb x 32 int8][nb x fp16 d]                              w = d * q
// (20 / 34 bytes per block, the sizes of GGUF's Q4_1 / Q8_0; GGUF Q4_0 becomes Q4_1 with m = -8 d, exactly).
// Nibble byte j of a block holds weight j (low 4 bits) and weight j + 16 (high 4 bits), as in GGUF.
// Every weight tensor is allocated with 16 spare bytes at its end (8-wide loads of the last row's scales).
//
// Activations are quantized per 32-block to int16 on the fly (the scheme of llama.cpp's Q8_0 / Q8_1
// activation blocks with 16-bit values), then each block dot product is an integer multiply-add
// (AVX2 madd_epi16) scaled in float, the structure of ggml_vec_dot_q4_1_q8_1 / _q8_0_q8_0:
//   Q4_1: sum_b d_w d_x sum(q_w q_x) + sum_b m_w sum(x)
//   Q8_0: sum_b d_w d_x sum(q_w q_x)
// Each weight block is read once per call for all T rows of x (T = 1..16: decode and verification).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define LASERLM_AVX2 1
#else
#define LASERLM_AVX2 0
#endif

namespace {

constexpr int QK = 32;
enum Fmt : int64_t { Q4_1 = 3, Q8_0 = 8 };  // GGML type ids of the semantics

inline int block_bytes(int64_t fmt) {
  switch (fmt) {
    case Q4_1: return 20;
    case Q8_0: return 34;
  }
  TORCH_CHECK(false, "laserlm kernels: unsupported block format ", fmt);
}
inline int quant_bytes(int64_t fmt) { return fmt == Q8_0 ? 32 : 16; }

inline float fp16_to_fp32(uint16_t h) {
#if defined(__F16C__)
  return _cvtsh_ss(h);
#else
  return static_cast<float>(c10::Half(h, c10::Half::from_bits()));
#endif
}

constexpr int64_t PF_ROWS = 4;
inline int64_t round8(int64_t n) { return (n + 7) / 8 * 8; }

// ---- activation quantization: x [T, K] -> int16 [T, qstride], d [T, nbs], s = sum(x) [T, nbs] (nbs = round8(nb),
// padding lanes zero). int16 per 32-block (d = max|x_b| / 32767): the rounding error is 1/256 of llama.cpp's
// int8 activations, which matters on small models whose hidden states have large outlier channels.
// Two layouts of a row of int16 values (qstride = nbp * 32, nbp = nb rounded up to even, the padding block zero):
//   natural (Q8_0 weights): value j of block b at b * 32 + j;
//   paired  (Q4_1 weights): blocks 2P and 2P + 1 share 64 values, value j of block b at
//           P * 64 + v * 16 + (b % 2) * 8 + (j % 16) / 2 with v = 2 (j % 2) + (j >= 16): the order in which
//           dot_rows_q4_1 extracts the nibbles of the two blocks from one 32-byte load (no widening shuffles).
inline int64_t nb_even(int64_t nb) { return (nb + 1) / 2 * 2; }
inline int64_t q16_index(int64_t b, int j, bool paired) {
  if (!paired) return b * QK + j;
  return (b >> 1) * 64 + (2 * (j & 1) + (j >= 16)) * 16 + (b & 1) * 8 + ((j & 15) >> 1);
}

void quantize_rows_q16(const float* x, int64_t T, int64_t K, bool paired, int16_t* q, int64_t qstride, float* d,
                       float* s) {
  const int64_t nb = K / QK, nbs = round8(nb);
  std::fill(d, d + T * nbs, 0.f);
  std::fill(s, s + T * nbs, 0.f);
  std::fill(q, q + T * qstride, static_cast<int16_t>(0));
  at::parallel_for(0, T * nb, 256, [&](int64_t b0, int64_t b1) {
    for (int64_t i = b0; i < b1; ++i) {
      const int64_t t = i / nb, b = i % nb;
      const float* xb = x + i * QK;
      float amax = 0.f, sum = 0.f;
      for (int j = 0; j < QK; ++j) {
        amax = std::max(amax, std::fabs(xb[j]));
        sum += xb[j];
      }
      const float dd = amax / 32767.f;
      const float id = dd != 0.f ? 1.f / dd : 0.f;
      int16_t* qt = q + t * qstride;
      if (paired) {
        for (int j = 0; j < QK; ++j) qt[q16_index(b, j, true)] = static_cast<int16_t>(std::nearbyint(xb[j] * id));
      } else {
        for (int j = 0; j < QK; ++j) qt[b * QK + j] = static_cast<int16_t>(std::nearbyint(xb[j] * id));
      }
      d[t * nbs + b] = dd;
      s[t * nbs + b] = sum;
    }
  });
}

#if LASERLM_AVX2
inline float hsum(__m256 v) {
  __m128 r = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  r = _mm_add_ps(r, _mm_movehl_ps(r, r));
  r = _mm_add_ss(r, _mm_movehdup_ps(r));
  return _mm_cvtss_f32(r);
}

// acc + madd_epi16(a, b): one VNNI instruction (vpdpwssd) where the CPU has it (AVX512-VNNI with VL, or AVX-VNNI),
// else a multiply-add and an add; the same int32 sums either way (no saturation in either form).
inline __m256i madd_add(__m256i acc, __m256i a, __m256i b) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpwssd_epi32(acc, a, b);
#elif defined(__AVXVNNI__)
  return _mm256_dpwssd_avx_epi32(acc, a, b);
#else
  return _mm256_add_epi32(acc, _mm256_madd_epi16(a, b));
#endif
}

inline __m256 keep_mask(int cnt) {
  return _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(cnt), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)));
}

// Dot products of one weight row with TN int16 activation rows, eight blocks per step. The integer dot product
// of each block stays in int32 lanes until the eight blocks' sums are gathered into one vector by horizontal adds;
// then one convert and one fused multiply-add per eight blocks apply the scales d_w * d_x. (A multiply-add per
// block chained the accumulator through the FMA latency: ~6 cycles per block.) Products are int16 x int16 ->
// int32 (_mm256_madd_epi16) and cannot overflow: |q_w| <= 127, |q_x| <= 32767, at most 32 products per lane sum.
//
// Q4_1: one 32-byte load holds the nibbles of two blocks (one per 128-bit lane); masks and 16-bit shifts give
// four vectors of 16 weights each, already int16, in the "paired" activation order.
template <int TN>
inline void dot_rows_q4_1(const uint8_t* row, const int16_t* xq, int64_t xstride, const float* xd, const float* xs,
                          int64_t nb, float* out, int64_t ostride) {
  const int64_t nbs = round8(nb);
  const uint16_t* dh = reinterpret_cast<const uint16_t*>(row + nb * 16);
  const uint16_t* mh = dh + nb;
  const __m256i m4 = _mm256_set1_epi16(0x000F);
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);  // hadd order [0 2 4 6 1 3 5 7] -> natural
  __m256 acc[TN], macc[TN];
#pragma GCC unroll 4
  for (int i = 0; i < TN; ++i) acc[i] = macc[i] = _mm256_setzero_ps();
  for (int64_t b0 = 0; b0 < nb; b0 += 8) {
    const int cnt = static_cast<int>(std::min<int64_t>(8, nb - b0));
    const __m256 keep = keep_mask(cnt);
    const __m256 dv = _mm256_and_ps(_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(dh + b0))), keep);
    const __m256 mv = _mm256_and_ps(_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(mh + b0))), keep);
#pragma GCC unroll 4
    for (int i = 0; i < TN; ++i) macc[i] = _mm256_fmadd_ps(mv, _mm256_loadu_ps(xs + i * nbs + b0), macc[i]);
    const int npairs = (cnt + 1) / 2;
    auto pair = [&](const int q, __m256i* p) __attribute__((always_inline)) {
      if (q >= npairs) {
#pragma GCC unroll 4
        for (int i = 0; i < TN; ++i) p[i] = _mm256_setzero_si256();
        return;
      }
      const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + (b0 + 2 * q) * 16));
      const __m256i wa = _mm256_and_si256(raw, m4);
      const __m256i wb = _mm256_and_si256(_mm256_srli_epi16(raw, 4), m4);
      const __m256i wc = _mm256_and_si256(_mm256_srli_epi16(raw, 8), m4);
      const __m256i wd = _mm256_srli_epi16(raw, 12);
#pragma GCC unroll 4
      for (int i = 0; i < TN; ++i) {
        const __m256i* xp = reinterpret_cast<const __m256i*>(xq + i * xstride + (b0 / 2 + q) * 64);
        const __m256i s0 = madd_add(_mm256_madd_epi16(wa, _mm256_loadu_si256(xp)), wb, _mm256_loadu_si256(xp + 1));
        const __m256i s1 = madd_add(_mm256_madd_epi16(wc, _mm256_loadu_si256(xp + 2)), wd, _mm256_loadu_si256(xp + 3));
        p[i] = _mm256_add_epi32(s0, s1);  // lanes 0-3: block b0 + 2q, lanes 4-7: block b0 + 2q + 1
      }
    };
    __m256i p0[TN], p1[TN], ha[TN];
    pair(0, p0);
    pair(1, p1);
#pragma GCC unroll 4
    for (int i = 0; i < TN; ++i) ha[i] = _mm256_hadd_epi32(p0[i], p1[i]);
    pair(2, p0);
    pair(3, p1);
#pragma GCC unroll 4
    for (int i = 0; i < TN; ++i) {
      const __m256i h = _mm256_hadd_epi32(ha[i], _mm256_hadd_epi32(p0[i], p1[i]));
      const __m256 sums = _mm256_cvtepi32_ps(_mm256_permutevar8x32_epi32(h, order));
      acc[i] = _mm256_fmadd_ps(_mm256_mul_ps(dv, _mm256_loadu_ps(xd + i * nbs + b0)), sums, acc[i]);
    }
  }
#pragma GCC unroll 4
  for (int i = 0; i < TN; ++i) out[i * ostride] = hsum(_mm256_add_ps(acc[i], macc[i]));
}

// Q8_0: each block's 32 int8 weights are widened to int16 (two 16-byte loads), natural activation order.
template <int TN>
inline void dot_rows_q8_0(const uint8_t* row, const int16_t* xq, int64_t xstride, const float* xd, const float*,
                          int64_t nb, float* out, int64_t ostride) {
  const int64_t nbs = round8(nb);
  const uint16_t* dh = reinterpret_cast<const uint16_t*>(row + nb * 32);
  __m256 acc[TN];
#pragma GCC unroll 4
  for (int i = 0; i < TN; ++i) acc[i] = _mm256_setzero_ps();
  for (int64_t b0 = 0; b0 < nb; b0 += 8) {
    const int cnt = static_cast<int>(std::min<int64_t>(8, nb - b0));
    const __m256 dv = _mm256_and_ps(_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(dh + b0))),
                                    keep_mask(cnt));
    auto blk = [&](const int j, __m256i* p) __attribute__((always_inline)) {
      if (j >= cnt) {
#pragma GCC unroll 4
        for (int i = 0; i < TN; ++i) p[i] = _mm256_setzero_si256();
        return;
      }
      const uint8_t* wp = row + (b0 + j) * 32;
      const __m256i w0 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wp)));
      const __m256i w1 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wp + 16)));
#pragma GCC unroll 4
      for (int i = 0; i < TN; ++i) {
        const __m256i* xp = reinterpret_cast<const __m256i*>(xq + i * xstride + (b0 + j) * QK);
        p[i] = madd_add(_mm256_madd_epi16(w0, _mm256_loadu_si256(xp)), w1, _mm256_loadu_si256(xp + 1));
      }
    };
    __m256i pa[TN], pb[TN], t[TN], hl[TN];
    // hadd tree: after two levels lane j of the low / high 128 bits holds the low / high half-sum of block j
    blk(0, pa);
    blk(1, pb);
#pragma GCC unroll 4
    for (int i = 0; i < TN; ++i) t[i] = _mm256_hadd_epi32(pa[i], pb[i]);
    blk(2, pa);
    blk(3, pb);
#pragma GCC unroll 4
    for (int i = 0; i < TN; ++i) hl[i] = _mm256_hadd_epi32(t[i], _mm256_hadd_epi32(pa[i], pb[i]));  // blocks 0-3
    blk(4, pa);
    blk(5, pb);
#pragma GCC unroll 4
    for (int i = 0; i < TN; ++i) t[i] = _mm256_hadd_epi32(pa[i], pb[i]);
    blk(6, pa);
    blk(7, pb);
#pragma GCC unroll 4
    for (int i = 0; i < TN; ++i) {
      const __m256i hh = _mm256_hadd_epi32(t[i], _mm256_hadd_epi32(pa[i], pb[i]));  // blocks 4-7
      const __m256i s = _mm256_add_epi32(_mm256_permute2x128_si256(hl[i], hh, 0x20),
                                         _mm256_permute2x128_si256(hl[i], hh, 0x31));
      acc[i] = _mm256_fmadd_ps(_mm256_mul_ps(dv, _mm256_loadu_ps(xd + i * nbs + b0)), _mm256_cvtepi32_ps(s), acc[i]);
    }
  }
#pragma GCC unroll 4
  for (int i = 0; i < TN; ++i) out[i * ostride] = hsum(acc[i]);
}
#else
template <int TN>
inline void dot_rows_scalar(int64_t fmt, const uint8_t* row, const int16_t* xq, int64_t xstride, const float* xd,
                            const float* xs, int64_t nb, float* out, int64_t ostride) {
  const int64_t nbs = round8(nb);
  const uint16_t* dh = reinterpret_cast<const uint16_t*>(row + nb * quant_bytes(fmt));
  const uint16_t* mh = dh + nb;
  const bool paired = fmt == Q4_1;
  for (int t = 0; t < TN; ++t) {
    const int16_t* qx = xq + t * xstride;
    float total = 0.f;
    for (int64_t b = 0; b < nb; ++b) {
      int64_t isum = 0;
      if (fmt == Q8_0) {
        const int8_t* qw = reinterpret_cast<const int8_t*>(row + b * 32);
        for (int j = 0; j < QK; ++j) isum += qw[j] * qx[q16_index(b, j, false)];
      } else {
        const uint8_t* q = row + b * 16;
        for (int j = 0; j < 16; ++j) {
          isum += (q[j] & 0x0F) * qx[q16_index(b, j, paired)];
          isum += (q[j] >> 4) * qx[q16_index(b, j + 16, paired)];
        }
        total += fp16_to_fp32(mh[b]) * xs[t * nbs + b];
      }
      total += fp16_to_fp32(dh[b]) * xd[t * nbs + b] * static_cast<float>(isum);
    }
    out[t * ostride] = total;
  }
}
template <int TN>
inline void dot_rows_q4_1(const uint8_t* row, const int16_t* xq, int64_t xstride, const float* xd, const float* xs,
                          int64_t nb, float* out, int64_t ostride) {
  dot_rows_scalar<TN>(Q4_1, row, xq, xstride, xd, xs, nb, out, ostride);
}
template <int TN>
inline void dot_rows_q8_0(const uint8_t* row, const int16_t* xq, int64_t xstride, const float* xd, const float* xs,
                          int64_t nb, float* out, int64_t ostride) {
  dot_rows_scalar<TN>(Q8_0, row, xq, xstride, xd, xs, nb, out, ostride);
}
#endif

#ifndef LASERLM_ROW_GROUP
#define LASERLM_ROW_GROUP 4
#endif
constexpr int ROW_GROUP = LASERLM_ROW_GROUP;  // activation rows per pass over a weight row

template <int FMT, int TN>
inline void dot_rows(const uint8_t* row, const int16_t* xq, int64_t xstride, const float* xd, const float* xs,
                     int64_t nb, float* out, int64_t ostride) {
  if (FMT == Q4_1) dot_rows_q4_1<TN>(row, xq, xstride, xd, xs, nb, out, ostride);
  else dot_rows_q8_0<TN>(row, xq, xstride, xd, xs, nb, out, ostride);
}

template <int FMT>
inline void dot_rows_any(const uint8_t* row, const int16_t* xq, int64_t xstride, const float* xd, const float* xs,
                         int64_t nb, int64_t T, float* out, int64_t ostride) {
  const int64_t nbs = round8(nb);
  int64_t t = 0;
  for (; t + ROW_GROUP <= T; t += ROW_GROUP)
    dot_rows<FMT, ROW_GROUP>(row, xq + t * xstride, xstride, xd + t * nbs, xs + t * nbs, nb, out + t * ostride, ostride);
  const int64_t rest = T - t;
  const int16_t* q = xq + t * xstride;
  const float *d = xd + t * nbs, *s = xs + t * nbs;
  float* o = out + t * ostride;
  if (rest == 3) dot_rows<FMT, 3>(row, q, xstride, d, s, nb, o, ostride);
  else if (rest == 2) dot_rows<FMT, 2>(row, q, xstride, d, s, nb, o, ostride);
  else if (rest == 1) dot_rows<FMT, 1>(row, q, xstride, d, s, nb, o, ostride);
}

// y [T, N] (row stride ldy) = x [T, K] @ W.T, W = N rows of blocks.
// Tiled for many activation rows (prefill chunks, batches of B rows, draft verification): each thread takes a tile
// of weight rows sized to stay in L2 (TILE_BYTES) and runs every group of ROW_GROUP activation rows over it, so one
// group's int16 rows stay in L1 across the tile. Without tiles, 16 rows of a K = 1536 input (48 KiB) spilled
// from L1 on every weight row and the 16-row step cost 2.5x the 8-row one. T <= ROW_GROUP keeps the plain streaming
// loop: the tiled loop with one group measured 1.3-1.4x slower at T = 4 (code generation of the nested loop).
constexpr int64_t TILE_BYTES = 96 * 1024;
void matmul_blocks(const float* x, int64_t T, int64_t K, const uint8_t* w, int64_t N, int64_t fmt, float* y,
                   int64_t ldy) {
  const int64_t nb = K / QK, rb = nb * block_bytes(fmt), nbs = round8(nb), qstride = nb_even(nb) * QK;
  std::vector<int16_t> xq(T * qstride);
  std::vector<float> xd(T * nbs), xs(T * nbs);
  quantize_rows_q16(x, T, K, fmt == Q4_1, xq.data(), qstride, xd.data(), xs.data());
  const int64_t grain = std::max<int64_t>(16, 2048 / std::max<int64_t>(nb, 1));
  if (T <= ROW_GROUP) {  // decode, short verification: one pass, each weight row read once for all T rows
    at::parallel_for(0, N, grain, [&](int64_t n0, int64_t n1) {
      for (int64_t n = n0; n < n1; ++n) {
        const uint8_t* row = w + n * rb;
        if (n + PF_ROWS < n1) {  // software prefetch: the hardware prefetcher alone left the loop at ~half bandwidth
          const uint8_t* next = row + PF_ROWS * rb;
          for (int64_t off = 0; off < rb; off += 64) _mm_prefetch(reinterpret_cast<const char*>(next + off), _MM_HINT_T0);
        }
        if (fmt == Q4_1) dot_rows_any<Q4_1>(row, xq.data(), qstride, xd.data(), xs.data(), nb, T, y + n, ldy);
        else dot_rows_any<Q8_0>(row, xq.data(), qstride, xd.data(), xs.data(), nb, T, y + n, ldy);
      }
    });
    return;
  }
  const int64_t tile = std::max<int64_t>(8, TILE_BYTES / std::max<int64_t>(rb, 1));
  at::parallel_for(0, N, grain, [&](int64_t n0, int64_t n1) {
    for (int64_t t0 = n0; t0 < n1; t0 += tile) {
      const int64_t t1 = std::min(n1, t0 + tile);
      for (int64_t g = 0; g < T; g += ROW_GROUP) {
        const int64_t rows = std::min<int64_t>(ROW_GROUP, T - g);
        const int16_t* q = xq.data() + g * qstride;
        const float *d = xd.data() + g * nbs, *s = xs.data() + g * nbs;
        for (int64_t n = t0; n < t1; ++n) {
          const uint8_t* row = w + n * rb;
          // software prefetch on the first pass (the hardware prefetcher alone left the loop at ~half bandwidth)
          if (g == 0 && n + PF_ROWS < n1) {
            const uint8_t* next = row + PF_ROWS * rb;
            for (int64_t off = 0; off < rb; off += 64) _mm_prefetch(reinterpret_cast<const char*>(next + off), _MM_HINT_T0);
          }
          if (fmt == Q4_1) dot_rows_any<Q4_1>(row, q, qstride, d, s, nb, rows, y + g * ldy + n, ldy);
          else dot_rows_any<Q8_0>(row, q, qstride, d, s, nb, rows, y + g * ldy + n, ldy);
        }
      }
    }
  });
}

void check_weight(const torch::Tensor& w, int64_t fmt, int64_t K) {
  TORCH_CHECK(w.dtype() == torch::kUInt8 && w.dim() == 2 && w.is_contiguous(), "weight blocks must be a contiguous uint8 [N, row_bytes] tensor");
  TORCH_CHECK(K % QK == 0, "in_features must be a multiple of 32, got ", K);
  TORCH_CHECK(w.size(1) == (K / QK) * block_bytes(fmt), "weight row has ", w.size(1), " bytes, expected ", (K / QK) * block_bytes(fmt));
  TORCH_CHECK(w.storage().nbytes() - w.storage_offset() >= static_cast<size_t>(w.numel() + 16),
              "weight blocks need 16 spare bytes after the last row (use laserlm.models.quant.padded)");
}

}  // namespace

// y [T, N] = x [T, K] @ dequant(w).T   (x float32; weights read once for all T rows)
torch::Tensor qmatmul(torch::Tensor x, torch::Tensor w, int64_t fmt, int64_t K) {
  check_weight(w, fmt, K);
  TORCH_CHECK(x.dtype() == torch::kFloat32 && x.dim() == 2 && x.size(1) == K, "x must be float32 [T, ", K, "]");
  x = x.contiguous();
  const int64_t T = x.size(0), N = w.size(0);
  auto y = torch::empty({T, N}, torch::kFloat32);
  matmul_blocks(x.data_ptr<float>(), T, K, w.data_ptr<uint8_t>(), N, fmt, y.data_ptr<float>(), N);
  return y;
}

// [len(rows), K] = dequant(w)[rows]  (rows int64; all rows when `rows` is empty), float32, or bfloat16 (each float32
// value d * q + m rounded to nearest even: the operand of a bfloat16 GEMM, half the bytes written)
template <typename Out>
void dequantize_rows(const uint8_t* wp, int64_t N, int64_t rb, int64_t fmt, int64_t K, const int64_t* ip, int64_t R,
                     Out* op) {
  const int64_t nb = K / QK, qb = quant_bytes(fmt);
  at::parallel_for(0, R, 64, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const int64_t n = ip ? ip[r] : r;
      TORCH_CHECK(n >= 0 && n < N, "row index ", n, " out of range [0, ", N, ")");
      const uint8_t* row = wp + n * rb;
      const uint16_t* dh = reinterpret_cast<const uint16_t*>(row + nb * qb);
      Out* o = op + r * K;
      for (int64_t b = 0; b < nb; ++b, o += QK) {
        const float d = fp16_to_fp32(dh[b]);
        if (fmt == Q8_0) {
          const int8_t* q = reinterpret_cast<const int8_t*>(row + b * 32);
          for (int j = 0; j < QK; ++j) o[j] = static_cast<Out>(d * q[j]);
        } else {
          const float m = fp16_to_fp32(dh[nb + b]);
          const uint8_t* qs = row + b * 16;
          for (int j = 0; j < 16; ++j) {
            o[j] = static_cast<Out>(d * (qs[j] & 0x0F) + m);
            o[j + 16] = static_cast<Out>(d * (qs[j] >> 4) + m);
          }
        }
      }
    }
  });
}

torch::Tensor dequantize(torch::Tensor w, int64_t fmt, int64_t K, torch::Tensor rows, bool bf16) {
  check_weight(w, fmt, K);
  const bool all = rows.numel() == 0;
  const int64_t R = all ? w.size(0) : rows.numel();
  auto idx = all ? rows : rows.to(torch::kInt64).contiguous();
  const int64_t* ip = all ? nullptr : idx.data_ptr<int64_t>();
  auto out = torch::empty({R, K}, bf16 ? torch::kBFloat16 : torch::kFloat32);
  if (bf16)
    dequantize_rows(w.data_ptr<uint8_t>(), w.size(0), w.size(1), fmt, K, ip, R, out.data_ptr<at::BFloat16>());
  else
    dequantize_rows(w.data_ptr<uint8_t>(), w.size(0), w.size(1), fmt, K, ip, R, out.data_ptr<float>());
  return out;
}

bool has_avx2() {
#if LASERLM_AVX2
  return true;
#else
  return false;
#endif
}

// ---- one whole decoder layer for a few tokens (decode / verification), fp32 activations ----------------
namespace {

#if LASERLM_AVX2
// e^x for 8 floats (Cephes' polynomial, as in avx_mathfun; relative error ~1e-7). Inputs are clamped to
// [-87, 88.37] (e^-87 ~ 1.6e-38: softmax weights and SiLU / GELU gates that small are 0 to float32 anyway).
inline __m256 exp256(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.0f)), _mm256_set1_ps(88.3762626647949f));
  const __m256 fx = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693359375f), x);
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.12194440e-4f), x);
  __m256 y = _mm256_set1_ps(1.9875691500e-4f);
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507e-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073e-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894e-2f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459e-1f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201e-1f));
  y = _mm256_add_ps(_mm256_fmadd_ps(y, _mm256_mul_ps(x, x), x), _mm256_set1_ps(1.0f));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(fx), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}
#endif

void rmsnorm_rows(const float* x, int64_t rows, int64_t d, const float* w, float eps, float* out) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * d;
    float ss = 0.f;
    int64_t i = 0;
#if LASERLM_AVX2
    __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
    for (; i + 16 <= d; i += 16) {
      const __m256 u = _mm256_loadu_ps(xr + i), v = _mm256_loadu_ps(xr + i + 8);
      a0 = _mm256_fmadd_ps(u, u, a0);
      a1 = _mm256_fmadd_ps(v, v, a1);
    }
    ss = hsum(_mm256_add_ps(a0, a1));
#endif
    for (; i < d; ++i) ss += xr[i] * xr[i];
    const float inv = 1.f / std::sqrt(ss / static_cast<float>(d) + eps);
    float* o = out + r * d;
    for (i = 0; i < d; ++i) o[i] = xr[i] * inv * w[i];
  }
}

// Where the keys / values of one (row, kv head) live: a contiguous [S, hd] block (the engine's cache), or pages
// of ps positions (the paged KV pool: page p of the row = table[p], rows of pool [Hkv, n_pages, ps, hd]).
struct KVRows {
  const float* k;  // contiguous: the [S, hd] block of this (row, head); paged: pool + head * n_pages * ps * hd
  const float* v;
  const int64_t* table = nullptr;  // paged: the row's pages of this layer, in order
  int64_t ps = 0;
  // [j0, j1) within one contiguous run starting at key j0: pointers to key j0 and the run's end (exclusive)
  inline int64_t run_end(int64_t j0, int64_t j1) const { return table ? std::min(j1, (j0 / ps + 1) * ps) : j1; }
  inline int64_t offset(int64_t j, int64_t hd) const { return table ? (table[j / ps] * ps + j % ps) * hd : j * hd; }
};

// sc[j] = scale * q . k_j for keys j in [j0, j1) of one contiguous run (four keys at a time)
inline void scores_run(const float* q, const float* k0, int64_t j0, int64_t j1, int64_t hd, float scale, float* sc) {
  int64_t j = j0;
#if LASERLM_AVX2
  if (hd % 8 == 0) {
    for (; j + 4 <= j1; j += 4) {
      const float* kr = k0 + (j - j0) * hd;
      __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps(), a2 = _mm256_setzero_ps(), a3 = _mm256_setzero_ps();
      for (int64_t e = 0; e < hd; e += 8) {
        const __m256 qv = _mm256_loadu_ps(q + e);
        a0 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(kr + e), a0);
        a1 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(kr + hd + e), a1);
        a2 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(kr + 2 * hd + e), a2);
        a3 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(kr + 3 * hd + e), a3);
      }
      const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
      const __m128 r = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
      _mm_storeu_ps(sc + j, _mm_mul_ps(r, _mm_set1_ps(scale)));
    }
  }
#endif
  for (; j < j1; ++j) {
    const float* k = k0 + (j - j0) * hd;
    float acc = 0.f;
    for (int64_t e = 0; e < hd; ++e) acc += q[e] * k[e];
    sc[j] = acc * scale;
  }
}

// o [hd] += sum_j sc[j] v_j over keys [j0, j1) of one contiguous run
inline void pv_run(const float* sc, const float* v0, int64_t j0, int64_t j1, int64_t hd, float* o) {
  int64_t e0 = 0;
#if LASERLM_AVX2
  if (hd % 8 == 0) {
    for (; e0 + 64 <= hd; e0 += 64) {
      __m256 acc[8];
#pragma GCC unroll 8
      for (int c = 0; c < 8; ++c) acc[c] = _mm256_loadu_ps(o + e0 + 8 * c);
      for (int64_t j = j0; j < j1; ++j) {
        const __m256 p = _mm256_set1_ps(sc[j]);
        const float* v = v0 + (j - j0) * hd + e0;
#pragma GCC unroll 8
        for (int c = 0; c < 8; ++c) acc[c] = _mm256_fmadd_ps(p, _mm256_loadu_ps(v + 8 * c), acc[c]);
      }
#pragma GCC unroll 8
      for (int c = 0; c < 8; ++c) _mm256_storeu_ps(o + e0 + 8 * c, acc[c]);
    }
    for (; e0 + 8 <= hd; e0 += 8) {
      __m256 acc = _mm256_loadu_ps(o + e0);
      for (int64_t j = j0; j < j1; ++j)
        acc = _mm256_fmadd_ps(_mm256_set1_ps(sc[j]), _mm256_loadu_ps(v0 + (j - j0) * hd + e0), acc);
      _mm256_storeu_ps(o + e0, acc);
    }
  }
#endif
  for (int64_t e = e0; e < hd; ++e) {
    float acc = o[e];
    for (int64_t j = j0; j < j1; ++j) acc += sc[j] * v0[(j - j0) * hd + e];
    o[e] = acc;
  }
}

// o [hd] = softmax(scale * q . K[lo..hi]) @ V[lo..hi] for one query row (keys lo..hi inclusive); sc scratch of at
// least hi + 1 floats. Scores four keys at a time, exponentials eight at a time, the weighted sum of V with 64
// output floats in registers; runs of contiguous keys (the whole range, or one page at a time).
// p_out (optional): the normalized probabilities of positions lo .. hi are written at p_out[lo .. hi]
void attend_row(const float* q, const KVRows& kv, int64_t lo, int64_t hi, int64_t hd, float scale, float* sc,
                float* o, float* p_out = nullptr) {
  for (int64_t j0 = lo; j0 <= hi;) {
    const int64_t j1 = kv.run_end(j0, hi + 1);
    scores_run(q, kv.k + kv.offset(j0, hd), j0, j1, hd, scale, sc);
    j0 = j1;
  }
  float mx = -INFINITY;
  for (int64_t j = lo; j <= hi; ++j) mx = std::max(mx, sc[j]);
  float sum = 0.f;
  int64_t j = lo;
#if LASERLM_AVX2
  {
    __m256 sv = _mm256_setzero_ps();
    const __m256 mv = _mm256_set1_ps(mx);
    for (; j + 8 <= hi + 1; j += 8) {
      const __m256 ev = exp256(_mm256_sub_ps(_mm256_loadu_ps(sc + j), mv));
      _mm256_storeu_ps(sc + j, ev);
      sv = _mm256_add_ps(sv, ev);
    }
    sum = hsum(sv);
  }
#endif
  for (; j <= hi; ++j) { sc[j] = std::exp(sc[j] - mx); sum += sc[j]; }
  const float inv = 1.f / sum;
  std::fill(o, o + hd, 0.f);
  for (int64_t j0 = lo; j0 <= hi;) {
    const int64_t j1 = kv.run_end(j0, hi + 1);
    pv_run(sc, kv.v + kv.offset(j0, hd), j0, j1, hd, o);
    j0 = j1;
  }
  for (int64_t e = 0; e < hd; ++e) o[e] *= inv;
  if (p_out != nullptr)
    for (int64_t jj = lo; jj <= hi; ++jj) p_out[jj] = sc[jj] * inv;
}

// gate activation times up, in place over inter values: out = act(g) * u (act 0 = SiLU, 1 = GELU tanh approx.)
void glu(const float* g, const float* u, int64_t n, int64_t act, float* out) {
  int64_t j = 0;
#if LASERLM_AVX2
  const __m256 one = _mm256_set1_ps(1.f);
  for (; j + 8 <= n; j += 8) {
    const __m256 gv = _mm256_loadu_ps(g + j);
    __m256 a;
    if (act == 0) {
      a = _mm256_div_ps(gv, _mm256_add_ps(one, exp256(_mm256_sub_ps(_mm256_setzero_ps(), gv))));
    } else {  // 0.5 g (1 + tanh(k (g + 0.044715 g^3))), tanh(z) = 1 - 2 / (e^{2z} + 1)
      const __m256 z = _mm256_mul_ps(_mm256_set1_ps(0.7978845608028654f),
                                     _mm256_fmadd_ps(_mm256_mul_ps(_mm256_set1_ps(0.044715f), gv), _mm256_mul_ps(gv, gv), gv));
      const __m256 t = _mm256_sub_ps(one, _mm256_div_ps(_mm256_set1_ps(2.f),
                                                        _mm256_add_ps(exp256(_mm256_add_ps(z, z)), one)));
      a = _mm256_mul_ps(_mm256_mul_ps(_mm256_set1_ps(0.5f), gv), _mm256_add_ps(one, t));
    }
    _mm256_storeu_ps(out + j, _mm256_mul_ps(a, _mm256_loadu_ps(u + j)));
  }
#endif
  for (; j < n; ++j) {
    const float x = g[j];
    const float a = act == 0 ? x / (1.f + std::exp(-x))
                             : 0.5f * x * (1.f + std::tanh(0.7978845608028654f * (x + 0.044715f * x * x * x)));
    out[j] = a * u[j];
  }
}

}  // namespace

// The static arguments of one decoder layer for the whole-layer kernel: the pre-norm transformer block of the
// Llama family (Llama, Mistral, Qwen2, Qwen3) and of Gemma3 (sandwich norms).
//   norms: {attn_in, attn_out (Gemma3) or empty, mlp_in, mlp_out (Gemma3) or empty, q_norm or empty, k_norm or empty}
//          (already the multiplicative weight: Gemma's 1 + w)
//   mats / fmts: {qkv, o, gate_up, down} blocks; qkv_bias [(H + 2 Hkv) hd] or empty
//   window: sliding-window size (0 = global attention); act: 0 = SiLU, 1 = GELU (tanh approximation)
namespace {

struct LayerSpec {
  std::vector<torch::Tensor> norms;
  double eps;
  std::vector<torch::Tensor> mats;
  std::vector<int64_t> fmts;
  torch::Tensor qkv_bias;
  int64_t n_heads, n_kv, hd;
  double scaling;
  int64_t window, act, inter;
};

LayerSpec make_spec(std::vector<torch::Tensor> norms, double eps, std::vector<torch::Tensor> mats,
                    std::vector<int64_t> fmts, torch::Tensor qkv_bias, int64_t n_heads, int64_t n_kv, int64_t hd,
                    double scaling, int64_t window, int64_t act, int64_t inter) {
  TORCH_CHECK(norms.size() == 6 && mats.size() == 4 && fmts.size() == 4, "6 norms, 4 matrices and 4 formats expected");
  TORCH_CHECK(n_heads > 0 && n_kv > 0 && n_heads % n_kv == 0 && hd > 0 && hd % 2 == 0, "bad head configuration");
  const int64_t d = mats[0].size(1) / block_bytes(fmts[0]) * QK;
  for (int i = 0; i < 4; ++i) check_weight(mats[i], fmts[i], i == 1 ? n_heads * hd : (i == 3 ? inter : d));
  for (auto& n : norms) TORCH_CHECK(n.numel() == 0 || (n.dtype() == torch::kFloat32 && n.is_contiguous()), "norm weights must be contiguous float32");
  return LayerSpec{norms, eps, mats, fmts, qkv_bias, n_heads, n_kv, hd, scaling, window, act, inter};
}

// Where a layer's K/V go and come from: the engine's contiguous cache [B, Hkv, S, hd] (one start for all rows), or
// the paged KV pool [Hkv, n_pages, ps, hd] with each row's page table of this layer [B, P] and its own start.
struct KVTarget {
  float* k;
  float* v;
  int64_t S = 0;                   // contiguous: positions per row
  const int64_t* tables = nullptr;  // paged: [B, P] page ids
  int64_t P = 0, n_pages = 0, ps = 0;
  std::vector<int64_t> starts;     // [B] position of each row's first new token
};

KVTarget contiguous_kv(const torch::Tensor& k_cache, const torch::Tensor& v_cache, int64_t B, int64_t n_kv, int64_t hd,
                       int64_t start, int64_t T) {
  TORCH_CHECK(k_cache.dtype() == torch::kFloat32 && k_cache.is_contiguous() && v_cache.is_contiguous() &&
              k_cache.dim() == 4 && k_cache.size(0) == B && k_cache.size(1) == n_kv && k_cache.size(3) == hd &&
              v_cache.sizes() == k_cache.sizes(), "KV cache must be contiguous float32 [B, Hkv, S, hd]");
  TORCH_CHECK(start >= 0 && start + T <= k_cache.size(2), "KV cache too short");
  KVTarget kv{k_cache.data_ptr<float>(), v_cache.data_ptr<float>(), k_cache.size(2)};
  kv.starts.assign(B, start);
  return kv;
}

// h [B, T, d] float32, in place: one layer, K/V of the new positions written to `kv`.
// cos, sin: [T, hd] (every row at the same positions) or [B, T, hd] (each row at its own).
// probs (optional): float32 [B, H, T, probs_S], zero-filled by the caller; row (b, head, t) receives the attention
// probabilities of its positions (what the PyTorch path keeps for adaptive depth's ATS), probs_S >= start + T.
void layer_forward(const LayerSpec& L, float* h, int64_t B, int64_t T, int64_t d, const torch::Tensor& cos,
                   const torch::Tensor& sin, const KVTarget& kv, float* probs = nullptr, int64_t probs_S = 0) {
  TORCH_CHECK(cos.dtype() == torch::kFloat32 && cos.is_contiguous() && sin.is_contiguous() &&
              sin.numel() == cos.numel() && (cos.numel() == T * L.hd || cos.numel() == B * T * L.hd),
              "cos / sin must be contiguous float32 [T, hd] or [B, T, hd]");
  const bool row_rope = cos.numel() != T * L.hd;
  const int64_t n_heads = L.n_heads, n_kv = L.n_kv, hd = L.hd, inter = L.inter, R = B * T;
  const int64_t qn = n_heads * hd, kvn = n_kv * hd, nqkv = qn + 2 * kvn;
  const float feps = static_cast<float>(L.eps);
  auto nptr = [&](int i) -> const float* { return L.norms[i].numel() ? L.norms[i].data_ptr<float>() : nullptr; };
  const auto& mats = L.mats;
  const auto& fmts = L.fmts;
  std::vector<float> xn(R * std::max(d, inter)), qkv(R * nqkv), att(R * qn), gu(R * 2 * inter), tmp(R * d);

  // attention block
  rmsnorm_rows(h, R, d, nptr(0), feps, xn.data());
  matmul_blocks(xn.data(), R, d, mats[0].data_ptr<uint8_t>(), nqkv, fmts[0], qkv.data(), nqkv);
  if (L.qkv_bias.numel()) {
    const float* bb = L.qkv_bias.data_ptr<float>();
    for (int64_t r = 0; r < R; ++r) for (int64_t j = 0; j < nqkv; ++j) qkv[r * nqkv + j] += bb[j];
  }
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  const int64_t half = hd / 2;
  std::vector<float> rot(hd);
  for (int64_t r = 0; r < R; ++r) {
    const int64_t t = row_rope ? r : r % T;  // row of the cos / sin table
    for (int64_t head = 0; head < n_heads + n_kv; ++head) {
      float* v = qkv.data() + r * nqkv + head * hd;
      const float* nw = head < n_heads ? nptr(4) : nptr(5);
      if (nw != nullptr) rmsnorm_rows(v, 1, hd, nw, feps, v);
      const float* c = cp + t * hd;
      const float* s = sp + t * hd;
      for (int64_t i = 0; i < half; ++i) {
        rot[i] = v[i] * c[i] - v[i + half] * s[i];
        rot[i + half] = v[i + half] * c[i + half] + v[i] * s[i + half];
      }
      std::memcpy(v, rot.data(), hd * sizeof(float));
    }
  }
  // K/V of the new positions
  auto slot = [&](const float* base, int64_t b, int64_t g, int64_t pos) -> float* {
    float* p = const_cast<float*>(base);
    if (kv.tables == nullptr) return p + ((b * n_kv + g) * kv.S + pos) * hd;
    const int64_t page = kv.tables[b * kv.P + pos / kv.ps];
    return p + ((g * kv.n_pages + page) * kv.ps + pos % kv.ps) * hd;
  };
  int64_t max_end = 0;
  for (int64_t b = 0; b < B; ++b) {
    max_end = std::max(max_end, kv.starts[b] + T);
    for (int64_t t = 0; t < T; ++t) {
      const float* row = qkv.data() + (b * T + t) * nqkv;
      for (int64_t g = 0; g < n_kv; ++g) {
        std::memcpy(slot(kv.k, b, g, kv.starts[b] + t), row + qn + g * hd, hd * sizeof(float));
        std::memcpy(slot(kv.v, b, g, kv.starts[b] + t), row + qn + kvn + g * hd, hd * sizeof(float));
      }
    }
  }
  const int64_t group = n_heads / n_kv, window = L.window;
  const float fscale = static_cast<float>(L.scaling);
  at::parallel_for(0, B * n_heads * T, 1, [&](int64_t i0, int64_t i1) {
    std::vector<float> sc(max_end + 8);
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t t = i % T, head = (i / T) % n_heads, b = i / (T * n_heads), g = head / group;
      const int64_t pos = kv.starts[b] + t;
      const int64_t lo = window > 0 ? std::max<int64_t>(0, pos - window + 1) : 0;
      KVRows rows;
      if (kv.tables == nullptr) {
        rows.k = kv.k + (b * n_kv + g) * kv.S * hd;
        rows.v = kv.v + (b * n_kv + g) * kv.S * hd;
      } else {
        rows.k = kv.k + g * kv.n_pages * kv.ps * hd;
        rows.v = kv.v + g * kv.n_pages * kv.ps * hd;
        rows.table = kv.tables + b * kv.P;
        rows.ps = kv.ps;
      }
      attend_row(qkv.data() + (b * T + t) * nqkv + head * hd, rows, lo, pos, hd, fscale, sc.data(),
                 att.data() + (b * T + t) * qn + head * hd,
                 probs != nullptr ? probs + ((b * n_heads + head) * T + t) * probs_S : nullptr);
    }
  });
  matmul_blocks(att.data(), R, qn, mats[1].data_ptr<uint8_t>(), d, fmts[1], tmp.data(), d);
  if (nptr(1) != nullptr) rmsnorm_rows(tmp.data(), R, d, nptr(1), feps, tmp.data());
  for (int64_t i = 0; i < R * d; ++i) h[i] += tmp[i];

  // MLP block
  rmsnorm_rows(h, R, d, nptr(2), feps, xn.data());
  matmul_blocks(xn.data(), R, d, mats[2].data_ptr<uint8_t>(), 2 * inter, fmts[2], gu.data(), 2 * inter);
  for (int64_t r = 0; r < R; ++r)
    glu(gu.data() + r * 2 * inter, gu.data() + r * 2 * inter + inter, inter, L.act, xn.data() + r * inter);
  matmul_blocks(xn.data(), R, inter, mats[3].data_ptr<uint8_t>(), d, fmts[3], tmp.data(), d);
  if (nptr(3) != nullptr) rmsnorm_rows(tmp.data(), R, d, nptr(3), feps, tmp.data());
  for (int64_t i = 0; i < R * d; ++i) h[i] += tmp[i];
}

torch::Tensor checked_hidden(const torch::Tensor& hidden) {
  TORCH_CHECK(hidden.dtype() == torch::kFloat32 && hidden.dim() == 3, "hidden must be float32 [B, T, d]");
  return hidden.contiguous().clone();
}

}  // namespace

// hidden [B, T, d] -> [B, T, d]: one decoder layer (see LayerSpec for the arguments); cos, sin [T, hd];
// k_cache, v_cache [B, Hkv, S, hd] float32, written at positions [start, start + T).
torch::Tensor decode_layer(torch::Tensor hidden, std::vector<torch::Tensor> norms, double eps,
                           std::vector<torch::Tensor> mats, std::vector<int64_t> fmts, torch::Tensor qkv_bias,
                           torch::Tensor cos, torch::Tensor sin, torch::Tensor k_cache, torch::Tensor v_cache,
                           int64_t start, int64_t n_heads, int64_t n_kv, int64_t hd, double scaling, int64_t window,
                           int64_t act, int64_t inter) {
  const LayerSpec L = make_spec(norms, eps, mats, fmts, qkv_bias, n_heads, n_kv, hd, scaling, window, act, inter);
  auto out = checked_hidden(hidden);
  layer_forward(L, out.data_ptr<float>(), out.size(0), out.size(1), out.size(2), cos, sin,
                contiguous_kv(k_cache, v_cache, out.size(0), n_kv, hd, start, out.size(1)));
  return out;
}

// A model's native layers, registered once (weights validated then), run several at a time in one call: a
// decode step of a 30-layer model crosses from Python into the kernels once instead of 30 times.
class LayerStack {
 public:
  int64_t add(std::vector<torch::Tensor> norms, double eps, std::vector<torch::Tensor> mats, std::vector<int64_t> fmts,
              torch::Tensor qkv_bias, int64_t n_heads, int64_t n_kv, int64_t hd, double scaling, int64_t window,
              int64_t act, int64_t inter) {
    layers_.push_back(make_spec(norms, eps, mats, fmts, qkv_bias, n_heads, n_kv, hd, scaling, window, act, inter));
    return static_cast<int64_t>(layers_.size()) - 1;
  }
  int64_t size() const { return static_cast<int64_t>(layers_.size()); }

  // hidden [B, T, d] -> [B, T, d] through the registered layers `ids` in order; cos[i], sin[i] [T, hd] and
  // k[i], v[i] [B, Hkv, S, hd] belong to ids[i]; K/V are written at positions [start, start + T). probs[i]: an
  // empty tensor, or a zero-filled float32 [B, H, T, S'] (S' >= start + T) that receives layer ids[i]'s attention
  // probabilities.
  torch::Tensor run(torch::Tensor hidden, std::vector<int64_t> ids, std::vector<torch::Tensor> cos,
                    std::vector<torch::Tensor> sin, std::vector<torch::Tensor> k, std::vector<torch::Tensor> v,
                    int64_t start, std::vector<torch::Tensor> probs) const {
    const size_t n = ids.size();
    TORCH_CHECK(cos.size() == n && sin.size() == n && k.size() == n && v.size() == n && probs.size() == n,
                "one cos, sin, K, V and probs tensor per layer expected");
    auto out = checked_hidden(hidden);
    float* h = out.data_ptr<float>();
    const int64_t B = out.size(0), T = out.size(1);
    for (size_t i = 0; i < n; ++i) {
      TORCH_CHECK(ids[i] >= 0 && ids[i] < size(), "layer id ", ids[i], " not registered");
      const LayerSpec& L = layers_[ids[i]];
      float* pp = nullptr;
      if (probs[i].numel()) {
        const auto& p = probs[i];
        TORCH_CHECK(p.dtype() == torch::kFloat32 && p.is_contiguous() && p.dim() == 4 && p.size(0) == B &&
                    p.size(1) == L.n_heads && p.size(2) == T && p.size(3) >= start + T,
                    "probs must be contiguous float32 [B, H, T, >= start + T]");
        pp = p.data_ptr<float>();
      }
      layer_forward(L, h, B, T, out.size(2), cos[i], sin[i], contiguous_kv(k[i], v[i], B, L.n_kv, L.hd, start, T), pp,
                    pp != nullptr ? probs[i].size(3) : 0);
    }
    return out;
  }

  // The same over the paged KV pool: pool_k, pool_v [Hkv, n_pages, ps, hd] float32 (shared by all layers);
  // tables[i] [B, P] int64 = each row's pages of layer ids[i] in order (enough for starts[b] + T positions);
  // starts [B] = each row's first new position; cos[i], sin[i] [B, T, hd]. Rows are computed exactly as each
  // row alone would be (the weights are read once for all of them).
  torch::Tensor run_paged(torch::Tensor hidden, std::vector<int64_t> ids, std::vector<torch::Tensor> cos,
                          std::vector<torch::Tensor> sin, torch::Tensor pool_k, torch::Tensor pool_v,
                          std::vector<torch::Tensor> tables, std::vector<int64_t> starts) const {
    const size_t n = ids.size();
    TORCH_CHECK(cos.size() == n && sin.size() == n && tables.size() == n, "one cos, sin and page table per layer expected");
    TORCH_CHECK(pool_k.dtype() == torch::kFloat32 && pool_k.is_contiguous() && pool_v.is_contiguous() &&
                pool_k.dim() == 4 && pool_v.sizes() == pool_k.sizes(), "KV pool must be contiguous float32 [Hkv, pages, ps, hd]");
    auto out = checked_hidden(hidden);
    const int64_t B = out.size(0), T = out.size(1);
    TORCH_CHECK(static_cast<int64_t>(starts.size()) == B, "one start per row expected");
    float* h = out.data_ptr<float>();
    for (size_t i = 0; i < n; ++i) {
      TORCH_CHECK(ids[i] >= 0 && ids[i] < size(), "layer id ", ids[i], " not registered");
      const LayerSpec& L = layers_[ids[i]];
      TORCH_CHECK(pool_k.size(0) == L.n_kv && pool_k.size(3) == L.hd, "KV pool shape does not match the layer");
      const torch::Tensor& tab = tables[i];
      TORCH_CHECK(tab.dtype() == torch::kInt64 && tab.is_contiguous() && tab.dim() == 2 && tab.size(0) == B,
                  "page tables must be contiguous int64 [B, P]");
      KVTarget kv{pool_k.data_ptr<float>(), pool_v.data_ptr<float>()};
      kv.tables = tab.data_ptr<int64_t>();
      kv.P = tab.size(1);
      kv.n_pages = pool_k.size(1);
      kv.ps = pool_k.size(2);
      kv.starts = starts;
      for (int64_t b = 0; b < B; ++b) {
        TORCH_CHECK(starts[b] >= 0 && starts[b] + T <= kv.P * kv.ps, "row ", b, ": page table too short");
        for (int64_t p = 0; p < (starts[b] + T + kv.ps - 1) / kv.ps; ++p)
          TORCH_CHECK(kv.tables[b * kv.P + p] >= 0 && kv.tables[b * kv.P + p] < kv.n_pages, "page id out of range");
      }
      layer_forward(L, h, B, T, out.size(2), cos[i], sin[i], kv);
    }
    return out;
  }

 private:
  std::vector<LayerSpec> layers_;
};

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("qmatmul", &qmatmul, "y [T, N] = x [T, K] @ dequant(w).T");
  m.def("dequantize", &dequantize, "float32 (or bfloat16) rows of a block matrix");
  m.def("decode_layer", &decode_layer, "one decoder layer over block matrices");
  m.def("has_avx2", &has_avx2, "built with AVX2 + FMA + F16C");
  pybind11::class_<LayerStack>(m, "LayerStack", pybind11::module_local())
      .def(pybind11::init<>())
      .def("add", &LayerStack::add)
      .def("size", &LayerStack::size)
      .def("run", &LayerStack::run, pybind11::call_guard<pybind11::gil_scoped_release>())
      .def("run_paged", &LayerStack::run_paged, pybind11::call_guard<pybind11::gil_scoped_release>());
}

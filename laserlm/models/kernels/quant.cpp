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

// ---- activation quantization: x [T, K] -> int16 [T, K], d [T, nbs], s = sum(x) [T, nbs] (nbs = round8(nb),
// padding lanes zero). int16 per 32-block (d = max|x_b| / 32767): the rounding error is 1/256 of llama.cpp's
// int8 activations, which matters on small models whose hidden states have large outlier channels.
void quantize_rows_q16(const float* x, int64_t T, int64_t K, int16_t* q, float* d, float* s) {
  const int64_t nb = K / QK, nbs = round8(nb);
  std::fill(d, d + T * nbs, 0.f);
  std::fill(s, s + T * nbs, 0.f);
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
      for (int j = 0; j < QK; ++j) q[i * QK + j] = static_cast<int16_t>(std::nearbyint(xb[j] * id));
      d[t * nbs + b] = dd;
      s[t * nbs + b] = sum;
    }
  });
}

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
inline float hsum(__m256 v) {
  __m128 r = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  r = _mm_add_ps(r, _mm_movehl_ps(r, r));
  r = _mm_add_ss(r, _mm_movehdup_ps(r));
  return _mm_cvtss_f32(r);
}

// weights of block b widened to int16: w0 = weights 0..15, w1 = 16..31
template <int FMT>
inline void load_block(const uint8_t* qs, int64_t b, __m256i& w0, __m256i& w1) {
  if (FMT == Q8_0) {
    const uint8_t* p = qs + b * 32;
    w0 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    w1 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16)));
  } else {
    const __m128i low4 = _mm_set1_epi8(0x0F);
    const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs + b * 16));
    w0 = _mm256_cvtepu8_epi16(_mm_and_si128(raw, low4));
    w1 = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(raw, 4), low4));
  }
}

// dot products of one weight row with TN int16 activation rows (TN compile-time 1..4: accumulators stay in
// registers); each weight block is loaded and widened once for all TN rows. Scales of eight blocks are
// converted (fp16 -> fp32) and multiplied by the activation scales in one vector op each; the block's
// lane is then broadcast with a permute. int16 x int16 -> int32 products (_mm256_madd_epi16) cannot
// overflow: |q_w| <= 127, |q_x| <= 32767, four products per lane.
template <int FMT, int TN>
inline void dot_rows(const uint8_t* row, const int16_t* xq, const float* xd, const float* xs, int64_t nb, int64_t K,
                     float* out, int64_t ostride) {
  const int64_t nbs = round8(nb);
  const uint8_t* qs = row;
  const uint16_t* dh = reinterpret_cast<const uint16_t*>(row + nb * quant_bytes(FMT));
  const uint16_t* mh = dh + nb;
  __m256 acc[TN], macc[TN];  // one chain per row: two (even / odd blocks) measured no faster
#pragma GCC unroll 4
  for (int i = 0; i < TN; ++i) acc[i] = macc[i] = _mm256_setzero_ps();
  for (int64_t b0 = 0; b0 < nb; b0 += 8) {
    const int cnt = static_cast<int>(std::min<int64_t>(8, nb - b0));
    const __m256 keep = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(cnt),
                                                               _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)));
    const __m256 dv = _mm256_and_ps(_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(dh + b0))), keep);
    __m256 sv[TN];
#pragma GCC unroll 4
    for (int i = 0; i < TN; ++i) sv[i] = _mm256_mul_ps(dv, _mm256_loadu_ps(xd + i * nbs + b0));
    if (FMT == Q4_1) {
      const __m256 mv = _mm256_and_ps(_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(mh + b0))), keep);
#pragma GCC unroll 4
      for (int i = 0; i < TN; ++i) macc[i] = _mm256_fmadd_ps(mv, _mm256_loadu_ps(xs + i * nbs + b0), macc[i]);
    }
    auto step = [&](const int j) __attribute__((always_inline)) {
      __m256i w0, w1;
      load_block<FMT>(qs, b0 + j, w0, w1);
      const __m256i lane = _mm256_set1_epi32(j);
#pragma GCC unroll 4
      for (int i = 0; i < TN; ++i) {
        const int16_t* xb = xq + i * K + (b0 + j) * QK;
        const __m256i x0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xb));
        const __m256i x1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xb + 16));
        const __m256i p = _mm256_add_epi32(_mm256_madd_epi16(w0, x0), _mm256_madd_epi16(w1, x1));
        acc[i] = _mm256_fmadd_ps(_mm256_permutevar8x32_ps(sv[i], lane), _mm256_cvtepi32_ps(p), acc[i]);
      }
    };
    if (cnt == 8) {
      step(0); step(1); step(2); step(3); step(4); step(5); step(6); step(7);
    } else {
      for (int j = 0; j < cnt; ++j) step(j);
    }
  }
#pragma GCC unroll 4
  for (int i = 0; i < TN; ++i) out[i * ostride] = hsum(_mm256_add_ps(acc[i], macc[i]));
}
#else
template <int FMT, int TN>
inline void dot_rows(const uint8_t* row, const int16_t* xq, const float* xd, const float* xs, int64_t nb, int64_t K,
                     float* out, int64_t ostride) {
  const int64_t nbs = round8(nb);
  const uint8_t* qs = row;
  const uint16_t* dh = reinterpret_cast<const uint16_t*>(row + nb * quant_bytes(FMT));
  const uint16_t* mh = dh + nb;
  for (int t = 0; t < TN; ++t) {
    float total = 0.f;
    for (int64_t b = 0; b < nb; ++b) {
      const int16_t* qx = xq + t * K + b * QK;
      int64_t isum = 0;
      if (FMT == Q8_0) {
        const int8_t* qw = reinterpret_cast<const int8_t*>(qs + b * 32);
        for (int j = 0; j < QK; ++j) isum += qw[j] * qx[j];
      } else {
        const uint8_t* q = qs + b * 16;
        for (int j = 0; j < 16; ++j) {
          isum += (q[j] & 0x0F) * qx[j];
          isum += (q[j] >> 4) * qx[j + 16];
        }
        total += fp16_to_fp32(mh[b]) * xs[t * nbs + b];
      }
      total += fp16_to_fp32(dh[b]) * xd[t * nbs + b] * static_cast<float>(isum);
    }
    out[t * ostride] = total;
  }
}
#endif

template <int FMT>
inline void dot_rows_any(const uint8_t* row, const int16_t* xq, const float* xd, const float* xs, int64_t nb,
                         int64_t T, int64_t K, float* out, int64_t ostride) {
  const int64_t nbs = round8(nb);
  int64_t t = 0;
  for (; t + 4 <= T; t += 4)
    dot_rows<FMT, 4>(row, xq + t * K, xd + t * nbs, xs + t * nbs, nb, K, out + t * ostride, ostride);
  switch (T - t) {
    case 3: dot_rows<FMT, 3>(row, xq + t * K, xd + t * nbs, xs + t * nbs, nb, K, out + t * ostride, ostride); break;
    case 2: dot_rows<FMT, 2>(row, xq + t * K, xd + t * nbs, xs + t * nbs, nb, K, out + t * ostride, ostride); break;
    case 1: dot_rows<FMT, 1>(row, xq + t * K, xd + t * nbs, xs + t * nbs, nb, K, out + t * ostride, ostride); break;
    default: break;
  }
}

// y [T, N] (row stride ldy) = x [T, K] @ W.T, W = N rows of blocks
void matmul_blocks(const float* x, int64_t T, int64_t K, const uint8_t* w, int64_t N, int64_t fmt, float* y,
                   int64_t ldy) {
  const int64_t nb = K / QK, rb = nb * block_bytes(fmt), nbs = round8(nb);
  std::vector<int16_t> xq(T * K);
  std::vector<float> xd(T * nbs), xs(T * nbs);
  quantize_rows_q16(x, T, K, xq.data(), xd.data(), xs.data());
  const int64_t grain = std::max<int64_t>(16, 2048 / std::max<int64_t>(nb, 1));
  at::parallel_for(0, N, grain, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n) {
      const uint8_t* row = w + n * rb;
      if (n + PF_ROWS < n1) {  // software prefetch: the hardware prefetcher alone left the loop at ~half bandwidth
        const uint8_t* next = row + PF_ROWS * rb;
        for (int64_t off = 0; off < rb; off += 64) _mm_prefetch(reinterpret_cast<const char*>(next + off), _MM_HINT_T0);
      }
      if (fmt == Q4_1) dot_rows_any<Q4_1>(row, xq.data(), xd.data(), xs.data(), nb, T, K, y + n, ldy);
      else dot_rows_any<Q8_0>(row, xq.data(), xd.data(), xs.data(), nb, T, K, y + n, ldy);
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

// float32 [len(rows), K] = dequant(w)[rows]  (rows int64; all rows when `rows` is empty)
torch::Tensor dequantize(torch::Tensor w, int64_t fmt, int64_t K, torch::Tensor rows) {
  check_weight(w, fmt, K);
  const bool all = rows.numel() == 0;
  const int64_t R = all ? w.size(0) : rows.numel(), nb = K / QK, rb = w.size(1), qb = quant_bytes(fmt);
  auto idx = all ? rows : rows.to(torch::kInt64).contiguous();
  const int64_t* ip = all ? nullptr : idx.data_ptr<int64_t>();
  auto out = torch::empty({R, K}, torch::kFloat32);
  const uint8_t* wp = w.data_ptr<uint8_t>();
  float* op = out.data_ptr<float>();
  const int64_t N = w.size(0);
  at::parallel_for(0, R, 64, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const int64_t n = all ? r : ip[r];
      TORCH_CHECK(n >= 0 && n < N, "row index ", n, " out of range [0, ", N, ")");
      const uint8_t* row = wp + n * rb;
      const uint16_t* dh = reinterpret_cast<const uint16_t*>(row + nb * qb);
      float* o = op + r * K;
      for (int64_t b = 0; b < nb; ++b, o += QK) {
        const float d = fp16_to_fp32(dh[b]);
        if (fmt == Q8_0) {
          const int8_t* q = reinterpret_cast<const int8_t*>(row + b * 32);
          for (int j = 0; j < QK; ++j) o[j] = d * q[j];
        } else {
          const float m = fp16_to_fp32(dh[nb + b]);
          const uint8_t* qs = row + b * 16;
          for (int j = 0; j < 16; ++j) {
            o[j] = d * (qs[j] & 0x0F) + m;
            o[j + 16] = d * (qs[j] >> 4) + m;
          }
        }
      }
    }
  });
  return out;
}

bool has_avx2() {
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
  return true;
#else
  return false;
#endif
}

// ---- one whole decoder layer for a few tokens (decode / verification), fp32 activations ----------------
namespace {

void rmsnorm_rows(const float* x, int64_t rows, int64_t d, const float* w, float eps, float* out) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * d;
    float ss = 0.f;
    for (int64_t i = 0; i < d; ++i) ss += xr[i] * xr[i];
    const float inv = 1.f / std::sqrt(ss / static_cast<float>(d) + eps);
    float* o = out + r * d;
    for (int64_t i = 0; i < d; ++i) o[i] = xr[i] * inv * w[i];
  }
}

inline float gelu_tanh(float x) {
  const float k = 0.7978845608028654f;  // sqrt(2 / pi)
  return 0.5f * x * (1.f + std::tanh(k * (x + 0.044715f * x * x * x)));
}

}  // namespace

// hidden [B, T, d] -> [B, T, d]: the pre-norm transformer block of the Llama family (Llama, Mistral, Qwen2,
// Qwen3) and of Gemma3 (sandwich norms), with K/V written to the cache at positions [start, start + T).
//   norms: {attn_in, attn_out (Gemma3) or empty, mlp_in, mlp_out (Gemma3) or empty, q_norm or empty, k_norm or empty}
//          (already the multiplicative weight: Gemma's 1 + w)
//   mats / fmts: {qkv, o, gate_up, down} blocks; qkv_bias [(H + 2 Hkv) hd] or empty
//   cos, sin [T, hd]; k_cache, v_cache [B, Hkv, S, hd] float32 contiguous
//   window: sliding-window size (0 = global attention); act: 0 = SiLU, 1 = GELU (tanh approximation)
torch::Tensor decode_layer(torch::Tensor hidden, std::vector<torch::Tensor> norms, double eps,
                           std::vector<torch::Tensor> mats, std::vector<int64_t> fmts, torch::Tensor qkv_bias,
                           torch::Tensor cos, torch::Tensor sin, torch::Tensor k_cache, torch::Tensor v_cache,
                           int64_t start, int64_t n_heads, int64_t n_kv, int64_t hd, double scaling, int64_t window,
                           int64_t act, int64_t inter) {
  TORCH_CHECK(hidden.dtype() == torch::kFloat32 && hidden.dim() == 3, "hidden must be float32 [B, T, d]");
  TORCH_CHECK(k_cache.dtype() == torch::kFloat32 && k_cache.is_contiguous() && v_cache.is_contiguous(),
              "KV cache must be contiguous float32");
  hidden = hidden.contiguous();
  const int64_t B = hidden.size(0), T = hidden.size(1), d = hidden.size(2), R = B * T;
  const int64_t S = k_cache.size(2), qn = n_heads * hd, kvn = n_kv * hd, nqkv = qn + 2 * kvn;
  TORCH_CHECK(start + T <= S, "KV cache too short");
  const float feps = static_cast<float>(eps);
  auto nptr = [&](int i) -> const float* { return norms[i].numel() ? norms[i].data_ptr<float>() : nullptr; };
  for (int i = 0; i < 4; ++i) check_weight(mats[i], fmts[i], i == 1 ? qn : (i == 3 ? inter : d));

  auto out = hidden.clone();
  float* h = out.data_ptr<float>();
  std::vector<float> xn(R * std::max(d, inter)), qkv(R * nqkv), att(R * qn), gu(R * 2 * inter), tmp(R * d);

  // attention block
  rmsnorm_rows(h, R, d, nptr(0), feps, xn.data());
  matmul_blocks(xn.data(), R, d, mats[0].data_ptr<uint8_t>(), nqkv, fmts[0], qkv.data(), nqkv);
  if (qkv_bias.numel()) {
    const float* bb = qkv_bias.data_ptr<float>();
    for (int64_t r = 0; r < R; ++r) for (int64_t j = 0; j < nqkv; ++j) qkv[r * nqkv + j] += bb[j];
  }
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  const int64_t half = hd / 2;
  std::vector<float> rot(hd);
  for (int64_t r = 0; r < R; ++r) {
    const int64_t t = r % T;
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
  float* kc = k_cache.data_ptr<float>();
  float* vc = v_cache.data_ptr<float>();
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = 0; t < T; ++t) {
      const float* row = qkv.data() + (b * T + t) * nqkv;
      for (int64_t g = 0; g < n_kv; ++g) {
        std::memcpy(kc + ((b * n_kv + g) * S + start + t) * hd, row + qn + g * hd, hd * sizeof(float));
        std::memcpy(vc + ((b * n_kv + g) * S + start + t) * hd, row + qn + kvn + g * hd, hd * sizeof(float));
      }
    }
  const int64_t group = n_heads / n_kv;
  const float fscale = static_cast<float>(scaling);
  at::parallel_for(0, B * n_heads * T, 1, [&](int64_t i0, int64_t i1) {
    std::vector<float> sc(start + T);
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t t = i % T, head = (i / T) % n_heads, b = i / (T * n_heads), g = head / group;
      const int64_t pos = start + t;
      const int64_t lo = window > 0 ? std::max<int64_t>(0, pos - window + 1) : 0;
      const float* q = qkv.data() + (b * T + t) * nqkv + head * hd;
      const float* kb = kc + (b * n_kv + g) * S * hd;
      const float* vb = vc + (b * n_kv + g) * S * hd;
      float mx = -INFINITY;
      for (int64_t j = lo; j <= pos; ++j) {
        const float* k = kb + j * hd;
        float acc = 0.f;
        for (int64_t e = 0; e < hd; ++e) acc += q[e] * k[e];
        sc[j] = acc * fscale;
        mx = std::max(mx, sc[j]);
      }
      float sum = 0.f;
      for (int64_t j = lo; j <= pos; ++j) { sc[j] = std::exp(sc[j] - mx); sum += sc[j]; }
      const float inv = 1.f / sum;
      float* o = att.data() + (b * T + t) * qn + head * hd;
      for (int64_t e = 0; e < hd; ++e) o[e] = 0.f;
      for (int64_t j = lo; j <= pos; ++j) {
        const float p = sc[j] * inv;
        const float* v = vb + j * hd;
        for (int64_t e = 0; e < hd; ++e) o[e] += p * v[e];
      }
    }
  });
  matmul_blocks(att.data(), R, qn, mats[1].data_ptr<uint8_t>(), d, fmts[1], tmp.data(), d);
  if (nptr(1) != nullptr) rmsnorm_rows(tmp.data(), R, d, nptr(1), feps, tmp.data());
  for (int64_t i = 0; i < R * d; ++i) h[i] += tmp[i];

  // MLP block
  rmsnorm_rows(h, R, d, nptr(2), feps, xn.data());
  matmul_blocks(xn.data(), R, d, mats[2].data_ptr<uint8_t>(), 2 * inter, fmts[2], gu.data(), 2 * inter);
  for (int64_t r = 0; r < R; ++r) {
    const float* g = gu.data() + r * 2 * inter;
    float* o = xn.data() + r * inter;
    if (act == 0) {
      for (int64_t j = 0; j < inter; ++j) o[j] = g[j] / (1.f + std::exp(-g[j])) * g[inter + j];
    } else {
      for (int64_t j = 0; j < inter; ++j) o[j] = gelu_tanh(g[j]) * g[inter + j];
    }
  }
  matmul_blocks(xn.data(), R, inter, mats[3].data_ptr<uint8_t>(), d, fmts[3], tmp.data(), d);
  if (nptr(3) != nullptr) rmsnorm_rows(tmp.data(), R, d, nptr(3), feps, tmp.data());
  for (int64_t i = 0; i < R * d; ++i) h[i] += tmp[i];
  return out;
}

// laserlm's CPU kernels bound to torch: block-quantized matrix products (qgemm.h), dequantization, and one whole
// decoder layer (or a run of them) for a few tokens: decode, verification and batched steps.
#include "qgemm.h"

#include <cmath>
#include <cstring>
#include <vector>

namespace {

void check_weight(const torch::Tensor& w, int64_t fmt, int64_t K, int64_t N) {
  TORCH_CHECK(w.dtype() == torch::kUInt8 && w.dim() == 2 && w.is_contiguous(),
              "weight must be a contiguous uint8 [groups, group_bytes] tensor in the kernel layout");
  const int64_t bw = block_weights(fmt);
  TORCH_CHECK(K % bw == 0 && K > 0, "in_features must be a positive multiple of ", bw, ", got ", K);
  TORCH_CHECK(N > 0 && w.size(0) == n_groups(N), "weight has ", w.size(0), " groups of 16 rows, expected ", n_groups(N),
              " for ", N, " rows");
  TORCH_CHECK(w.size(1) == (K / QK) * region_bytes(fmt), "weight group has ", w.size(1), " bytes, expected ",
              (K / QK) * region_bytes(fmt));
}

}  // namespace

// y [T, N] = x [T, K] @ dequant(w).T   (x float32; w [ceil(N / 16), K / 32 * region_bytes] in the kernel layout)
torch::Tensor qmatmul(torch::Tensor x, torch::Tensor w, int64_t fmt, int64_t K, int64_t N) {
  check_weight(w, fmt, K, N);
  TORCH_CHECK(x.dtype() == torch::kFloat32 && x.dim() == 2 && x.size(1) == K, "x must be float32 [T, ", K, "]");
  x = x.contiguous();
  const int64_t T = x.size(0);
  auto y = torch::empty({T, N}, torch::kFloat32);
  if (T > 0) matmul_blocks(x.data_ptr<float>(), T, K, w.data_ptr<uint8_t>(), N, fmt, y.data_ptr<float>(), N);
  return y;
}

// [len(rows), K] = dequant(w)[rows]  (rows int64; all N rows when `rows` is empty), float32, or bfloat16 (each float32
// value d * q + m rounded to nearest even: the operand of a bfloat16 GEMM, half the bytes written)
template <typename Out>
void dequantize_rows(const uint8_t* wp, int64_t N, int64_t fmt, int64_t K, const int64_t* ip, int64_t R, Out* op) {
  const int64_t nb = K / QK, gbytes = nb * region_bytes(fmt), qb = quant_bytes(fmt);
  at::parallel_for(0, R, 64, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const int64_t n = ip ? ip[r] : r;
      TORCH_CHECK(n >= 0 && n < N, "row index ", n, " out of range [0, ", N, ")");
      const uint8_t* gw = wp + (n / GR) * gbytes;
      const int c = static_cast<int>(n % GR);
      Out* o = op + r * K;
      if (fmt == Q6_K) {  // (d * sc) * (q - 32), in gguf's order of float operations
        for (int64_t sb = 0; sb < nb / 8; ++sb, o += 256) {
          const uint8_t* reg = gw + sb * Q6K_REGION;
          const float d = fp16_to_fp32(reinterpret_cast<const uint16_t*>(reg + Q6K_D)[c]);
          for (int k = 0; k < 256; ++k) {
            const float dsc = d * static_cast<float>(static_cast<int8_t>(reg[Q6K_SC + 16 * (k / 16) + c]));
            o[k] = static_cast<Out>(dsc * static_cast<float>(q6k_q(reg, c, k) - 32));
          }
        }
        continue;
      }
      for (int64_t b = 0; b < nb; ++b, o += QK) {
        const uint8_t* reg = block_quants(fmt, gw, b);
        if (fmt == Q4_K) {  // (d * sc) * q - dmin * m, in gguf's order of float operations
          float dw, mw;
          q4k_scales(gw, b, c, &dw, &mw);
          for (int h = 0; h < 4; ++h)
            for (int j = 0; j < 4; ++j) {
              const uint8_t byte = reg[h * 64 + c * 4 + j];
              const float lo = dw * static_cast<float>(byte & 0x0F), hi = dw * static_cast<float>(byte >> 4);
              o[8 * h + j] = static_cast<Out>(lo - mw);
              o[8 * h + 4 + j] = static_cast<Out>(hi - mw);
            }
          continue;
        }
        const uint16_t* dh = reinterpret_cast<const uint16_t*>(reg + qb);
        const float d = fp16_to_fp32(dh[c]);
        if (fmt == Q8_0) {
          for (int k = 0; k < QK; ++k)
            o[k] = static_cast<Out>(d * static_cast<int8_t>(reg[(k / 4) * 64 + c * 4 + (k % 4)]));
        } else {
          const float m = fp16_to_fp32(dh[GR + c]);
          for (int h = 0; h < 4; ++h)
            for (int j = 0; j < 4; ++j) {
              const uint8_t byte = reg[h * 64 + c * 4 + j];
              o[8 * h + j] = static_cast<Out>(d * (byte & 0x0F) + m);
              o[8 * h + 4 + j] = static_cast<Out>(d * (byte >> 4) + m);
            }
        }
      }
    }
  });
}

torch::Tensor dequantize(torch::Tensor w, int64_t fmt, int64_t K, int64_t N, torch::Tensor rows, bool bf16) {
  check_weight(w, fmt, K, N);
  const bool all = rows.numel() == 0;
  const int64_t R = all ? N : rows.numel();
  auto idx = all ? rows : rows.to(torch::kInt64).contiguous();
  const int64_t* ip = all ? nullptr : idx.data_ptr<int64_t>();
  auto out = torch::empty({R, K}, bf16 ? torch::kBFloat16 : torch::kFloat32);
  if (bf16)
    dequantize_rows(w.data_ptr<uint8_t>(), N, fmt, K, ip, R, out.data_ptr<at::BFloat16>());
  else
    dequantize_rows(w.data_ptr<uint8_t>(), N, fmt, K, ip, R, out.data_ptr<float>());
  return out;
}

// the variant in use ("avx512", "avx2" or "scalar"); set_isa picks another one this CPU has (tests, A/B runs)
std::string kernel_isa() { return isa_name(g_isa); }
std::string best_isa() { return isa_name(detect_isa()); }
void set_isa(std::string name) {
  const int want = parse_isa(name);
  TORCH_CHECK(want <= detect_isa(), "this CPU cannot run the ", name, " kernels (best: ", isa_name(detect_isa()), ")");
  g_isa = want;
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

#if defined(__AVX512F__)
// e^x for 16 floats (the polynomial of exp256, 16 lanes wide).
inline __m512 exp512(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.0f)), _mm512_set1_ps(88.3762626647949f));
  const __m512 fx = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                         _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  x = _mm512_fnmadd_ps(fx, _mm512_set1_ps(0.693359375f), x);
  x = _mm512_fnmadd_ps(fx, _mm512_set1_ps(-2.12194440e-4f), x);
  __m512 y = _mm512_set1_ps(1.9875691500e-4f);
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(1.3981999507e-3f));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(8.3334519073e-3f));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(4.1665795894e-2f));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(1.6666665459e-1f));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(5.0000001201e-1f));
  y = _mm512_add_ps(_mm512_fmadd_ps(y, _mm512_mul_ps(x, x), x), _mm512_set1_ps(1.0f));
  const __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(fx), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(y, _mm512_castsi512_ps(e));
}

// Lane j of the result = the sum of the 16 lanes of v[j] (a fixed tree: lanes paired 2l, 2l + 1 at every level).
inline __m512 sum16x16(__m512* v) {
  const __m512i ev = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
  const __m512i od = _mm512_setr_epi32(1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
  for (int n = 8; n >= 1; n /= 2)
    for (int i = 0; i < n; ++i)
      v[i] = _mm512_add_ps(_mm512_permutex2var_ps(v[2 * i], ev, v[2 * i + 1]),
                           _mm512_permutex2var_ps(v[2 * i], od, v[2 * i + 1]));
  return v[0];
}

constexpr int ATT_MAX_Q = 16;  // queries per call of attend_group

// acc[r][c] += p[r] v[c] for RN queries over 64 output floats (4 vectors) of one key (p[r] == 0: nothing to add)
template <int RN>
inline void pv_key(__m512 (&acc)[4][4], const float* vj, const float* const* p, int64_t j) {
  const __m512 v0 = _mm512_loadu_ps(vj), v1 = _mm512_loadu_ps(vj + 16), v2 = _mm512_loadu_ps(vj + 32),
               v3 = _mm512_loadu_ps(vj + 48);
  for (int r = 0; r < RN; ++r) {
    const float pr = p[r][j];
    if (pr == 0.f) continue;  // outside the query's range (or underflowed): adds nothing
    const __m512 pv = _mm512_set1_ps(pr);
    acc[r][0] = _mm512_fmadd_ps(pv, v0, acc[r][0]);
    acc[r][1] = _mm512_fmadd_ps(pv, v1, acc[r][1]);
    acc[r][2] = _mm512_fmadd_ps(pv, v2, acc[r][2]);
    acc[r][3] = _mm512_fmadd_ps(pv, v3, acc[r][3]);
  }
}

// out[r][e0 .. e0 + 64) = inv[r] * sum_j p[r][j] v_j for RN queries, keys klo .. khi in order
template <int RN>
void pv_rows(const float* v, const int64_t* off, int64_t klo, int64_t khi, int64_t e0, const float* const* p,
             const float* inv, float* const* out) {
  __m512 acc[4][4];
  for (int r = 0; r < 4; ++r)
    for (int c = 0; c < 4; ++c) acc[r][c] = _mm512_setzero_ps();
  for (int64_t j = klo; j <= khi; ++j) pv_key<RN>(acc, v + off[j - klo] + e0, p, j);
  for (int r = 0; r < RN; ++r)
    for (int c = 0; c < 4; ++c)
      _mm512_storeu_ps(out[r] + e0 + c * 16, _mm512_mul_ps(acc[r][c], _mm512_set1_ps(inv[r])));
}

// Attention of R <= ATT_MAX_Q queries that share one key/value head (the query heads of a GQA group at one or more
// positions of one sequence). Query r: q[r] [HD], keys [lo[r], hi[r]] (hi = its position), result out[r] [HD] =
// softmax(scale q . K) V, and (p_out[r] not null) its probabilities at p_out[r][lo .. hi].
// Keys are scored 16 at a time in blocks aligned at absolute positions, the softmax sums lane by lane over those
// blocks, and V is accumulated key after key, so a query's arithmetic does not depend on the other queries of the
// call (keys outside its range add exact zeros): a row of a prompt chunk is computed as it would be alone. The keys
// and values are read once per call for all R queries. sc: scratch of R * (16 * (blocks + 1)) floats; off: scratch of
// (keys + 1) offsets.
template <int HD>
void attend_group(const float* const* q, const int64_t* lo, const int64_t* hi, int R, const KVRows& kv, float scale,
                  float* sc, int64_t* off, float* const* out, float* const* p_out) {
  constexpr int NC = HD / 16;
  int64_t klo = lo[0], khi = hi[0];
  for (int r = 1; r < R; ++r) {
    klo = std::min(klo, lo[r]);
    khi = std::max(khi, hi[r]);
  }
  for (int64_t j0 = klo; j0 <= khi;) {  // where each key is (one page-table lookup per run of contiguous keys)
    const int64_t j1 = kv.run_end(j0, khi + 1), o = kv.offset(j0, HD);
    for (int64_t j = j0; j < j1; ++j) off[j - klo] = o + (j - j0) * HD;
    j0 = j1;
  }
  const int64_t b0 = klo / 16, b1 = khi / 16 + 1, width = (b1 - b0) * 16;
  const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  // scores, block by block
  for (int64_t blk = b0; blk < b1; ++blk) {
    const float* kp[16];
    for (int j = 0; j < 16; ++j) {
      const int64_t pos = std::min(std::max(blk * 16 + j, klo), khi);  // clamped: lanes outside are masked below
      kp[j] = kv.k + off[pos - klo];
    }
    for (int r = 0; r < R; ++r) {
      float* s = sc + r * width + (blk - b0) * 16;
      const __m512i rel = _mm512_add_epi32(lane, _mm512_set1_epi32(static_cast<int>(blk * 16 - lo[r])));
      const __mmask16 valid = _mm512_cmp_epi32_mask(rel, _mm512_setzero_si512(), _MM_CMPINT_NLT) &
                              _mm512_cmp_epi32_mask(rel, _mm512_set1_epi32(static_cast<int>(hi[r] - lo[r])),
                                                    _MM_CMPINT_LE);
      if (valid == 0) {
        _mm512_storeu_ps(s, _mm512_set1_ps(-INFINITY));
        continue;
      }
      __m512 qv[NC];
      for (int c = 0; c < NC; ++c) qv[c] = _mm512_loadu_ps(q[r] + c * 16);
      __m512 acc[16];
      for (int j = 0; j < 16; ++j) {
        __m512 a = _mm512_mul_ps(qv[0], _mm512_loadu_ps(kp[j]));
        for (int c = 1; c < NC; ++c) a = _mm512_fmadd_ps(qv[c], _mm512_loadu_ps(kp[j] + c * 16), a);
        acc[j] = a;
      }
      const __m512 dots = _mm512_mul_ps(sum16x16(acc), _mm512_set1_ps(scale));
      _mm512_storeu_ps(s, _mm512_mask_blend_ps(valid, _mm512_set1_ps(-INFINITY), dots));
    }
  }
  // softmax per query: max, exponentials (exact zeros outside the range), lane-wise sums over the blocks
  float inv[ATT_MAX_Q];
  const float* prow[ATT_MAX_Q];
  for (int r = 0; r < R; ++r) {
    float* s = sc + r * width;
    __m512 mx = _mm512_set1_ps(-INFINITY);
    for (int64_t i = 0; i < width; i += 16) mx = _mm512_max_ps(mx, _mm512_loadu_ps(s + i));
    const __m512 m = _mm512_set1_ps(_mm512_reduce_max_ps(mx));
    __m512 sum = _mm512_setzero_ps();
    for (int64_t i = 0; i < width; i += 16) {
      const __m512 x = _mm512_loadu_ps(s + i);
      const __mmask16 fin = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-INFINITY), _CMP_NEQ_OQ);
      const __m512 e = _mm512_maskz_mov_ps(fin, exp512(_mm512_sub_ps(x, m)));
      _mm512_storeu_ps(s + i, e);
      sum = _mm512_add_ps(sum, e);
    }
    inv[r] = 1.f / _mm512_reduce_add_ps(sum);
    prow[r] = s - b0 * 16;  // prow[r][j]: the weight of key j
  }
  // out = P V: key after key, 64 output floats and up to 4 queries at a time (16 accumulators)
  for (int r0 = 0; r0 < R; r0 += 4) {
    const int rn = std::min(4, R - r0);
    for (int64_t e0 = 0; e0 < HD; e0 += 64) {
      if (rn == 4) pv_rows<4>(kv.v, off, klo, khi, e0, prow + r0, inv + r0, out + r0);
      else if (rn == 3) pv_rows<3>(kv.v, off, klo, khi, e0, prow + r0, inv + r0, out + r0);
      else if (rn == 2) pv_rows<2>(kv.v, off, klo, khi, e0, prow + r0, inv + r0, out + r0);
      else pv_rows<1>(kv.v, off, klo, khi, e0, prow + r0, inv + r0, out + r0);
    }
  }
  if (p_out != nullptr)
    for (int r = 0; r < R; ++r)
      if (p_out[r] != nullptr)
        for (int64_t j = lo[r]; j <= hi[r]; ++j) p_out[r][j] = prow[r][j] * inv[r];
}
#endif

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
//   mats / fmts / rows: the blocks, formats and output rows of {qkv, o, gate_up, down}, each one matrix or several
//          stacked along its output rows (a fused projection whose parts have different formats, as a Q4_K_M file's
//          Q4_K q/k beside its Q6_K v); rows may be empty when there are exactly four matrices
//   qkv_bias [(H + 2 Hkv) hd] or empty
//   window: sliding-window size (0 = global attention); act: 0 = SiLU, 1 = GELU (tanh approximation)
namespace {

struct MatPart {
  torch::Tensor w;
  int64_t fmt, rows;
};
using Mat = std::vector<MatPart>;  // one matrix: its parts in the order of their output rows

struct LayerSpec {
  std::vector<torch::Tensor> norms;
  double eps;
  std::vector<Mat> mats;  // qkv, o, gate_up, down
  torch::Tensor qkv_bias;
  int64_t n_heads, n_kv, hd;
  double scaling;
  int64_t window, act, inter;
};

LayerSpec make_spec(std::vector<torch::Tensor> norms, double eps, std::vector<torch::Tensor> mats,
                    std::vector<int64_t> fmts, std::vector<int64_t> rows, torch::Tensor qkv_bias, int64_t n_heads,
                    int64_t n_kv, int64_t hd, double scaling, int64_t window, int64_t act, int64_t inter) {
  TORCH_CHECK(norms.size() == 6, "6 norms expected");
  TORCH_CHECK(mats.size() >= 4 && fmts.size() == mats.size() && (rows.empty() ? mats.size() == 4 : rows.size() == mats.size()),
              "one format and one row count per matrix part expected (4 matrices without row counts)");
  TORCH_CHECK(n_heads > 0 && n_kv > 0 && n_heads % n_kv == 0 && hd > 0 && hd % 2 == 0, "bad head configuration");
  const int64_t d = mats[0].size(1) / region_bytes(fmts[0]) * QK;
  const int64_t outs[4] = {(n_heads + 2 * n_kv) * hd, d, 2 * inter, d};
  const int64_t ins[4] = {d, n_heads * hd, d, inter};
  std::vector<Mat> ms(4);
  size_t p = 0;
  for (int i = 0; i < 4; ++i) {
    int64_t got = 0;
    while (got < outs[i]) {
      TORCH_CHECK(p < mats.size(), "the matrix parts end before matrix ", i, " has its ", outs[i], " rows");
      const int64_t r = rows.empty() ? outs[i] : rows[p];
      TORCH_CHECK(r > 0 && got + r <= outs[i], "matrix ", i, ": parts of ", got, " + ", r, " rows exceed ", outs[i]);
      check_weight(mats[p], fmts[p], ins[i], r);
      ms[i].push_back(MatPart{mats[p], fmts[p], r});
      got += r;
      ++p;
    }
  }
  TORCH_CHECK(p == mats.size(), mats.size() - p, " matrix parts left over");
  for (auto& n : norms) TORCH_CHECK(n.numel() == 0 || (n.dtype() == torch::kFloat32 && n.is_contiguous()), "norm weights must be contiguous float32");
  return LayerSpec{norms, eps, ms, qkv_bias, n_heads, n_kv, hd, scaling, window, act, inter};
}

// y [R, ldy] (columns [0, rows of m)) = x [R, K] @ m.T, part by part
void matmul_mat(const Mat& m, const float* x, int64_t R, int64_t K, float* y, int64_t ldy) {
  int64_t off = 0;
  for (const MatPart& p : m) {
    matmul_blocks(x, R, K, p.w.data_ptr<uint8_t>(), p.rows, p.fmt, y + off, ldy);
    off += p.rows;
  }
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
  std::vector<float> xn(R * std::max(d, inter)), qkv(R * nqkv), att(R * qn), gu(R * 2 * inter), tmp(R * d);

  // attention block
  rmsnorm_rows(h, R, d, nptr(0), feps, xn.data());
  matmul_mat(mats[0], xn.data(), R, d, qkv.data(), nqkv);
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
  auto kv_rows = [&](int64_t b, int64_t g) {
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
    return rows;
  };
  auto window_lo = [&](int64_t pos) { return window > 0 ? std::max<int64_t>(0, pos - window + 1) : int64_t{0}; };
#if defined(__AVX512F__)
  if ((hd == 64 || hd == 128 || hd == 256) && group <= ATT_MAX_Q) {
    // the query heads of one KV head, for a few positions at a time, share each read of the keys and values; when
    // that leaves fewer than two tasks per thread (a decode step of few sequences), a tile's queries are split into
    // parts (each query's result is the same in any part)
    const int64_t tq = std::max<int64_t>(1, std::min<int64_t>(T, ATT_MAX_Q / group)), ntile = (T + tq - 1) / tq;
    const int64_t tasks = B * n_kv * ntile, threads = at::get_num_threads();
    const int64_t parts = std::min<int64_t>(group * tq, std::max<int64_t>(1, (2 * threads + tasks - 1) / tasks));
    at::parallel_for(0, tasks * parts, 1, [&](int64_t i0, int64_t i1) {
      std::vector<float> sc(ATT_MAX_Q * ((max_end + 15) / 16 + 1) * 16);
      std::vector<int64_t> off(max_end + 1);
      for (int64_t i = i0; i < i1; ++i) {
        const int64_t part = i % parts, task = i / parts;
        const int64_t tile = task % ntile, g = (task / ntile) % n_kv, b = task / (ntile * n_kv);
        const int64_t t0 = tile * tq, t1 = std::min(T, t0 + tq);
        const int64_t nq = (t1 - t0) * group, per = (nq + parts - 1) / parts;
        const int64_t q0 = part * per, q1 = std::min(nq, q0 + per);
        if (q0 >= q1) continue;
        const float* qp[ATT_MAX_Q];
        float* op[ATT_MAX_Q];
        float* pp[ATT_MAX_Q];
        int64_t lo[ATT_MAX_Q], hi[ATT_MAX_Q];
        int R = 0;
        for (int64_t k = q0; k < q1; ++k, ++R) {
          const int64_t t = t0 + k / group, head = g * group + k % group, pos = kv.starts[b] + t;
          qp[R] = qkv.data() + (b * T + t) * nqkv + head * hd;
          op[R] = att.data() + (b * T + t) * qn + head * hd;
          pp[R] = probs != nullptr ? probs + ((b * n_heads + head) * T + t) * probs_S : nullptr;
          lo[R] = window_lo(pos);
          hi[R] = pos;
        }
        const KVRows rows = kv_rows(b, g);
        float* const* po = probs != nullptr ? pp : nullptr;
        if (hd == 64) attend_group<64>(qp, lo, hi, R, rows, fscale, sc.data(), off.data(), op, po);
        else if (hd == 128) attend_group<128>(qp, lo, hi, R, rows, fscale, sc.data(), off.data(), op, po);
        else attend_group<256>(qp, lo, hi, R, rows, fscale, sc.data(), off.data(), op, po);
      }
    });
  } else
#endif
  {
    at::parallel_for(0, B * n_heads * T, 1, [&](int64_t i0, int64_t i1) {
      std::vector<float> sc(max_end + 8);
      for (int64_t i = i0; i < i1; ++i) {
        const int64_t t = i % T, head = (i / T) % n_heads, b = i / (T * n_heads), g = head / group;
        const int64_t pos = kv.starts[b] + t;
        attend_row(qkv.data() + (b * T + t) * nqkv + head * hd, kv_rows(b, g), window_lo(pos), pos, hd, fscale,
                   sc.data(), att.data() + (b * T + t) * qn + head * hd,
                   probs != nullptr ? probs + ((b * n_heads + head) * T + t) * probs_S : nullptr);
      }
    });
  }
  matmul_mat(mats[1], att.data(), R, qn, tmp.data(), d);
  if (nptr(1) != nullptr) rmsnorm_rows(tmp.data(), R, d, nptr(1), feps, tmp.data());
  for (int64_t i = 0; i < R * d; ++i) h[i] += tmp[i];

  // MLP block
  rmsnorm_rows(h, R, d, nptr(2), feps, xn.data());
  matmul_mat(mats[2], xn.data(), R, d, gu.data(), 2 * inter);
  for (int64_t r = 0; r < R; ++r)
    glu(gu.data() + r * 2 * inter, gu.data() + r * 2 * inter + inter, inter, L.act, xn.data() + r * inter);
  matmul_mat(mats[3], xn.data(), R, inter, tmp.data(), d);
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
                           std::vector<torch::Tensor> mats, std::vector<int64_t> fmts, std::vector<int64_t> rows,
                           torch::Tensor qkv_bias,
                           torch::Tensor cos, torch::Tensor sin, torch::Tensor k_cache, torch::Tensor v_cache,
                           int64_t start, int64_t n_heads, int64_t n_kv, int64_t hd, double scaling, int64_t window,
                           int64_t act, int64_t inter) {
  const LayerSpec L = make_spec(norms, eps, mats, fmts, rows, qkv_bias, n_heads, n_kv, hd, scaling, window, act, inter);
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
              std::vector<int64_t> rows, torch::Tensor qkv_bias, int64_t n_heads, int64_t n_kv, int64_t hd,
              double scaling, int64_t window, int64_t act, int64_t inter) {
    layers_.push_back(make_spec(norms, eps, mats, fmts, rows, qkv_bias, n_heads, n_kv, hd, scaling, window, act,
                                inter));
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
  m.def("qmatmul", &qmatmul, "y [T, N] = x [T, K] @ dequant(w).T, w in the kernel layout");
  m.def("dequantize", &dequantize, "float32 (or bfloat16) rows of a block matrix in the kernel layout");
  m.def("kernel_isa", &kernel_isa, "the kernel variant in use: avx512, avx2 or scalar");
  m.def("best_isa", &best_isa, "the best kernel variant this CPU runs");
  m.def("set_isa", &set_isa, "use another kernel variant this CPU runs (tests, A/B runs)");
  m.def("decode_layer", &decode_layer, "one decoder layer over block matrices");
  m.def("has_avx2", &has_avx2, "built with AVX2 + FMA + F16C");
  pybind11::class_<LayerStack>(m, "LayerStack", pybind11::module_local())
      .def(pybind11::init<>())
      .def("add", &LayerStack::add)
      .def("size", &LayerStack::size)
      .def("run", &LayerStack::run, pybind11::call_guard<pybind11::gil_scoped_release>())
      .def("run_paged", &LayerStack::run_paged, pybind11::call_guard<pybind11::gil_scoped_release>());
}

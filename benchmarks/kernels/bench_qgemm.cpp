// The block kernels of laserlm/models/kernels/qgemm.h without torch: time y = x @ W.T for SmolLM2's matrix shapes,
// T = 1..16 (and 64) activation rows, weights cold (many copies, more than the L3) or hot (one copy, in cache).
//
//   g++ -O3 -march=native -fno-math-errno -Ibenchmarks/kernels -Ilaserlm/models/kernels \
//       benchmarks/kernels/bench_qgemm.cpp -o /tmp/bench_qgemm && /tmp/bench_qgemm [cold|hot] [avx512|avx2|scalar]
//
// Prints microseconds per call, the weight bytes per second and the multiply-adds per second.
#define LASERLM_STANDALONE
#include "qgemm.h"

#include <chrono>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>

int main(int argc, char** argv) {
  const bool cold = argc < 2 || std::string(argv[1]) != "hot";
  if (argc >= 3) g_isa = std::min(detect_isa(), parse_isa(argv[2]));
  std::printf("variant %s, weights %s\n", isa_name(g_isa), cold ? "cold" : "hot");
  std::mt19937 rng(0);
  struct Shape { const char* name; int64_t N, K, fmt; };
  const Shape shapes[] = {{"qkv q4_1", 960, 576, Q4_1}, {"gate_up q4_1", 3072, 576, Q4_1},
                          {"down q4_1", 576, 1536, Q4_1}, {"head q8_0", 49152, 576, Q8_0}};
  for (const Shape& s : shapes) {
    const int64_t nb = s.K / 32, G = n_groups(s.N), gb = nb * region_bytes(s.fmt), bytes = G * gb;
    const int copies = cold ? static_cast<int>(std::max<int64_t>(2, (256 << 20) / bytes)) : 1;
    std::vector<std::vector<uint8_t>> ws(copies, std::vector<uint8_t>(bytes));
    for (auto& w : ws) {
      for (auto& b : w) b = rng() & 0xFF;
      for (int64_t g = 0; g < G; ++g)  // small valid fp16 scales
        for (int64_t b = 0; b < nb; ++b) {
          uint16_t* sc = reinterpret_cast<uint16_t*>(w.data() + g * gb + b * region_bytes(s.fmt) + quant_bytes(s.fmt));
          for (int i = 0; i < (s.fmt == Q4_1 ? 32 : 16); ++i) sc[i] = 0x2000 + (rng() & 0xFF);
        }
    }
    std::vector<float> x(64 * s.K), y(64 * s.N);
    for (auto& v : x) v = std::normal_distribution<float>()(rng);
    for (int T : {1, 2, 3, 4, 6, 8, 12, 16, 64}) {
      double best = 1e30;
      for (int rep = 0; rep < 5; ++rep) {
        const int calls = cold ? copies : std::max(1, static_cast<int>(2e8 / (double(T) * s.N * s.K)));
        const auto t0 = std::chrono::steady_clock::now();
        for (int c = 0; c < calls; ++c)
          matmul_blocks(x.data(), T, s.K, ws[c % copies].data(), s.N, s.fmt, y.data(), s.N);
        best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() / calls);
      }
      std::printf("%-13s T=%2d %9.1f us %6.1f GB/s %6.1f GMAC/s\n", s.name, T, best * 1e6, bytes / best / 1e9,
                  double(T) * s.N * s.K / best / 1e9);
    }
  }
}

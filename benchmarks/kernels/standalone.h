#pragma once
#include <cstdint>
#include <stdexcept>
#define TORCH_CHECK(cond, ...) do { if (!(cond)) throw std::runtime_error("check failed: " #cond); } while (0)
namespace at {
template <class F> void parallel_for(int64_t b, int64_t e, int64_t, const F& f) { if (b < e) f(b, e); }
}

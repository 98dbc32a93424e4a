// kvlab::gemv(x, w): F.linear without bias for float32 on the CPU, one row of x at a time. A decode step of
// one conversation is a GEMV per weight, bound by how fast the weights are read. One thread reads memory
// fastest as many sequential streams at once, each prefetching ahead of itself (benchmarks/read_streams.c):
// so a thread's rows of w are split into S bands, read side by side. Over the bundled model's weights, one
// thread, this reads within a few percent of that fastest read, where inductor's frozen GEMM templates take
// about a third longer (benchmarks/results/gemv_rate.md). With several threads each takes a contiguous block
// of rows (at::parallel_for), read the same way. Built on first use (kvlab.kernels) and called by name from
// the compiled CPU step (kvlab.kernels.gemv).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <cstring>

namespace {

constexpr int S = 16;         // streams (bands of rows read at once); 8-32 measured, 16 fastest here
constexpr long AHEAD = 512;   // bytes each stream prefetches ahead of itself
constexpr long GRAIN = 1024;  // fewest rows a thread takes
typedef float v16 __attribute__((vector_size(64)));

inline v16 load16(const float *p) {
  v16 v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

inline float total(v16 v) {
  float s = 0.f;
  for (int i = 0; i < 16; i++) s += v[i];
  return s;
}

// y[n] = sum_k w[n, k] x[k] for N rows of a row-major w [N, K], K a multiple of 16
void gemv_rows(const float *w, const float *x, float *y, long N, long K) {
  long band = N / S;
  for (long r = 0; r < band; r++) {
    v16 acc[S] = {};
    const float *rows[S];
    for (int s = 0; s < S; s++) rows[s] = w + (s * band + r) * K;
    for (long k = 0; k < K; k += 16) {
      v16 xv = load16(x + k);
      for (int s = 0; s < S; s++) {
        __builtin_prefetch(reinterpret_cast<const char *>(rows[s] + k) + AHEAD, 0, 3);
        acc[s] += load16(rows[s] + k) * xv;
      }
    }
    for (int s = 0; s < S; s++) y[s * band + r] = total(acc[s]);
  }
  for (long n = band * S; n < N; n++) {
    v16 a = {};
    for (long k = 0; k < K; k += 16) a += load16(w + n * K + k) * load16(x + k);
    y[n] = total(a);
  }
}

at::Tensor gemv(const at::Tensor &x, const at::Tensor &w) {
  TORCH_CHECK(x.device().is_cpu() && w.device().is_cpu(), "kvlab::gemv runs on the CPU");
  TORCH_CHECK(x.scalar_type() == at::kFloat && w.scalar_type() == at::kFloat, "kvlab::gemv takes float32");
  TORCH_CHECK(w.dim() == 2 && w.size(1) % 16 == 0, "kvlab::gemv takes a 2-D weight, rows a multiple of 16");
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) == w.size(1), "kvlab::gemv: x's last size must be w's columns");
  at::Tensor xc = x.contiguous(), wc = w.contiguous();
  long N = wc.size(0), K = wc.size(1), M = K ? xc.numel() / K : 0;
  std::vector<int64_t> sizes = xc.sizes().vec();
  sizes.back() = N;
  at::Tensor y = at::empty(sizes, xc.options());
  const float *wp = wc.data_ptr<float>(), *xp = xc.data_ptr<float>();
  float *yp = y.data_ptr<float>();
  for (long m = 0; m < M; m++)
    at::parallel_for(0, N, GRAIN, [&](int64_t begin, int64_t end) {
      gemv_rows(wp + begin * K, xp + m * K, yp + m * N + begin, end - begin, K);
    });
  return y;
}

}  // namespace

TORCH_LIBRARY(kvlab, m) { m.def("gemv(Tensor x, Tensor w) -> Tensor"); }
TORCH_LIBRARY_IMPL(kvlab, CPU, m) { m.impl("gemv", &gemv); }

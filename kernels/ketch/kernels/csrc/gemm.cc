// Dense matmul for the native backend: y[..., N] = x[..., K] . w[K, N], float32, on the CPU,
// through OpenBLAS (the scipy-openblas32 wheel). OpenBLAS is built with DYNAMIC_ARCH: it picks
// its kernels from the CPU when the library loads (Haswell/Zen for AVX2, SkylakeX/Cooperlake
// for AVX-512), so nothing here assumes an instruction set.
//
// Why not paddle.matmul: the CPU wheel's matmul goes through MKL-ML, which on the AMD machines
// this project runs on takes a slow path (17-24 GFLOP/s on one thread where OpenBLAS reaches
// 60-80, measured in docs/backend.md). Rows below kGemvRows go through one GEMV each: OpenBLAS's
// GEMM is 2-3x slower than that at 2-3 rows.
#include <algorithm>
#include <atomic>
#include <cstdint>
#include <limits>
#include <vector>

#include "cblas.h"
#include "paddle/extension.h"

namespace ketch {

constexpr int64_t kGemvRows = 4;

void SetThreads(int num_threads) {
  // OpenBLAS's thread count is process-wide; set it only when it changes.
  static std::atomic<int> current{-1};
  if (num_threads > 0 && current.exchange(num_threads) != num_threads) {
    scipy_openblas_set_num_threads(num_threads);
  }
}

std::vector<paddle::Tensor> Linear(const paddle::Tensor& x_in, const paddle::Tensor& w_in,
                                   int num_threads) {
  const paddle::Tensor x = x_in.is_contiguous() ? x_in : x_in.contiguous();
  const paddle::Tensor w = w_in.is_contiguous() ? w_in : w_in.contiguous();
  PD_CHECK(x.place() == paddle::CPUPlace() && w.place() == paddle::CPUPlace(),
           "ketch_linear: CPU tensors only");
  PD_CHECK(x.dtype() == paddle::DataType::FLOAT32 && w.dtype() == paddle::DataType::FLOAT32,
           "ketch_linear: float32 only");
  PD_CHECK(w.shape().size() == 2, "ketch_linear: w must be [K, N]");
  PD_CHECK(!x.shape().empty() && x.shape().back() == w.shape()[0],
           "ketch_linear: x's last dimension must equal w's first");
  const int64_t k = w.shape()[0];
  const int64_t n = w.shape()[1];
  int64_t m = 1;
  for (size_t i = 0; i + 1 < x.shape().size(); ++i) m *= x.shape()[i];
  // scipy-openblas32 takes 32-bit sizes: refuse what would wrap rather than compute garbage.
  constexpr int64_t kMax = std::numeric_limits<int32_t>::max();
  PD_CHECK(m <= kMax && n <= kMax && k <= kMax,
           "ketch_linear: a dimension exceeds OpenBLAS's 32-bit sizes");
  std::vector<int64_t> out_shape = x.shape();
  out_shape.back() = n;
  auto y = paddle::empty(out_shape, paddle::DataType::FLOAT32, paddle::CPUPlace());
  if (m == 0 || n == 0) return {y};
  float* out = y.data<float>();
  if (k == 0) {
    std::fill(out, out + m * n, 0.0f);
    return {y};
  }
  SetThreads(num_threads);
  const float* a = x.data<float>();
  const float* b = w.data<float>();
  if (m < kGemvRows) {
    for (int64_t r = 0; r < m; ++r) {
      scipy_cblas_sgemv(CblasRowMajor, CblasTrans, k, n, 1.0f, b, n, a + r * k, 1, 0.0f,
                        out + r * n, 1);
    }
  } else {
    scipy_cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, m, n, k, 1.0f, a, k, b, n,
                      0.0f, out, n);
  }
  return {y};
}

std::vector<std::vector<int64_t>> LinearShape(const std::vector<int64_t>& x,
                                              const std::vector<int64_t>& w) {
  std::vector<int64_t> out = x;
  if (!out.empty() && w.size() == 2) out.back() = w[1];
  return {out};
}

std::vector<paddle::DataType> LinearDtype(const paddle::DataType& x, const paddle::DataType&) {
  return {x};
}

}  // namespace ketch

PD_BUILD_OP(ketch_linear)
    .Inputs({"x", "w"})
    .Outputs({"y"})
    .Attrs({"num_threads: int"})
    .SetKernelFn(PD_KERNEL(ketch::Linear))
    .SetInferShapeFn(PD_INFER_SHAPE(ketch::LinearShape))
    .SetInferDtypeFn(PD_INFER_DTYPE(ketch::LinearDtype));

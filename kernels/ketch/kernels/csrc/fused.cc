// Fused elementwise ops of the native backend's decoder layer, float32, CPU. Each replaces a run
// of small paddle ops whose dispatch, not arithmetic, is the cost at serving batch sizes (an
// RMSNorm is 7 dygraph ops, the rotary embedding with its splits and reshapes about 13):
//
//   ketch_rms_norm(x [.., D], w [D], eps)                -> y = x * rsqrt(mean(x^2) + eps) * w
//   ketch_add_rms_norm(h, delta, w, eps)                 -> (s = h + delta, rms_norm(s, w, eps))
//   ketch_rope_qkv(qkv [T, (H + 2 KV) D], cos, sin [T, D], heads, kv_heads)
//       -> q [T, H, D], k [T, KV, D] rotated (rotate-half: the first and second halves of each
//          head pair up, as Hugging Face's Llama/Qwen2), v [T, KV, D] copied
//
// The references are the plain-paddle formulas in ketch.kernels.fused (and dense_graph). The
// library is compiled for the x86-64 baseline; the loops are simple enough for the compiler's
// SSE2 vectorisation, and they are memory-bound at these sizes.
#include <cmath>
#include <cstdint>
#include <vector>

#include "paddle/extension.h"

namespace ketch {

namespace {

void CheckFloat(const paddle::Tensor& t, const char* name) {
  PD_CHECK(t.place() == paddle::CPUPlace() && t.dtype() == paddle::DataType::FLOAT32, name,
           " must be a float32 CPU tensor");
}

paddle::Tensor Dense(const paddle::Tensor& t) { return t.is_contiguous() ? t : t.contiguous(); }

// One row: out = x * rsqrt(sum(x^2) / d + eps) * w.
inline void NormRow(const float* x, const float* w, float* out, int64_t d, float eps) {
  float sum = 0.0f;
  for (int64_t i = 0; i < d; ++i) sum += x[i] * x[i];
  const float inv = 1.0f / std::sqrt(sum * (1.0f / static_cast<float>(d)) + eps);
  for (int64_t i = 0; i < d; ++i) out[i] = x[i] * inv * w[i];
}

int64_t Rows(const paddle::Tensor& x) {
  int64_t rows = 1;
  for (size_t i = 0; i + 1 < x.shape().size(); ++i) rows *= x.shape()[i];
  return rows;
}

void CheckNorm(const paddle::Tensor& x, const paddle::Tensor& w) {
  CheckFloat(x, "x");
  CheckFloat(w, "weight");
  PD_CHECK(!x.shape().empty() && w.shape().size() == 1 && w.shape()[0] == x.shape().back(),
           "weight must be [D] with D = x's last dimension");
}

}  // namespace

std::vector<paddle::Tensor> RmsNorm(const paddle::Tensor& x_in, const paddle::Tensor& w_in,
                                    float eps) {
  CheckNorm(x_in, w_in);
  const paddle::Tensor x = Dense(x_in), w = Dense(w_in);
  auto y = paddle::empty(x.shape(), paddle::DataType::FLOAT32, paddle::CPUPlace());
  const int64_t d = x.shape().back(), rows = Rows(x);
  const float *xp = x.data<float>(), *wp = w.data<float>();
  float* yp = y.data<float>();
  for (int64_t r = 0; r < rows; ++r) NormRow(xp + r * d, wp, yp + r * d, d, eps);
  return {y};
}

std::vector<paddle::Tensor> AddRmsNorm(const paddle::Tensor& h_in, const paddle::Tensor& delta_in,
                                       const paddle::Tensor& w_in, float eps) {
  CheckNorm(h_in, w_in);
  CheckFloat(delta_in, "delta");
  PD_CHECK(delta_in.shape() == h_in.shape(), "delta must have h's shape");
  const paddle::Tensor h = Dense(h_in), delta = Dense(delta_in), w = Dense(w_in);
  auto s = paddle::empty(h.shape(), paddle::DataType::FLOAT32, paddle::CPUPlace());
  auto y = paddle::empty(h.shape(), paddle::DataType::FLOAT32, paddle::CPUPlace());
  const int64_t d = h.shape().back(), rows = Rows(h);
  const float *hp = h.data<float>(), *dp = delta.data<float>(), *wp = w.data<float>();
  float *sp = s.data<float>(), *yp = y.data<float>();
  for (int64_t r = 0; r < rows; ++r) {
    float* srow = sp + r * d;
    for (int64_t i = 0; i < d; ++i) srow[i] = hp[r * d + i] + dp[r * d + i];
    NormRow(srow, wp, yp + r * d, d, eps);
  }
  return {s, y};
}

std::vector<paddle::Tensor> RopeQkv(const paddle::Tensor& qkv_in, const paddle::Tensor& cos_in,
                                    const paddle::Tensor& sin_in, int heads, int kv_heads) {
  CheckFloat(qkv_in, "qkv");
  CheckFloat(cos_in, "cos");
  CheckFloat(sin_in, "sin");
  PD_CHECK(heads > 0 && kv_heads > 0, "heads and kv_heads must be positive");
  PD_CHECK(qkv_in.shape().size() == 2 && cos_in.shape().size() == 2 &&
               cos_in.shape() == sin_in.shape() && cos_in.shape()[0] == qkv_in.shape()[0],
           "qkv must be [T, (heads + 2 kv_heads) D], cos and sin [T, D]");
  const int64_t t = qkv_in.shape()[0], d = cos_in.shape()[1];
  PD_CHECK(d % 2 == 0 && qkv_in.shape()[1] == (heads + 2 * kv_heads) * d,
           "qkv's width must be (heads + 2 kv_heads) * D with an even head dim D");
  const paddle::Tensor qkv = Dense(qkv_in), cos = Dense(cos_in), sin = Dense(sin_in);
  auto q = paddle::empty({t, heads, d}, paddle::DataType::FLOAT32, paddle::CPUPlace());
  auto k = paddle::empty({t, kv_heads, d}, paddle::DataType::FLOAT32, paddle::CPUPlace());
  auto v = paddle::empty({t, kv_heads, d}, paddle::DataType::FLOAT32, paddle::CPUPlace());
  const int64_t width = (heads + 2 * kv_heads) * d, half = d / 2;
  const float *src = qkv.data<float>(), *cp = cos.data<float>(), *sp = sin.data<float>();
  float *qp = q.data<float>(), *kp = k.data<float>(), *vp = v.data<float>();
  for (int64_t row = 0; row < t; ++row) {
    const float* in = src + row * width;
    const float *c = cp + row * d, *s = sp + row * d;
    for (int64_t head = 0; head < heads + kv_heads; ++head) {
      const float* x = in + head * d;
      float* out = head < heads ? qp + (row * heads + head) * d
                                : kp + (row * kv_heads + head - heads) * d;
      for (int64_t i = 0; i < half; ++i) out[i] = x[i] * c[i] + (-x[i + half]) * s[i];
      for (int64_t i = half; i < d; ++i) out[i] = x[i] * c[i] + x[i - half] * s[i];
    }
    const float* vin = in + (heads + kv_heads) * d;
    float* vout = vp + row * kv_heads * d;
    for (int64_t i = 0; i < kv_heads * d; ++i) vout[i] = vin[i];
  }
  return {q, k, v};
}

std::vector<std::vector<int64_t>> SameShape(const std::vector<int64_t>& x,
                                            const std::vector<int64_t>&) {
  return {x};
}

std::vector<std::vector<int64_t>> TwoSameShapes(const std::vector<int64_t>& h,
                                                const std::vector<int64_t>&,
                                                const std::vector<int64_t>&) {
  return {h, h};
}

std::vector<std::vector<int64_t>> RopeShapes(const std::vector<int64_t>& qkv,
                                             const std::vector<int64_t>& cos,
                                             const std::vector<int64_t>&, int heads,
                                             int kv_heads) {
  const int64_t t = qkv.empty() ? -1 : qkv[0], d = cos.size() == 2 ? cos[1] : -1;
  return {{t, heads, d}, {t, kv_heads, d}, {t, kv_heads, d}};
}

std::vector<paddle::DataType> OneFloat(const paddle::DataType&, const paddle::DataType&) {
  return {paddle::DataType::FLOAT32};
}

std::vector<paddle::DataType> TwoFloats(const paddle::DataType&, const paddle::DataType&,
                                        const paddle::DataType&) {
  return {paddle::DataType::FLOAT32, paddle::DataType::FLOAT32};
}

std::vector<paddle::DataType> ThreeFloats(const paddle::DataType&, const paddle::DataType&,
                                          const paddle::DataType&) {
  return {paddle::DataType::FLOAT32, paddle::DataType::FLOAT32, paddle::DataType::FLOAT32};
}

}  // namespace ketch

PD_BUILD_OP(ketch_rms_norm)
    .Inputs({"x", "weight"})
    .Outputs({"y"})
    .Attrs({"eps: float"})
    .SetKernelFn(PD_KERNEL(ketch::RmsNorm))
    .SetInferShapeFn(PD_INFER_SHAPE(ketch::SameShape))
    .SetInferDtypeFn(PD_INFER_DTYPE(ketch::OneFloat));

PD_BUILD_OP(ketch_add_rms_norm)
    .Inputs({"h", "delta", "weight"})
    .Outputs({"sum", "y"})
    .Attrs({"eps: float"})
    .SetKernelFn(PD_KERNEL(ketch::AddRmsNorm))
    .SetInferShapeFn(PD_INFER_SHAPE(ketch::TwoSameShapes))
    .SetInferDtypeFn(PD_INFER_DTYPE(ketch::TwoFloats));

PD_BUILD_OP(ketch_rope_qkv)
    .Inputs({"qkv", "cos", "sin"})
    .Outputs({"q", "k", "v"})
    .Attrs({"heads: int", "kv_heads: int"})
    .SetKernelFn(PD_KERNEL(ketch::RopeQkv))
    .SetInferShapeFn(PD_INFER_SHAPE(ketch::RopeShapes))
    .SetInferDtypeFn(PD_INFER_DTYPE(ketch::ThreeFloats));

// Routed experts (a MoE block's sparse MLP) in one op, float32 (weights float32, bfloat16 or int8),
// CPU:
//
//   ketch_fused_moe(x [T, H], routing [T, K], indices [T, K] int64, gate_up [E, P, H, NR],
//                   down [E, P', I, NR], first, inter, isa, num_threads) -> y [T, H]
//
// gate_up[j] is held expert first + j's [gate | up] weight packed with glu (packed_gemm.cc's
// ketch_pack_weight: [P, H, NR], SwiGLU in the epilogue), down[j] its down weight packed plain
// ([P', I, NR]), the held experts stacked (two tensors: each tensor handed to an op costs its
// dispatch microseconds, and a decode step calls this once per layer). y[t] = the sum over t's
// picks of a held expert e, in ascending e, of routing[t, slot] * down_e(swiglu(x[t] . gate_up_e));
// picks of experts outside [first, first + E) (another rank's) add nothing, a token with none
// gets zeros. Both weights may instead be bfloat16 (ketch_pack_weight_bf16), widened as they load,
// or both int8 (ketch_pack_weight_i8), with their dequantization scales:
//
//   ketch_fused_moe_i8(x, routing, indices, gate_up, down, gate_up_scale [E, 2I],
//                      down_scale [E, hidden], first, inter, isa, num_threads) -> y [T, H]
//
// expert j's rows of gate_up_scale and down_scale being its weights' per-column scales
// (ketch_quantize_int8), applied to each finished sum as ketch_packed_linear_i8 applies them.
//
// Steps: a counting sort of the T * K picks by expert (stable: token order within an expert);
// each picked row of x gathered into its expert's contiguous run; the gate_up GEMM of every
// expert, then the down GEMM of every expert, each as one pool of (expert, row block, panel)
// items over one OpenMP team (dynamic: experts get uneven rows); then each token's weighted sum
// over its picks. The micro-kernels are the dense linear's (packed_gemm.h), so every output row
// is what ketch_packed_linear gives for that row alone, and the sum is done as the one-matmul-
// per-expert loop (ketch.engine.models.moe.combine) does it: 0, then + (y * w) expert by expert,
// a multiply and an add (no FMA: this file is compiled for the x86-64 baseline), so the two
// agree bit for bit.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "packed_gemm.h"
#include "paddle/extension.h"

namespace ketch {

namespace {

// The picks grouped by held expert: rows [start[j], start[j + 1]) of the gathered input are
// expert j's, row r is pick pick[r] (= t * K + slot); row_of[p] is pick p's row or -1.
struct Groups {
  std::vector<int64_t> start, pick, row_of;
};

Groups GroupByExpert(const int64_t* indices, int64_t picks, int64_t first, int64_t held) {
  Groups g{std::vector<int64_t>(held + 1, 0), {}, std::vector<int64_t>(picks, -1)};
  for (int64_t p = 0; p < picks; ++p) {
    const int64_t j = indices[p] - first;
    if (j >= 0 && j < held) ++g.start[j + 1];
  }
  for (int64_t j = 0; j < held; ++j) g.start[j + 1] += g.start[j];
  g.pick.resize(g.start[held]);
  std::vector<int64_t> next(g.start.begin(), g.start.end() - 1);
  for (int64_t p = 0; p < picks; ++p) {
    const int64_t j = indices[p] - first;
    if (j < 0 || j >= held) continue;
    g.row_of[p] = next[j];
    g.pick[next[j]++] = p;
  }
  return g;
}

// One GEMM per expert with rows, as a flat list of work items.
struct Batch {
  std::vector<Gemm> gemms;
  std::vector<GemmPlan> plans;
  std::vector<int64_t> first_item;  // prefix sums of plans[i].items
  int64_t flops = 0;

  void Add(const Gemm& g, Isa isa) {
    if (first_item.empty()) first_item.push_back(0);
    gemms.push_back(g);
    plans.push_back(PlanGemm(g, isa));
    first_item.push_back(first_item.back() + plans.back().items);
    flops += g.m * g.n * g.k;
  }
  int64_t items() const { return first_item.empty() ? 0 : first_item.back(); }
  void RunItem(Isa isa, int64_t item) const {
    const auto at = std::upper_bound(first_item.begin(), first_item.end(), item) - 1;
    const size_t i = static_cast<size_t>(at - first_item.begin());
    RunGemmItem(gemms[i], isa, plans[i], item - *at);
  }
};

void RunBatch(const Batch& batch, Isa isa, int num_threads) {
  const int64_t items = batch.items();
  const int threads = GemmThreads(batch.flops, num_threads);
  if (threads > 1) {
#pragma omp parallel for num_threads(threads) schedule(dynamic, 1)
    for (int64_t item = 0; item < items; ++item) batch.RunItem(isa, item);
  } else {
    for (int64_t item = 0; item < items; ++item) batch.RunItem(isa, item);
  }
}

// Each token's output: its picks in ascending expert order, 0 + y * w + y * w ...
void Combine(const Groups& g, const int64_t* indices, const float* routing, const float* rows,
             float* y, int64_t tokens, int64_t top_k, int64_t hidden, int num_threads) {
  const int threads = GemmThreads(tokens * top_k * hidden * 64, num_threads);
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
  for (int64_t t = 0; t < tokens; ++t) {
    float* out = y + t * hidden;
    std::fill(out, out + hidden, 0.0f);
    std::vector<int64_t> order;
    for (int64_t s = 0; s < top_k; ++s)
      if (g.row_of[t * top_k + s] >= 0) order.push_back(t * top_k + s);
    std::sort(order.begin(), order.end(),
              [&](int64_t a, int64_t b) { return indices[a] < indices[b]; });
    for (const int64_t p : order) {
      const float w = routing[p];
      const float* src = rows + g.row_of[p] * hidden;
      for (int64_t i = 0; i < hidden; ++i) {
        const float scaled = src[i] * w;
        out[i] += scaled;
      }
    }
  }
}

// The gathered rows and both GEMMs' outputs, reused from call to call on a thread (grown, never
// shrunk): a fresh buffer per call is fresh pages, whose faults and zeroing cost a decode step's
// layer tens of microseconds and a prefill chunk's milliseconds.
float* Scratch(int64_t floats) {
  thread_local std::vector<float> buffer;
  if (static_cast<int64_t>(buffer.size()) < floats) buffer.resize(floats);
  return buffer.data();
}

void CheckFloatCpu(const paddle::Tensor& t, const char* name) {
  PD_CHECK(t.place() == paddle::CPUPlace() && t.dtype() == paddle::DataType::FLOAT32, name,
           " must be a float32 CPU tensor");
}

paddle::Tensor Dense(const paddle::Tensor& t) { return t.is_contiguous() ? t : t.contiguous(); }

// The packed weights from element `offset` on, float, bfloat16 or int8 as the tensor holds them.
const void* Weights(const paddle::Tensor& packed, int64_t offset) {
  if (packed.dtype() == paddle::DataType::BFLOAT16) return packed.data<paddle::bfloat16>() + offset;
  if (packed.dtype() == paddle::DataType::INT8) return packed.data<int8_t>() + offset;
  return packed.data<float>() + offset;
}

// Checks the stacked experts against the layer's shapes; `int8`: ketch_fused_moe_i8's.
void CheckExperts(const paddle::Tensor& gate_up, const paddle::Tensor& down, int64_t hidden,
                  int64_t inter, int64_t nr, bool int8) {
  if (int8) {
    PD_CHECK(gate_up.place() == paddle::CPUPlace() && down.place() == paddle::CPUPlace() &&
                 gate_up.dtype() == paddle::DataType::INT8 &&
                 down.dtype() == paddle::DataType::INT8,
             "ketch_fused_moe_i8: gate_up and down must both be int8 CPU tensors");
  } else if (gate_up.dtype() == paddle::DataType::BFLOAT16) {
    PD_CHECK(gate_up.place() == paddle::CPUPlace() && down.place() == paddle::CPUPlace() &&
                 down.dtype() == paddle::DataType::BFLOAT16,
             "ketch_fused_moe: gate_up and down must both be float32 or both bfloat16 CPU tensors");
  } else {
    CheckFloatCpu(gate_up, "gate_up");
    CheckFloatCpu(down, "down");
  }
  const auto gs = gate_up.shape(), ds = down.shape();
  PD_CHECK(gs.size() == 4 && gs[1] == (inter + nr / 2 - 1) / (nr / 2) && gs[2] == hidden &&
               gs[3] == nr && gate_up.is_contiguous(),
           "ketch_fused_moe: gate_up must be [E, ceil(I / ", nr / 2, "), hidden, ", nr,
           "], each packed with glu, I = inter = ", inter);
  PD_CHECK(ds.size() == 4 && ds[0] == gs[0] && ds[1] == (hidden + nr - 1) / nr &&
               ds[2] == inter && ds[3] == nr && down.is_contiguous(),
           "ketch_fused_moe: down must be [E, ceil(hidden / ", nr, "), I, ", nr,
           "] with gate_up's E");
}

// Checks one stack of per-expert scales ([E, columns] float32) and returns it dense.
paddle::Tensor CheckScales(const paddle::Tensor& scale, int64_t experts, int64_t columns,
                           const char* name) {
  CheckFloatCpu(scale, name);
  PD_CHECK(scale.shape().size() == 2 && scale.shape()[0] == experts &&
               scale.shape()[1] == columns,
           "ketch_fused_moe_i8: ", name, " must be [", experts, ", ", columns,
           "], each expert's per-column scales");
  return Dense(scale);
}

// ketch_fused_moe, and ketch_fused_moe_i8 with both scale stacks.
std::vector<paddle::Tensor> RunFusedMoe(const paddle::Tensor& x_in,
                                        const paddle::Tensor& routing_in,
                                        const paddle::Tensor& indices_in,
                                        const paddle::Tensor& gate_up, const paddle::Tensor& down,
                                        const paddle::Tensor* up_scale_in,
                                        const paddle::Tensor* down_scale_in, int first, int inter,
                                        const std::string& isa, int num_threads) {
  const Isa kind = ParseIsa(isa);
  const int64_t nr = PanelWidth(kind);
  CheckFloatCpu(x_in, "x");
  CheckFloatCpu(routing_in, "routing");
  PD_CHECK(indices_in.place() == paddle::CPUPlace() &&
               indices_in.dtype() == paddle::DataType::INT64,
           "indices must be an int64 CPU tensor");
  PD_CHECK(x_in.shape().size() == 2, "ketch_fused_moe: x must be [T, hidden]");
  const int64_t tokens = x_in.shape()[0], hidden = x_in.shape()[1];
  PD_CHECK(routing_in.shape().size() == 2 && routing_in.shape()[0] == tokens &&
               indices_in.shape() == routing_in.shape(),
           "ketch_fused_moe: routing and indices must both be [T, top_k] with x's T");
  PD_CHECK(first >= 0 && inter > 0, "ketch_fused_moe: needs first >= 0 and inter > 0");
  const bool int8 = up_scale_in != nullptr;
  CheckExperts(gate_up, down, hidden, inter, nr, int8);
  const int64_t held = gate_up.shape()[0];
  const Panel panel = int8 ? Panel::kInt8
                      : gate_up.dtype() == paddle::DataType::BFLOAT16 ? Panel::kBfloat16
                                                                       : Panel::kFloat32;
  paddle::Tensor up_scale, down_scale;
  if (int8) {
    up_scale = CheckScales(*up_scale_in, held, 2 * static_cast<int64_t>(inter), "gate_up_scale");
    down_scale = CheckScales(*down_scale_in, held, hidden, "down_scale");
  }
  const int64_t up_size = gate_up.shape()[1] * hidden * nr;  // weights per expert
  const int64_t down_size = down.shape()[1] * inter * nr;
  const int64_t top_k = routing_in.shape()[1];
  auto y = paddle::empty({tokens, hidden}, paddle::DataType::FLOAT32, paddle::CPUPlace());
  if (tokens * hidden == 0) return {y};
  const paddle::Tensor x = Dense(x_in), routing = Dense(routing_in), indices = Dense(indices_in);
  const int64_t* idx = indices.data<int64_t>();
  const Groups groups = GroupByExpert(idx, tokens * top_k, first, held);
  const int64_t rows = groups.start[held];
  float* gathered = Scratch(rows * (2 * hidden + inter));
  float* act = gathered + rows * hidden;
  float* out = act + rows * inter;
  const float* xp = x.data<float>();
  for (int64_t r = 0; r < rows; ++r)
    std::memcpy(gathered + r * hidden, xp + groups.pick[r] / top_k * hidden,
                hidden * sizeof(float));
  Batch up, dn;
  for (int64_t j = 0; j < held; ++j) {
    const int64_t m = groups.start[j + 1] - groups.start[j], r0 = groups.start[j];
    if (m == 0) continue;
    const void* up_w = Weights(gate_up, j * up_size);
    const void* down_w = Weights(down, j * down_size);
    const float* up_s = int8 ? up_scale.data<float>() + j * 2 * inter : nullptr;
    const float* down_s = int8 ? down_scale.data<float>() + j * hidden : nullptr;
    up.Add({gathered + r0 * hidden, up_w, nullptr, act + r0 * inter, m, hidden, inter, nr, true,
            panel, up_s},
           kind);
    dn.Add({act + r0 * inter, down_w, nullptr, out + r0 * hidden, m, inter, hidden, nr, false,
            panel, down_s},
           kind);
  }
  RunBatch(up, kind, num_threads);
  RunBatch(dn, kind, num_threads);
  Combine(groups, idx, routing.data<float>(), out, y.data<float>(), tokens, top_k, hidden,
          num_threads);
  return {y};
}

}  // namespace

std::vector<paddle::Tensor> FusedMoe(const paddle::Tensor& x, const paddle::Tensor& routing,
                                     const paddle::Tensor& indices, const paddle::Tensor& gate_up,
                                     const paddle::Tensor& down, int first, int inter,
                                     const std::string& isa, int num_threads) {
  return RunFusedMoe(x, routing, indices, gate_up, down, nullptr, nullptr, first, inter, isa,
                     num_threads);
}

std::vector<paddle::Tensor> FusedMoeInt8(const paddle::Tensor& x, const paddle::Tensor& routing,
                                         const paddle::Tensor& indices,
                                         const paddle::Tensor& gate_up,
                                         const paddle::Tensor& down,
                                         const paddle::Tensor& gate_up_scale,
                                         const paddle::Tensor& down_scale, int first, int inter,
                                         const std::string& isa, int num_threads) {
  return RunFusedMoe(x, routing, indices, gate_up, down, &gate_up_scale, &down_scale, first,
                     inter, isa, num_threads);
}

std::vector<std::vector<int64_t>> FusedMoeShape(const std::vector<int64_t>& x,
                                                const std::vector<int64_t>&,
                                                const std::vector<int64_t>&,
                                                const std::vector<int64_t>&,
                                                const std::vector<int64_t>&, int, int,
                                                const std::string&, int) {
  return {x};
}

std::vector<paddle::DataType> FusedMoeDtype(const paddle::DataType& x, const paddle::DataType&,
                                            const paddle::DataType&,
                                            const paddle::DataType&, const paddle::DataType&) {
  return {x};
}

std::vector<std::vector<int64_t>> FusedMoeInt8Shape(
    const std::vector<int64_t>& x, const std::vector<int64_t>&, const std::vector<int64_t>&,
    const std::vector<int64_t>&, const std::vector<int64_t>&, const std::vector<int64_t>&,
    const std::vector<int64_t>&, int, int, const std::string&, int) {
  return {x};
}

std::vector<paddle::DataType> FusedMoeInt8Dtype(const paddle::DataType& x, const paddle::DataType&,
                                                const paddle::DataType&, const paddle::DataType&,
                                                const paddle::DataType&, const paddle::DataType&,
                                                const paddle::DataType&) {
  return {x};
}

}  // namespace ketch

PD_BUILD_OP(ketch_fused_moe_i8)
    .Inputs({"x", "routing", "indices", "gate_up", "down", "gate_up_scale", "down_scale"})
    .Outputs({"y"})
    .Attrs({"first: int", "inter: int", "isa: std::string", "num_threads: int"})
    .SetKernelFn(PD_KERNEL(ketch::FusedMoeInt8))
    .SetInferShapeFn(PD_INFER_SHAPE(ketch::FusedMoeInt8Shape))
    .SetInferDtypeFn(PD_INFER_DTYPE(ketch::FusedMoeInt8Dtype));

PD_BUILD_OP(ketch_fused_moe)
    .Inputs({"x", "routing", "indices", "gate_up", "down"})
    .Outputs({"y"})
    .Attrs({"first: int", "inter: int", "isa: std::string", "num_threads: int"})
    .SetKernelFn(PD_KERNEL(ketch::FusedMoe))
    .SetInferShapeFn(PD_INFER_SHAPE(ketch::FusedMoeShape))
    .SetInferDtypeFn(PD_INFER_DTYPE(ketch::FusedMoeDtype));

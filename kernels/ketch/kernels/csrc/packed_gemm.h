// The packed-weight GEMM's building blocks (packed_gemm.cc), shared by the ops built on it: the
// dense linear (ketch_packed_linear) and the fused routed experts (fused_moe.cc), which runs many
// small GEMMs, one per expert, as one pool of work items over one team of threads.
#pragma once

#include <cstdint>
#include <string>

#include "bf16.h"  // RoundToBf16: float -> bfloat16 bits, rounded to nearest even

namespace ketch {

enum class Isa { kGeneric, kAvx2, kAvx512 };

// "avx512", "avx2" or "generic"; anything else is refused (PD_CHECK).
Isa ParseIsa(const std::string& isa);
// Columns per packed panel: the layout a weight is packed in for this instruction set.
int PanelWidth(Isa isa);

// A panel's element type. Every kernel widens bfloat16 and int8 to float as it loads a panel.
enum class Panel { kFloat32, kBfloat16, kInt8 };

struct Gemm {
  const float* x;       // [m, k]
  const void* packed;   // [panels, k, nr] of float, bfloat16 bits (uint16_t) or int8_t
  const float* bias;    // [n] or nullptr (never with glu)
  float* y;             // [m, n]
  int64_t m, k, n, nr;
  bool glu;             // panels of (gate, up) halves; y = silu(gate) * up
  Panel panel = Panel::kFloat32;
  // int8 panels only: each unpacked column's dequantization scale, [n] in column order ([2n],
  // gate columns then up columns, with glu), applied to the finished sum before bias or SwiGLU.
  const float* scale = nullptr;
};

// A GEMM's work as independent items: (row block, panel) pairs (two panels a row block at one
// row on AVX2), each writing its own outputs.
// Every output row's sum runs over k in order whatever the item or tile, so a row's result does
// not depend on which other rows share its GEMM (the fused experts rely on this).
struct GemmPlan {
  int64_t block;     // rows per block
  int64_t panels;    // panels per row block
  int64_t items;     // blocks * ceil(panels / span)
  int64_t span = 1;  // panels per item (2 for a one-row GEMM on AVX2: more FMA chains per row)
};

GemmPlan PlanGemm(const Gemm& g, Isa isa);
void RunGemmItem(const Gemm& g, Isa isa, const GemmPlan& plan, int64_t item);
// Threads worth starting for `flops` multiply-adds: each must get real work.
int GemmThreads(int64_t flops, int num_threads);
// The whole GEMM, its items over up to num_threads OpenMP threads. Needs k > 0.
void RunGemm(const Gemm& g, Isa isa, int num_threads);

}  // namespace ketch

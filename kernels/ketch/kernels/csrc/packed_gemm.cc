// Dense matmul on weights packed once at load: y[M, N] = x[M, K] . w[K, N] (+ bias), float32, CPU.
//
//   ketch_pack_weight(w [K, N], isa, glu)                  -> packed [P, K, NR]
//   ketch_pack_weight_bf16(w [K, N] f32 or bf16, isa, glu) -> packed [P, K, NR] bfloat16
//   ketch_packed_linear(x [.., K], packed, bias?, n, isa, num_threads, glu) -> y [.., n]
//   ketch_quantize_int8(w [K, N] f32 or bf16)              -> q [K, N] int8, scale [N] f32
//   ketch_pack_weight_i8(q [K, N] int8, isa, glu)          -> packed [P, K, NR] int8
//   ketch_packed_linear_i8(x, packed, scale, bias?, n, isa, num_threads, glu) -> y [.., n]
//
// glu = false: P = ceil(N / NR) panels of NR consecutive columns, y = x . w (+ bias), n = N.
// glu = true (SwiGLU fused into the epilogue): w = [gate | up], [K, 2I]; each panel holds NR/2
// gate columns and the NR/2 up columns of the same outputs, P = ceil(I / (NR/2)), and
// y = silu(x . gate) * (x . up), n = I: the MLP's activation costs no pass of its own.
//
// Why our own GEMM: a library GEMM (OpenBLAS, MKL) packs the weight matrix into its panel layout
// on every call. At serving batch sizes (1-64 rows) that copy of the whole weight costs as much
// as the arithmetic: OpenBLAS reached 35-73 GFLOP/s on one thread at 4-32 rows where the FMA
// units allow ~110 (2-core AMD EPYC with AVX-512, docs/backend.md). Packed once, each panel of NR
// columns is one contiguous [K, NR] block: the micro-kernel streams it once per MR rows, with
// MR x NR accumulators in registers and one broadcast of x per row and k.
//
// bfloat16 weights (ketch_pack_weight_bf16): the same panels at half the bytes, for decode, whose
// few rows leave the GEMM bound by streaming the weights from memory. The kernels widen each
// panel row to float as they load it (bf16 is the top half of a float: zero-extend the 16-bit
// words to 32 and shift left 16) and run the float FMAs, so x, the accumulation and the epilogues
// stay float32 on every CPU, and the result is the float GEMM on the bf16-rounded weight.
//
// int8 weights (W8A16 in spirit: int8 weights, float32 activations): symmetric per-column
// quantization (ketch_quantize_int8: scale = max |column| / 127, q = round-to-even(w / scale)
// clamped to +-127), a quarter of the float32 bytes plus one float per column. The kernels
// sign-extend each panel row's bytes to 32-bit integers and convert them to float as they load
// them (exact), run the same float FMAs, and multiply each column's finished sum by its scale in
// the epilogue, before the bias or SwiGLU (with glu the gate and up columns keep their own
// scales): the float GEMM on q, scaled, which is the GEMM on q * scale up to float rounding.
//
// Register blocks: AVX-512 MR 12 x NR 32 (24 zmm accumulators), AVX2 + FMA MR 6 x NR 16 (12 ymm),
// generic MR 4 x NR 8 (plain loops the compiler vectorises for the baseline). The packed layout
// depends on NR, so a weight is packed for the isa it will run with (the op checks). Rows come
// in blocks sized to keep their x rows in L2 while each panel is reused; with num_threads > 1
// the (row block, panel) items are split over OpenMP threads. Columns past n in the last panel
// are zero in the packing and never stored.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <type_traits>
#include <vector>

#include <immintrin.h>

#include "packed_gemm.h"
#include "paddle/extension.h"
#include "simd.h"

namespace ketch {

namespace {

// The micro-kernels touch the panel this many k-rows ahead: a panel row is one or two cache lines
// read once per tile, and with few rows per tile (a MoE expert's handful at decode) the
// hardware prefetcher alone left the stream at ~2/3 of the memory bandwidth.
constexpr int64_t kPrefetchRows = 16;

// Output columns per panel.
KETCH_INLINE int64_t PanelOutputs(const Gemm& g) { return g.glu ? g.nr / 2 : g.nr; }

KETCH_INLINE float Silu(float x) { return x / (1.0f + std::exp(-x)); }

// A packed weight element as float: a float as it is, bfloat16 bits as the float's top half, an
// int8 as its integer value (the column's scale comes in the epilogue).
KETCH_INLINE float Widen(float v) { return v; }
KETCH_INLINE float Widen(uint16_t v) { return Bf16ToFloat(v); }
KETCH_INLINE float Widen(int8_t v) { return static_cast<float>(v); }

// int8 panels: the dequantization scales of `panel`'s nr columns in panel order (its gate
// columns, then the same outputs' up columns, with glu), 0 past the `cols` stored. Each
// kernel multiplies its finished sums by them, once per tile: x . (q * s) = (x . q) * s.
KETCH_INLINE void PanelScales(const Gemm& g, int64_t panel, int cols, float* out) {
  const int64_t width = PanelOutputs(g);
  std::fill(out, out + g.nr, 0.0f);
  for (int j = 0; j < cols; ++j) {
    out[j] = g.scale[panel * width + j];
    if (g.glu) out[width + j] = g.scale[g.n + panel * width + j];
  }
}

// One (rows x nr) tile: rows <= MR of x against one packed panel of W (float, bfloat16 bits or
// int8); `cols` of the nr are stored.
template <typename W, int MR>
KETCH_INLINE void TileGeneric(const Gemm& g, int64_t row, int64_t panel, int rows, int cols) {
  constexpr int NR = 8;
  float acc[MR][NR] = {};
  const W* b = static_cast<const W*>(g.packed) + panel * g.k * NR;
  const float* x = g.x + row * g.k;
  for (int64_t kk = 0; kk < g.k; ++kk) {
    float bk[NR];
    for (int j = 0; j < NR; ++j) bk[j] = Widen(b[kk * NR + j]);
    for (int r = 0; r < MR; ++r) {
      if (r >= rows) break;
      const float a = x[r * g.k + kk];
      for (int j = 0; j < NR; ++j) acc[r][j] += a * bk[j];
    }
  }
  if constexpr (std::is_same_v<W, int8_t>) {
    float scale[NR];
    PanelScales(g, panel, cols, scale);
    for (int r = 0; r < rows; ++r)
      for (int j = 0; j < NR; ++j) acc[r][j] *= scale[j];
  }
  for (int r = 0; r < rows; ++r) {
    if (g.glu) {
      float* out = g.y + (row + r) * g.n + panel * (NR / 2);
      for (int j = 0; j < cols; ++j) out[j] = Silu(acc[r][j]) * acc[r][NR / 2 + j];
      continue;
    }
    float* out = g.y + (row + r) * g.n + panel * NR;
    for (int j = 0; j < cols; ++j) out[j] = acc[r][j] + (g.bias ? g.bias[panel * NR + j] : 0.0f);
  }
}

#pragma GCC push_options
#pragma GCC target("avx2,fma")
KETCH_INLINE __m256 SiluAvx2(__m256 x) {
  const __m256 e = VecAvx2::exp(_mm256_sub_ps(_mm256_setzero_ps(), x));
  return _mm256_div_ps(x, _mm256_add_ps(_mm256_set1_ps(1.0f), e));
}

// 8 packed weights at p as floats: bfloat16 bits zero-extended to 32 and shifted into the top;
// int8 sign-extended to 32-bit integers and converted (exactly: |q| <= 127).
KETCH_INLINE __m256 LoadAvx2(const float* p) { return _mm256_loadu_ps(p); }
KETCH_INLINE __m256 LoadAvx2(const uint16_t* p) { return VecAvx2::load(p); }
KETCH_INLINE __m256 LoadAvx2(const int8_t* p) {
  const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes));
}

// The same prefetch distance in bytes whatever the element: a bfloat16 panel row is half as long
// as a float one, an int8 one a quarter.
template <typename W>
constexpr int64_t kAhead = kPrefetchRows * sizeof(float) / sizeof(W);

// A finished AVX2 tile's epilogue: acc0/acc1 [MR] are one panel's sums for rows row..row+MR-1;
// int8 scales, then the bias or SwiGLU, then the `cols` stored outputs.
template <typename W, int MR>
KETCH_INLINE void FinishAvx2(const Gemm& g, int64_t row, int64_t panel, int cols, __m256* acc0,
                             __m256* acc1) {
  constexpr int NR = 16;
  alignas(32) float tmp[NR];
  if constexpr (std::is_same_v<W, int8_t>) {
    PanelScales(g, panel, cols, tmp);
    const __m256 s0 = _mm256_load_ps(tmp), s1 = _mm256_load_ps(tmp + 8);
#pragma GCC unroll 16
    for (int r = 0; r < MR; ++r) {
      acc0[r] = _mm256_mul_ps(acc0[r], s0);
      acc1[r] = _mm256_mul_ps(acc1[r], s1);
    }
  }
  if (g.glu) {  // acc0: 8 gate columns, acc1: the same 8 outputs' up columns
#pragma GCC unroll 16
    for (int r = 0; r < MR; ++r) {
      float* out = g.y + (row + r) * g.n + panel * (NR / 2);
      const __m256 v = _mm256_mul_ps(SiluAvx2(acc0[r]), acc1[r]);
      if (cols == NR / 2) {
        _mm256_storeu_ps(out, v);
      } else {
        _mm256_store_ps(tmp, v);
        for (int j = 0; j < cols; ++j) out[j] = tmp[j];
      }
    }
    return;
  }
#pragma GCC unroll 16
  for (int r = 0; r < MR; ++r) {
    float* out = g.y + (row + r) * g.n + panel * NR;
    if (g.bias) {
      const float* bias = g.bias + panel * NR;
      if (cols == NR) {
        acc0[r] = _mm256_add_ps(acc0[r], _mm256_loadu_ps(bias));
        acc1[r] = _mm256_add_ps(acc1[r], _mm256_loadu_ps(bias + 8));
      }
    }
    if (cols == NR) {
      _mm256_storeu_ps(out, acc0[r]);
      _mm256_storeu_ps(out + 8, acc1[r]);
    } else {
      _mm256_store_ps(tmp, acc0[r]);
      _mm256_store_ps(tmp + 8, acc1[r]);
      for (int j = 0; j < cols; ++j) out[j] = tmp[j] + (g.bias ? g.bias[panel * NR + j] : 0.0f);
    }
  }
}

template <typename W, int MR>
__attribute__((target("avx2,fma"))) void TileAvx2(const Gemm& g, int64_t row, int64_t panel,
                                                  int cols) {
  constexpr int NR = 16;
  __m256 acc0[MR], acc1[MR];
#pragma GCC unroll 16
  for (int r = 0; r < MR; ++r) acc0[r] = acc1[r] = _mm256_setzero_ps();
  const W* b = static_cast<const W*>(g.packed) + panel * g.k * NR;
  const float* x = g.x + row * g.k;
  for (int64_t kk = 0; kk < g.k; ++kk) {
    _mm_prefetch(reinterpret_cast<const char*>(b + (kk + kAhead<W>) * NR), _MM_HINT_T0);
    const __m256 b0 = LoadAvx2(b + kk * NR), b1 = LoadAvx2(b + kk * NR + 8);
#pragma GCC unroll 16
    for (int r = 0; r < MR; ++r) {
      const __m256 a = _mm256_broadcast_ss(x + r * g.k + kk);
      acc0[r] = _mm256_fmadd_ps(a, b0, acc0[r]);
      acc1[r] = _mm256_fmadd_ps(a, b1, acc1[r]);
    }
  }
  FinishAvx2<W, MR>(g, row, panel, cols, acc0, acc1);
}

// One row against two neighbouring panels at once (a GEMM of one row: decode). One panel gives a
// row only two chains of dependent FMAs, which their latency, not the weight stream, then bounds
// (int8 panels stream fast enough for that to show); two panels give four. Each output's sum is
// still over k in order, as in TileAvx2<W, 1>: the same result, bit for bit.
template <typename W>
__attribute__((target("avx2,fma"))) void TilePairAvx2(const Gemm& g, int64_t row, int64_t panel,
                                                      int cols, int cols_next) {
  constexpr int NR = 16;
  __m256 acc0[1] = {_mm256_setzero_ps()}, acc1[1] = {_mm256_setzero_ps()};
  __m256 acc2[1] = {_mm256_setzero_ps()}, acc3[1] = {_mm256_setzero_ps()};
  const W* b = static_cast<const W*>(g.packed) + panel * g.k * NR;
  const W* c = b + g.k * NR;  // the next panel
  const float* x = g.x + row * g.k;
  for (int64_t kk = 0; kk < g.k; ++kk) {
    _mm_prefetch(reinterpret_cast<const char*>(b + (kk + kAhead<W>) * NR), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(c + (kk + kAhead<W>) * NR), _MM_HINT_T0);
    const __m256 a = _mm256_broadcast_ss(x + kk);
    acc0[0] = _mm256_fmadd_ps(a, LoadAvx2(b + kk * NR), acc0[0]);
    acc1[0] = _mm256_fmadd_ps(a, LoadAvx2(b + kk * NR + 8), acc1[0]);
    acc2[0] = _mm256_fmadd_ps(a, LoadAvx2(c + kk * NR), acc2[0]);
    acc3[0] = _mm256_fmadd_ps(a, LoadAvx2(c + kk * NR + 8), acc3[0]);
  }
  FinishAvx2<W, 1>(g, row, panel, cols, acc0, acc1);
  FinishAvx2<W, 1>(g, row, panel + 1, cols_next, acc2, acc3);
}
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx512f,avx2,fma")
KETCH_INLINE __m512 SiluAvx512(__m512 x) {
  const __m512 e = VecAvx512::exp(_mm512_sub_ps(_mm512_setzero_ps(), x));
  return _mm512_div_ps(x, _mm512_add_ps(_mm512_set1_ps(1.0f), e));
}

// 16 packed weights at p as floats (bfloat16 bits and int8 widened as in LoadAvx2).
KETCH_INLINE __m512 LoadAvx512(const float* p) { return _mm512_loadu_ps(p); }
KETCH_INLINE __m512 LoadAvx512(const uint16_t* p) { return VecAvx512::load(p); }
KETCH_INLINE __m512 LoadAvx512(const int8_t* p) {
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(bytes));
}

template <typename W, int MR>
__attribute__((target("avx512f,avx2,fma"))) void TileAvx512(const Gemm& g, int64_t row,
                                                            int64_t panel, int cols) {
  constexpr int NR = 32;
  __m512 acc0[MR], acc1[MR];
#pragma GCC unroll 16
  for (int r = 0; r < MR; ++r) acc0[r] = acc1[r] = _mm512_setzero_ps();
  const W* b = static_cast<const W*>(g.packed) + panel * g.k * NR;
  const float* x = g.x + row * g.k;
  for (int64_t kk = 0; kk < g.k; ++kk) {
    const __m512 b0 = LoadAvx512(b + kk * NR), b1 = LoadAvx512(b + kk * NR + 16);
#pragma GCC unroll 16
    for (int r = 0; r < MR; ++r) {
      const __m512 a = _mm512_set1_ps(x[r * g.k + kk]);
      acc0[r] = _mm512_fmadd_ps(a, b0, acc0[r]);
      acc1[r] = _mm512_fmadd_ps(a, b1, acc1[r]);
    }
  }
  if constexpr (std::is_same_v<W, int8_t>) {
    alignas(64) float scale[NR];
    PanelScales(g, panel, cols, scale);
    const __m512 s0 = _mm512_load_ps(scale), s1 = _mm512_load_ps(scale + 16);
#pragma GCC unroll 16
    for (int r = 0; r < MR; ++r) {
      acc0[r] = _mm512_mul_ps(acc0[r], s0);
      acc1[r] = _mm512_mul_ps(acc1[r], s1);
    }
  }
  if (g.glu) {  // acc0: 16 gate columns, acc1: the same 16 outputs' up columns
    const __mmask16 mask = cols >= 16 ? 0xffff : static_cast<__mmask16>((1u << cols) - 1);
#pragma GCC unroll 16
    for (int r = 0; r < MR; ++r) {
      float* out = g.y + (row + r) * g.n + panel * (NR / 2);
      _mm512_mask_storeu_ps(out, mask, _mm512_mul_ps(SiluAvx512(acc0[r]), acc1[r]));
    }
    return;
  }
  const __mmask16 m0 = cols >= 16 ? 0xffff : static_cast<__mmask16>((1u << cols) - 1);
  const __mmask16 m1 = cols <= 16 ? 0 : static_cast<__mmask16>((1u << (cols - 16)) - 1);
  __m512 bias0 = _mm512_setzero_ps(), bias1 = _mm512_setzero_ps();
  if (g.bias) {
    bias0 = _mm512_maskz_loadu_ps(m0, g.bias + panel * NR);
    bias1 = _mm512_maskz_loadu_ps(m1, g.bias + panel * NR + 16);
  }
#pragma GCC unroll 16
  for (int r = 0; r < MR; ++r) {
    float* out = g.y + (row + r) * g.n + panel * NR;
    _mm512_mask_storeu_ps(out, m0, _mm512_add_ps(acc0[r], bias0));
    _mm512_mask_storeu_ps(out + 16, m1, _mm512_add_ps(acc1[r], bias1));
  }
}
#pragma GCC pop_options

// Dispatches a tile of `rows` (1..MR) rows to the kernel compiled for exactly that many.
#define KETCH_TILE_SWITCH(FN, MR_MAX)                                              \
  template <typename W, int R = MR_MAX>                                            \
  KETCH_INLINE void FN##Rows(const Gemm& g, int64_t row, int64_t panel, int rows,  \
                             int cols) {                                           \
    if constexpr (R > 1) {                                                         \
      if (rows < R) return FN##Rows<W, R - 1>(g, row, panel, rows, cols);          \
    }                                                                              \
    FN<W, R>(g, row, panel, cols);                                                 \
  }

KETCH_TILE_SWITCH(TileAvx512, 12)
KETCH_TILE_SWITCH(TileAvx2, 6)

int TileHeight(Isa isa) { return isa == Isa::kAvx512 ? 12 : isa == Isa::kAvx2 ? 6 : 4; }

template <typename W>
void RunTile(const Gemm& g, Isa isa, int64_t row, int64_t panel, int rows, int cols) {
  if (isa == Isa::kAvx512) {
    TileAvx512Rows<W>(g, row, panel, rows, cols);
  } else if (isa == Isa::kAvx2) {
    TileAvx2Rows<W>(g, row, panel, rows, cols);
  } else {
    TileGeneric<W, 4>(g, row, panel, rows, cols);
  }
}

// Stored outputs of `panel`.
KETCH_INLINE int PanelCols(const Gemm& g, int64_t panel) {
  const int64_t per_panel = PanelOutputs(g);
  return static_cast<int>(std::min<int64_t>(per_panel, g.n - panel * per_panel));
}

// Rows [row, row + rows) against panels [first, last).
template <typename W>
void RunTiles(const Gemm& g, Isa isa, int64_t row, int rows, int64_t first, int64_t last) {
  if (isa == Isa::kAvx2 && rows == 1 && last - first == 2) {
    TilePairAvx2<W>(g, row, first, PanelCols(g, first), PanelCols(g, first + 1));
    return;
  }
  for (int64_t panel = first; panel < last; ++panel)
    RunTile<W>(g, isa, row, panel, rows, PanelCols(g, panel));
}

}  // namespace

Isa ParseIsa(const std::string& isa) {
  if (isa == "avx512") return Isa::kAvx512;
  if (isa == "avx2") return Isa::kAvx2;
  PD_CHECK(isa == "generic", "unknown isa ", isa, " (expected avx512, avx2 or generic)");
  return Isa::kGeneric;
}

int PanelWidth(Isa isa) { return isa == Isa::kAvx512 ? 32 : isa == Isa::kAvx2 ? 16 : 8; }

GemmPlan PlanGemm(const Gemm& g, Isa isa) {
  const int64_t mr = TileHeight(isa);
  const int64_t per_panel = PanelOutputs(g), panels = (g.n + per_panel - 1) / per_panel;
  // Row blocks of at most ~256 KiB of x (a multiple of MR rows), reused across all panels.
  const int64_t fit = std::max<int64_t>(mr, (256 * 1024 / 4 / std::max<int64_t>(g.k, 1)) / mr * mr);
  const int64_t block = std::max<int64_t>(1, std::min<int64_t>(g.m, fit));
  // One row on AVX2: items of two panels (TilePairAvx2).
  const int64_t span = isa == Isa::kAvx2 && g.m == 1 ? 2 : 1;
  return {block, panels, (g.m + block - 1) / block * ((panels + span - 1) / span), span};
}

void RunGemmItem(const Gemm& g, Isa isa, const GemmPlan& plan, int64_t item) {
  const int64_t mr = TileHeight(isa), per_block = (plan.panels + plan.span - 1) / plan.span;
  const int64_t b = item / per_block, first = item % per_block * plan.span;
  const int64_t last = std::min(plan.panels, first + plan.span);
  const int64_t end = std::min(g.m, (b + 1) * plan.block);
  // Tiles of balanced height (8 rows on AVX2 are 4 + 4, not 6 + 2: each tile streams the panel).
  for (int64_t row = b * plan.block; row < end;) {
    const int64_t left = end - row, tiles = (left + mr - 1) / mr;
    const int rows = static_cast<int>((left + tiles - 1) / tiles);
    switch (g.panel) {
      case Panel::kBfloat16:
        RunTiles<uint16_t>(g, isa, row, rows, first, last);
        break;
      case Panel::kInt8:
        RunTiles<int8_t>(g, isa, row, rows, first, last);
        break;
      default:
        RunTiles<float>(g, isa, row, rows, first, last);
    }
    row += rows;
  }
}

int GemmThreads(int64_t flops, int num_threads) {
  // A thread start costs microseconds: only threads that each get ~2^18 multiply-adds.
  return static_cast<int>(
      std::min<int64_t>(std::max(1, num_threads), std::max<int64_t>(1, flops >> 18)));
}

void RunGemm(const Gemm& g, Isa isa, int num_threads) {
  const GemmPlan plan = PlanGemm(g, isa);
  const int threads = GemmThreads(g.m * g.n * g.k, num_threads);
  if (threads > 1) {
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t item = 0; item < plan.items; ++item) RunGemmItem(g, isa, plan, item);
  } else {
    for (int64_t item = 0; item < plan.items; ++item) RunGemmItem(g, isa, plan, item);
  }
}

namespace {

void CheckFloatCpu(const paddle::Tensor& t, const char* name) {
  PD_CHECK(t.place() == paddle::CPUPlace() && t.dtype() == paddle::DataType::FLOAT32, name,
           " must be a float32 CPU tensor");
}

}  // namespace

namespace {

// A weight of S as a panel element of D: float as it is, float rounded to bfloat16, bfloat16 (a
// checkpoint's) as it is, or int8 (quantized by QuantizeInt8) as it is.
template <typename D, typename S>
KETCH_INLINE D ToPanel(S v) {
  if constexpr (std::is_same_v<D, uint16_t> && std::is_same_v<S, float>) {
    return RoundToBf16(v);
  } else {
    static_assert(std::is_same_v<D, S>, "panels are packed from their own type (or bf16 from f32)");
    return v;
  }
}

// w [k, n] of S into panels of D (see the file comment for the layout); zero past the columns.
template <typename S, typename D>
void PackPanels(const S* src, D* dst, int64_t k, int64_t n, int64_t nr, bool glu) {
  // Each panel: `groups` runs of `width` columns; glu: gate outputs, then the same outputs' up.
  const int64_t width = glu ? nr / 2 : nr, outputs = glu ? n / 2 : n;
  const int64_t panels = (outputs + width - 1) / width;
  for (int64_t p = 0; p < panels; ++p) {
    const int64_t cols = std::min(width, outputs - p * width);
    for (int64_t kk = 0; kk < k; ++kk) {
      D* out = dst + (p * k + kk) * nr;
      const S* in = src + kk * n + p * width;
      std::fill(out, out + nr, D{});
      for (int64_t j = 0; j < cols; ++j) out[j] = ToPanel<D>(in[j]);
      if (!glu) continue;
      for (int64_t j = 0; j < cols; ++j) out[width + j] = ToPanel<D>(in[outputs + j]);
    }
  }
}

// The checked, dense [K, N] weight to pack and its panel count.
paddle::Tensor WeightToPack(const paddle::Tensor& w_in, int64_t nr, bool glu, int64_t* panels) {
  PD_CHECK(w_in.shape().size() == 2, "ketch_pack_weight: w must be [K, N]");
  const int64_t n = w_in.shape()[1], width = glu ? nr / 2 : nr, outputs = glu ? n / 2 : n;
  PD_CHECK(!glu || n % 2 == 0, "ketch_pack_weight: a glu weight [K, 2I] needs an even N, got ", n);
  *panels = (outputs + width - 1) / width;
  return w_in.is_contiguous() ? w_in : w_in.contiguous();
}

}  // namespace

std::vector<paddle::Tensor> PackWeight(const paddle::Tensor& w_in, const std::string& isa,
                                       bool glu) {
  CheckFloatCpu(w_in, "w");
  const int64_t nr = PanelWidth(ParseIsa(isa));
  int64_t panels = 0;
  const paddle::Tensor w = WeightToPack(w_in, nr, glu, &panels);
  const int64_t k = w.shape()[0], n = w.shape()[1];
  auto packed = paddle::empty({panels, k, nr}, paddle::DataType::FLOAT32, paddle::CPUPlace());
  PackPanels(w.data<float>(), packed.data<float>(), k, n, nr, glu);
  return {packed};
}

// The same panels of bfloat16: half the bytes for the kernels to stream. A float32 w is rounded
// to nearest even; a bfloat16 one (a checkpoint's own) is laid out as it is.
std::vector<paddle::Tensor> PackWeightBf16(const paddle::Tensor& w_in, const std::string& isa,
                                           bool glu) {
  const bool from_bf16 = w_in.dtype() == paddle::DataType::BFLOAT16;
  PD_CHECK(w_in.place() == paddle::CPUPlace() &&
               (from_bf16 || w_in.dtype() == paddle::DataType::FLOAT32),
           "w must be a float32 or bfloat16 CPU tensor");
  const int64_t nr = PanelWidth(ParseIsa(isa));
  int64_t panels = 0;
  const paddle::Tensor w = WeightToPack(w_in, nr, glu, &panels);
  const int64_t k = w.shape()[0], n = w.shape()[1];
  auto packed = paddle::empty({panels, k, nr}, paddle::DataType::BFLOAT16, paddle::CPUPlace());
  auto* dst = reinterpret_cast<uint16_t*>(packed.data<paddle::bfloat16>());
  if (from_bf16) {
    PackPanels(reinterpret_cast<const uint16_t*>(w.data<paddle::bfloat16>()), dst, k, n, nr, glu);
  } else {
    PackPanels(w.data<float>(), dst, k, n, nr, glu);
  }
  return {packed};
}

namespace {

// Symmetric per-column int8 quantization of w [k, n] (S: float or bfloat16 bits); see
// QuantizeInt8. A column holding a NaN gets a NaN scale, one holding an infinity (and no NaN) an
// infinite one, and zeros for q.
template <typename S>
void QuantizeColumns(const S* w, int8_t* q, float* scale, int64_t k, int64_t n) {
  std::vector<float> top(n, 0.0f);
  for (int64_t kk = 0; kk < k; ++kk) {
    const S* row = w + kk * n;
    for (int64_t j = 0; j < n; ++j) {
      const float a = std::fabs(Widen(row[j]));
      // NaN sticks (a comparison with it is false); otherwise the largest, inf included.
      top[j] = (a > top[j] || a != a) ? a : top[j];
    }
  }
  constexpr float kTiny = std::numeric_limits<float>::denorm_min();
  std::vector<float> inverse_ok(n);
  for (int64_t j = 0; j < n; ++j) {
    const float t = top[j];
    // A zero column: scale 1 (its q are 0). A column so small that t / 127 underflows to 0: the
    // smallest subnormal, whose multiples are exactly the column's values (|w| < 127 of them).
    // A column near the largest float whose t / 127 rounded up: one step down, so that q * scale
    // (q = +-127) stays finite.
    float s = t == 0.0f ? 1.0f : t / 127.0f;
    if (s == 0.0f) s = kTiny;
    if (std::isinf(s * 127.0f) && std::isfinite(s)) s = std::nextafter(s, 0.0f);
    scale[j] = s;
  }
  // Rounding to nearest, ties to even, by adding and subtracting 1.5 * 2^23 (exact for |v| <=
  // 2^22 in the default rounding mode, and vectorises for the x86-64 baseline, unlike rint);
  // the clamp comes first, to +-127, an integer, so the order does not change the result.
  constexpr float kMagic = 12582912.0f;
  for (int64_t kk = 0; kk < k; ++kk) {
    const S* row = w + kk * n;
    int8_t* out = q + kk * n;
    for (int64_t j = 0; j < n; ++j) {
      const float s = scale[j];
      float v = Widen(row[j]) / s;
      v = std::isfinite(s) ? std::min(127.0f, std::max(-127.0f, v)) : 0.0f;
      out[j] = static_cast<int8_t>(static_cast<int>((v + kMagic) - kMagic));
    }
  }
}

}  // namespace

// w [K, N] (float32 or bfloat16) -> q [K, N] int8, scale [N] float32: per output column,
// scale = max_k |w[k, n]| / 127 (1 for a zero column, the smallest subnormal where that underflows
// to 0, one float lower where 127 * scale would overflow) and q = w / scale rounded to nearest even,
// clamped to [-127, 127], so that q * scale is the weight the int8 GEMM multiplies by. A column
// with a NaN or an infinity gets a non-finite scale (the caller refuses the weight).
std::vector<paddle::Tensor> QuantizeInt8(const paddle::Tensor& w_in) {
  const bool from_bf16 = w_in.dtype() == paddle::DataType::BFLOAT16;
  PD_CHECK(w_in.place() == paddle::CPUPlace() &&
               (from_bf16 || w_in.dtype() == paddle::DataType::FLOAT32),
           "w must be a float32 or bfloat16 CPU tensor");
  PD_CHECK(w_in.shape().size() == 2, "ketch_quantize_int8: w must be [K, N]");
  const paddle::Tensor w = w_in.is_contiguous() ? w_in : w_in.contiguous();
  const int64_t k = w.shape()[0], n = w.shape()[1];
  auto q = paddle::empty({k, n}, paddle::DataType::INT8, paddle::CPUPlace());
  auto scale = paddle::empty({n}, paddle::DataType::FLOAT32, paddle::CPUPlace());
  if (from_bf16) {
    QuantizeColumns(reinterpret_cast<const uint16_t*>(w.data<paddle::bfloat16>()),
                    q.data<int8_t>(), scale.data<float>(), k, n);
  } else {
    QuantizeColumns(w.data<float>(), q.data<int8_t>(), scale.data<float>(), k, n);
  }
  return {q, scale};
}

// int8 panels (from QuantizeInt8's q): a quarter of the float32 bytes; the scales stay apart.
std::vector<paddle::Tensor> PackWeightInt8(const paddle::Tensor& q_in, const std::string& isa,
                                           bool glu) {
  PD_CHECK(q_in.place() == paddle::CPUPlace() && q_in.dtype() == paddle::DataType::INT8,
           "q must be an int8 CPU tensor");
  const int64_t nr = PanelWidth(ParseIsa(isa));
  int64_t panels = 0;
  const paddle::Tensor q = WeightToPack(q_in, nr, glu, &panels);
  const int64_t k = q.shape()[0], n = q.shape()[1];
  auto packed = paddle::empty({panels, k, nr}, paddle::DataType::INT8, paddle::CPUPlace());
  PackPanels(q.data<int8_t>(), packed.data<int8_t>(), k, n, nr, glu);
  return {packed};
}

namespace {

// ketch_packed_linear and ketch_packed_linear_i8; `scale` with int8 panels only.
std::vector<paddle::Tensor> RunPackedLinear(const paddle::Tensor& x_in,
                                            const paddle::Tensor& packed,
                                            const paddle::optional<paddle::Tensor>& bias,
                                            const paddle::Tensor* scale, int n,
                                            const std::string& isa, int num_threads, bool glu) {
  CheckFloatCpu(x_in, "x");
  const bool bf16 = packed.dtype() == paddle::DataType::BFLOAT16;
  Panel kind_of_panel = bf16 ? Panel::kBfloat16 : Panel::kFloat32;
  paddle::Tensor scale_dense;
  if (scale) {
    PD_CHECK(packed.place() == paddle::CPUPlace() && packed.dtype() == paddle::DataType::INT8,
             "ketch_packed_linear_i8: packed must be an int8 CPU tensor (ketch_pack_weight_i8)");
    CheckFloatCpu(*scale, "scale");
    const int64_t columns = glu ? 2 * static_cast<int64_t>(n) : n;
    PD_CHECK(scale->shape().size() == 1 && scale->shape()[0] == columns,
             "ketch_packed_linear_i8: scale must be [", columns, "], one per weight column");
    scale_dense = scale->is_contiguous() ? *scale : scale->contiguous();
    kind_of_panel = Panel::kInt8;
  } else if (!bf16) {
    CheckFloatCpu(packed, "packed");
  }
  PD_CHECK(packed.place() == paddle::CPUPlace(), "packed must be a CPU tensor");
  const Isa kind = ParseIsa(isa);
  const int64_t nr = PanelWidth(kind), width = glu ? nr / 2 : nr;
  const auto ps = packed.shape();
  PD_CHECK(ps.size() == 3 && ps[2] == nr && packed.is_contiguous(),
           "ketch_packed_linear: packed must be [P, K, ", nr, "] as ketch_pack_weight makes it for ",
           isa);
  PD_CHECK(n >= 0 && (static_cast<int64_t>(n) + width - 1) / width == ps[0],
           "ketch_packed_linear: n = ", n, " does not match ", ps[0], " panels of ", width,
           " outputs");
  PD_CHECK(!x_in.shape().empty() && x_in.shape().back() == ps[1],
           "ketch_packed_linear: x's last dimension must be K = ", ps[1]);
  PD_CHECK(!(glu && bias), "ketch_packed_linear: no bias with glu");
  const paddle::Tensor x = x_in.is_contiguous() ? x_in : x_in.contiguous();
  const float* bias_data = nullptr;
  paddle::Tensor bias_dense;
  if (bias) {
    CheckFloatCpu(*bias, "bias");
    PD_CHECK(bias->shape().size() == 1 && bias->shape()[0] == n, "bias must be [n]");
    bias_dense = bias->is_contiguous() ? *bias : bias->contiguous();
    bias_data = bias_dense.data<float>();
  }
  std::vector<int64_t> out_shape = x.shape();
  out_shape.back() = n;
  auto y = paddle::empty(out_shape, paddle::DataType::FLOAT32, paddle::CPUPlace());
  int64_t m = 1;
  for (size_t i = 0; i + 1 < out_shape.size(); ++i) m *= out_shape[i];
  if (m == 0 || n == 0) return {y};
  const void* weights = kind_of_panel == Panel::kInt8
                            ? static_cast<const void*>(packed.data<int8_t>())
                        : bf16 ? static_cast<const void*>(packed.data<paddle::bfloat16>())
                               : static_cast<const void*>(packed.data<float>());
  const float* scale_data = scale ? scale_dense.data<float>() : nullptr;
  const Gemm g{x.data<float>(), weights,   bias_data,     y.data<float>(), m, ps[1], n, nr,
               glu,             kind_of_panel, scale_data};
  if (g.k == 0) {  // x . w = 0: the bias, or silu(0) * 0
    for (int64_t r = 0; r < m; ++r)
      for (int64_t j = 0; j < n; ++j) g.y[r * n + j] = bias_data ? bias_data[j] : 0.0f;
    return {y};
  }
  RunGemm(g, kind, num_threads);
  return {y};
}

}  // namespace

std::vector<paddle::Tensor> PackedLinear(const paddle::Tensor& x, const paddle::Tensor& packed,
                                         const paddle::optional<paddle::Tensor>& bias, int n,
                                         const std::string& isa, int num_threads, bool glu) {
  return RunPackedLinear(x, packed, bias, nullptr, n, isa, num_threads, glu);
}

// y = (x . q) * scale per column (+ bias, or SwiGLU of the scaled gate and up sums).
std::vector<paddle::Tensor> PackedLinearInt8(const paddle::Tensor& x, const paddle::Tensor& packed,
                                             const paddle::Tensor& scale,
                                             const paddle::optional<paddle::Tensor>& bias, int n,
                                             const std::string& isa, int num_threads, bool glu) {
  return RunPackedLinear(x, packed, bias, &scale, n, isa, num_threads, glu);
}

std::vector<std::vector<int64_t>> PackWeightShape(const std::vector<int64_t>& w,
                                                  const std::string& isa, bool glu) {
  const int64_t nr = PanelWidth(ParseIsa(isa)), width = glu ? nr / 2 : nr;
  if (w.size() != 2) return {{-1, -1, nr}};
  const int64_t outputs = glu ? w[1] / 2 : w[1];
  return {{(outputs + width - 1) / width, w[0], nr}};
}

std::vector<std::vector<int64_t>> PackedLinearShape(const std::vector<int64_t>& x,
                                                    const std::vector<int64_t>&,
                                                    const paddle::optional<std::vector<int64_t>>&,
                                                    int n, const std::string&, int, bool) {
  std::vector<int64_t> out = x;
  if (!out.empty()) out.back() = n;
  return {out};
}

std::vector<paddle::DataType> SameDtype(const paddle::DataType& x) { return {x}; }
std::vector<paddle::DataType> Bf16Dtype(const paddle::DataType&) {
  return {paddle::DataType::BFLOAT16};
}

std::vector<paddle::DataType> PackedLinearDtype(const paddle::DataType& x, const paddle::DataType&,
                                                const paddle::optional<paddle::DataType>&) {
  return {x};
}

std::vector<std::vector<int64_t>> PackedLinearInt8Shape(
    const std::vector<int64_t>& x, const std::vector<int64_t>& packed, const std::vector<int64_t>&,
    const paddle::optional<std::vector<int64_t>>& bias, int n, const std::string& isa,
    int num_threads, bool glu) {
  return PackedLinearShape(x, packed, bias, n, isa, num_threads, glu);
}

std::vector<paddle::DataType> PackedLinearInt8Dtype(const paddle::DataType& x,
                                                    const paddle::DataType&,
                                                    const paddle::DataType&,
                                                    const paddle::optional<paddle::DataType>&) {
  return {x};
}

std::vector<std::vector<int64_t>> QuantizeInt8Shape(const std::vector<int64_t>& w) {
  if (w.size() != 2) return {{-1, -1}, {-1}};
  return {w, {w[1]}};
}

std::vector<paddle::DataType> QuantizeInt8Dtype(const paddle::DataType&) {
  return {paddle::DataType::INT8, paddle::DataType::FLOAT32};
}

}  // namespace ketch

PD_BUILD_OP(ketch_pack_weight)
    .Inputs({"w"})
    .Outputs({"packed"})
    .Attrs({"isa: std::string", "glu: bool"})
    .SetKernelFn(PD_KERNEL(ketch::PackWeight))
    .SetInferShapeFn(PD_INFER_SHAPE(ketch::PackWeightShape))
    .SetInferDtypeFn(PD_INFER_DTYPE(ketch::SameDtype));

PD_BUILD_OP(ketch_pack_weight_bf16)
    .Inputs({"w"})
    .Outputs({"packed"})
    .Attrs({"isa: std::string", "glu: bool"})
    .SetKernelFn(PD_KERNEL(ketch::PackWeightBf16))
    .SetInferShapeFn(PD_INFER_SHAPE(ketch::PackWeightShape))
    .SetInferDtypeFn(PD_INFER_DTYPE(ketch::Bf16Dtype));

PD_BUILD_OP(ketch_quantize_int8)
    .Inputs({"w"})
    .Outputs({"q", "scale"})
    .SetKernelFn(PD_KERNEL(ketch::QuantizeInt8))
    .SetInferShapeFn(PD_INFER_SHAPE(ketch::QuantizeInt8Shape))
    .SetInferDtypeFn(PD_INFER_DTYPE(ketch::QuantizeInt8Dtype));

PD_BUILD_OP(ketch_pack_weight_i8)
    .Inputs({"q"})
    .Outputs({"packed"})
    .Attrs({"isa: std::string", "glu: bool"})
    .SetKernelFn(PD_KERNEL(ketch::PackWeightInt8))
    .SetInferShapeFn(PD_INFER_SHAPE(ketch::PackWeightShape))
    .SetInferDtypeFn(PD_INFER_DTYPE(ketch::SameDtype));

PD_BUILD_OP(ketch_packed_linear_i8)
    .Inputs({"x", "packed", "scale", paddle::Optional("bias")})
    .Outputs({"y"})
    .Attrs({"n: int", "isa: std::string", "num_threads: int", "glu: bool"})
    .SetKernelFn(PD_KERNEL(ketch::PackedLinearInt8))
    .SetInferShapeFn(PD_INFER_SHAPE(ketch::PackedLinearInt8Shape))
    .SetInferDtypeFn(PD_INFER_DTYPE(ketch::PackedLinearInt8Dtype));

PD_BUILD_OP(ketch_packed_linear)
    .Inputs({"x", "packed", paddle::Optional("bias")})
    .Outputs({"y"})
    .Attrs({"n: int", "isa: std::string", "num_threads: int", "glu: bool"})
    .SetKernelFn(PD_KERNEL(ketch::PackedLinear))
    .SetInferShapeFn(PD_INFER_SHAPE(ketch::PackedLinearShape))
    .SetInferDtypeFn(PD_INFER_DTYPE(ketch::PackedLinearDtype));

// Paged attention and the KV write over Ketch's block tables, as paddle CPU custom ops.
//
// KV cache layout (per layer, for keys and for values): [kv_heads, num_blocks, block_size,
// head_dim], float32 or bfloat16, contiguous: the worker's shared-memory buffer viewed through
// from_dlpack. A bfloat16 cache is written rounded to nearest even (RoundToBf16, as the packed
// GEMM's bfloat16 weights) and widened back to float32 as the kernels load its rows; queries,
// scores, softmax and sums are float32 whatever the cache holds, and the output is float32.
// A step's tokens are flattened: q [T, heads, head_dim], sequence b owns rows
// [query_start[b], query_start[b + 1]) and has context_lens[b] tokens in all (cached prefix plus
// these), so its i-th new token sits at position context_lens[b] - n + i and sees keys 0..that;
// with a sliding window w > 0, only the keys j with position - j < w (transformers' mask).
//
// ketch_paged_attention's `isa` attribute picks the kernel: "avx512", "avx2" (AVX2 + FMA) or
// "generic". The library itself is built for the x86-64 baseline; the AVX2 and AVX-512 kernels
// are compiled in `#pragma GCC target` regions and run only when the caller, which read the
// CPU's features at start-up, asks for them. Nothing here probes the CPU.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "paddle/extension.h"
#include "simd.h"

namespace ketch {

struct AttentionArgs {
  const float* q;
  float* out;
  const void* k_cache;  // float, or bfloat16 bits (uint16_t) with bf16
  const void* v_cache;
  const int32_t* block_tables;  // [num_seqs, max_blocks]
  const int32_t* query_start;   // [num_seqs + 1]
  const int32_t* context_lens;  // [num_seqs]
  int64_t max_blocks, num_heads, kv_heads, head_dim, num_blocks, block_size;
  float scale;
  int num_threads;
  int64_t window;  // keys a query sees, its own included; 0: every earlier key
  bool bf16;       // the caches hold bfloat16
};

// A tile of one sequence's new tokens [first, first + tokens) for one KV head.
struct WorkItem {
  int32_t seq, kv_head, first, tokens;
};

struct TileShape {
  // Keys [key_begin, num_keys) are scored: the tile's last row sees up to num_keys, and with a
  // window its first row sees nothing before key_begin (rounded down to a block), so the blocks
  // before it are never read. Score column c is key key_begin + c.
  int64_t kv_head, group, first, rows, q_start, computed, key_begin, num_keys, stride;
  const int32_t* table;
  int64_t window;

  TileShape(const AttentionArgs& a, const WorkItem& w, int width)
      : kv_head(w.kv_head),
        group(a.num_heads / a.kv_heads),
        first(w.first),
        rows(static_cast<int64_t>(w.tokens) * group),
        q_start(a.query_start[w.seq]),
        table(a.block_tables + w.seq * a.max_blocks),
        window(a.window) {
    const int64_t n = a.query_start[w.seq + 1] - q_start;
    computed = a.context_lens[w.seq] - n;
    num_keys = computed + first + w.tokens;
    key_begin = first_visible(0) / a.block_size * a.block_size;
    stride = (num_keys - key_begin + width - 1) / width * width;
  }
  // Query row r of the tile is token first + r / group, head kv_head * group + r % group.
  int64_t visible_keys(int64_t r) const { return computed + first + r / group + 1; }
  int64_t first_visible(int64_t r) const {
    return window > 0 ? std::max<int64_t>(0, visible_keys(r) - window) : 0;
  }
  int64_t head_offset(const AttentionArgs& a, int64_t r) const {
    const int64_t token = q_start + first + r / group;
    return (token * a.num_heads + kv_head * group + r % group) * a.head_dim;
  }
};

// The first row of the block holding `key` in this tile's KV head, as the cache's element C.
template <typename C>
inline const C* key_block(const AttentionArgs& a, const TileShape& t, int64_t key) {
  const int64_t block = t.table[key / a.block_size];
  return static_cast<const C*>(a.k_cache) +
         (t.kv_head * a.num_blocks + block) * a.block_size * a.head_dim;
}
template <typename C>
inline const C* value_block(const AttentionArgs& a, const TileShape& t, int64_t key) {
  const int64_t block = t.table[key / a.block_size];
  return static_cast<const C*>(a.v_cache) +
         (t.kv_head * a.num_blocks + block) * a.block_size * a.head_dim;
}

struct Scratch {
  std::vector<float> queries, scores, inv_sums, acc;
  std::vector<float*> out_rows;
};

#define KETCH_TARGET
namespace generic {
using V = VecScalar;
#include "attention_kernel.inc"
}  // namespace generic
#undef KETCH_TARGET

#pragma GCC push_options
#pragma GCC target("avx2,fma")
#define KETCH_TARGET __attribute__((target("avx2,fma")))
namespace avx2 {
using V = VecAvx2;
#include "attention_kernel.inc"
}  // namespace avx2
#undef KETCH_TARGET
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx512f,avx2,fma")
#define KETCH_TARGET __attribute__((target("avx512f,avx2,fma")))
namespace avx512 {
using V = VecAvx512;
#include "attention_kernel.inc"
}  // namespace avx512
#undef KETCH_TARGET
#pragma GCC pop_options

// Query tokens per tile: about 32 score rows, so a tile's queries and scores stay in cache.
constexpr int64_t kTileRows = 32;

std::vector<WorkItem> plan(const AttentionArgs& a, int64_t num_seqs) {
  const int64_t group = a.num_heads / a.kv_heads;
  const int64_t per_tile = std::max<int64_t>(1, kTileRows / group);
  std::vector<WorkItem> items;
  for (int64_t b = 0; b < num_seqs; ++b) {
    const int64_t n = a.query_start[b + 1] - a.query_start[b];
    for (int64_t first = 0; first < n; first += per_tile)
      for (int64_t h = 0; h < a.kv_heads; ++h)
        items.push_back({static_cast<int32_t>(b), static_cast<int32_t>(h),
                         static_cast<int32_t>(first),
                         static_cast<int32_t>(std::min(per_tile, n - first))});
  }
  return items;
}

void check_metadata(const AttentionArgs& a, int64_t num_seqs, int64_t num_tokens) {
  PD_CHECK(a.query_start[0] == 0 && a.query_start[num_seqs] == num_tokens,
           "query_start must run from 0 to the number of query tokens");
  for (int64_t b = 0; b < num_seqs; ++b) {
    const int64_t n = a.query_start[b + 1] - a.query_start[b];
    const int64_t ctx = a.context_lens[b];
    PD_CHECK(n >= 0 && ctx >= n, "sequence ", b, ": context_lens must cover its query tokens");
    PD_CHECK(ctx <= a.max_blocks * a.block_size, "sequence ", b, ": context beyond its blocks");
    const int32_t* table = a.block_tables + b * a.max_blocks;
    for (int64_t k = 0; k < (ctx + a.block_size - 1) / a.block_size; ++k)
      PD_CHECK(table[k] >= 0 && table[k] < a.num_blocks, "sequence ", b, ": block id ",
               table[k], " outside the cache");
  }
}

void check_float(const paddle::Tensor& t, const char* name, size_t rank) {
  PD_CHECK(t.is_cpu() && t.dtype() == paddle::DataType::FLOAT32, name, " must be float32 on CPU");
  PD_CHECK(t.shape().size() == rank && t.is_contiguous(), name, " must be contiguous, rank ",
           rank);
}

// A KV cache: float32 or bfloat16, contiguous, rank 4; true for bfloat16.
bool check_cache(const paddle::Tensor& t, const char* name) {
  const auto dtype = t.dtype();
  PD_CHECK(t.is_cpu() &&
               (dtype == paddle::DataType::FLOAT32 || dtype == paddle::DataType::BFLOAT16),
           name, " must be float32 or bfloat16 on CPU");
  PD_CHECK(t.shape().size() == 4 && t.is_contiguous(), name, " must be contiguous, rank 4");
  return dtype == paddle::DataType::BFLOAT16;
}

const void* cache_data(const paddle::Tensor& t, bool bf16) {
  return bf16 ? static_cast<const void*>(t.data<paddle::bfloat16>())
              : static_cast<const void*>(t.data<float>());
}

void check_int(const paddle::Tensor& t, const char* name, size_t rank) {
  PD_CHECK(t.is_cpu() && t.dtype() == paddle::DataType::INT32, name, " must be int32 on CPU");
  PD_CHECK(t.shape().size() == rank && t.is_contiguous(), name, " must be contiguous, rank ",
           rank);
}

std::vector<paddle::Tensor> PagedAttention(const paddle::Tensor& q, const paddle::Tensor& k_cache,
                                           const paddle::Tensor& v_cache,
                                           const paddle::Tensor& block_tables,
                                           const paddle::Tensor& query_start,
                                           const paddle::Tensor& context_lens, float scale,
                                           int num_threads, const std::string& isa, int window) {
  check_float(q, "q", 3);
  const bool bf16 = check_cache(k_cache, "k_cache");
  PD_CHECK(check_cache(v_cache, "v_cache") == bf16, "k_cache and v_cache differ in dtype");
  check_int(block_tables, "block_tables", 2);
  check_int(query_start, "query_start", 1);
  check_int(context_lens, "context_lens", 1);
  const auto qs = q.shape(), cs = k_cache.shape();
  PD_CHECK(v_cache.shape() == cs, "k_cache and v_cache differ in shape");
  PD_CHECK(qs[2] == cs[3] && qs[1] % cs[0] == 0, "q heads must be a multiple of KV heads, ",
           "with the cache's head_dim");
  const int64_t num_seqs = context_lens.shape()[0];
  PD_CHECK(query_start.shape()[0] == num_seqs + 1 && block_tables.shape()[0] == num_seqs,
           "query_start needs num_seqs + 1 entries, block_tables num_seqs rows");
  const int width = isa == "avx512" ? 16 : isa == "avx2" ? 8 : 1;
  PD_CHECK(isa == "avx512" || isa == "avx2" || isa == "generic", "unknown isa ", isa);
  PD_CHECK(qs[2] % width == 0, "head_dim ", qs[2], " is not a multiple of ", width);
  PD_CHECK(window >= 0, "window must be 0 (full attention) or positive, got ", window);
  auto out = paddle::empty(qs, paddle::DataType::FLOAT32, q.place());
  const AttentionArgs a{q.data<float>(), out.data<float>(), cache_data(k_cache, bf16),
                        cache_data(v_cache, bf16), block_tables.data<int32_t>(),
                        query_start.data<int32_t>(), context_lens.data<int32_t>(),
                        block_tables.shape()[1], qs[1], cs[0], cs[3], cs[1], cs[2], scale,
                        std::max(1, num_threads), window, bf16};
  check_metadata(a, num_seqs, qs[0]);
  const std::vector<WorkItem> items = plan(a, num_seqs);
  if (isa == "avx512") {
    avx512::attend(a, items);
  } else if (isa == "avx2") {
    avx2::attend(a, items);
  } else {
    generic::attend(a, items);
  }
  return {out};
}

std::vector<std::vector<int64_t>> PagedAttentionShape(
    const std::vector<int64_t>& q, const std::vector<int64_t>&, const std::vector<int64_t>&,
    const std::vector<int64_t>&, const std::vector<int64_t>&, const std::vector<int64_t>&) {
  return {q};
}

std::vector<paddle::DataType> PagedAttentionDtype(paddle::DataType q, paddle::DataType,
                                                  paddle::DataType, paddle::DataType,
                                                  paddle::DataType, paddle::DataType) {
  return {q};
}

// One token's rows of one head into a cache row: copied, or rounded to bfloat16.
inline void write_row(const float* src, float* dst, int64_t n) {
  std::memcpy(dst, src, n * sizeof(float));
}
inline void write_row(const float* src, uint16_t* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = RoundToBf16(src[i]);
}

template <typename C>
void write_slots(const float* ksrc, const float* vsrc, C* kdst, C* vdst, const int64_t* slot,
                 int64_t tokens, int64_t heads, int64_t dim, int64_t slots) {
  for (int64_t t = 0; t < tokens; ++t) {
    if (slot[t] < 0) continue;
    for (int64_t h = 0; h < heads; ++h) {
      const int64_t src = (t * heads + h) * dim, dst = (h * slots + slot[t]) * dim;
      write_row(ksrc + src, kdst + dst, dim);
      write_row(vsrc + src, vdst + dst, dim);
    }
  }
}

// k, v: [T, kv_heads, head_dim] float32; slot_mapping[t] = block * block_size + offset, or -1 to
// skip. A bfloat16 cache gets each value rounded to nearest even.
void ReshapeAndCache(const paddle::Tensor& k, const paddle::Tensor& v, paddle::Tensor& k_cache,
                     paddle::Tensor& v_cache, const paddle::Tensor& slot_mapping) {
  check_float(k, "key", 3);
  check_float(v, "value", 3);
  const bool bf16 = check_cache(k_cache, "k_cache");
  PD_CHECK(check_cache(v_cache, "v_cache") == bf16, "k_cache and v_cache differ in dtype");
  PD_CHECK(slot_mapping.is_cpu() && slot_mapping.dtype() == paddle::DataType::INT64 &&
               slot_mapping.is_contiguous(),
           "slot_mapping must be contiguous int64 on CPU");
  const auto ks = k.shape(), cs = k_cache.shape();
  PD_CHECK(v.shape() == ks && v_cache.shape() == cs, "key/value or their caches differ in shape");
  PD_CHECK(ks[1] == cs[0] && ks[2] == cs[3] && slot_mapping.numel() == ks[0],
           "key [T, kv_heads, head_dim] does not match the cache or slot_mapping");
  const int64_t tokens = ks[0], heads = ks[1], dim = ks[2], slots = cs[1] * cs[2];
  const int64_t* slot = slot_mapping.data<int64_t>();
  const float *ksrc = k.data<float>(), *vsrc = v.data<float>();
  for (int64_t t = 0; t < tokens; ++t) PD_CHECK(slot[t] < slots, "slot ", slot[t], " out of range");
  if (bf16) {
    write_slots(ksrc, vsrc, reinterpret_cast<uint16_t*>(k_cache.data<paddle::bfloat16>()),
                reinterpret_cast<uint16_t*>(v_cache.data<paddle::bfloat16>()), slot, tokens,
                heads, dim, slots);
  } else {
    write_slots(ksrc, vsrc, k_cache.data<float>(), v_cache.data<float>(), slot, tokens, heads,
                dim, slots);
  }
}

}  // namespace ketch

PD_BUILD_OP(ketch_paged_attention)
    .Inputs({"q", "k_cache", "v_cache", "block_tables", "query_start", "context_lens"})
    .Outputs({"out"})
    .Attrs({"scale: float", "num_threads: int", "isa: std::string", "window: int"})
    .SetKernelFn(PD_KERNEL(ketch::PagedAttention))
    .SetInferShapeFn(PD_INFER_SHAPE(ketch::PagedAttentionShape))
    .SetInferDtypeFn(PD_INFER_DTYPE(ketch::PagedAttentionDtype));

PD_BUILD_OP(ketch_reshape_and_cache)
    .Inputs({"key", "value", "k_cache", "v_cache", "slot_mapping"})
    .Outputs({"k_cache_out", "v_cache_out"})
    .SetInplaceMap({{"k_cache", "k_cache_out"}, {"v_cache", "v_cache_out"}})
    .SetKernelFn(PD_KERNEL(ketch::ReshapeAndCache));

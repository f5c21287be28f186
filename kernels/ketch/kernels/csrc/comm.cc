// Collectives between the tensor-parallel worker processes of one engine, through one shared-
// memory segment (ketch.kernels.collective.ShmGroup owns it and documents the layout):
//
//   ketch_shm_all_reduce(x, ctrl, data, rank, world, timeout_ms, parent_pid) -> sum of x over ranks
//
// x is float32 or int32 (int32 carries the bytes of a broadcast exactly: the other ranks add 0).
// ctrl: int64, 16 slots per rank (two cache lines): [0] the rank's arrival count, [1 + (seq & 1)]
// the element count it brought to call seq. data: the two alternating buffers, each `world` slots of `slot`
// 4-byte elements. Per chunk of x: copy it into this rank's slot of buffer (seq & 1), publish
// seq with a release store, wait (acquire) until every rank has published seq, then sum the
// slots in rank order, so every rank computes the same bits. One barrier per chunk is enough:
// a rank reuses buffer b at seq + 2 only after every rank arrived at seq + 1, that is after
// every rank finished reading seq. A rank that brings another element count fails the call on
// every rank (a mismatched batch would otherwise corrupt silently); a peer that does not arrive
// within timeout_ms fails it; an engine that died (getppid changed) ends the process.
#include <sched.h>
#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <cstring>
#include <vector>

#include "paddle/extension.h"

namespace ketch {

namespace {

constexpr int64_t kCtrlStride = 16;

inline void Pause() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

// Waits until rank p's arrival count reaches seq; returns its element count.
int64_t WaitFor(int64_t* ctrl, int p, int64_t seq, int64_t timeout_ms, int64_t parent_pid) {
  int64_t* arrived = ctrl + p * kCtrlStride;
  for (int64_t spins = 0;; ++spins) {
    if (__atomic_load_n(arrived, __ATOMIC_ACQUIRE) >= seq) {
      return __atomic_load_n(arrived + 1 + (seq & 1), __ATOMIC_RELAXED);
    }
    if (spins < 256) {
      Pause();
      continue;
    }
    sched_yield();  // the engine and the API server share these cores
    if ((spins & 1023) == 0) {
      static thread_local std::chrono::steady_clock::time_point start;
      const auto now = std::chrono::steady_clock::now();
      if (spins == 1024) start = now;
      if (parent_pid > 0 && getppid() != parent_pid) _exit(0);  // the engine is gone
      const auto waited =
          std::chrono::duration_cast<std::chrono::milliseconds>(now - start).count();
      PD_CHECK(spins == 1024 || waited < timeout_ms, "tensor-parallel rank ", p,
               " did not reach the all-reduce within ", timeout_ms, " ms");
    }
  }
}

template <typename T>
void Reduce(const T* x, T* out, int64_t n, int64_t* ctrl, T* data, int64_t slot, int rank,
            int world, int64_t timeout_ms, int64_t parent_pid) {
  int64_t* mine = ctrl + rank * kCtrlStride;
  for (int64_t begin = 0; begin < n || (n == 0 && begin == 0); begin += slot) {
    const int64_t len = n - begin < slot ? n - begin : slot;
    const int64_t seq = __atomic_load_n(mine, __ATOMIC_RELAXED) + 1;
    T* buffer = data + (seq & 1) * world * slot;
    if (len > 0) std::memcpy(buffer + rank * slot, x + begin, len * sizeof(T));
    __atomic_store_n(mine + 1 + (seq & 1), n, __ATOMIC_RELAXED);
    __atomic_store_n(mine, seq, __ATOMIC_RELEASE);
    for (int p = 0; p < world; ++p) {
      if (p == rank) continue;
      const int64_t theirs = WaitFor(ctrl, p, seq, timeout_ms, parent_pid);
      PD_CHECK(theirs == n, "tensor-parallel ranks disagree on the all-reduce: rank ", rank,
               " brought ", n, " elements, rank ", p, " ", theirs);
    }
    if (len == 0) break;
    T* o = out + begin;
    std::memcpy(o, buffer, len * sizeof(T));
    for (int p = 1; p < world; ++p) {
      const T* src = buffer + p * slot;
      for (int64_t i = 0; i < len; ++i) o[i] += src[i];
    }
  }
}

}  // namespace

std::vector<paddle::Tensor> ShmAllReduce(const paddle::Tensor& x_in, const paddle::Tensor& ctrl,
                                         const paddle::Tensor& data, int rank, int world,
                                         int64_t timeout_ms, int64_t parent_pid) {
  PD_CHECK(x_in.place() == paddle::CPUPlace(), "x must be a CPU tensor");
  PD_CHECK(x_in.dtype() == paddle::DataType::FLOAT32 || x_in.dtype() == paddle::DataType::INT32,
           "x must be float32 or int32");
  PD_CHECK(ctrl.dtype() == paddle::DataType::INT64 && data.dtype() == paddle::DataType::INT64,
           "ctrl and data must be int64 views of the group's segment");
  PD_CHECK(world >= 1 && rank >= 0 && rank < world, "rank must be in [0, world)");
  PD_CHECK(ctrl.numel() >= world * kCtrlStride, "ctrl is too small for ", world, " ranks");
  const int64_t slot = data.numel() * 2 / (2 * world);  // 4-byte elements per rank slot
  PD_CHECK(slot > 0, "data is too small for ", world, " ranks");
  const paddle::Tensor x = x_in.is_contiguous() ? x_in : x_in.contiguous();
  auto out = paddle::empty(x.shape(), x.dtype(), paddle::CPUPlace());
  auto* c = const_cast<int64_t*>(ctrl.data<int64_t>());
  auto* raw = const_cast<int64_t*>(data.data<int64_t>());
  if (x.dtype() == paddle::DataType::FLOAT32) {
    Reduce(x.data<float>(), out.data<float>(), x.numel(), c, reinterpret_cast<float*>(raw), slot,
           rank, world, timeout_ms, parent_pid);
  } else {
    Reduce(x.data<int32_t>(), out.data<int32_t>(), x.numel(), c,
           reinterpret_cast<int32_t*>(raw), slot, rank, world, timeout_ms, parent_pid);
  }
  return {out};
}

std::vector<std::vector<int64_t>> AllReduceShape(const std::vector<int64_t>& x,
                                                 const std::vector<int64_t>&,
                                                 const std::vector<int64_t>&, int, int, int64_t,
                                                 int64_t) {
  return {x};
}

std::vector<paddle::DataType> AllReduceDtype(const paddle::DataType& x, const paddle::DataType&,
                                             const paddle::DataType&) {
  return {x};
}

}  // namespace ketch

PD_BUILD_OP(ketch_shm_all_reduce)
    .Inputs({"x", "ctrl", "data"})
    .Outputs({"out"})
    .Attrs({"rank: int", "world: int", "timeout_ms: int64_t", "parent_pid: int64_t"})
    .SetKernelFn(PD_KERNEL(ketch::ShmAllReduce))
    .SetInferShapeFn(PD_INFER_SHAPE(ketch::AllReduceShape))
    .SetInferDtypeFn(PD_INFER_DTYPE(ketch::AllReduceDtype));

// Device-side helpers and launch utilities shared by the CUDA kernels and their
// launchers (no XLA include).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <atomic>
#include <cstdint>
#include <string>
#include <type_traits>
#include <utility>

#include "kernels/common/numeric.h"

namespace jax_moe {

// Device storage type of each FFI float type, and its f32 conversions.
template <DType DT> struct DevScalar;
template <> struct DevScalar<DType::F32> {
  using T = float;
  __device__ static float Load(float v) { return v; }
  __device__ static float Store(float v) { return v; }
};
template <> struct DevScalar<DType::BF16> {
  using T = __nv_bfloat16;
  __device__ static float Load(__nv_bfloat16 v) { return __bfloat162float(v); }
  __device__ static __nv_bfloat16 Store(float v) { return __float2bfloat16_rn(v); }
};
template <> struct DevScalar<DType::F16> {
  using T = __half;
  __device__ static float Load(__half v) { return __half2float(v); }
  __device__ static __half Store(float v) { return __float2half_rn(v); }
};

// An f32 rounded to DT and back: the step-by-step chain's rounding points.
template <DType DT>
__device__ __forceinline__ float Round(float v) {
  return DevScalar<DT>::Load(DevScalar<DT>::Store(v));
}

// The elements of a 16-byte vector of DT (4 f32 or 8 bf16/f16) as f32.
template <DType DT>
__device__ __forceinline__ void Unpack(const uint4& raw,
                                       float (&f)[16 / sizeof(typename DevScalar<DT>::T)]) {
  using T = typename DevScalar<DT>::T;
  const T* v = reinterpret_cast<const T*>(&raw);
#pragma unroll
  for (int x = 0; x < static_cast<int>(16 / sizeof(T)); ++x) f[x] = DevScalar<DT>::Load(v[x]);
}

// cp.async (sm_80+): 16 bytes global -> shared, through L2 only (cg: the
// data is used once per block, L1 would only be polluted).
__device__ __forceinline__ void CpAsync16(void* smem, const void* gmem) {
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(s), "l"(gmem) : "memory");
}
// The same, reading src_bytes (0 or 16) and zero-filling the rest: with 0
// nothing is read, so a masked-off row costs no memory traffic.
__device__ __forceinline__ void CpAsync16Zfill(void* smem, const void* gmem, int src_bytes) {
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(s), "l"(gmem),
               "r"(src_bytes)
               : "memory");
}
__device__ __forceinline__ void CpAsyncCommit() {
  asm volatile("cp.async.commit_group;\n" ::: "memory");
}
// Waits until at most N of this thread's committed groups are still in flight.
template <int N>
__device__ __forceinline__ void CpAsyncWait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

// Streaming 16-byte load that does not allocate in L1 (weights are read once).
__device__ __forceinline__ uint4 LdgStream(const void* p) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
}

// Inclusive prefix sum over the 32 lanes of a warp (all lanes must call it).
template <typename T>
__device__ __forceinline__ T WarpInclusiveSum(T v) {
  const int lane = threadIdx.x & 31;
#pragma unroll
  for (int d = 1; d < 32; d <<= 1) {
    const T u = __shfl_up_sync(0xffffffffu, v, d);
    if (lane >= d) v += u;
  }
  return v;
}

// ---- tensor-core building blocks (sm_80+): mma.sync m16n8k16 fed by ldmatrix

template <typename T>
__device__ __forceinline__ uint16_t FromFloat16(float v) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    return __bfloat16_as_ushort(__float2bfloat16_rn(v));
  } else {
    return __half_as_ushort(__float2half_rn(v));
  }
}

__device__ __forceinline__ uint32_t Pack2(uint16_t lo, uint16_t hi) {
  return static_cast<uint32_t>(lo) | (static_cast<uint32_t>(hi) << 16);
}

// Two floats rounded to bf16 / f16 in one instruction, lo in the low half.
template <typename T>
__device__ __forceinline__ uint32_t PackFloat2(float lo, float hi) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<const uint32_t*>(&v);
  } else {
    const __half2 v = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<const uint32_t*>(&v);
  }
}

// Four 8x8 b16 matrices; lanes 8i..8i+7 give the row addresses of matrix i,
// and register i returns row lane/4, columns 2*(lane%4)..+1 of matrix i.
__device__ __forceinline__ void Ldmatrix4(uint32_t (&r)[4], const void* smem) {
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(s));
}
// The same, transposed: register i returns rows 2*(lane%4)..+1, column lane/4
// of matrix i.
__device__ __forceinline__ void Ldmatrix4Trans(uint32_t (&r)[4], const void* smem) {
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(s));
}

// Two 8x8 b16 matrices, transposed; lanes 8i..8i+7 give the row addresses of
// matrix i (lanes 16..31 are ignored), and register i returns rows
// 2*(lane%4)..+1, column lane/4 of matrix i.
__device__ __forceinline__ void Ldmatrix2Trans(uint32_t (&r)[2], const void* smem) {
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%0, %1}, [%2];\n"
               : "=r"(r[0]), "=r"(r[1])
               : "r"(s));
}

// Two 8x8 b16 matrices; lanes 8i..8i+7 give the row addresses of matrix i
// (lanes 16..31 are ignored), and register i returns row lane/4, columns
// 2*(lane%4)..+1 of matrix i.
__device__ __forceinline__ void Ldmatrix2(uint32_t (&r)[2], const void* smem) {
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0, %1}, [%2];\n"
               : "=r"(r[0]), "=r"(r[1])
               : "r"(s));
}

// Hopper (sm_90+) tensor-memory-accelerator copies and mbarriers. Callers compile them only for
// __CUDA_ARCH__ >= 900 and launch them only on such devices.
__device__ __forceinline__ unsigned SmemAddr(const void* p) {
  return static_cast<unsigned>(__cvta_generic_to_shared(p));
}
__device__ __forceinline__ void MbarInit(uint64_t* bar, unsigned count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(SmemAddr(bar)), "r"(count)
               : "memory");
}
// Makes the initialised barriers visible to the async proxy (the copy engine).
__device__ __forceinline__ void FenceMbarInit() {
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}
// One arrival that also expects `bytes` of bulk-copy completions this phase.
__device__ __forceinline__ void MbarArriveExpectTx(uint64_t* bar, unsigned bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(SmemAddr(bar)),
               "r"(bytes)
               : "memory");
}
__device__ __forceinline__ void MbarArrive(uint64_t* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(SmemAddr(bar)) : "memory");
}
// Blocks until the phase of parity `parity` has completed.
__device__ __forceinline__ void MbarWait(uint64_t* bar, unsigned parity) {
  asm volatile(
      "{\n"
      " .reg .pred done;\n"
      "WAIT_%=:\n"
      " mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      " @!done bra WAIT_%=;\n"
      "}\n" ::"r"(SmemAddr(bar)),
      "r"(parity)
      : "memory");
}
// The tensor memory accelerator: a 2-D box of `map` at (c0 innermost, c1)
// into shared memory, completion counted on `bar`'s transactions.
__device__ __forceinline__ void TmaLoad2D(void* dst, const void* map, int c0, int c1,
                                          uint64_t* bar, uint64_t policy) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint"
      " [%0], [%1, {%2, %3}], [%4], %5;\n" ::"r"(SmemAddr(dst)),
      "l"(map), "r"(c0), "r"(c1), "r"(SmemAddr(bar)), "l"(policy)
      : "memory");
}
// The same without a cache hint, and its 3-D and 4-D forms (c0 innermost).
__device__ __forceinline__ void TmaLoad2D(void* dst, const void* map, int c0, int c1,
                                          uint64_t* bar) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%2, %3}], [%4];\n" ::"r"(SmemAddr(dst)),
      "l"(map), "r"(c0), "r"(c1), "r"(SmemAddr(bar))
      : "memory");
}
__device__ __forceinline__ void TmaLoad3D(void* dst, const void* map, int c0, int c1, int c2,
                                          uint64_t* bar) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%2, %3, %4}], [%5];\n" ::"r"(SmemAddr(dst)),
      "l"(map), "r"(c0), "r"(c1), "r"(c2), "r"(SmemAddr(bar))
      : "memory");
}
__device__ __forceinline__ void TmaLoad4D(void* dst, const void* map, int c0, int c1, int c2,
                                          int c3, uint64_t* bar) {
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%2, %3, %4, %5}], [%6];\n" ::"r"(SmemAddr(dst)),
      "l"(map), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(SmemAddr(bar))
      : "memory");
}
// A bulk copy (no tensor map) of `bytes` (a multiple of 16; both addresses
// 16-byte aligned) from global into shared memory, completion counted on
// `bar`'s transactions.
__device__ __forceinline__ void BulkLoad(void* dst, const void* src, unsigned bytes,
                                         uint64_t* bar) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::
          "r"(SmemAddr(dst)),
      "l"(src), "r"(bytes), "r"(SmemAddr(bar))
      : "memory");
}
// An arrival on `bar` once this thread's earlier cp.async copies have landed
// (counted in the barrier's init count).
__device__ __forceinline__ void CpAsyncArriveNoinc(uint64_t* bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(SmemAddr(bar))
               : "memory");
}
// An L2 policy for data read once (streamed weights): evicted first.
__device__ __forceinline__ uint64_t L2EvictFirst() {
  uint64_t p;
  asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;\n" : "=l"(p));
  return p;
}

template <typename T>
__device__ __forceinline__ void Mma16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0,
                                         uint32_t b1) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
        "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  } else {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
        "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
}

// Opting a kernel in to more than 48 KB of dynamic shared memory is a
// per-device function attribute, not a stream operation: done once per device
// and kernel (no host sync; safe while XLA captures a command buffer).
template <auto Kernel>
cudaError_t EnsureDynamicSmem(int bytes) {
  static std::atomic<uint64_t> done{0};
  int dev = 0;
  cudaError_t err = cudaGetDevice(&dev);
  if (err != cudaSuccess) return err;
  const uint64_t bit = dev >= 0 && dev < 64 ? uint64_t{1} << dev : 0;
  if (bit != 0 && (done.load(std::memory_order_acquire) & bit) != 0) return cudaSuccess;
  err = cudaFuncSetAttribute(Kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
  if (err == cudaSuccess && bit != 0) done.fetch_or(bit, std::memory_order_acq_rel);
  return err;
}

// A positive per-device value, asked of `query(device)` once per device and
// each call site (each lambda type has its own cache) and cached; the query
// returns <= 0 when it fails, and so does this (0), then and later. Not a
// stream operation: safe while XLA captures a command buffer.
template <typename Query>
int OncePerDevice(Query&& query) {
  constexpr int kMaxDevices = 64;
  static std::atomic<int> cache[kMaxDevices];  // 0: not asked yet; -1: failed
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  int v = dev >= 0 && dev < kMaxDevices ? cache[dev].load(std::memory_order_acquire) : 0;
  if (v == 0) {
    v = query(dev);
    cudaGetLastError();
    if (v <= 0) v = -1;
    if (dev >= 0 && dev < kMaxDevices) cache[dev].store(v, std::memory_order_release);
  }
  return v > 0 ? v : 0;
}

// Device attribute `kAttr` of the current device, asked once per device; 0
// when the query fails. (Each attribute is its own instantiation, so its own
// cache in OncePerDevice.)
template <cudaDeviceAttr kAttr>
int DeviceAttribute() {
  return OncePerDevice([](int dev) {
    int v = 0;
    return cudaDeviceGetAttribute(&v, kAttr, dev) == cudaSuccess ? v : 0;
  });
}

// The current device's SM count, opt-in shared memory per block and compute
// capability major version.
inline int DeviceSms() { return DeviceAttribute<cudaDevAttrMultiProcessorCount>(); }
inline int DeviceSmemOptin() { return DeviceAttribute<cudaDevAttrMaxSharedMemoryPerBlockOptin>(); }
inline int DeviceMajor() { return DeviceAttribute<cudaDevAttrComputeCapabilityMajor>(); }

// How many blocks of `Kernel` (`threads` threads, `dynamic_smem` bytes of
// dynamic shared memory; a kernel passes the same values at every call) the
// current device holds at once: occupancy x SM count, asked once per device.
// 0 when the query fails.
template <auto Kernel>
int ResidentBlocks(int threads, int dynamic_smem = 0) {
  return OncePerDevice([&](int) {
    int per_sm = 0;
    const bool ok =
        cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, Kernel, threads, dynamic_smem) ==
        cudaSuccess;
    return ok ? per_sm * DeviceSms() : 0;
  });
}

// A benchmark build's phase timestamp: thread 0 of block b writes the
// globaltimer to stamps[b * stride + i] (nothing when stamps is null). The
// one-token kernels call it through their own macros, compiled in only with
// their benchmarks' switches.
__device__ __forceinline__ void StampGlobaltimer(unsigned long long* stamps, int stride, int i) {
  if (stamps != nullptr && threadIdx.x == 0) {
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    stamps[blockIdx.x * stride + i] = t;
  }
}

// Programmatic dependent launch (sm_90+; no-ops elsewhere and for a kernel
// launched without the attribute). A kernel calls PdlTrigger() once it may
// let the next kernel of its stream start (the next one still waits for it in
// PdlWait), and PdlWait() before it first reads what the previous kernel
// wrote. Every block of a kernel launched so waits before it exits, so a
// wait covers all the kernels of the chain before. Here: the GEMM and
// activation kernels trigger at their start (a GEMM waits first when its tile
// schedule is the previous kernel's output: GemmArgs.wait_first), the token
// index kernels right after their wait, the router at its start; the combine
// only waits. Paged decode: the split kernels trigger after their main loop,
// the decode combine only waits.
__device__ __forceinline__ void PdlTrigger() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void PdlWait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}

// Launches `kernel` on `stream` with the launch attribute `attr` (none when
// null).
template <typename... Params, typename... Args>
cudaError_t LaunchWithAttribute(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem,
                                cudaStream_t stream, cudaLaunchAttribute* attr, Args&&... args) {
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cfg.attrs = attr;
  cfg.numAttrs = attr != nullptr ? 1 : 0;
  return cudaLaunchKernelEx(&cfg, kernel, std::forward<Args>(args)...);
}

// Launches `kernel` on `stream`; with `pdl`, with programmatic stream
// serialisation: it may start while the stream's previous kernel runs (its
// PdlWait waits for that kernel's completion and writes).
template <typename... Params, typename... Args>
cudaError_t LaunchKernel(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem,
                         cudaStream_t stream, bool pdl, Args&&... args) {
  cudaLaunchAttribute attr{};
  attr.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr.val.programmaticStreamSerializationAllowed = 1;
  return LaunchWithAttribute(kernel, grid, block, smem, stream, pdl ? &attr : nullptr,
                             std::forward<Args>(args)...);
}

// Launches `kernel` on `stream` as a cooperative grid: every block resident
// at once, which a grid-wide barrier (cooperative_groups) needs.
template <typename... Params, typename... Args>
cudaError_t LaunchCooperative(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem,
                              cudaStream_t stream, Args&&... args) {
  cudaLaunchAttribute attr{};
  attr.id = cudaLaunchAttributeCooperative;
  attr.val.cooperative = 1;
  return LaunchWithAttribute(kernel, grid, block, smem, stream, &attr,
                             std::forward<Args>(args)...);
}

inline unsigned CeilDiv(int64_t a, int64_t b) { return static_cast<unsigned>((a + b - 1) / b); }

// Grid size capped at a fixed number of blocks; kernels stride over the rest.
inline unsigned GridFor(int64_t items, int64_t per_block, unsigned cap = 65535u * 4) {
  int64_t g = (items + per_block - 1) / per_block;
  if (g < 1) g = 1;
  return static_cast<unsigned>(g > cap ? cap : g);
}

}  // namespace jax_moe

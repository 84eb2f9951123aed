// What the CUTLASS sm90 grouped GEMMs (gemm_sm90a.cuh, wgrad_sm90a.cu,
// fp8_sm90a.cuh) share: the CUTLASS includes and the check for device-side
// TMA descriptor updates, the problem shape types, and host helpers (the
// device check, the scratch alignment, the CUTLASS workspace size, the
// grouped GEMM's set-up and its launch). Each including translation unit
// gets its own copy (anonymous namespace), so each probes its own kernels.
#pragma once

#include <cuda_runtime.h>

#include <atomic>
#include <cstddef>
#include <cstdint>

#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/epilogue/fusion/operations.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/dispatch_policy.hpp"
#include "cutlass/gemm/gemm.h"
#include "cutlass/gemm/group_array_problem_shape.hpp"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#include "cutlass/util/packed_stride.hpp"

#if !defined(CUTLASS_ARCH_MMA_MODIFIABLE_TMA_SM90_SUPPORTED)
#error "the sm90 grouped GEMM needs device-side TMA descriptor updates (CUDA >= 12.3)"
#endif

namespace jax_moe {
namespace {

// (M, N, K) per group.
using ProblemShape = cutlass::gemm::GroupProblemShape<cute::Shape<int, int, int>>;
using ShapeMNK = ProblemShape::UnderlyingProblemShape;

// The largest SM count the scratch is sized for (a full GH100 die). A device
// with more SMs runs a persistent grid of this many CTAs.
constexpr int kMaxSms = 144;
constexpr size_t kScratchAlign = 256;  // every scratch section, and the base

constexpr size_t RoundUp(size_t v, size_t a) { return (v + a - 1) / a * a; }

inline bool Aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

// Host: the CUTLASS workspace of a ptr-array grouped kernel for kMaxSms SMs.
// Reads no device data (host problem shapes absent) and makes no CUDA call.
template <typename G>
size_t WorkspaceBytes(int64_t groups) {
  typename G::Gemm::Arguments args{};
  args.mode = cutlass::gemm::GemmUniversalMode::kGrouped;
  args.problem_shape = {static_cast<int>(groups), nullptr, nullptr};
  args.hw_info.sm_count = kMaxSms;
  return G::Gemm::get_workspace_size(args);
}

// Host: sets `gemm` up for `groups` problems D = A * B (no C) whose shapes,
// pointers and strides are device arrays that the caller's setup kernel
// writes (CUTLASS reads them on the device: host_problem_shapes absent).
// Host-only (initialize sets the kernel's shared memory attribute): false,
// with nothing launched, when CUTLASS declines the problems or needs more
// than `workspace_bytes` of workspace, and the caller falls back.
// `more(args)` sets a kernel's further arguments (the fp8 GEMM's scales).
template <typename Gemm, typename Shape, typename PtrA, typename StrideA, typename PtrB,
          typename StrideB, typename PtrD, typename StrideD, typename More = void (*)(
              typename Gemm::Arguments&)>
bool InitGrouped(Gemm& gemm, int64_t groups, Shape* shapes, PtrA ptr_a, StrideA* stride_a,
                 PtrB ptr_b, StrideB* stride_b, PtrD ptr_d, StrideD* stride_d, int dev, int sms,
                 void* workspace, size_t workspace_bytes, cudaStream_t stream,
                 More more = [](typename Gemm::Arguments&) {}) {
  typename Gemm::Arguments args{};
  args.mode = cutlass::gemm::GemmUniversalMode::kGrouped;
  args.problem_shape = {static_cast<int>(groups), shapes, nullptr};
  args.mainloop.ptr_A = ptr_a;
  args.mainloop.dA = stride_a;
  args.mainloop.ptr_B = ptr_b;
  args.mainloop.dB = stride_b;
  args.epilogue.thread.alpha = 1.0f;
  args.epilogue.thread.beta = 0.0f;
  args.epilogue.ptr_C = nullptr;
  args.epilogue.dC = nullptr;
  args.epilogue.ptr_D = ptr_d;
  args.epilogue.dD = stride_d;
  args.hw_info.device_id = dev;
  args.hw_info.sm_count = sms;
  more(args);
  if (Gemm::get_workspace_size(args) > workspace_bytes ||
      gemm.can_implement(args) != cutlass::Status::kSuccess ||
      gemm.initialize(args, workspace, stream) != cutlass::Status::kSuccess) {
    cudaGetLastError();
    return false;
  }
  return true;
}

// Host: launches `gemm` (set up by InitGrouped) on `stream`; a launch error,
// or cudaErrorLaunchFailure when CUTLASS reports a failure without one.
template <typename Gemm>
cudaError_t RunGemm(Gemm& gemm, cudaStream_t stream) {
  const cutlass::Status st = gemm.run(stream);
  cudaError_t err = cudaGetLastError();
  if (err == cudaSuccess && st != cutlass::Status::kSuccess) err = cudaErrorLaunchFailure;
  return err;
}

// The current device and its SM count (capped at kMaxSms) when an sm90 path
// can run there: compute capability 9.0 (sm_90a code runs on no other) and
// `probe`, one of the caller's kernels, loads. Queried once per device.
inline bool UsableDevice(const void* probe, int* dev, int* sms) {
  constexpr int kMaxDevices = 64;
  static std::atomic<int> cache[kMaxDevices];  // 0: not asked yet, -1: unusable, else SMs
  if (cudaGetDevice(dev) != cudaSuccess) {
    cudaGetLastError();
    return false;
  }
  int v = *dev >= 0 && *dev < kMaxDevices ? cache[*dev].load(std::memory_order_acquire) : 0;
  if (v == 0) {
    int major = 0, minor = 0, count = 0;
    cudaFuncAttributes attr;
    const bool ok =
        cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, *dev) == cudaSuccess &&
        cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, *dev) == cudaSuccess &&
        cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, *dev) == cudaSuccess &&
        major == 9 && minor == 0 && count > 0 &&
        cudaFuncGetAttributes(&attr, probe) == cudaSuccess;
    cudaGetLastError();  // a failed query leaves nothing behind for the next launch check
    v = ok ? (count < kMaxSms ? count : kMaxSms) : -1;
    if (*dev >= 0 && *dev < kMaxDevices) cache[*dev].store(v, std::memory_order_release);
  }
  *sms = v;
  return v > 0;
}

}  // namespace
}  // namespace jax_moe

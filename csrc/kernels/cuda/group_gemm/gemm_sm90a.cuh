// The Hopper grouped GEMM's machinery, templated on the layout of w: the
// CUTLASS kernel types, the scratch layout, the set-up and prep kernels and
// the tile choice. gemm_sm90a.cu instantiates it for w[e] as (N, K) (the
// forward), gemm_kn_sm90a.cu for w[e] as (K, N) (the backward's dgrad,
// against the forward's weights without a transposed copy): two translation
// units, so the two sets of six CUTLASS kernels compile in parallel. Each
// includer gets its own copy (anonymous namespace).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include <cub/block/block_scan.cuh>

#include "kernels/common/gemm_dims.h"
#include "kernels/common/numeric.h"
#include "kernels/cuda/group_gemm/expert_rows.cuh"
#include "kernels/cuda/group_gemm/gemm_sm90a.h"
#include "kernels/cuda/group_gemm/sm90_common.cuh"

namespace jax_moe {
namespace {

using namespace cute;

constexpr int kSetupThreads = 1024;
constexpr int kPrepThreads = 256;
// Rows per expert (average) below which the 64-row tiles run.
constexpr int64_t kSkinnyRows = 64;

// A (M, K) row-major, B = w[e] (N, K) row-major, which is CUTLASS's
// column-major B: both K-major ("TN"); or B = w[e] (K, N) row-major,
// CUTLASS's row-major B (N-major, "TT"). D (M, N) row-major. 8 elements = the
// 16 bytes TMA needs.
// Cooperative: two consumer warpgroups split each tile's M (tile M >= 128).
// Pingpong: each consumer warpgroup owns a whole tile (M = 64) and the two
// alternate mainloop and epilogue.
struct Cooperative {
  using Mainloop = cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperative;
  using Epilogue = cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative;
};
struct Pingpong {
  using Mainloop = cutlass::gemm::KernelPtrArrayTmaWarpSpecializedPingpong;
  using Epilogue = cutlass::epilogue::PtrArrayTmaWarpSpecializedPingpong;
};

template <typename Element, typename TileShape, typename ClusterShape, typename Schedule,
          typename LayoutB_>
struct Sm90Gemm {
  using LayoutA = cutlass::layout::RowMajor;
  using LayoutB = LayoutB_;
  using LayoutD = cutlass::layout::RowMajor;
  static constexpr int kAlignment = 8;
  using Epilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
      cutlass::epilogue::collective::EpilogueTileAuto, float, float,
      void, LayoutD*, kAlignment,  // no C: D = alpha * acc
      Element, LayoutD*, kAlignment, typename Schedule::Epilogue,
      cutlass::epilogue::fusion::LinearCombination<Element, float>>::CollectiveOp;
  using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Element, LayoutA*, kAlignment,
      Element, LayoutB*, kAlignment, float, TileShape, ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(
          sizeof(typename Epilogue::SharedStorage))>,
      typename Schedule::Mainloop>::CollectiveOp;
  // No tile scheduler named: the ptr-array kernel's default, the persistent
  // group scheduler (no split-K / stream-K).
  using Kernel = cutlass::gemm::kernel::GemmUniversal<ProblemShape, Mainloop, Epilogue>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
  using StrideA = typename Kernel::InternalStrideA;
  using StrideB = typename Kernel::InternalStrideB;
  using StrideD = typename Kernel::InternalStrideD;
};

using Cluster1 = Shape<_1, _1, _1>;

// The tile configurations of one B layout (LayoutB: w[e] as (N, K) row-major,
// CUTLASS's ColumnMajor, or as (K, N) row-major, CUTLASS's RowMajor).
template <typename LayoutB>
struct Tiles {
  template <typename Element>
  using Skinny = Sm90Gemm<Element, Shape<_64, _128, _64>, Cluster1, Pingpong, LayoutB>;
  template <typename Element>
  using Narrow = Sm90Gemm<Element, Shape<_128, _128, _64>, Cluster1, Cooperative, LayoutB>;
  template <typename Element>
  using Wide = Sm90Gemm<Element, Shape<_128, _256, _64>, Cluster1, Cooperative, LayoutB>;
  using StrideA = typename Narrow<cutlass::bfloat16_t>::StrideA;
  using StrideB = typename Narrow<cutlass::bfloat16_t>::StrideB;
  using StrideD = typename Narrow<cutlass::bfloat16_t>::StrideD;
  // One set of stride types for all six kernels (they depend on the layouts only).
  static_assert(std::is_same_v<StrideA, typename Wide<cutlass::half_t>::StrideA> &&
                std::is_same_v<StrideB, typename Wide<cutlass::half_t>::StrideB> &&
                std::is_same_v<StrideD, typename Wide<cutlass::half_t>::StrideD> &&
                std::is_same_v<StrideA, typename Skinny<cutlass::half_t>::StrideA> &&
                std::is_same_v<StrideB, typename Skinny<cutlass::half_t>::StrideB> &&
                std::is_same_v<StrideD, typename Skinny<cutlass::half_t>::StrideD>);
};

// Where each part of the call's scratch lives (byte offsets from the
// 256-byte aligned base); `bytes` includes the slack for aligning the base.
struct ScratchLayout {
  size_t rows_total, shapes, ptr_a, ptr_b, ptr_d, stride_a, stride_b, stride_d, workspace, expand;
  size_t bytes;
};

template <typename LayoutB>
ScratchLayout MakeLayout(int64_t m, int64_t k, int64_t groups, bool gather) {
  using T = Tiles<LayoutB>;
  using StrideA = typename T::StrideA;
  using StrideB = typename T::StrideB;
  using StrideD = typename T::StrideD;
  const size_t g = static_cast<size_t>(groups);
  size_t ws = 0;
  for (size_t w : {WorkspaceBytes<typename T::template Narrow<cutlass::bfloat16_t>>(groups),
                   WorkspaceBytes<typename T::template Narrow<cutlass::half_t>>(groups),
                   WorkspaceBytes<typename T::template Wide<cutlass::bfloat16_t>>(groups),
                   WorkspaceBytes<typename T::template Wide<cutlass::half_t>>(groups),
                   WorkspaceBytes<typename T::template Skinny<cutlass::bfloat16_t>>(groups),
                   WorkspaceBytes<typename T::template Skinny<cutlass::half_t>>(groups)})
    ws = w > ws ? w : ws;
  ScratchLayout l{};
  size_t off = 0;
  auto take = [&](size_t n) {
    const size_t at = off;
    off = RoundUp(off + n, kScratchAlign);
    return at;
  };
  l.rows_total = take(sizeof(int64_t));
  l.shapes = take(g * sizeof(ShapeMNK));
  l.ptr_a = take(g * sizeof(void*));
  l.ptr_b = take(g * sizeof(void*));
  l.ptr_d = take(g * sizeof(void*));
  l.stride_a = take(g * sizeof(StrideA));
  l.stride_b = take(g * sizeof(StrideB));
  l.stride_d = take(g * sizeof(StrideD));
  l.workspace = take(ws);
  l.expand = take(gather ? static_cast<size_t>(m) * static_cast<size_t>(k) * 2 : 0);
  l.bytes = off + kScratchAlign;
  return l;
}

// ---------------------------------------------------------------------------
// Device: the group arrays, the gather expand and the tail
// ---------------------------------------------------------------------------

// One block: expert e gets rows [min(P_e, M), min(P_{e+1}, M)) (P: prefix sum
// of max(size, 0), scanned 1024 experts per pass by ForEachExpertRows), i.e.
// the problem (rows, N, K) and the pointers to its first rows of A and D and
// to w[e] (N x K elements in either layout). Also stores min(P_E, M), the
// first tail row.
template <typename Element, typename StrideA, typename StrideB, typename StrideD>
__global__ void __launch_bounds__(kSetupThreads)
    Sm90SetupKernel(const int32_t* __restrict__ sizes, int64_t groups, int64_t m, int n, int k,
                    const Element* a, const Element* w, Element* d, StrideA sa, StrideB sb,
                    StrideD sd, ShapeMNK* shapes, const Element** ptr_a, const Element** ptr_b,
                    Element** ptr_d, StrideA* stride_a, StrideB* stride_b, StrideD* stride_d,
                    int64_t* rows_total) {
  __shared__ typename cub::BlockScan<int64_t, kSetupThreads>::TempStorage scan;
  const int64_t rows = ForEachExpertRows<kSetupThreads>(
      sizes, groups, m, scan, [&](int64_t e, int64_t start, int64_t end) {
        if (e < groups) {
          shapes[e] = ShapeMNK(static_cast<int>(end - start), n, k);
          ptr_a[e] = a + start * k;
          ptr_b[e] = w + e * static_cast<int64_t>(n) * k;
          ptr_d[e] = d + start * n;
          stride_a[e] = sa;
          stride_b[e] = sb;
          stride_d[e] = sd;
        }
      });
  if (threadIdx.x == 0) *rows_total = rows;
}

// Grid-stride over rows, 16-byte vectors along the row: with a gather, rows
// [0, rows_total) of the expanded input become x[rows[r] / topk] (zero for an
// invalid entry); rows [rows_total, m) of out become zero. kv, nv: vectors
// per row of x and of out.
__global__ void __launch_bounds__(kPrepThreads)
    Sm90PrepKernel(const uint4* __restrict__ x, const int32_t* __restrict__ rows, int64_t topk,
                   int64_t limit, uint4* __restrict__ expand, uint4* __restrict__ out,
                   const int64_t* __restrict__ rows_total_ptr, int64_t m, int64_t kv, int64_t nv) {
  const int64_t rows_total = *rows_total_ptr;
  const uint4 zero = make_uint4(0, 0, 0, 0);
  for (int64_t r = (rows != nullptr ? 0 : rows_total) + blockIdx.x; r < m; r += gridDim.x) {
    if (r < rows_total) {
      const int64_t src = ExpandSourceRow(rows[r], topk, limit);
      uint4* to = expand + r * kv;
      if (src >= 0) {
        const uint4* from = x + src * kv;
        for (int64_t c = threadIdx.x; c < kv; c += kPrepThreads) to[c] = from[c];
      } else {
        for (int64_t c = threadIdx.x; c < kv; c += kPrepThreads) to[c] = zero;
      }
    } else {
      uint4* to = out + r * nv;
      for (int64_t c = threadIdx.x; c < nv; c += kPrepThreads) to[c] = zero;
    }
  }
}

// ---------------------------------------------------------------------------
// Host
// ---------------------------------------------------------------------------

template <typename G>
cudaError_t RunSm90(const Sm90GemmCall& c, int dev, int sms, bool* ran) {
  using Element = typename G::Gemm::ElementA;
  using StrideA = typename G::StrideA;
  using StrideB = typename G::StrideB;
  using StrideD = typename G::StrideD;
  const bool gather = c.rows != nullptr;
  const ScratchLayout l = MakeLayout<typename G::LayoutB>(c.m, c.k, c.groups, gather);
  char* base = reinterpret_cast<char*>(
      RoundUp(reinterpret_cast<uintptr_t>(c.scratch), kScratchAlign));
  if (c.scratch == nullptr || base + (l.bytes - kScratchAlign) >
                                  static_cast<char*>(c.scratch) + c.scratch_bytes)
    return cudaSuccess;  // Python sized it for another configuration: fall back
  auto* shapes = reinterpret_cast<ShapeMNK*>(base + l.shapes);
  auto* ptr_a = reinterpret_cast<const Element**>(base + l.ptr_a);
  auto* ptr_b = reinterpret_cast<const Element**>(base + l.ptr_b);
  auto* ptr_d = reinterpret_cast<Element**>(base + l.ptr_d);
  auto* stride_a = reinterpret_cast<StrideA*>(base + l.stride_a);
  auto* stride_b = reinterpret_cast<StrideB*>(base + l.stride_b);
  auto* stride_d = reinterpret_cast<StrideD*>(base + l.stride_d);
  auto* rows_total = reinterpret_cast<int64_t*>(base + l.rows_total);
  const auto* a = static_cast<const Element*>(
      gather ? static_cast<const void*>(base + l.expand) : c.x);

  typename G::Gemm gemm;
  if (!InitGrouped(gemm, c.groups, shapes, ptr_a, stride_a, ptr_b, stride_b, ptr_d, stride_d, dev,
                   sms, base + l.workspace, l.expand - l.workspace, c.stream))
    return cudaSuccess;

  const int n = static_cast<int>(c.n), k = static_cast<int>(c.k);
  Sm90SetupKernel<Element, StrideA, StrideB, StrideD><<<1, kSetupThreads, 0, c.stream>>>(
      c.sizes, c.groups, c.m, n, k, a, static_cast<const Element*>(c.w),
      static_cast<Element*>(c.out), cutlass::make_cute_packed_stride(StrideA{}, {1, k, 1}),
      cutlass::make_cute_packed_stride(StrideB{}, {n, k, 1}),
      cutlass::make_cute_packed_stride(StrideD{}, {1, n, 1}), shapes, ptr_a, ptr_b, ptr_d,
      stride_a, stride_b, stride_d, rows_total);
  cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) return err;
  *ran = true;  // from here on, the call is ours (errors are reported, not retried)
  const int64_t prep_blocks = c.m < int64_t{sms} * 8 ? c.m : int64_t{sms} * 8;
  Sm90PrepKernel<<<static_cast<unsigned>(prep_blocks), kPrepThreads, 0, c.stream>>>(
      static_cast<const uint4*>(c.x), c.rows, c.topk, c.x_rows * c.topk,
      reinterpret_cast<uint4*>(base + l.expand), static_cast<uint4*>(c.out), rows_total, c.m,
      c.k / 8, c.n / 8);
  err = cudaGetLastError();
  if (err != cudaSuccess) return err;
  return RunGemm(gemm, c.stream);
}

// GroupGemmSm90 for one layout of w (see Tiles).
template <typename LayoutB>
cudaError_t DispatchSm90(const Sm90GemmCall& c, bool* ran) {
  using T = Tiles<LayoutB>;
  *ran = false;
  if (c.m <= 0 || c.m > kInt32Max || c.n <= 0 || c.n > kInt32Max || c.k <= 0 || c.k > kInt32Max ||
      c.groups <= 0 || c.groups > kInt32Max || c.n % 8 != 0 || c.k % 8 != 0 ||
      !Aligned16(c.x) || !Aligned16(c.w) || !Aligned16(c.out))
    return cudaSuccess;
  int dev = 0, sms = 0;
  if (!UsableDevice(reinterpret_cast<const void*>(Sm90PrepKernel), &dev, &sms))
    return cudaSuccess;
  if (c.max_ctas > 0 && c.max_ctas < sms) sms = c.max_ctas;
  const bool skinny = c.m < kSkinnyRows * c.groups;
  const bool wide = !skinny && c.n >= 256;
  if (c.bf16) {
    return wide     ? RunSm90<typename T::template Wide<cutlass::bfloat16_t>>(c, dev, sms, ran)
           : skinny ? RunSm90<typename T::template Skinny<cutlass::bfloat16_t>>(c, dev, sms, ran)
                    : RunSm90<typename T::template Narrow<cutlass::bfloat16_t>>(c, dev, sms, ran);
  }
  return wide     ? RunSm90<typename T::template Wide<cutlass::half_t>>(c, dev, sms, ran)
         : skinny ? RunSm90<typename T::template Skinny<cutlass::half_t>>(c, dev, sms, ran)
                  : RunSm90<typename T::template Narrow<cutlass::half_t>>(c, dev, sms, ran);
}

template <typename LayoutB>
int64_t ScratchBytesSm90(int64_t m, int64_t k, int64_t groups, bool gather) {
  if (m < 0 || k < 0 || groups < 1) return 0;
  return static_cast<int64_t>(MakeLayout<LayoutB>(m, k, groups, gather).bytes);
}

}  // namespace
}  // namespace jax_moe

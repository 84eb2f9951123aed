// The weight gradient of the grouped GEMM on Hopper: per expert e,
// out[e] (n, k) = dy_e^T x_e over the expert's rows, a "k-grouped" GEMM (the
// reduction runs over the ragged dimension). One CUTLASS 3.x ptr-array
// grouped GEMM launch, each expert a problem (M, N, K) = (n, k, rows_e):
//   A = dy_e^T (n x rows_e): element (i, r) at dy[(start_e + r) * n + i], i.e.
//       column-major with leading dimension n (M-major);
//   B = x_e (rows_e x k): element (r, j) at x[(start_e + r) * k + j], i.e.
//       row-major with leading dimension k (N-major);
//   D = out[e] (n x k) row-major.
// Both operands are MN-major, which wgmma reads directly for 16-bit types.
//
// Design
//  * Compiled for sm_90a only (CMake builds every *_sm90a.cu so); the caller
//    falls back to a portable kernel when GroupGemmWgradSm90 does not apply.
//  * As the forward (gemm_sm90a.cu): no host sync. A one-block kernel turns
//    expert_sizes into the per-expert problem shapes, pointers and strides
//    (host_problem_shapes = nullptr); the persistent grid reads them on the
//    device. Everything lives in the call's scratch output.
//  * Ragged K: the ptr-array kernel rewrites each CTA's TMA descriptors with
//    the group's (M, N, K) before loading it, so the last partial K tile of
//    an expert is zero-filled by TMA for both operands and never reads the
//    next expert's rows.
//  * Empty experts (no rows, or all their rows past m) get an empty problem,
//    M = K = 0, hence no tiles: with K = 0 and tiles the accumulators would be
//    stored without ever being cleared. Their out[e] is zeroed by the prep
//    kernel from a list of empty experts that the setup kernel compacts.
//  * Gather: TMA cannot gather rows, so the prep kernel first expands
//    x[rows[r] / topk] (zero rows for invalid entries) into the scratch.
//  * Tile 128x256x64, cooperative, 1x1 cluster (the forward's "Wide"). The
//    group scheduler has no split-K or stream-K: each output tile is summed
//    by one CTA over the expert's rows in order, so results are bitwise
//    reproducible run to run.
//  * bf16 and f16 only: 2 CUTLASS instantiations, the bulk of the compile time.
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include <cub/block/block_scan.cuh>

#include "kernels/common/gemm_dims.h"
#include "kernels/common/numeric.h"
#include "kernels/cuda/group_gemm/expert_rows.cuh"
#include "kernels/cuda/group_gemm/sm90_common.cuh"
#include "kernels/cuda/group_gemm/wgrad_sm90a.h"

namespace jax_moe {
namespace {

using namespace cute;

constexpr int kSetupThreads = 1024;
constexpr int kPrepThreads = 128;

// The schedule and tile: cooperative 128x256 (both consumer warpgroups on
// one tile). JAX_MOE_WGRAD_PINGPONG is a benchmark-only switch (see
// benchmarks/kernels/CMakeLists.txt; the shipped objects never see it): the
// ping-pong schedule, each consumer warpgroup on its own
// JAX_MOE_WGRAD_TILE_M x JAX_MOE_WGRAD_TILE_N tile, so that one tile's
// stores overlap the other's MMAs (few rows an expert make the stores the
// larger part).
#ifdef JAX_MOE_WGRAD_PINGPONG
using WgradTile = Shape<Int<JAX_MOE_WGRAD_TILE_M>, Int<JAX_MOE_WGRAD_TILE_N>, _64>;
using WgradMainloopSchedule = cutlass::gemm::KernelPtrArrayTmaWarpSpecializedPingpong;
using WgradEpilogueSchedule = cutlass::epilogue::PtrArrayTmaWarpSpecializedPingpong;
#else
using WgradTile = Shape<_128, _256, _64>;
using WgradMainloopSchedule = cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperative;
#ifdef JAX_MOE_WGRAD_NO_SMEM_EPILOGUE
// Benchmark-only: each consumer thread stores its accumulators straight to
// global memory (no shared-memory staging, no TMA store to wait for).
using WgradEpilogueSchedule = cutlass::epilogue::PtrArrayNoSmemWarpSpecialized;
#else
using WgradEpilogueSchedule = cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative;
#endif
#endif

// The epilogue's subtile: 128x64, each tile's 64 KB of gradient stored in
// four 16 KB TMA stores. With few rows an expert (a training step of a few
// thousand tokens), writing the gradient bounds the kernel, and CUTLASS's
// own choice (128x32: eight 8 KB stores) keeps too few bytes in flight.
// JAX_MOE_WGRAD_EPILOGUE_N, another benchmark-only switch, sets the
// subtile's N instead (M: the tile's).
#ifdef JAX_MOE_WGRAD_EPILOGUE_N
using WgradEpilogueTile = Shape<decltype(get<0>(WgradTile{})), Int<JAX_MOE_WGRAD_EPILOGUE_N>>;
#else
using WgradEpilogueTile = Shape<decltype(get<0>(WgradTile{})), _64>;
#endif

#ifdef JAX_MOE_WGRAD_STAGES_D
// Benchmark-only: the builder's epilogue with JAX_MOE_WGRAD_STAGES_D
// shared-memory buffers for D (TMA stores that may be in flight) instead of
// its two, so that more of a tile's stores can overlap the next tile's MMAs.
template <class Policy>
struct WithStagesD;
template <int C, int D, int F, bool R, bool Delay, int W>
struct WithStagesD<cutlass::epilogue::Sm90PtrArrayTmaWarpSpecialized<C, D, F, R, Delay, W>> {
  using type = cutlass::epilogue::Sm90PtrArrayTmaWarpSpecialized<
      C, JAX_MOE_WGRAD_STAGES_D, F, R, Delay, W>;
};
template <class Fusion, class Policy>
struct FusionWithPolicy;
template <class Old, class... Rest, class Policy>
struct FusionWithPolicy<cutlass::epilogue::fusion::FusionCallbacks<Old, Rest...>, Policy> {
  using type = cutlass::epilogue::fusion::FusionCallbacks<Policy, Rest...>;
};
template <class Epilogue>
struct EpilogueWithStagesD;
template <class P, class Tile, class EpiTile, class EC, class SC, class ED, class SD, class Fusion,
          class... Rest>
struct EpilogueWithStagesD<
    cutlass::epilogue::collective::CollectiveEpilogue<P, Tile, EpiTile, EC, SC, ED, SD, Fusion,
                                                      Rest...>> {
  using Policy = typename WithStagesD<P>::type;
  using type = cutlass::epilogue::collective::CollectiveEpilogue<
      Policy, Tile, EpiTile, EC, SC, ED, SD, typename FusionWithPolicy<Fusion, Policy>::type,
      Rest...>;
};
#endif

// JAX_MOE_WGRAD_CLUSTER_M, another benchmark-only switch: a cluster of that
// many CTAs along M, which share each B tile (x's rows) by TMA multicast.
#ifdef JAX_MOE_WGRAD_CLUSTER_M
using WgradCluster = Shape<Int<JAX_MOE_WGRAD_CLUSTER_M>, _1, _1>;
#else
using WgradCluster = Shape<_1, _1, _1>;
#endif

template <typename Element>
struct WgradGemm {
  using LayoutA = cutlass::layout::ColumnMajor;  // dy_e^T, M-major
  using LayoutB = cutlass::layout::RowMajor;     // x_e, N-major
  using LayoutD = cutlass::layout::RowMajor;
  using TileShape = WgradTile;
  using ClusterShape = WgradCluster;
  static constexpr int kAlignment = 8;  // 16 bytes, as TMA needs
  using BuiltEpilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
      WgradEpilogueTile, float, float, void, LayoutD*, kAlignment,  // no C: D = alpha * acc
      Element, LayoutD*, kAlignment, WgradEpilogueSchedule,
#ifdef JAX_MOE_WGRAD_NO_SMEM_EPILOGUE
      cutlass::epilogue::fusion::LinearCombination<Element, float, void, float>>::CollectiveOp;
#else
      cutlass::epilogue::fusion::LinearCombination<Element, float>>::CollectiveOp;
#endif
#ifdef JAX_MOE_WGRAD_STAGES_D
  using Epilogue = typename EpilogueWithStagesD<BuiltEpilogue>::type;
#else
  using Epilogue = BuiltEpilogue;
#endif
  using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Element, LayoutA*, kAlignment,
      Element, LayoutB*, kAlignment, float, TileShape, ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(
          sizeof(typename Epilogue::SharedStorage))>,
      WgradMainloopSchedule>::CollectiveOp;
  // No tile scheduler named: the ptr-array kernel's default, the persistent
  // group scheduler (no split-K / stream-K).
  using Kernel = cutlass::gemm::kernel::GemmUniversal<ProblemShape, Mainloop, Epilogue>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
  using StrideA = typename Kernel::InternalStrideA;
  using StrideB = typename Kernel::InternalStrideB;
  using StrideD = typename Kernel::InternalStrideD;
};

using StrideA = WgradGemm<cutlass::bfloat16_t>::StrideA;
using StrideB = WgradGemm<cutlass::bfloat16_t>::StrideB;
using StrideD = WgradGemm<cutlass::bfloat16_t>::StrideD;
static_assert(std::is_same_v<StrideA, WgradGemm<cutlass::half_t>::StrideA> &&
              std::is_same_v<StrideB, WgradGemm<cutlass::half_t>::StrideB> &&
              std::is_same_v<StrideD, WgradGemm<cutlass::half_t>::StrideD>);

// Where each part of the call's scratch lives (byte offsets from the
// 256-byte aligned base); `bytes` includes the slack for aligning the base.
struct ScratchLayout {
  size_t info, shapes, ptr_a, ptr_b, ptr_d, stride_a, stride_b, stride_d, empty, workspace,
      expand;
  size_t bytes;
};

ScratchLayout MakeLayout(int64_t m, int64_t k, int64_t groups, bool gather) {
  const size_t g = static_cast<size_t>(groups);
  const size_t ws_bf16 = WorkspaceBytes<WgradGemm<cutlass::bfloat16_t>>(groups);
  const size_t ws_f16 = WorkspaceBytes<WgradGemm<cutlass::half_t>>(groups);
  ScratchLayout l{};
  size_t off = 0;
  auto take = [&](size_t n) {
    const size_t at = off;
    off = RoundUp(off + n, kScratchAlign);
    return at;
  };
  l.info = take(2 * sizeof(int64_t));
  l.shapes = take(g * sizeof(ShapeMNK));
  l.ptr_a = take(g * sizeof(void*));
  l.ptr_b = take(g * sizeof(void*));
  l.ptr_d = take(g * sizeof(void*));
  l.stride_a = take(g * sizeof(StrideA));
  l.stride_b = take(g * sizeof(StrideB));
  l.stride_d = take(g * sizeof(StrideD));
  l.empty = take(g * sizeof(int32_t));
  l.workspace = take(ws_bf16 > ws_f16 ? ws_bf16 : ws_f16);
  l.expand = take(gather ? static_cast<size_t>(m) * static_cast<size_t>(k) * 2 : 0);
  l.bytes = off + kScratchAlign;
  return l;
}

// ---------------------------------------------------------------------------
// Device: the group arrays, the gather expand and the empty experts
// ---------------------------------------------------------------------------

// One block: expert e gets rows [min(P_e, M), min(P_{e+1}, M)) (P: prefix sum
// of max(size, 0), scanned 1024 experts per pass by ForEachExpertRows), i.e.
// the problem (n, k, rows) with pointers to its first rows of dy and x (b: x
// or its expansion) and to out[e]; an expert with no rows gets the empty
// problem and its index goes to `empty`, in expert order (a second scan of
// each pass). info[0]: min(P_E, M), the rows in use; info[1]: the number of
// empty experts.
template <typename Element>
__global__ void __launch_bounds__(kSetupThreads)
    WgradSetupKernel(const int32_t* __restrict__ sizes, int64_t groups, int64_t m, int n, int k,
                     const Element* dy, const Element* b, Element* out, StrideA sa, StrideB sb,
                     StrideD sd, ShapeMNK* shapes, const Element** ptr_a, const Element** ptr_b,
                     Element** ptr_d, StrideA* stride_a, StrideB* stride_b, StrideD* stride_d,
                     int32_t* empty, int64_t* info) {
  using Scan = cub::BlockScan<int64_t, kSetupThreads>;
  __shared__ typename Scan::TempStorage scan;
  int64_t empty_carry = 0;  // empty experts before this pass
  const int64_t rows_used = ForEachExpertRows<kSetupThreads>(
      sizes, groups, m, scan, [&](int64_t e, int64_t start, int64_t end) {
        const int64_t is_empty = e < groups && end == start ? 1 : 0;
        int64_t slot, pass_empty;
        __syncthreads();  // `scan` is reused
        Scan(scan).ExclusiveSum(is_empty, slot, pass_empty);
        if (e < groups) {
          const int rows = static_cast<int>(end - start);
          shapes[e] = is_empty ? ShapeMNK(0, k, 0) : ShapeMNK(n, k, rows);
          ptr_a[e] = dy + start * n;
          ptr_b[e] = b + start * k;
          ptr_d[e] = out + e * static_cast<int64_t>(n) * k;
          stride_a[e] = sa;
          stride_b[e] = sb;
          stride_d[e] = sd;
          if (is_empty) empty[empty_carry + slot] = static_cast<int32_t>(e);
        }
        empty_carry += pass_empty;
      });
  if (threadIdx.x == 0) {
    info[0] = rows_used;
    info[1] = empty_carry;
  }
}

// Grid-stride over 16-byte-vector rows of k elements (kv vectors): first,
// with a gather, rows [0, rows_total) of the expansion become x[rows[r] / topk]
// (zero for an invalid entry); then the n rows of out[e] of each empty expert
// become zero.
__global__ void __launch_bounds__(kPrepThreads)
    WgradPrepKernel(const uint4* __restrict__ x, const int32_t* __restrict__ rows, int64_t topk,
                    int64_t limit, uint4* __restrict__ expand, uint4* __restrict__ out,
                    const int32_t* __restrict__ empty, const int64_t* __restrict__ info,
                    int64_t n, int64_t kv) {
  const int64_t gather_rows = rows != nullptr ? info[0] : 0;
  const int64_t total = gather_rows + info[1] * n;
  const uint4 zero = make_uint4(0, 0, 0, 0);
  for (int64_t r = blockIdx.x; r < total; r += gridDim.x) {
    const uint4* from = nullptr;
    uint4* to;
    if (r < gather_rows) {
      to = expand + r * kv;
      const int64_t src = ExpandSourceRow(rows[r], topk, limit);
      if (src >= 0) from = x + src * kv;
    } else {
      const int64_t j = r - gather_rows;
      to = out + (empty[j / n] * n + j % n) * kv;
    }
    if (from != nullptr) {
#pragma unroll 4
      for (int64_t c = threadIdx.x; c < kv; c += kPrepThreads) to[c] = from[c];
    } else {
#pragma unroll 4
      for (int64_t c = threadIdx.x; c < kv; c += kPrepThreads) to[c] = zero;
    }
  }
}

// ---------------------------------------------------------------------------
// Host
// ---------------------------------------------------------------------------

template <typename G>
cudaError_t RunWgrad(const Sm90WgradCall& c, int dev, int sms, bool* ran) {
  using Element = typename G::Gemm::ElementA;
  const bool gather = c.rows != nullptr;
  const ScratchLayout l = MakeLayout(c.m, c.k, c.groups, gather);
  char* base = reinterpret_cast<char*>(
      RoundUp(reinterpret_cast<uintptr_t>(c.scratch), kScratchAlign));
  if (c.scratch == nullptr || base + (l.bytes - kScratchAlign) >
                                  static_cast<char*>(c.scratch) + c.scratch_bytes)
    return cudaSuccess;  // sized for another configuration: fall back
  auto* info = reinterpret_cast<int64_t*>(base + l.info);
  auto* shapes = reinterpret_cast<ShapeMNK*>(base + l.shapes);
  auto* ptr_a = reinterpret_cast<const Element**>(base + l.ptr_a);
  auto* ptr_b = reinterpret_cast<const Element**>(base + l.ptr_b);
  auto* ptr_d = reinterpret_cast<Element**>(base + l.ptr_d);
  auto* stride_a = reinterpret_cast<StrideA*>(base + l.stride_a);
  auto* stride_b = reinterpret_cast<StrideB*>(base + l.stride_b);
  auto* stride_d = reinterpret_cast<StrideD*>(base + l.stride_d);
  auto* empty = reinterpret_cast<int32_t*>(base + l.empty);
  const auto* b = static_cast<const Element*>(
      gather ? static_cast<const void*>(base + l.expand) : c.x);

  typename G::Gemm gemm;
#ifdef JAX_MOE_WGRAD_RASTER_N
  // Benchmark-only: tiles handed out along N, so that the CTAs running at
  // once write whole rows of out[e] rather than columns of tiles.
  const auto raster = [](typename G::Gemm::Arguments& args) {
    args.scheduler.raster_order = decltype(args.scheduler.raster_order)::AlongN;
  };
#else
  const auto raster = [](typename G::Gemm::Arguments&) {};
#endif
  if (!InitGrouped(gemm, c.groups, shapes, ptr_a, stride_a, ptr_b, stride_b, ptr_d, stride_d, dev,
                   sms, base + l.workspace, l.expand - l.workspace, c.stream, raster))
    return cudaSuccess;

  const int n = static_cast<int>(c.n), k = static_cast<int>(c.k);
  // Leading dimensions n (A), k (B and D); one group per problem (L = 1).
  WgradSetupKernel<Element><<<1, kSetupThreads, 0, c.stream>>>(
      c.sizes, c.groups, c.m, n, k, static_cast<const Element*>(c.dy), b,
      static_cast<Element*>(c.out), cutlass::make_cute_packed_stride(StrideA{}, {n, 1, 1}),
      cutlass::make_cute_packed_stride(StrideB{}, {k, 1, 1}),
      cutlass::make_cute_packed_stride(StrideD{}, {1, k, 1}), shapes, ptr_a, ptr_b, ptr_d,
      stride_a, stride_b, stride_d, empty, info);
  cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) return err;
  *ran = true;  // from here on, the call is ours (errors are reported, not retried)
  WgradPrepKernel<<<static_cast<unsigned>(sms) * 16, kPrepThreads, 0, c.stream>>>(
      static_cast<const uint4*>(c.x), c.rows, c.topk, c.x_rows * c.topk,
      reinterpret_cast<uint4*>(base + l.expand), static_cast<uint4*>(c.out), empty, info, c.n,
      c.k / 8);
  err = cudaGetLastError();
  if (err != cudaSuccess) return err;
  return RunGemm(gemm, c.stream);
}

}  // namespace

int64_t GroupGemmWgradSm90ScratchBytes(int64_t m, int64_t k, int64_t groups, bool gather) {
  if (m < 0 || k < 0 || groups < 1) return 0;
  return static_cast<int64_t>(MakeLayout(m, k, groups, gather).bytes);
}

cudaError_t GroupGemmWgradSm90(const Sm90WgradCall& c, bool* ran) {
  *ran = false;
  if (c.m < 0 || c.m > kInt32Max || c.n <= 0 || c.n > kInt32Max || c.k <= 0 ||
      c.k > kInt32Max || c.groups <= 0 || c.groups > kInt32Max || c.n % 8 != 0 ||
      c.k % 8 != 0 || !Aligned16(c.dy) || !Aligned16(c.x) || !Aligned16(c.out))
    return cudaSuccess;
  int dev = 0, sms = 0;
  if (!UsableDevice(reinterpret_cast<const void*>(WgradPrepKernel), &dev, &sms))
    return cudaSuccess;
  if (c.max_ctas > 0 && c.max_ctas < sms) sms = c.max_ctas;
  return c.bf16 ? RunWgrad<WgradGemm<cutlass::bfloat16_t>>(c, dev, sms, ran)
                : RunWgrad<WgradGemm<cutlass::half_t>>(c, dev, sms, ran);
}

}  // namespace jax_moe

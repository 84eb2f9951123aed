// The Hopper fp8 grouped GEMM's implementation, a template over the CUTLASS
// configuration (M tile, cluster, schedule); fp8_sm90a.cu instantiates the
// ones the library runs. A call is three launches (four with a tail
// configuration), no host sync:
//  1. a one-block set-up kernel writes each expert's problem (rows, n, k),
//     pointers, strides and scale layouts (the shapes depend on expert_sizes,
//     which live on the device);
//  2. a prep kernel quantises x per row (gathered from the tokens' rows with
//     a gather; with an activation, act(gate) * up of x's row rounded to
//     bf16, as the activation kernel) and 128 channels into the scratch
//     (kernels/common/fp8_e4m3.h's rule: the same codes as the CPU kernel and
//     the twin), each expert's scales M-major and packed ([block][row of the
//     expert], from the expert's first row times the blocks on: CUTLASS
//     derives every scale layout from the expert's shape), transposes
//     w_scale to [expert][k block][n block] (CUTLASS's sm90 kernel takes
//     MN-major scales only) and zeroes the rows past the groups;
//  3. CUTLASS's ptr-array blockwise-scaled fp8 kernel (TMA + wgmma, e4m3 x
//     e4m3, f32 accumulation promoted per 128-channel block with both
//     operands' scales);
//  4. with a tail configuration, that kernel in smaller tiles on the rows
//     of each expert that the first launch leaves (Fp8HeadRows), a second
//     problem an expert.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include <cub/block/block_scan.cuh>

#include "cutlass/detail/blockwise_scale_layout.hpp"

#include "kernels/common/fp8_e4m3.h"
#include "kernels/common/gemm_dims.h"
#include "kernels/cuda/act_math.cuh"
#include "kernels/cuda/group_gemm/expert_rows.cuh"
#include "kernels/cuda/group_gemm/fp8_quant.cuh"
#include "kernels/cuda/group_gemm/fp8_sm90a.h"
#include "kernels/cuda/group_gemm/sm90_common.cuh"

namespace jax_moe {
namespace {

using namespace cute;

constexpr int kSetupThreads = 1024;
constexpr int kPrepThreads = 256;
constexpr int kPrepPasses = 4;  // the prep kernel's 256-channel passes a step

using Element = cutlass::float_e4m3_t;
using ElementD = cutlass::bfloat16_t;
using LayoutA = cutlass::layout::RowMajor;     // x quantised (M, K)
using LayoutB = cutlass::layout::ColumnMajor;  // w[e] (N, K) row-major: both K-major
using LayoutD = cutlass::layout::RowMajor;     // out (M, N)
using StrideA = cutlass::detail::TagToStrideA_t<LayoutA*>;
using StrideB = cutlass::detail::TagToStrideB_t<LayoutB*>;
using StrideD = cutlass::detail::TagToStrideC_t<LayoutD*>;
using InternalStrideA = cute::remove_pointer_t<StrideA>;
using InternalStrideB = cute::remove_pointer_t<StrideB>;
using InternalStrideD = cute::remove_pointer_t<StrideD>;

// x's scales per row and 128 channels, w's per 128 x 128 block; both
// MN-major (CUTLASS's sm90 kernel takes no other).
using ScaleConfig = cutlass::detail::Sm90BlockwiseScaleConfig<1, kFp8Block, kFp8Block>;
using LayoutSFA = decltype(ScaleConfig::deduce_layoutSFA());
using LayoutSFB = decltype(ScaleConfig::deduce_layoutSFB());

// N and K tiles 128: one weight scale a tile, one scale block a k tile.
template <int kTileM, int kClusterM, bool kPingpong>
struct Fp8Gemm {
  using TileShape = Shape<Int<kTileM>, _128, _128>;
  using ClusterShape = Shape<Int<kClusterM>, _1, _1>;
  using EpilogueSchedule =
      cute::conditional_t<kPingpong, cutlass::epilogue::PtrArrayTmaWarpSpecializedPingpong,
                          cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative>;
  using KernelSchedule = cute::conditional_t<
      kPingpong, cutlass::gemm::KernelPtrArrayTmaWarpSpecializedPingpongFP8Blockwise,
      cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperativeFP8Blockwise>;
  using Epilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
      cutlass::epilogue::collective::EpilogueTileAuto, float, float,
      void, LayoutD*, 8,  // no C: D = alpha * acc
      ElementD, LayoutD*, 8, EpilogueSchedule,
      cutlass::epilogue::fusion::LinearCombination<ElementD, float>>::CollectiveOp;
  using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Element,
      cute::tuple<LayoutA*, LayoutSFA*>, 16, Element, cute::tuple<LayoutB*, LayoutSFB*>, 16,
      float, TileShape, ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(
          sizeof(typename Epilogue::SharedStorage))>,
      KernelSchedule>::CollectiveOp;
  using Kernel = cutlass::gemm::kernel::GemmUniversal<ProblemShape, Mainloop, Epilogue>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
  static_assert(std::is_same_v<typename Kernel::InternalStrideA, InternalStrideA> &&
                std::is_same_v<typename Kernel::InternalStrideB, InternalStrideB> &&
                std::is_same_v<typename Kernel::InternalStrideD, InternalStrideD>);
};

// Where each part of the call's scratch lives (byte offsets from the
// 256-byte aligned base); `bytes` includes the slack for aligning the base.
struct ScratchLayout {
  size_t row0, shapes, ptr_a, ptr_b, ptr_sfa, ptr_sfb, ptr_d, stride_a, stride_b, stride_d,
      layout_sfa, layout_sfb, workspace, tail_workspace, xq, sxa, swt;
  size_t bytes;
};

// `workspace_bytes`, `tail_workspace_bytes`: the CUTLASS workspaces of the
// configurations run; with `tail`, a second launch whose problems take the
// second half of each problem array.
ScratchLayout MakeLayout(int64_t m, int64_t n, int64_t k, int64_t groups,
                         size_t workspace_bytes, bool tail, size_t tail_workspace_bytes) {
  const size_t g = static_cast<size_t>(groups) * (tail ? 2 : 1);
  const size_t kb = static_cast<size_t>((k + kFp8Block - 1) / kFp8Block);
  const size_t nb = static_cast<size_t>((n + kFp8Block - 1) / kFp8Block);
  ScratchLayout l{};
  size_t off = 0;
  auto take = [&](size_t bytes) {
    const size_t at = off;
    off = RoundUp(off + bytes, kScratchAlign);
    return at;
  };
  l.row0 = take((static_cast<size_t>(groups) + 1) * sizeof(int64_t));
  l.shapes = take(g * sizeof(ShapeMNK));
  l.ptr_a = take(g * sizeof(void*));
  l.ptr_b = take(g * sizeof(void*));
  l.ptr_sfa = take(g * sizeof(void*));
  l.ptr_sfb = take(g * sizeof(void*));
  l.ptr_d = take(g * sizeof(void*));
  l.stride_a = take(g * sizeof(InternalStrideA));
  l.stride_b = take(g * sizeof(InternalStrideB));
  l.stride_d = take(g * sizeof(InternalStrideD));
  l.layout_sfa = take(g * sizeof(LayoutSFA));
  l.layout_sfb = take(g * sizeof(LayoutSFB));
  l.workspace = take(workspace_bytes);
  l.tail_workspace = take(tail_workspace_bytes);
  l.xq = take(static_cast<size_t>(m) * static_cast<size_t>(k));
  l.sxa = take(static_cast<size_t>(m) * kb * sizeof(float));
  l.swt = take(static_cast<size_t>(groups) * nb * kb * sizeof(float));
  l.bytes = off + kScratchAlign;
  return l;
}

// With a tail launch, the rows of an expert that the 128-row tiles take: all
// but a last partial tile of at most 64 rows, which the tail's 64-row tiles
// take (so a tile computes at most 64 rows that are not there).
__host__ __device__ constexpr int64_t Fp8HeadRows(int64_t rows) {
  return rows % 128 != 0 && rows % 128 <= 64 ? rows - rows % 128 : rows;
}

// One block: expert e gets rows [min(P_e, M), min(P_{e+1}, M)) (P: the prefix
// sum of max(size, 0); ForEachExpertRows), as every grouped GEMM here;
// row0[e] is its first row, row0[groups] = min(P_E, M) the first row past the
// groups. Its x scales are the (k blocks, rows) M-major block at
// sxa + row0[e] * k blocks. With `tail`, problem e is the expert's first
// Fp8HeadRows rows and problem groups + e the rest, each with its own scale
// block.
__global__ void __launch_bounds__(kSetupThreads)
    Fp8SetupKernel(const int32_t* __restrict__ sizes, int64_t groups, int64_t m, int n, int k,
                   const Element* xq, const float* sxa, const Element* w, const float* swt,
                   ElementD* d, ShapeMNK* shapes, const Element** ptr_a, const Element** ptr_b,
                   const float** ptr_sfa, const float** ptr_sfb, ElementD** ptr_d,
                   InternalStrideA* stride_a, InternalStrideB* stride_b,
                   InternalStrideD* stride_d, LayoutSFA* layout_sfa, LayoutSFB* layout_sfb,
                   int64_t* row0, bool tail) {
  __shared__ typename cub::BlockScan<int64_t, kSetupThreads>::TempStorage scan;
  const int kb = (k + kFp8Block - 1) / kFp8Block, nb = (n + kFp8Block - 1) / kFp8Block;
  const int64_t rows_total = ForEachExpertRows<kSetupThreads>(
      sizes, groups, m, scan, [&](int64_t e, int64_t start, int64_t end) {
        if (e >= groups) return;
        // Problem p: rows [from, from + rows) of the call, expert e's weights.
        auto problem = [&](int64_t p, int64_t from, int rows) {
          shapes[p] = ShapeMNK(rows, n, k);
          ptr_a[p] = xq + from * k;
          ptr_b[p] = w + e * static_cast<int64_t>(n) * k;
          ptr_sfa[p] = sxa + from * kb;
          ptr_sfb[p] = swt + e * static_cast<int64_t>(nb) * kb;
          ptr_d[p] = d + from * n;
          stride_a[p] = cutlass::make_cute_packed_stride(InternalStrideA{}, {rows, k, 1});
          stride_b[p] = cutlass::make_cute_packed_stride(InternalStrideB{}, {n, k, 1});
          stride_d[p] = cutlass::make_cute_packed_stride(InternalStrideD{}, {rows, n, 1});
          layout_sfa[p] = ScaleConfig::tile_atom_to_shape_SFA(make_shape(rows, n, k, 1));
          layout_sfb[p] = ScaleConfig::tile_atom_to_shape_SFB(make_shape(rows, n, k, 1));
        };
        const int64_t head = tail ? Fp8HeadRows(end - start) : end - start;
        problem(e, start, static_cast<int>(head));
        if (tail) problem(groups + e, start + head, static_cast<int>(end - start - head));
        row0[e] = start;
      });
  if (threadIdx.x == 0) row0[groups] = rows_total;
}

// One warp a row (grid-stride over the rows in the groups): lane l takes 8
// channels (one 16-byte load; k % 16 == 0 and x 16-byte aligned: all 8 in
// k or all past it) of each 256-channel pass, 16 lanes a 128-channel block,
// kPrepPasses passes a step.
// The row's expert is looked up once. A block's scale from its half-warp's
// amax, its codes in one 8-byte store, the scale at its place in its
// expert's packed block. Then w_scale transposed and the rows
// [row0[groups], m) of out zeroed (16-byte stores, n % 8 == 0).
// kAct >= 0: x's rows are the previous GEMM's (gate, up) (kGated, pitch 2k)
// or its rows (pitch k), and the quantised row is act(gate) * up, or act(x),
// rounded to bf16: the activation kernel's arithmetic (act_math.cuh).
template <int kAct, bool kGated>
__global__ void __launch_bounds__(kPrepThreads)
    Fp8PrepKernel(const uint16_t* __restrict__ x, const int32_t* __restrict__ gather,
                  int64_t topk, int64_t limit, uint8_t* __restrict__ xq,
                  float* __restrict__ sxa, const float* __restrict__ w_scale,
                  float* __restrict__ swt, uint4* __restrict__ out,
                  const int64_t* __restrict__ row0, int64_t m, int64_t n, int64_t k,
                  int64_t groups, bool tail) {
  constexpr bool kUp = kAct >= 0 && kGated;  // a second load a pass: the up half
  const int64_t kb = (k + kFp8Block - 1) / kFp8Block, nb = (n + kFp8Block - 1) / kFp8Block;
  const int64_t pitch = kUp ? 2 * k : k;  // x's row
  const int64_t rows_total = row0[groups];
  const int lane = threadIdx.x & 31;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * (kPrepThreads / 32);
  const int64_t warp0 = static_cast<int64_t>(blockIdx.x) * (kPrepThreads / 32) + (threadIdx.x >> 5);
  for (int64_t r = warp0; r < rows_total; r += warps) {
    // The row's expert: the last e with row0[e] <= r (an empty expert shares
    // its start with the next one, so the last such e owns r).
    int64_t lo = 0, hi = groups - 1;
    while (lo < hi) {
      const int64_t mid = (lo + hi + 1) / 2;
      if (row0[mid] <= r) lo = mid;
      else hi = mid - 1;
    }
    int64_t start = row0[lo], rows = row0[lo + 1] - start;
    if (tail) {  // the row's problem: the expert's head or its tail (Fp8SetupKernel)
      const int64_t head = Fp8HeadRows(rows);
      if (r - start < head) rows = head;
      else start += head, rows -= head;
    }
    // The row's source: row r of x, or with a gather the token row of entry r
    // (none: a zero row, whose codes and scale are those of zeros).
    const int64_t from = gather == nullptr ? r : ExpandSourceRow(gather[r], topk, limit);
    const uint16_t* xr = x + (from >= 0 ? from : 0) * pitch;
    uint8_t* qr = xq + r * k;
    float* sr = sxa + start * kb + (r - start);  // + block * rows
    // kPrepPasses passes a step, their loads issued first: one 16-byte load
    // a lane at a time leaves too few bytes in flight to read at the copy rate.
    for (int64_t pass0 = 0; pass0 < kb; pass0 += 2 * kPrepPasses) {  // uniform: shuffles below
      uint4 raw[kPrepPasses], up[kUp ? kPrepPasses : 1];
#pragma unroll
      for (int p = 0; p < kPrepPasses; ++p) {
        const int64_t c0 = (pass0 + 2 * p) * kFp8Block + lane * 8;
        const bool in = c0 < k && from >= 0;
        raw[p] = in ? *reinterpret_cast<const uint4*>(xr + c0) : make_uint4(0, 0, 0, 0);
        if constexpr (kUp)
          up[p] = in ? *reinterpret_cast<const uint4*>(xr + k + c0) : make_uint4(0, 0, 0, 0);
      }
#pragma unroll
      for (int p = 0; p < kPrepPasses; ++p) {
        if (pass0 + 2 * p >= kb) break;  // uniform: no work on a pass wholly past k
        const int64_t c0 = (pass0 + 2 * p) * kFp8Block + lane * 8;
        float v[8];
        Unpack<DType::BF16>(raw[p], v);
        if constexpr (kAct >= 0) {  // zeros past k stay zero: act(0) = 0
          float u[8];
          if constexpr (kUp) Unpack<DType::BF16>(up[p], u);
#pragma unroll
          for (int j = 0; j < 8; ++j) {
            float a = Act<kAct>(v[j]);
            if constexpr (kUp) a *= u[j];
            v[j] = __bfloat162float(__float2bfloat16_rn(a));
          }
        }
        const float scale = Fp8HalfWarpScale(v);  // every lane: a block past k is all zeros
        if (c0 < k) {
          *reinterpret_cast<uint2*>(qr + c0) = Fp8Codes8(v, 1.0f / scale);
          if ((lane & 15) == 0) sr[(c0 / kFp8Block) * rows] = scale;
        }
      }
    }
  }
  const int64_t tid = static_cast<int64_t>(blockIdx.x) * kPrepThreads + threadIdx.x;
  const int64_t threads = static_cast<int64_t>(gridDim.x) * kPrepThreads;
  for (int64_t i = tid; i < groups * nb * kb; i += threads) {  // i: [e][kb][nb] of swt
    const int64_t e = i / (nb * kb), rest = i % (nb * kb), bk = rest / nb, bn = rest % nb;
    swt[i] = w_scale[(e * nb + bn) * kb + bk];
  }
  const int64_t nv = n / 8;
  for (int64_t i = tid; i < (m - rows_total) * nv; i += threads)
    out[rows_total * nv + i] = make_uint4(0, 0, 0, 0);
}

// The prep kernel for an activation (-1: none) and its gating.
using Fp8PrepFn = decltype(&Fp8PrepKernel<-1, false>);
inline Fp8PrepFn Fp8PrepKernelFor(int activation, bool gated) {
  switch (activation) {
    case kSilu: return gated ? Fp8PrepKernel<kSilu, true> : Fp8PrepKernel<kSilu, false>;
    case kGeluExact:
      return gated ? Fp8PrepKernel<kGeluExact, true> : Fp8PrepKernel<kGeluExact, false>;
    case kGeluTanh:
      return gated ? Fp8PrepKernel<kGeluTanh, true> : Fp8PrepKernel<kGeluTanh, false>;
    default: return Fp8PrepKernel<-1, false>;
  }
}

// Host: the CUTLASS workspace of configuration G, 0 for void (no launch).
template <typename G>
size_t Fp8WorkspaceBytes(int64_t groups) {
  if constexpr (std::is_void_v<G>) return 0;
  else return WorkspaceBytes<G>(groups);
}

// GroupGemmFp8Sm90 (fp8_sm90a.h) on configuration G, or with a Tail
// configuration, G on each expert's Fp8HeadRows rows and Tail on the rest,
// launched after G.
template <typename G, typename Tail = void>
cudaError_t RunFp8(const Sm90Fp8Call& c, bool* ran) {
  constexpr bool kTail = !std::is_void_v<Tail>;
  *ran = false;
  if (c.m <= 0 || c.m > kInt32Max || c.n <= 0 || c.n > kInt32Max || c.k <= 0 ||
      c.k > kInt32Max || c.groups <= 0 || c.groups > kInt32Max || c.n % 8 != 0 ||
      c.k % 16 != 0 || c.m * ((c.k + kFp8Block - 1) / kFp8Block) > kInt32Max ||
      !Aligned16(c.x) || !Aligned16(c.w) || !Aligned16(c.out))
    return cudaSuccess;
  int dev = 0, sms = 0;
  if (!UsableDevice(reinterpret_cast<const void*>(Fp8PrepKernel<-1, false>), &dev, &sms))
    return cudaSuccess;
  const ScratchLayout l = MakeLayout(c.m, c.n, c.k, c.groups, WorkspaceBytes<G>(c.groups),
                                    kTail, Fp8WorkspaceBytes<Tail>(c.groups));
  char* base = reinterpret_cast<char*>(
      RoundUp(reinterpret_cast<uintptr_t>(c.scratch), kScratchAlign));
  if (c.scratch == nullptr || base + (l.bytes - kScratchAlign) >
                                  static_cast<char*>(c.scratch) + c.scratch_bytes)
    return cudaSuccess;  // Python sized it for another configuration: fall back
  auto* shapes = reinterpret_cast<ShapeMNK*>(base + l.shapes);
  auto* ptr_a = reinterpret_cast<const Element**>(base + l.ptr_a);
  auto* ptr_b = reinterpret_cast<const Element**>(base + l.ptr_b);
  auto* ptr_sfa = reinterpret_cast<const float**>(base + l.ptr_sfa);
  auto* ptr_sfb = reinterpret_cast<const float**>(base + l.ptr_sfb);
  auto* ptr_d = reinterpret_cast<ElementD**>(base + l.ptr_d);
  auto* stride_a = reinterpret_cast<InternalStrideA*>(base + l.stride_a);
  auto* stride_b = reinterpret_cast<InternalStrideB*>(base + l.stride_b);
  auto* stride_d = reinterpret_cast<InternalStrideD*>(base + l.stride_d);
  auto* layout_sfa = reinterpret_cast<LayoutSFA*>(base + l.layout_sfa);
  auto* layout_sfb = reinterpret_cast<LayoutSFB*>(base + l.layout_sfb);
  auto* row0 = reinterpret_cast<int64_t*>(base + l.row0);
  auto* xq = reinterpret_cast<uint8_t*>(base + l.xq);
  auto* sxa = reinterpret_cast<float*>(base + l.sxa);
  auto* swt = reinterpret_cast<float*>(base + l.swt);

  // Sets `gemm` up for problems [p0, p0 + groups) of the arrays.
  auto init = [&](auto& gemm, int64_t p0, size_t workspace, size_t workspace_bytes) {
    using Args = typename std::remove_reference_t<decltype(gemm)>::Arguments;
    return InitGrouped(gemm, c.groups, shapes + p0, ptr_a + p0, stride_a + p0, ptr_b + p0,
                       stride_b + p0, ptr_d + p0, stride_d + p0, dev, sms, base + workspace,
                       workspace_bytes, c.stream, [&](Args& args) {
                         args.mainloop.ptr_SFA = ptr_sfa + p0;
                         args.mainloop.layout_SFA = layout_sfa + p0;
                         args.mainloop.ptr_SFB = ptr_sfb + p0;
                         args.mainloop.layout_SFB = layout_sfb + p0;
                       });
  };
  typename G::Gemm gemm;
  if (!init(gemm, 0, l.workspace, l.tail_workspace - l.workspace)) return cudaSuccess;
  using TailGemm = typename cute::conditional_t<kTail, Tail, G>::Gemm;
  TailGemm tail_gemm;
  if constexpr (kTail) {
    if (!init(tail_gemm, c.groups, l.tail_workspace, l.xq - l.tail_workspace)) return cudaSuccess;
  }

  const int n = static_cast<int>(c.n), k = static_cast<int>(c.k);
  Fp8SetupKernel<<<1, kSetupThreads, 0, c.stream>>>(
      c.sizes, c.groups, c.m, n, k, reinterpret_cast<const Element*>(xq), sxa,
      reinterpret_cast<const Element*>(c.w), swt, static_cast<ElementD*>(c.out), shapes, ptr_a,
      ptr_b, ptr_sfa, ptr_sfb, ptr_d, stride_a, stride_b, stride_d, layout_sfa, layout_sfb,
      row0, kTail);
  cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) return err;
  *ran = true;  // from here on, the call is ours (errors are reported, not retried)
  // A warp a row, up to 8 blocks (64 warps) an SM.
  const int64_t want = (c.m + kPrepThreads / 32 - 1) / (kPrepThreads / 32);
  const int64_t cap = static_cast<int64_t>(sms) * 8;
  const unsigned prep_blocks = static_cast<unsigned>(want < sms ? sms : (want < cap ? want : cap));
  Fp8PrepKernelFor(c.activation, c.gated)<<<prep_blocks, kPrepThreads, 0, c.stream>>>(
      static_cast<const uint16_t*>(c.x), c.rows, c.topk, c.x_rows * c.topk, xq, sxa, c.w_scale,
      swt, static_cast<uint4*>(c.out),
      row0, c.m, c.n, c.k, c.groups, kTail);
  err = cudaGetLastError();
  if (err != cudaSuccess) return err;
  err = RunGemm(gemm, c.stream);
  if constexpr (kTail) {
    if (err == cudaSuccess) err = RunGemm(tail_gemm, c.stream);
  }
  return err;
}

}  // namespace
}  // namespace jax_moe

// Steps 4 and 6 on Hopper (tile_m = 256): the grouped GEMM as a CUTLASS 3.x
// ptr-array grouped GEMM (TMA loads and stores, wgmma, warp-specialized
// cooperative kernel, persistent grid). Same semantics as dispatch.cu:
// out[rows of expert e] = x[rows of e] @ w[e]^T with f32 accumulation, expert
// e owning rows [min(P_e, M), min(P_{e+1}, M)) where P is the prefix sum of
// max(size, 0), and rows [min(P_E, M), M) zero.
//
// Design
//  * Compiled for sm_90a only (wgmma and TMA are "arch conditional": a plain
//    sm_90 target builds a kernel that only reports an error at run time;
//    CMake builds every *_sm90a.cu so). The group_gemm handler
//    (csrc/ffi/group_gemm.cc) calls GroupGemmSm90 for tile_m = 256 and falls
//    back to the 128-row mma.sync kernel when it does not apply.
//  * No host sync: the per-expert problem shapes and the A/B/D pointer and
//    stride arrays are written on the device by a one-block kernel from
//    expert_sizes (CUTLASS gets host_problem_shapes = nullptr and reads the
//    shapes on the device). The CUTLASS workspace (one TMA descriptor set per
//    SM) depends only on the SM count, so its size is known without device
//    data. Everything lives in the call's scratch output (an XLA buffer sized
//    in Python by GroupGemmSm90ScratchBytes), not in the FFI scratch allocator's
//    memory: that memory is freed when the handler returns, while a CUDA
//    graph recorded from the handler (kCmdBufferCompatible) replays the
//    same addresses later.
//  * Gather (step 3 fused): TMA cannot gather rows, so the rows are first
//    expanded into the scratch (16-byte vector copies, zero rows for invalid
//    sources) and the GEMM reads that buffer.
//  * Tail rows [rows_total, M) are zeroed by the same prep kernel; empty
//    experts get an M = 0 problem, which the group tile scheduler skips.
//  * Tiles: 64x128x64 (pingpong: each consumer warpgroup owns a tile) while
//    experts average < kSkinnyRows rows, where a 128-row tile would be mostly
//    padding; from there 128x256x64 where N >= 256, else 128x128x64. At 64,
//    128 and 192 rows per expert the 128x256 tiles were faster than 128x128
//    on every GEMM measured on the H200 (docs/performance.md).
//    All on one-CTA clusters: a 2x1 cluster (the weight tile multicast to a
//    pair of M tiles) rounds every expert's rows up to 256, and at 256-512
//    rows per expert on average that padding cost more than the multicast
//    saved; at 2048 rows per expert the two were equal. 1x2 clusters (A
//    multicast) and 128x128 pingpong were in between (docs/performance.md).
//    The persistent group scheduler has no split-K or stream-K: each output
//    is summed by one CTA in a fixed K order, so results are bitwise
//    reproducible run to run (but not equal to the mma.sync tiles' bits).
//  * Two layouts of w: (E, N, K) for the forward (this file) and (E, K, N)
//    for the dgrad (gemm_kn_sm90a.cu, w_kn), from one template
//    (gemm_sm90a.cuh). bf16 and f16 only, 3 tile configs: 6 CUTLASS
//    instantiations per file, the bulk of the build's compile time.
#include "kernels/cuda/group_gemm/gemm_sm90a.cuh"

namespace jax_moe {

int64_t GroupGemmSm90ScratchBytes(int64_t m, int64_t k, int64_t groups, bool gather) {
  const int64_t nk = ScratchBytesSm90<cutlass::layout::ColumnMajor>(m, k, groups, gather);
  const int64_t kn = GroupGemmSm90KnScratchBytes(m, k, groups, gather);
  return nk > kn ? nk : kn;
}

cudaError_t GroupGemmSm90(const Sm90GemmCall& c, bool* ran) {
  if (c.w_kn) return GroupGemmSm90Kn(c, ran);
  return DispatchSm90<cutlass::layout::ColumnMajor>(c, ran);
}

}  // namespace jax_moe

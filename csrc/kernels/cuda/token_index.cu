// Step 2 on the GPU: a stable counting sort of the flat (token, slot) entries
// by local expert id, in three launches with no host round trip:
//   count : per-chunk histograms           -> scratch[chunk][expert]
//   scan  : a warp per expert: its total (expert_sizes) and each chunk's
//           first slot within the expert   -> scratch[chunk][expert]
//   place : one warp per chunk adds the experts' offsets (an exclusive scan
//           of expert_sizes, redone per chunk: E is small) and walks its
//           entries in order; lanes with the same expert get consecutive
//           slots via __match_any_sync, so the order inside an expert is the
//           flat order (stable), as on the CPU. Past the placed rows,
//           dst_to_src gets -1.
// The scan and place kernels issue their global loads together before they
// use them: these kernels are a few dependent loads each, so latency is
// their whole cost (a serial scan over the chunks measured slow at 65536
// entries on the H200; see docs/performance.md).
// Up to one chunk of entries (decode batches) one warp does all three steps in
// a single launch, with the expert offsets in shared memory.
#include "kernels/cuda/token_index.h"

#include "kernels/cuda/cuda_common.cuh"

namespace jax_moe {
namespace {

__device__ __forceinline__ int LocalId(int32_t id, int64_t start, int local) {
  int64_t e = static_cast<int64_t>(id) - start;
  return (e >= 0 && e < local) ? static_cast<int>(e) : -1;
}

__global__ void CountKernel(const int32_t* __restrict__ ids, int64_t n, int64_t start,
                            int local, int32_t* __restrict__ scratch) {
  PdlWait();  // launched with PDL: its inputs may be the previous kernel's output
  PdlTrigger();
  extern __shared__ int32_t hist[];
  for (int e = threadIdx.x; e < local; e += blockDim.x) hist[e] = 0;
  __syncthreads();
  const int64_t begin = static_cast<int64_t>(blockIdx.x) * kIndexChunk;
  for (int64_t i = begin + threadIdx.x; i < begin + kIndexChunk && i < n; i += blockDim.x) {
    int e = LocalId(ids[i], start, local);
    if (e >= 0) atomicAdd(&hist[e], 1);
  }
  __syncthreads();
  int32_t* out = scratch + static_cast<int64_t>(blockIdx.x) * local;
  for (int e = threadIdx.x; e < local; e += blockDim.x) out[e] = hist[e];
}

constexpr int kScanWarps = 8;  // experts per scan block
constexpr int kScanLoads = 8;  // chunk counts in flight per lane

// Warp per expert e: scratch[c][e] (chunk c's count) becomes the number of e's
// entries in chunks before c; sizes[e] the total.
__global__ void __launch_bounds__(kScanWarps * 32)
    ScanKernel(int64_t chunks, int local, int32_t* __restrict__ scratch,
               int32_t* __restrict__ sizes) {
  PdlWait();  // launched with PDL: its inputs may be the previous kernel's output
  PdlTrigger();
  const int lane = threadIdx.x % 32;
  const int e = blockIdx.x * kScanWarps + threadIdx.x / 32;
  if (e >= local) return;  // warp-uniform
  int32_t run = 0;
  for (int64_t c0 = 0; c0 < chunks; c0 += 32 * kScanLoads) {
    int32_t v[kScanLoads];
#pragma unroll
    for (int j = 0; j < kScanLoads; ++j) {
      const int64_t c = c0 + 32 * j + lane;
      v[j] = c < chunks ? scratch[c * local + e] : 0;
    }
#pragma unroll
    for (int j = 0; j < kScanLoads; ++j) {
      const int32_t incl = WarpInclusiveSum(v[j]);
      const int64_t c = c0 + 32 * j + lane;
      if (c < chunks) scratch[c * local + e] = run + incl - v[j];
      run += __shfl_sync(0xffffffffu, incl, 31);
    }
  }
  if (lane == 0) sizes[e] = run;
}

// One warp: base[e] = counts[0] + ... + counts[e - 1] for e < local (lane
// owns a contiguous segment of experts; counts may alias base), also copied
// to sizes[e] = counts[e] when sizes is given. Returns the total in every
// lane; base is visible to the whole warp on return.
__device__ __forceinline__ int32_t WarpExpertOffsets(const int32_t* counts, int local,
                                                     int32_t* base, int32_t* sizes) {
  const int lane = threadIdx.x % 32;
  const int per = (local + 31) / 32;
  const int b0 = min(lane * per, local), b1 = min(b0 + per, local);
  int32_t seg = 0;
  for (int e = b0; e < b1; ++e) seg += counts[e];
  const int32_t incl = WarpInclusiveSum(seg);
  const int32_t total = __shfl_sync(0xffffffffu, incl, 31);
  int32_t run = incl - seg;
  for (int e = b0; e < b1; ++e) {  // only this lane's segment: no hazard
    const int32_t v = counts[e];
    if (sizes != nullptr) sizes[e] = v;
    base[e] = run;
    run += v;
  }
  __syncwarp();
  return total;
}

// One step of a warp's stable placement: entry i (< end, else unused) of
// local expert e (-1: not placed); `base` holds each expert's next free slot.
// Lanes with the same expert get consecutive slots via __match_any_sync, in
// lane order. The whole warp must call it.
__device__ __forceinline__ void PlaceStep(int e, int64_t i, int64_t end, int32_t* base,
                                          int32_t* __restrict__ src_to_dst,
                                          int32_t* __restrict__ dst_to_src) {
  const int lane = threadIdx.x % 32;
  const unsigned same = __match_any_sync(0xffffffffu, e);
  const int rank = __popc(same & ((1u << lane) - 1u));
  if (e >= 0) {
    const int32_t pos = base[e] + rank;
    src_to_dst[i] = pos;
    dst_to_src[pos] = static_cast<int32_t>(i);
  } else if (i < end) {
    src_to_dst[i] = -1;
  }
  __syncwarp();
  if (e >= 0 && rank == 0) base[e] += __popc(same);
  __syncwarp();
}

// Stable placement of entries [begin, end) by one warp, 32 at a time in flat
// order, each 32 loaded as they are placed: the decode-sized form (T = 1:
// one step).
__device__ __forceinline__ void PlaceChunk(const int32_t* __restrict__ ids, int64_t begin,
                                           int64_t end, int64_t start, int local, int32_t* base,
                                           int32_t* __restrict__ src_to_dst,
                                           int32_t* __restrict__ dst_to_src) {
  for (int64_t i0 = begin; i0 < end; i0 += 32) {
    const int64_t i = i0 + (threadIdx.x % 32);
    PlaceStep(i < end ? LocalId(ids[i], start, local) : -1, i, end, base, src_to_dst, dst_to_src);
  }
}

// The same for a whole chunk (end - begin <= kIndexChunk) whose expert ids
// were loaded up front (LoadChunkIds), so that no step waits on a load.
constexpr int kIdsPerLane = static_cast<int>(kIndexChunk / 32);

__device__ __forceinline__ void LoadChunkIds(const int32_t* __restrict__ ids, int64_t begin,
                                             int64_t end, int64_t start, int local,
                                             int (&e)[kIdsPerLane]) {
  const int lane = threadIdx.x % 32;
#pragma unroll
  for (int j = 0; j < kIdsPerLane; ++j) {
    const int64_t i = begin + 32 * j + lane;
    e[j] = i < end ? LocalId(ids[i], start, local) : -1;
  }
}

__device__ __forceinline__ void PlaceLoadedChunk(const int (&ex)[kIdsPerLane], int64_t begin,
                                                 int64_t end, int32_t* base,
                                                 int32_t* __restrict__ src_to_dst,
                                                 int32_t* __restrict__ dst_to_src) {
#pragma unroll
  for (int j = 0; j < kIdsPerLane; ++j)
    PlaceStep(ex[j], begin + 32 * j + threadIdx.x % 32, end, base, src_to_dst, dst_to_src);
}

// n <= kIndexChunk: histogram, scan and placement by one warp, one launch.
__global__ void SmallIndexKernel(const int32_t* __restrict__ ids, int64_t n, int64_t start,
                                 int local, int32_t* __restrict__ sizes,
                                 int32_t* __restrict__ src_to_dst,
                                 int32_t* __restrict__ dst_to_src) {
  PdlWait();  // launched with PDL: its inputs may be the previous kernel's output
  PdlTrigger();
  extern __shared__ int32_t base[];
  const int lane = threadIdx.x;
  for (int e = lane; e < local; e += 32) base[e] = 0;
  __syncwarp();
  for (int64_t i = lane; i < n; i += 32) {
    const int e = LocalId(ids[i], start, local);
    if (e >= 0) atomicAdd(&base[e], 1);
  }
  __syncwarp();
  const int32_t total = WarpExpertOffsets(base, local, base, sizes);
  PlaceChunk(ids, 0, n, start, local, base, src_to_dst, dst_to_src);
  for (int64_t p = lane; p < n; p += 32)
    if (p >= total) dst_to_src[p] = -1;
}

__global__ void PlaceKernel(const int32_t* __restrict__ ids, int64_t n, int64_t start,
                            int local, const int32_t* __restrict__ scratch,
                            const int32_t* __restrict__ sizes, int32_t* __restrict__ src_to_dst,
                            int32_t* __restrict__ dst_to_src) {
  PdlWait();  // launched with PDL: its inputs may be the previous kernel's output
  PdlTrigger();
  extern __shared__ int32_t base[];  // next free slot per expert for this chunk
  const int lane = threadIdx.x;      // one warp per block
  const int64_t c = blockIdx.x;
  const int64_t begin = c * kIndexChunk;
  const int64_t end = min(begin + kIndexChunk, n);
  int ex[kIdsPerLane];
  LoadChunkIds(ids, begin, end, start, local, ex);
  const int32_t total = WarpExpertOffsets(sizes, local, base, nullptr);
  for (int e = lane; e < local; e += 32) base[e] += scratch[c * local + e];
  __syncwarp();
  PlaceLoadedChunk(ex, begin, end, base, src_to_dst, dst_to_src);
  for (int64_t p = begin + lane; p < end; p += 32)
    if (p >= total) dst_to_src[p] = -1;
}

}  // namespace

cudaError_t LaunchTokenIndex(cudaStream_t stream, const int32_t* ids, int64_t n,
                             int64_t start_expert, int64_t local, int32_t* src_to_dst,
                             int32_t* dst_to_src, int32_t* expert_sizes, int32_t* s,
                             bool chained) {
  const int64_t chunks = (n + kIndexChunk - 1) / kIndexChunk;
  const size_t smem = sizeof(int32_t) * local;
  const int lc = static_cast<int>(local);
  // The first launch follows the router when chained; the later ones follow
  // this step's own kernels, inside this call either way.
  const bool sm90 = DeviceMajor() >= 9, pdl = chained && sm90;
  if (chunks <= 1)  // decode-sized: one launch
    return LaunchKernel(SmallIndexKernel, 1, 32, smem, stream, pdl, ids, n, start_expert, lc,
                        expert_sizes, src_to_dst, dst_to_src);
  const unsigned grid = static_cast<unsigned>(chunks);
  cudaError_t err = LaunchKernel(CountKernel, grid, 256, smem, stream, pdl, ids, n, start_expert,
                                 lc, s);
  if (err == cudaSuccess)
    err = LaunchKernel(ScanKernel, static_cast<unsigned>(CeilDiv(local, kScanWarps)),
                       kScanWarps * 32, 0, stream, sm90, chunks, lc, s, expert_sizes);
  if (err == cudaSuccess)
    err = LaunchKernel(PlaceKernel, grid, 32, smem, stream, sm90, ids, n, start_expert, lc,
                       static_cast<const int32_t*>(s), expert_sizes, src_to_dst, dst_to_src);
  return err;
}

}  // namespace jax_moe

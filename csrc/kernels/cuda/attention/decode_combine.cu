// The combine kernel of paged decode: merges the splits' partial softmax
// states into the output (see paged_decode.cu), and its launcher.
#include <cuda_runtime.h>

#include <cfloat>
#include <cstdint>

#include "kernels/common/attention.h"
#include "kernels/common/numeric.h"
#include "kernels/cuda/attention/decode_common.cuh"
#include "kernels/cuda/attention/launch.h"
#include "kernels/cuda/cuda_common.cuh"

namespace jax_moe {
namespace {


constexpr int kCombineWarps = 4;  // one (sequence, query head) per warp
constexpr int kCombineThreads = 32 * kCombineWarps;
constexpr int kCombineBatch = 8;  // partial outputs in flight per lane (divides 32)

// grid (ceil(rows / kCombineWarps)), kCombineThreads threads; warp w of the
// block merges row bh = batch * hq + head (bh < rows): out = sum_s w_s o_s /
// sum_s w_s l_s over the splits holding tokens, w_s = exp(m_s - max_s m_s);
// no valid token: 0. Compiled for head dim D, it serves V head dims dv <= D
// (multiples of 8): lane l holds elements l * D / 32 .. of every partial
// output (rows of dv) while they lie below dv, and adds the splits in split
// order; the weights of 32 splits are
// computed one per lane and broadcast by shuffle. No shared memory and no
// block barrier: a length, the stats, then the partial outputs
// kCombineBatch splits at a time. Sums run in a fixed order (bitwise
// reproducible run to run).
template <DType DT, int D>
__global__ void __launch_bounds__(kCombineThreads)
    DecodeCombineKernel(const float* __restrict__ part_out, const float* __restrict__ part_stats,
                        const int32_t* __restrict__ lengths, int64_t hq, int64_t rows,
                        int64_t max_tokens, int64_t num_splits, int64_t split, int dv,
                        typename DevScalar<DT>::T* __restrict__ out) {
  using S = DevScalar<DT>;
  constexpr int kE = D / 32;  // elements per lane
  static_assert(D % 32 == 0 && (kE == 2 || kE % 4 == 0), "combine layout");
  PdlWait();  // launched with PDL: the split kernel's partials
  const int lane = threadIdx.x % 32;
  const int64_t bh = blockIdx.x * int64_t{kCombineWarps} + threadIdx.x / 32;
  if (bh >= rows) return;  // warp-uniform
  const int64_t len = ClampLength(lengths[bh / hq], max_tokens);
  int64_t used = (len + split - 1) / split;  // splits holding tokens
  if (used > num_splits) used = num_splits;
  const float* st = part_stats + bh * num_splits * 2;
  // kE (2, 4 or 8) divides dv (a multiple of 8): a lane's elements lie all
  // below dv or all past it. Lanes past it still take part in the shuffles.
  const bool mine = lane * kE < dv;
  const float* po = part_out + bh * num_splits * dv + (mine ? lane * kE : 0);

  float mx = -INFINITY;
  for (int64_t s = lane; s < used; s += 32) mx = fmaxf(mx, st[2 * s]);
  mx = WarpMax(mx);
  float acc[kE];
#pragma unroll
  for (int e = 0; e < kE; ++e) acc[e] = 0.f;
  float den = 0.f;
  for (int64_t c0 = 0; c0 < used; c0 += 32) {
    float ws = 0.f;  // the weight of split c0 + lane
    if (c0 + lane < used) {
      const float ms = st[2 * (c0 + lane)];
      ws = ms == -INFINITY ? 0.f : expf(ms - mx);  // a split without valid token: 0
      den += ws * st[2 * (c0 + lane) + 1];
    }
    // Eight partial outputs are loaded before any is added, so that a row
    // of many splits costs a few memory round trips, not one per split.
    // Past the last split the loads are skipped and the weight is 0.
    const int n = static_cast<int>(used - c0 < 32 ? used - c0 : 32);
    for (int j0 = 0; j0 < n; j0 += kCombineBatch) {
      float x[kCombineBatch][kE];
#pragma unroll
      for (int u = 0; u < kCombineBatch; ++u) {
        const float* row = po + (c0 + j0 + u) * dv;
        const bool live = mine && j0 + u < n;
        if constexpr (kE == 2) {
          const float2 v = live ? *reinterpret_cast<const float2*>(row) : make_float2(0.f, 0.f);
          x[u][0] = v.x;
          x[u][1] = v.y;
        } else {
#pragma unroll
          for (int q = 0; q < kE / 4; ++q) {
            const float4 v = live ? reinterpret_cast<const float4*>(row)[q]
                                  : make_float4(0.f, 0.f, 0.f, 0.f);
            x[u][4 * q] = v.x;
            x[u][4 * q + 1] = v.y;
            x[u][4 * q + 2] = v.z;
            x[u][4 * q + 3] = v.w;
          }
        }
      }
#pragma unroll
      for (int u = 0; u < kCombineBatch; ++u) {
        const float wj = __shfl_sync(0xffffffffu, ws, j0 + u);  // 0 past the last split
#pragma unroll
        for (int e = 0; e < kE; ++e) acc[e] += wj * x[u][e];
      }
    }
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) den += __shfl_xor_sync(0xffffffffu, den, o);
  if (!mine) return;
  auto* dst = out + bh * dv + lane * kE;
#pragma unroll
  for (int e = 0; e < kE; ++e) dst[e] = S::Store(den > 0.f ? acc[e] / den : 0.f);
}

// With PDL (sm_90+) the combine's blocks are resident when the split
// kernel's last blocks finish.
template <DType DT, int D>
cudaError_t LaunchCombine(cudaStream_t stream, const DecodeDims& d, const float* part_out,
                          const float* part_stats, const int32_t* lengths, void* out,
                          bool allow_pdl) {
  using T = typename DevScalar<DT>::T;
  const int64_t out_rows = d.batch * d.hq;
  return LaunchKernel(DecodeCombineKernel<DT, D>, CeilDiv(out_rows, kCombineWarps),
                      kCombineThreads, 0, stream, allow_pdl && DeviceMajor() >= 9, part_out,
                      part_stats, lengths, d.hq, out_rows, d.max_tokens, d.num_splits,
                      d.split_tokens, static_cast<int>(d.v_dim), static_cast<T*>(out));
}

template <DType DT>
cudaError_t DispatchCombine(cudaStream_t stream, const DecodeDims& d, const float* part_out,
                            const float* part_stats, const int32_t* lengths, void* out,
                            bool allow_pdl) {
  switch (DecodeTileDim(d.v_dim)) {
    case 64:
      return LaunchCombine<DT, 64>(stream, d, part_out, part_stats, lengths, out, allow_pdl);
    case 128:
      return LaunchCombine<DT, 128>(stream, d, part_out, part_stats, lengths, out, allow_pdl);
    default:
      return LaunchCombine<DT, 256>(stream, d, part_out, part_stats, lengths, out, allow_pdl);
  }
}

}  // namespace

cudaError_t LaunchDecodeCombine(cudaStream_t stream, DType dtype, const DecodeDims& d,
                                const float* part_out, const float* part_stats,
                                const int32_t* lengths, void* out, bool allow_pdl) {
  switch (dtype) {
    case DType::F32:
      return DispatchCombine<DType::F32>(stream, d, part_out, part_stats, lengths, out,
                                         allow_pdl);
    case DType::BF16:
      return DispatchCombine<DType::BF16>(stream, d, part_out, part_stats, lengths, out,
                                          allow_pdl);
    case DType::F16:
      return DispatchCombine<DType::F16>(stream, d, part_out, part_stats, lengths, out,
                                         allow_pdl);
  }
  return cudaErrorInvalidValue;
}

}  // namespace jax_moe

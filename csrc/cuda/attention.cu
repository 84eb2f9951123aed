// Paged KV cache on the GPU: write_kv (scatter new K/V rows into their slots,
// in place) and flash-decoding attention for one query token per sequence.
//
// Decode runs in two kernels, both with fixed reduction orders (bitwise
// reproducible run to run):
//  1. DecodeSplitKernel: one block per (batch b, kv head, split of
//     kDecodeSplitTokens tokens). For each query head of the GQA group it
//     computes the split's scores (K rows read with 16-byte loads, a group of
//     TPT lanes per token), the split's max m and sum l of exp(score - m), and
//     the unnormalised sum of exp(score - m) * V, written to the scratch
//     outputs part_out (B, Hq, S, D) and part_stats (B, Hq, S, 2). No
//     allocation: the scratch is an extra output of the custom call.
//  2. DecodeCombineKernel: one block per (b, query head), one thread per
//     dimension; merges the splits in split order.
// Semantics are those of the CPU handler (csrc/cpu/attention.cc): lengths are
// clamped to [0, max_pages * page_size], tokens on a page id outside
// [0, num_pages) are skipped, and a sequence without valid tokens gives 0.
#include <cfloat>
#include <utility>

#include "attention_checks.h"
#include "cuda/cuda_common.cuh"
#include "ops.h"

namespace jax_moe {
namespace {

// ---- write_kv ----------------------------------------------------------------

// One block per token (grid-stride); `Unit` is the copy granule. Slots outside
// [0, num_slots) are skipped. Duplicate slots race (Python rejects them eagerly).
template <typename Unit>
__global__ void WriteKvKernel(const Unit* __restrict__ k, const Unit* __restrict__ v,
                              const int32_t* __restrict__ slots, int64_t n,
                              int64_t units_per_row, int64_t num_slots, Unit* __restrict__ k_out,
                              Unit* __restrict__ v_out) {
  for (int64_t i = blockIdx.x; i < n; i += gridDim.x) {
    const int64_t s = slots[i];
    if (s < 0 || s >= num_slots) continue;  // uniform over the block
    const Unit* ks = k + i * units_per_row;
    const Unit* vs = v + i * units_per_row;
    Unit* kd = k_out + s * units_per_row;
    Unit* vd = v_out + s * units_per_row;
    for (int64_t u = threadIdx.x; u < units_per_row; u += blockDim.x) {
      kd[u] = ks[u];
      vd[u] = vs[u];
    }
  }
}

template <typename Unit>
ffi::Error LaunchWriteKv(cudaStream_t stream, const void* k, const void* v, const int32_t* slots,
                         int64_t n, int64_t row_bytes, int64_t num_slots, void* k_out,
                         void* v_out) {
  const int64_t units = row_bytes / static_cast<int64_t>(sizeof(Unit));
  const int threads = units >= 256 ? 256 : (units >= 128 ? 128 : 64);
  WriteKvKernel<Unit><<<GridFor(n, 1, 1u << 20), threads, 0, stream>>>(
      static_cast<const Unit*>(k), static_cast<const Unit*>(v), slots, n, units, num_slots,
      static_cast<Unit*>(k_out), static_cast<Unit*>(v_out));
  return LastCudaError("write_kv launch");
}

ffi::Error WriteKvCuda(cudaStream_t stream, ffi::AnyBuffer k_pages, ffi::AnyBuffer v_pages,
                       ffi::AnyBuffer k, ffi::AnyBuffer v, ffi::Buffer<ffi::S32> slots,
                       ffi::Result<ffi::AnyBuffer> k_out, ffi::Result<ffi::AnyBuffer> v_out) {
  WriteKvDims d;
  if (auto err = CheckWriteKv(k_pages, v_pages, k, v, slots, *k_out, *v_out, &d); err.failure())
    return err;
  // The outputs alias the caches (input_output_aliases), so they already hold
  // them; should XLA ever hand over distinct buffers, copy (async, on stream).
  for (auto [dst, src] : {std::pair{k_out->untyped_data(), k_pages.untyped_data()},
                          std::pair{v_out->untyped_data(), v_pages.untyped_data()}}) {
    if (dst == src || k_pages.size_bytes() == 0) continue;
    if (cudaMemcpyAsync(dst, src, k_pages.size_bytes(), cudaMemcpyDeviceToDevice, stream) !=
        cudaSuccess)
      return LastCudaError("write_kv cache copy");
  }
  if (d.n == 0 || d.row_elems == 0) return ffi::Error::Success();
  const int64_t row_bytes = d.row_elems * ffi::ByteWidth(k.element_type());
  const void* kp = k.untyped_data();
  const void* vp = v.untyped_data();
  void* ko = k_out->untyped_data();
  void* vo = v_out->untyped_data();
  if (row_bytes % 16 == 0)
    return LaunchWriteKv<uint4>(stream, kp, vp, slots.typed_data(), d.n, row_bytes, d.num_slots,
                                ko, vo);
  if (row_bytes % 4 == 0)
    return LaunchWriteKv<uint32_t>(stream, kp, vp, slots.typed_data(), d.n, row_bytes,
                                   d.num_slots, ko, vo);
  return LaunchWriteKv<uint16_t>(stream, kp, vp, slots.typed_data(), d.n, row_bytes, d.num_slots,
                                 ko, vo);
}

// ---- paged decode ------------------------------------------------------------

constexpr int kDecodeThreads = 128;
constexpr int kWarps = kDecodeThreads / 32;
constexpr int kSplit = static_cast<int>(kDecodeSplitTokens);

// Lane layout of one K/V row of D elements of type T: VEC elements per 16-byte
// chunk, TPT lanes per token (a power of two <= 32, aligned inside a warp),
// CPL chunks per lane, NG tokens in flight per block.
template <typename T, int D>
struct RowLayout {
  static constexpr int kVec = 16 / sizeof(T);
  static constexpr int kChunks = D / kVec;
  static constexpr int kTpt = kChunks < 32 ? kChunks : 32;
  static constexpr int kCpl = kChunks / kTpt;
  static constexpr int kGroups = kDecodeThreads / kTpt;
  static_assert(kChunks % kTpt == 0 && (kTpt & (kTpt - 1)) == 0 && 32 % kTpt == 0, "layout");
};

// Block-wide reductions in a fixed order (xor tree in each warp, then the warp
// results in warp order); every thread gets the result.
__device__ __forceinline__ float BlockMax(float x, float* scratch) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, o));
  if ((threadIdx.x & 31) == 0) scratch[threadIdx.x >> 5] = x;
  __syncthreads();
  float r = scratch[0];
#pragma unroll
  for (int w = 1; w < kWarps; ++w) r = fmaxf(r, scratch[w]);
  __syncthreads();  // scratch free again
  return r;
}

__device__ __forceinline__ float BlockSum(float x, float* scratch) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
  if ((threadIdx.x & 31) == 0) scratch[threadIdx.x >> 5] = x;
  __syncthreads();
  float r = scratch[0];
#pragma unroll
  for (int w = 1; w < kWarps; ++w) r += scratch[w];
  __syncthreads();
  return r;
}

__device__ __forceinline__ int64_t ClampLength(int32_t len, int64_t max_tokens) {
  const int64_t l = len;
  return l < 0 ? 0 : (l > max_tokens ? max_tokens : l);
}

// grid (batch * hkv, num_splits), kDecodeThreads threads.
template <ffi::DataType DT, int D>
__global__ void __launch_bounds__(kDecodeThreads)
    DecodeSplitKernel(const typename DevScalar<DT>::T* __restrict__ q,
                      const typename DevScalar<DT>::T* __restrict__ kc,
                      const typename DevScalar<DT>::T* __restrict__ vc,
                      const int32_t* __restrict__ table, const int32_t* __restrict__ lengths,
                      int64_t hq, int64_t hkv, int64_t group, int64_t num_pages,
                      int64_t page_size, int64_t max_pages, int64_t num_splits, float scale,
                      float* __restrict__ part_out, float* __restrict__ part_stats) {
  using S = DevScalar<DT>;
  using T = typename S::T;
  using L = RowLayout<T, D>;
  constexpr int kVec = L::kVec, kTpt = L::kTpt, kCpl = L::kCpl, kGroups = L::kGroups;

  __shared__ float qs[D];
  __shared__ float sc[kSplit];
  __shared__ int64_t slot_of[kSplit];  // cache slot of each token of the split, -1: skipped
  __shared__ float red[kGroups * D];
  __shared__ float scratch[kWarps];

  const int64_t b = blockIdx.x / hkv;
  const int64_t kvh = blockIdx.x % hkv;
  const int64_t split = blockIdx.y;
  const int tid = threadIdx.x;
  const int lane = tid % kTpt;   // lane within the token group
  const int grp = tid / kTpt;    // token group
  const int64_t max_tokens = max_pages * page_size;
  const int64_t len = ClampLength(lengths[b], max_tokens);
  const int64_t t0 = split * kSplit;
  const int ntok = static_cast<int>(len > t0 ? (len - t0 < kSplit ? len - t0 : kSplit) : 0);
  const int64_t row = hkv * D;  // elements per cache slot

  for (int i = tid; i < ntok; i += kDecodeThreads) {
    const int64_t t = t0 + i;
    const int64_t page = table[b * max_pages + t / page_size];
    slot_of[i] = (page >= 0 && page < num_pages) ? page * page_size + t % page_size : -1;
  }

  for (int64_t g = 0; g < group; ++g) {
    const int64_t h = kvh * group + g;
    const int64_t part = (b * hq + h) * num_splits + split;
    for (int e = tid; e < D; e += kDecodeThreads) qs[e] = S::Load(q[(b * hq + h) * D + e]) * scale;
    __syncthreads();  // qs and slot_of visible; sc/red of the previous head consumed

    // Pass 1: scores. Every thread runs the same trip count (the shuffles
    // need the whole warp); tokens past ntok compute nothing.
    for (int base = 0; base < ntok; base += kGroups) {
      const int i = base + grp;
      const int64_t slot = i < ntok ? slot_of[i] : -1;
      float dot = 0.f;
      if (slot >= 0) {
        const T* krow = kc + slot * row + kvh * D;
#pragma unroll
        for (int c = 0; c < kCpl; ++c) {
          const int e0 = (c * kTpt + lane) * kVec;
          T vals[kVec];
          *reinterpret_cast<uint4*>(vals) = __ldg(reinterpret_cast<const uint4*>(krow + e0));
#pragma unroll
          for (int x = 0; x < kVec; ++x) dot += qs[e0 + x] * S::Load(vals[x]);
        }
      }
#pragma unroll
      for (int o = kTpt / 2; o > 0; o >>= 1) dot += __shfl_xor_sync(0xffffffffu, dot, o);
      if (lane == 0 && i < ntok) sc[i] = slot >= 0 ? dot : -INFINITY;
    }
    __syncthreads();

    float m = -INFINITY;
    for (int i = tid; i < ntok; i += kDecodeThreads) m = fmaxf(m, sc[i]);
    m = BlockMax(m, scratch);
    float l = 0.f;
    for (int i = tid; i < ntok; i += kDecodeThreads) {
      const float p = sc[i] == -INFINITY ? 0.f : expf(sc[i] - m);
      sc[i] = p;
      l += p;
    }
    l = BlockSum(l, scratch);  // its barrier also publishes sc

    // Pass 2: sum of p * V, per token group, then the groups in group order.
    float acc[kCpl * kVec];
#pragma unroll
    for (int x = 0; x < kCpl * kVec; ++x) acc[x] = 0.f;
    for (int base = 0; base < ntok; base += kGroups) {
      const int i = base + grp;
      if (i >= ntok) continue;
      const int64_t slot = slot_of[i];
      if (slot < 0) continue;
      const float p = sc[i];
      const T* vrow = vc + slot * row + kvh * D;
#pragma unroll
      for (int c = 0; c < kCpl; ++c) {
        const int e0 = (c * kTpt + lane) * kVec;
        T vals[kVec];
        *reinterpret_cast<uint4*>(vals) = __ldg(reinterpret_cast<const uint4*>(vrow + e0));
#pragma unroll
        for (int x = 0; x < kVec; ++x) acc[c * kVec + x] += p * S::Load(vals[x]);
      }
    }
#pragma unroll
    for (int c = 0; c < kCpl; ++c) {
#pragma unroll
      for (int x = 0; x < kVec; ++x) red[grp * D + (c * kTpt + lane) * kVec + x] = acc[c * kVec + x];
    }
    __syncthreads();
    for (int e = tid; e < D; e += kDecodeThreads) {
      float o = 0.f;
#pragma unroll
      for (int gi = 0; gi < kGroups; ++gi) o += red[gi * D + e];
      part_out[part * D + e] = o;
    }
    if (tid == 0) {
      part_stats[part * 2] = m;
      part_stats[part * 2 + 1] = l;
    }
    // The barrier at the top of the next head orders the reuse of qs/sc/red.
  }
}

// grid (batch * hq), D threads: out = sum_s w_s o_s / sum_s w_s l_s with
// w_s = exp(m_s - max_s m_s), splits in order; no valid token: 0.
template <ffi::DataType DT, int D>
__global__ void __launch_bounds__(D)
    DecodeCombineKernel(const float* __restrict__ part_out, const float* __restrict__ part_stats,
                        const int32_t* __restrict__ lengths, int64_t hq, int64_t max_tokens,
                        int64_t num_splits, typename DevScalar<DT>::T* __restrict__ out) {
  using S = DevScalar<DT>;
  const int64_t bh = blockIdx.x;
  const int64_t b = bh / hq;
  const int e = threadIdx.x;
  const int64_t len = ClampLength(lengths[b], max_tokens);
  int64_t used = (len + kSplit - 1) / kSplit;  // splits holding tokens
  if (used > num_splits) used = num_splits;
  const float* st = part_stats + bh * num_splits * 2;
  const float* po = part_out + bh * num_splits * D;
  float mx = -INFINITY;
  for (int64_t s = 0; s < used; ++s) mx = fmaxf(mx, st[2 * s]);
  float num = 0.f, den = 0.f;
  if (mx != -INFINITY) {
    for (int64_t s = 0; s < used; ++s) {
      const float ms = st[2 * s];
      if (ms == -INFINITY) continue;  // no valid token in this split
      const float w = expf(ms - mx);
      den += w * st[2 * s + 1];
      num += w * po[s * D + e];
    }
  }
  out[bh * D + e] = S::Store(den > 0.f ? num / den : 0.f);
}

template <ffi::DataType DT, int D>
ffi::Error LaunchDecode(cudaStream_t stream, const ffi::AnyBuffer& q, const ffi::AnyBuffer& kp,
                        const ffi::AnyBuffer& vp, const int32_t* table, const int32_t* lengths,
                        const DecodeDims& d, float scale, void* out, float* part_out,
                        float* part_stats) {
  using T = typename DevScalar<DT>::T;
  const dim3 grid(static_cast<unsigned>(d.batch * d.hkv), static_cast<unsigned>(d.num_splits));
  DecodeSplitKernel<DT, D><<<grid, kDecodeThreads, 0, stream>>>(
      static_cast<const T*>(q.untyped_data()), static_cast<const T*>(kp.untyped_data()),
      static_cast<const T*>(vp.untyped_data()), table, lengths, d.hq, d.hkv, d.group,
      d.num_pages, d.page_size, d.max_pages, d.num_splits, scale, part_out, part_stats);
  if (auto err = LastCudaError("paged_decode split launch"); err.failure()) return err;
  DecodeCombineKernel<DT, D><<<static_cast<unsigned>(d.batch * d.hq), D, 0, stream>>>(
      part_out, part_stats, lengths, d.hq, d.max_tokens, d.num_splits, static_cast<T*>(out));
  return LastCudaError("paged_decode combine launch");
}

ffi::Error PagedDecodeCuda(cudaStream_t stream, ffi::AnyBuffer q, ffi::AnyBuffer k_pages,
                           ffi::AnyBuffer v_pages, ffi::Buffer<ffi::S32> page_table,
                           ffi::Buffer<ffi::S32> lengths, float scale,
                           ffi::Result<ffi::AnyBuffer> out,
                           ffi::Result<ffi::Buffer<ffi::F32>> part_out,
                           ffi::Result<ffi::Buffer<ffi::F32>> part_stats) {
  DecodeDims d;
  if (auto err = CheckDecode(q, k_pages, v_pages, page_table, lengths, *out, *part_out,
                             *part_stats, &d);
      err.failure())
    return err;
  if (d.batch == 0 || d.hq == 0) return ffi::Error::Success();
  if (d.num_splits > 65535) return InvalidArg("paged_decode: max_pages * page_size too large");
  if (d.batch * d.hkv >= (int64_t{1} << 31) || d.batch * d.hq >= (int64_t{1} << 31))
    return InvalidArg("paged_decode: batch * heads must be < 2^31");
  return DispatchFloat(q.element_type(), "q", [&]<ffi::DataType DT>() {
    const auto* table = page_table.typed_data();
    const auto* lens = lengths.typed_data();
    float* po = part_out->typed_data();
    float* ps = part_stats->typed_data();
    switch (d.head_dim) {
      case 64:
        return LaunchDecode<DT, 64>(stream, q, k_pages, v_pages, table, lens, d, scale,
                                    out->untyped_data(), po, ps);
      case 128:
        return LaunchDecode<DT, 128>(stream, q, k_pages, v_pages, table, lens, d, scale,
                                     out->untyped_data(), po, ps);
      default:
        return LaunchDecode<DT, 256>(stream, q, k_pages, v_pages, table, lens, d, scale,
                                     out->untyped_data(), po, ps);
    }
  });
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(kWriteKvCuda, WriteKvCuda,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>(),
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(kPagedDecodeCuda, PagedDecodeCuda,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Attr<float>("scale")
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>(),
                              {ffi::Traits::kCmdBufferCompatible});

}  // namespace jax_moe

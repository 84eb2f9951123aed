// The routed layer for ONE token in one kernel (ops.moe_decode): route,
// w13 with SiLU-and-mul, w2 and the weighted combine.
//
// Why one kernel: at one token the layer is a read of the k chosen experts'
// weights (75.5 MB at Qwen3-30B-A3B) and little else. The step-by-step chain
// (router, token index, w13 GEMM, activation, w2 GEMM, combine) pays a
// launch gap and a ramp at each step, and w2's bytes only start to stream
// once w13's are done. Here one block per SM (cooperative launch):
//   1. routes the token itself: softmax top-k by ranks over all threads;
//   2. starts copying its w2 rows (its output columns, for every chosen
//      expert) into shared memory -- bulk copies (TMA) on sm_90, cp.async
//      before -- so that they stream WHILE
//   3. its warps stream w13's gate/up row pairs, one warp a pair, and write
//      act = round(silu(round(g)) * round(u)) to a global scratch (k, I);
//   4. after a grid-wide barrier, each warp reads one slot of act from L2
//      into registers and dots its w2 rows with it (y rounded like the w2
//      GEMM's output); the block writes its columns of out = sum_j w_j * y_j
//      in slot order (the combine).
// Rounding points are the step-by-step path's (h, act and y in the input
// dtype, f32 sums); the order of every sum is fixed, so the result is the
// same bits run to run. Where a block's w2 rows do not fit in shared memory
// it takes them in passes. The routing rule is kernels/common/routing.h's.
// Timings and phases: benchmarks/kernels/moe_decode_bench.cu and
// docs/performance.md.
#include "kernels/cuda/moe_decode.h"

#include <cooperative_groups.h>

#include <algorithm>

#include "kernels/common/routing.h"
#include "kernels/cuda/cuda_common.cuh"

namespace jax_moe {
namespace {

namespace cg = cooperative_groups;

constexpr int kThreads = 512;
constexpr int kWarps = kThreads / 32;
constexpr int kMaxHChunks = static_cast<int>(kDecodeMaxHidden / 256);  // 16 bytes a lane each
constexpr int kDotCols = 4;  // w2 columns a warp sums at once (WarpSum4)

// Phase timestamps, in the benchmark's build only (JAX_MOE_DECODE_STAMPS,
// kernels/cuda/moe_decode.h): block b writes globaltimer at point i to
// g_decode_stamps[b * 8 + i].
#ifdef JAX_MOE_DECODE_STAMPS
__device__ unsigned long long* g_decode_stamps;
#define DECODE_STAMP(i) StampGlobaltimer(g_decode_stamps, 8, (i))
#else
#define DECODE_STAMP(i) \
  do {                  \
  } while (0)
#endif
// Static shared memory (logits, ids, weights, barrier), kept out of the
// dynamic budget.
constexpr int kStaticSmem = static_cast<int>(kDecodeMaxExperts) * 4 + 512;

struct DecodeArgs {
  const void* x;       // (H)
  const void* logits;  // (E), f32 / bf16 / f16 (logit_type)
  const void* w13;     // (E, 2I, H)
  const void* w2;      // (E, H, I)
  float* act;          // (k, I) scratch
  void* out;           // (H)
  int logit_type;      // 0 f32, 1 bf16, 2 f16
  int experts, hidden, inter, topk;
  int cols;       // output columns of a block
  int pass_cols;  // of them, how many a pass holds in shared memory
  bool renormalize;
  float scale;
};

template <DType DT>
__device__ __forceinline__ float Dot8(const uint4& a, const uint4& b) {
  float fa[8], fb[8];
  Unpack<DT>(a, fa);
  Unpack<DT>(b, fb);
  float s = 0.f;
#pragma unroll
  for (int q = 0; q < 8; ++q) s = fmaf(fa[q], fb[q], s);
  return s;
}

__device__ __forceinline__ float WarpSum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

__device__ __forceinline__ float LoadLogit(const void* p, int type, int e) {
  if (type == 1) return __bfloat162float(static_cast<const __nv_bfloat16*>(p)[e]);
  if (type == 2) return __half2float(static_cast<const __half*>(p)[e]);
  return static_cast<const float*>(p)[e];
}

// Step 1, all threads: expert e's rank is the number of experts ahead of it
// (a larger logit, or an equal one with a lower id); the ranks below k are
// the picks, in order (RouteBeats: the router's order). `tpe` adjacent
// threads share an expert's comparisons (4 at 128 experts) so that routing is
// a short step before the stream. A NaN logit is -inf (RouteLogit), as in the
// router; that also keeps the ranks a permutation (every id valid, each slot
// written once). Ends with a __syncthreads. The weights come later
// (RouteWeights): the stream needs only the ids.
__device__ void RouteIds(const DecodeArgs& a, float* lg, int* ids) {
  const int e_count = a.experts, k = a.topk;
  for (int e = threadIdx.x; e < e_count; e += kThreads) {
    const float v = LoadLogit(a.logits, a.logit_type, e);
    lg[e] = RouteLogit(v);
  }
  int tpe = 1;  // a power of two <= 32: the shuffles below stay in a warp
  while (tpe < 32 && tpe * 2 * e_count <= kThreads) tpe *= 2;
  const int per = kThreads / tpe, sub = threadIdx.x % tpe;
  __syncthreads();
  for (int base = 0; base < e_count; base += per) {  // the same trip count in every thread
    const int e = base + static_cast<int>(threadIdx.x) / tpe;
    const bool valid = e < e_count;
    const float v = valid ? lg[e] : 0.f;
    int rank = 0;
#pragma unroll 8
    for (int o = sub; o < e_count; o += tpe) {
      const float w = lg[o];
      rank += RouteBeats(w, o, v, e);
    }
    for (int m = 1; m < tpe; m <<= 1) rank += __shfl_xor_sync(0xffffffffu, rank, m);
    if (valid && sub == 0 && rank < k) ids[rank] = e;
  }
  __syncthreads();
}

// The k weights, by one warp, sums in a fixed order: the softmax with the
// picks' terms as the sum (renormalize) or all experts' terms, times the
// scaling factor. A row of nothing but -inf gets NaN weights, as softmax
// gives it.
__device__ void RouteWeights(const DecodeArgs& a, const float* lg, const int* ids, float* wts) {
  const int e_count = a.experts, k = a.topk, lane = threadIdx.x % 32;
  const float mx = lg[ids[0]];
  float sum = 0.f;
  if (a.renormalize) {
    for (int j = 0; j < k; ++j) sum += SoftmaxTerm(lg[ids[j]], mx);
  } else {
    for (int e = lane; e < e_count; e += 32) sum += SoftmaxTerm(lg[e], mx);
    sum = WarpSum(sum);
  }
  if (lane < k) wts[lane] = SoftmaxScore(lg[ids[lane]], mx, sum) * a.scale;
}

// Warp sums of 4 values at once: 6 shuffles instead of 20. Each exchange
// keeps half of the values and sends the other half, so a lane's partial
// sums pair up exactly as in WarpSum (same bits). Value t ends in lane 8 * t.
__device__ __forceinline__ float WarpSum4(const float (&s)[4], int lane) {
  const bool hi16 = lane & 16, hi8 = lane & 8;
  const float a0 = (hi16 ? s[2] : s[0]) + __shfl_xor_sync(0xffffffffu, hi16 ? s[0] : s[2], 16);
  const float a1 = (hi16 ? s[3] : s[1]) + __shfl_xor_sync(0xffffffffu, hi16 ? s[1] : s[3], 16);
  float b = (hi8 ? a1 : a0) + __shfl_xor_sync(0xffffffffu, hi8 ? a0 : a1, 8);
#pragma unroll
  for (int o = 4; o > 0; o >>= 1) b += __shfl_xor_sync(0xffffffffu, b, o);
  return b;
}

// Warp sums of g and u at once (6 shuffles instead of 10), same bits as two
// WarpSums; every lane gets both.
__device__ __forceinline__ void WarpSum2(float& g, float& u, int lane) {
  const bool hi16 = lane & 16;
  float b = (hi16 ? u : g) + __shfl_xor_sync(0xffffffffu, hi16 ? g : u, 16);
#pragma unroll
  for (int o = 8; o > 0; o >>= 1) b += __shfl_xor_sync(0xffffffffu, b, o);
  const float other = __shfl_xor_sync(0xffffffffu, b, 16);
  g = hi16 ? other : b;
  u = hi16 ? b : other;
}

// Step 2: columns [c0, c0 + n) of this block's slice, for every slot, into
// w2s [slot][column][I]. Per slot they are n contiguous rows of w2.
template <typename T>
__device__ void IssueW2(const DecodeArgs& a, const int* ids, int h0, int c0, int n, T* w2s,
                        uint64_t* bar) {
  const int k = a.topk, I = a.inter;
  const T* w2 = static_cast<const T*>(a.w2);
#if __CUDA_ARCH__ >= 900
  if (threadIdx.x == 0) {
    // The copy engine's writes after this block's plain reads of w2s.
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
    const unsigned bytes = static_cast<unsigned>(n) * I * sizeof(T);  // I % 256 == 0
    MbarArriveExpectTx(bar, bytes * k);
    for (int j = 0; j < k; ++j)
      BulkLoad(w2s + static_cast<size_t>(j) * a.pass_cols * I,
               w2 + (static_cast<int64_t>(ids[j]) * a.hidden + h0 + c0) * I, bytes, bar);
  }
#else
  const int row_vecs = I * static_cast<int>(sizeof(T)) / 16;
  const int total = k * n * row_vecs;
  for (int v = threadIdx.x; v < total; v += kThreads) {
    const int r = v / row_vecs, c = v % row_vecs;  // r = slot * n + column
    const int j = r / n, col = r % n;
    CpAsync16(reinterpret_cast<uint4*>(w2s + (static_cast<size_t>(j) * a.pass_cols + col) * I) + c,
              reinterpret_cast<const uint4*>(
                  w2 + (static_cast<int64_t>(ids[j]) * a.hidden + h0 + c0 + col) * I) + c);
  }
  CpAsyncCommit();
#endif
}

__device__ __forceinline__ void WaitW2(uint64_t* bar, int pass) {
#if __CUDA_ARCH__ >= 900
  MbarWait(bar, pass & 1);
#else
  CpAsyncWait<0>();
#endif
}

// KI = I / 256: 16-byte chunks of an act row a lane holds.
template <DType DT, int KI>
__global__ void __launch_bounds__(kThreads, 1) MoeDecodeKernel(DecodeArgs a) {
  using T = typename DevScalar<DT>::T;
  extern __shared__ __align__(128) unsigned char smem[];
  __shared__ float lg[kDecodeMaxExperts];
  __shared__ int ids[kDecodeMaxTopk];
  __shared__ float wts[kDecodeMaxTopk];
  __shared__ __align__(8) uint64_t bar;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int H = a.hidden, I = a.inter, k = a.topk, pc = a.pass_cols;
  // Dynamic shared memory: w2 rows [slot][pass column][I], then y [pass
  // column][slot] (f32).
  T* w2s = reinterpret_cast<T*>(smem);
  float* ys = reinterpret_cast<float*>(smem + static_cast<size_t>(k) * pc * I * sizeof(T));

#if __CUDA_ARCH__ >= 900
  if (threadIdx.x == 0) {
    MbarInit(&bar, 1);
    FenceMbarInit();
  }
#endif
  // x in registers: chunk c of a lane is elements (c * 32 + lane) * 8 + [0, 8).
  const int hchunks = H / 256;
  uint4 xv[kMaxHChunks];
#pragma unroll
  for (int c = 0; c < kMaxHChunks; ++c)
    xv[c] = c < hchunks ? __ldg(static_cast<const uint4*>(a.x) + c * 32 + lane) : uint4{};
  DECODE_STAMP(0);
  RouteIds(a, lg, ids);
  DECODE_STAMP(1);

  const int h0 = blockIdx.x * a.cols;
  const int ncols = max(0, min(a.cols, H - h0));
  if (ncols > 0) IssueW2(a, ids, h0, 0, min(pc, ncols), w2s, &bar);

  // Step 3: gate/up row pairs p = (slot j, row i), one warp each, every
  // load of a pair in flight before the first is used.
  const int pairs = k * I;
  const T* w13 = static_cast<const T*>(a.w13);
  for (int p = blockIdx.x * kWarps + warp; p < pairs; p += gridDim.x * kWarps) {
    const int j = p / I, i = p % I;
    const T* g_row = w13 + (static_cast<int64_t>(ids[j]) * 2 * I + i) * H;
    const T* u_row = g_row + static_cast<int64_t>(I) * H;
    // Chunks past H re-read chunk 0 (an L2 hit) and are dropped by the
    // select: unconditional loads keep the arrays in registers.
    uint4 gv[kMaxHChunks], uv[kMaxHChunks];
#pragma unroll
    for (int c = 0; c < kMaxHChunks; ++c) {
      const int cc = c < hchunks ? c : 0;
      gv[c] = LdgStream(reinterpret_cast<const uint4*>(g_row) + cc * 32 + lane);
      uv[c] = LdgStream(reinterpret_cast<const uint4*>(u_row) + cc * 32 + lane);
    }
    float g = 0.f, u = 0.f;
#pragma unroll
    for (int c = 0; c < kMaxHChunks; ++c) {
      const float dg = Dot8<DT>(gv[c], xv[c]), du = Dot8<DT>(uv[c], xv[c]);
      g += c < hchunks ? dg : 0.f;
      u += c < hchunks ? du : 0.f;
    }
    WarpSum2(g, u, lane);
    g = Round<DT>(g);  // h is rounded there too
    u = Round<DT>(u);
    if (lane == 0) a.act[p] = Round<DT>(g / (1.f + expf(-g)) * u);
  }

  if (warp == 0) RouteWeights(a, lg, ids, wts);  // read in the combine, past the barrier

  // Step 4. The barrier orders every block's act writes before these reads.
  DECODE_STAMP(2);
  cg::this_grid().sync();
  DECODE_STAMP(3);
  if (ncols == 0) return;
  // Warps split by slot: warp w takes slot j = w / wps (k <= 8, so wps >= 2)
  // and reads act[j] from L2 straight into registers; shared memory then
  // serves only w2 rows.
  const int wps = kWarps / k, j = warp / wps;
  float av[KI][8];
  if (j < k) {
    const float4* src = reinterpret_cast<const float4*>(a.act + j * I);
    float4 lo[KI], hi[KI];
#pragma unroll
    for (int c = 0; c < KI; ++c) {  // every load in flight before the first use
      lo[c] = __ldcg(src + (c * 32 + lane) * 2);
      hi[c] = __ldcg(src + (c * 32 + lane) * 2 + 1);
    }
#pragma unroll
    for (int c = 0; c < KI; ++c) {
      av[c][0] = lo[c].x, av[c][1] = lo[c].y, av[c][2] = lo[c].z, av[c][3] = lo[c].w;
      av[c][4] = hi[c].x, av[c][5] = hi[c].y, av[c][6] = hi[c].z, av[c][7] = hi[c].w;
    }
  }
  for (int pass = 0, c0 = 0; c0 < ncols; ++pass, c0 += pc) {
    const int n = min(pc, ncols - c0);
    if (pass > 0) {
      __syncthreads();  // the previous pass is done with w2s and ys
      IssueW2(a, ids, h0, c0, n, w2s, &bar);
    }
    WaitW2(&bar, pass);
    __syncthreads();
    DECODE_STAMP(4);
    if (j < k) {
      for (int col0 = warp % wps; col0 < n; col0 += kDotCols * wps) {
        uint4 wv[kDotCols][KI];
        float s[kDotCols];
#pragma unroll
        for (int t = 0; t < kDotCols; ++t) {
          const int col = min(col0 + t * wps, n - 1);  // a clamped column is summed, not stored
          const T* row = w2s + (static_cast<size_t>(j) * pc + col) * I;
#pragma unroll
          for (int c = 0; c < KI; ++c)
            wv[t][c] = *reinterpret_cast<const uint4*>(row + (c * 32 + lane) * 8);
          s[t] = 0.f;
        }
#pragma unroll
        for (int t = 0; t < kDotCols; ++t) {
#pragma unroll
          for (int c = 0; c < KI; ++c) {
            float w[8];
            Unpack<DT>(wv[t][c], w);
#pragma unroll
            for (int q = 0; q < 8; ++q) s[t] = fmaf(w[q], av[c][q], s[t]);
          }
        }
        const float v = WarpSum4(s, lane);  // column col0 + t * wps in lane 8 * t
        const int col = col0 + (lane / 8) * wps;
        if (lane % 8 == 0 && col < n)
          ys[col * k + j] = Round<DT>(v);
      }
    }
    DECODE_STAMP(5);
    __syncthreads();
    T* out = static_cast<T*>(a.out);
    for (int col = threadIdx.x; col < n; col += kThreads) {
      float o = 0.f;
      for (int jj = 0; jj < k; ++jj) o += wts[jj] * ys[col * k + jj];
      out[h0 + c0 + col] = DevScalar<DT>::Store(o);
    }
  }
  DECODE_STAMP(6);
}

template <DType DT, int KI>
cudaError_t LaunchDecode(cudaStream_t stream, const DecodeArgs& args, int grid, int smem,
                         int max_smem) {
  constexpr auto kernel = MoeDecodeKernel<DT, KI>;
  // Opted in once per device, to the most any call can ask for.
  if (cudaError_t e = EnsureDynamicSmem<kernel>(max_smem); e != cudaSuccess) return e;
  return LaunchCooperative(kernel, dim3(grid), dim3(kThreads), smem, stream, args);
}

}  // namespace

#ifdef JAX_MOE_DECODE_STAMPS
cudaError_t SetMoeDecodeStamps(unsigned long long* stamps) {
  return cudaMemcpyToSymbol(g_decode_stamps, &stamps, sizeof(stamps));
}
#endif

// Sizes the grid (one block per SM) and the shared memory, then launches.
cudaError_t LaunchMoeDecode(cudaStream_t stream, DType dtype, const MoeDecodeProblem& p) {
  DecodeArgs args{p.x, p.logits, p.w13, p.w2, p.act, p.out,
                  p.logit_dtype == DType::BF16 ? 1 : p.logit_dtype == DType::F16 ? 2 : 0,
                  static_cast<int>(p.experts), static_cast<int>(p.hidden),
                  static_cast<int>(p.inter), static_cast<int>(p.topk), 0, 0, p.renormalize,
                  p.scale};
  const int sms = DeviceSms(), optin = DeviceSmemOptin();
  if (sms <= 0 || optin <= 0) return cudaErrorInvalidDevice;
  const int k = args.topk, inter = args.inter, hidden = args.hidden;
  args.cols = (hidden + sms - 1) / sms;
  const int grid = (hidden + args.cols - 1) / args.cols;
  // Columns of w2 rows a pass holds: what fits beside y.
  const int elt = 2;  // bf16 / f16
  const int budget_all = optin - kStaticSmem;
  args.pass_cols = std::min(args.cols, budget_all / (k * (inter * elt + 4)));
  if (args.pass_cols < 1) return cudaErrorInvalidConfiguration;
  const int smem = k * args.pass_cols * inter * elt + args.pass_cols * k * 4;
  auto launch = [&]<DType DT>() -> cudaError_t {
    switch (inter / 256) {
      case 1: return LaunchDecode<DT, 1>(stream, args, grid, smem, budget_all);
      case 2: return LaunchDecode<DT, 2>(stream, args, grid, smem, budget_all);
      case 3: return LaunchDecode<DT, 3>(stream, args, grid, smem, budget_all);
      default: return LaunchDecode<DT, 4>(stream, args, grid, smem, budget_all);
    }
  };
  return dtype == DType::BF16 ? launch.template operator()<DType::BF16>()
                              : launch.template operator()<DType::F16>();
}

}  // namespace jax_moe

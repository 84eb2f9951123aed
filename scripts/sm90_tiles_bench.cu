// Experiment: which CUTLASS tile / cluster / schedule should the sm90 grouped
// GEMM (tile_m = 256, csrc/cuda/group_gemm_sm90.cu) run at prefill sizes?
// The wide config used to pair M tiles in a 2x1 cluster, so an expert's rows
// were padded to a multiple of 256: at 256 rows per expert on average
// (DeepSeek-V3 T = 8192, Mixtral T = 1024) about half the experts paid for a
// nearly empty second cluster. One-CTA clusters, or a 1x2 cluster (the two
// CTAs share the M tile, A multicast instead of B), keep the 128-row
// granularity. Run 13.2 put 128x256 on one CTA first; it is now shipped.
//
// Times RunSm90<config> (setup, tail prep, CUTLASS GEMM; no gather) on the
// prefill GEMMs of the issue's grid, routings rotated over 4 random draws,
// CUDA events, median of 7 x 10 calls; checks every config against a naive
// f32 GEMM on sampled rows.
//
// Not part of the build; needs an sm_90 GPU and the nvidia-cutlass headers.
// From the repository root (CONFIGS=1 or 2 picks half of the configs, to
// compile the halves on two cores; CONFIGS=3 the two shipped 128-row
// configs between their thresholds):
//   C=$(python3 -c "import cutlass_library, os; print(os.path.dirname(cutlass_library.__file__))")/source
//   nvcc -O3 -std=c++17 -arch=sm_90a --expt-relaxed-constexpr -DNDEBUG -DCONFIGS=1 \
//     -DJAX_MOE_WITH_CUDA=1 -DJAX_MOE_WITH_SM90=1 -I csrc -I $C/include -I $C/tools/util/include \
//     -I $(python3 -c "import jax.ffi; print(jax.ffi.include_dir())") \
//     scripts/sm90_tiles_bench.cu -o /tmp/sm90_tiles_bench1
#include "../csrc/cuda/group_gemm_sm90.cu"
#include "bench_util.cuh"

#include <cmath>
#include <cstring>
#include <cstdio>
#include <vector>

namespace jax_moe {
namespace {

using Wide2x1 = Sm90Gemm<cutlass::bfloat16_t, Wide, Shape<_2, _1, _1>, Cooperative>;
using Wide1x2 = Sm90Gemm<cutlass::bfloat16_t, Wide, Shape<_1, _2, _1>, Cooperative>;
using Narrow1x2 = Sm90Gemm<cutlass::bfloat16_t, Narrow, Shape<_1, _2, _1>, Cooperative>;
using NarrowPing = Sm90Gemm<cutlass::bfloat16_t, Narrow, Cluster1, Pingpong>;
using NarrowPing1x2 = Sm90Gemm<cutlass::bfloat16_t, Narrow, Shape<_1, _2, _1>, Pingpong>;

struct Case {
  const char* name;
  int E, N, K, T, topk;
};
constexpr Case kCases[] = {
    {"deepseek_v3 T=8192 up", 256, 4096, 7168, 8192, 8},
    {"deepseek_v3 T=8192 down", 256, 7168, 2048, 8192, 8},
    {"qwen3_30b T=8192 up", 128, 1536, 2048, 8192, 8},
    {"qwen3_30b T=8192 down", 128, 2048, 768, 8192, 8},
    {"qwen3_235b T=8192 up", 128, 3072, 4096, 8192, 8},
    {"qwen3_235b T=8192 down", 128, 4096, 1536, 8192, 8},
    {"mixtral T=1024 up", 8, 28672, 4096, 1024, 2},
    {"mixtral T=1024 down", 8, 4096, 14336, 1024, 2},
    {"mixtral T=8192 up", 8, 28672, 4096, 8192, 2},
    {"deepseek_v3 T=1024 up", 256, 4096, 7168, 1024, 8},
};
// Between the 64- and 256-row thresholds (CONFIGS=3: 128x128 against
// 128x256 tiles, both on one CTA): 64, 128 and 192 rows per expert.
constexpr Case kMidCases[] = {
    {"qwen3_30b T=1024 up", 128, 1536, 2048, 1024, 8},
    {"qwen3_30b T=2048 up", 128, 1536, 2048, 2048, 8},
    {"qwen3_30b T=2048 down", 128, 2048, 768, 2048, 8},
    {"qwen3_30b T=3072 up", 128, 1536, 2048, 3072, 8},
    {"qwen3_235b T=2048 up", 128, 3072, 4096, 2048, 8},
    {"qwen3_235b T=2048 down", 128, 4096, 1536, 2048, 8},
    {"deepseek_v3 T=2048 up", 256, 4096, 7168, 2048, 8},
    {"deepseek_v3 T=4096 up", 256, 4096, 7168, 4096, 8},
    {"deepseek_v3 T=4096 down", 256, 7168, 2048, 4096, 8},
    {"mixtral T=512 up", 8, 28672, 4096, 512, 2},
    {"mixtral T=512 down", 8, 4096, 14336, 512, 2},
    {"mixtral T=768 up", 8, 28672, 4096, 768, 2},
};
constexpr int kRot = 4;

__global__ void FillKernel(uint16_t* p, int64_t n, uint32_t seed, float scale) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n;
       i += int64_t{gridDim.x} * blockDim.x) {
    uint32_t h = static_cast<uint32_t>(i) * 2654435761u ^ seed;
    h ^= h >> 15;
    h *= 2246822519u;
    h ^= h >> 13;
    const float u = (h & 0xffffff) / 16777216.f - 0.5f;
    p[i] = __bfloat16_as_ushort(__float2bfloat16(u * scale));
  }
}

// out rows r = sample * stride: the f32 dot products of the naive GEMM.
__global__ void RefKernel(const uint16_t* x, const uint16_t* w, const int32_t* sizes, int groups,
                          int64_t m, int n, int k, int64_t stride, float* ref) {
  const int64_t r = blockIdx.x * stride;
  if (r >= m) return;
  int64_t start = 0;
  int e = 0;
  for (; e < groups; ++e) {
    if (r < start + sizes[e]) break;
    start += sizes[e];
  }
  for (int c = threadIdx.x; c < n; c += blockDim.x) {
    float acc = 0.f;
    if (e < groups) {
      const uint16_t* wr = w + (static_cast<int64_t>(e) * n + c) * k;
      const uint16_t* xr = x + r * k;
      for (int i = 0; i < k; ++i)
        acc += __bfloat162float(__ushort_as_bfloat16(xr[i])) *
               __bfloat162float(__ushort_as_bfloat16(wr[i]));
    }
    ref[static_cast<int64_t>(blockIdx.x) * n + c] = acc;
  }
}

template <typename G>
void Time(const char* cfg, const Case& cs) {
  const int64_t m = int64_t{cs.T} * cs.topk, n = cs.N, k = cs.K;
  uint16_t *x, *w, *out;
  int32_t* sizes;
  void* scratch;
  const size_t scratch_bytes = GroupGemmSm90ScratchBytes(m, k, cs.E, false) + (1 << 20);
  CK(cudaMalloc(&x, m * k * 2));
  CK(cudaMalloc(&w, int64_t{cs.E} * n * k * 2));
  CK(cudaMalloc(&out, m * n * 2));
  CK(cudaMalloc(&sizes, kRot * cs.E * 4));
  CK(cudaMalloc(&scratch, scratch_bytes));
  FillKernel<<<1024, 256>>>(x, m * k, 1, 2.f);
  FillKernel<<<1024, 256>>>(w, int64_t{cs.E} * n * k, 2, 2.f / std::sqrt(float(k)));
  double active = 0;
  const std::vector<int32_t> hs = RandomExpertSizes(cs.E, cs.T, cs.topk, kRot, &active);
  CK(cudaMemcpy(sizes, hs.data(), hs.size() * 4, cudaMemcpyHostToDevice));
  int dev = 0, sms = 0;
  if (!UsableDevice(&dev, &sms)) {
    printf("no usable sm90 device\n");
    exit(1);
  }
  auto call = [&](int c) {
    Sm90GemmCall sc{};
    sc.stream = 0;
    sc.bf16 = true;
    sc.x = x;
    sc.w = w;
    sc.sizes = sizes + (c % kRot) * cs.E;
    sc.rows = nullptr;
    sc.topk = 1;
    sc.out = out;
    sc.m = m;
    sc.n = n;
    sc.k = k;
    sc.groups = cs.E;
    sc.x_rows = m;
    sc.scratch = scratch;
    sc.scratch_bytes = scratch_bytes;
    bool ran = false;
    CK(RunSm90<G>(sc, dev, sms, &ran));
    if (!ran) {
      printf("%s: did not run (workspace or can_implement)\n", cfg);
      exit(1);
    }
  };
  // Check routing 0 against the naive GEMM on every 61st row.
  call(0);
  const int64_t stride = 61, samples = (m + stride - 1) / stride;
  float* ref;
  CK(cudaMalloc(&ref, samples * n * 4));
  RefKernel<<<static_cast<unsigned>(samples), 256>>>(x, w, sizes, cs.E, m, n, k, stride, ref);
  std::vector<float> hr(samples * n);
  std::vector<uint16_t> ho(m * n);
  CK(cudaMemcpy(hr.data(), ref, hr.size() * 4, cudaMemcpyDeviceToHost));
  CK(cudaMemcpy(ho.data(), out, ho.size() * 2, cudaMemcpyDeviceToHost));
  double worst = 0, scale = 0;
  for (int64_t s = 0; s < samples; ++s)
    for (int64_t c = 0; c < n; ++c) {
      uint32_t bits = static_cast<uint32_t>(ho[s * stride * n + c]) << 16;
      float o;
      std::memcpy(&o, &bits, 4);
      const float r = hr[s * n + c];
      worst = std::max(worst, static_cast<double>(std::fabs(o - r)));
      scale = std::max(scale, static_cast<double>(std::fabs(r)));
    }
  const double us = MedianLaunchMicros(call, 10, 7);
  const double flops = 2.0 * m * n * k;
  printf("  %-28s %-16s %9.1f us %6.1f TFLOP/s  max err %.3g of %.3g%s\n", cs.name, cfg, us,
         flops / us / 1e6, worst, scale, worst > 0.02 * scale + 1e-3 ? "  WRONG" : "");
  fflush(stdout);
  for (void* p : {static_cast<void*>(x), static_cast<void*>(w), static_cast<void*>(out),
                  static_cast<void*>(sizes), scratch, static_cast<void*>(ref)})
    CK(cudaFree(p));
}

}  // namespace
}  // namespace jax_moe

int main() {
  using namespace jax_moe;
#if CONFIGS == 3
  for (const Case& cs : kMidCases) {
    Time<NarrowGemm<cutlass::bfloat16_t>>("128x128 1x1 coop", cs);
    Time<WideGemm<cutlass::bfloat16_t>>("128x256 1x1 coop", cs);
  }
#else
  for (const Case& cs : kCases) {
#if CONFIGS == 1
    Time<Wide2x1>("128x256 2x1 coop", cs);
    Time<Wide1x2>("128x256 1x2 coop", cs);
    Time<WideGemm<cutlass::bfloat16_t>>("128x256 1x1 coop", cs);  // shipped
#else
    Time<NarrowGemm<cutlass::bfloat16_t>>("128x128 1x1 coop", cs);  // shipped
    Time<Narrow1x2>("128x128 1x2 coop", cs);
    Time<NarrowPing>("128x128 1x1 ping", cs);
    Time<NarrowPing1x2>("128x128 1x2 ping", cs);
#endif
  }
#endif
  return 0;
}

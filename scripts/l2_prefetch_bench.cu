// Experiment: at decode sizes a layer's two grouped GEMMs read their weights
// well below the HBM rate (launch ramp, few bytes per SM). Does asking L2 for
// the down projection's active experts (w2) before the gate/up GEMM runs make
// the pair faster? The pair runs as the layer runs it (shipped decode
// dispatch), alone and after a prefetch kernel of each flavour; the routing
// rotates over kRot random draws so no call finds the previous one's experts
// in L2 on purpose. Answer (H200, run 10.1 in benchmarks/RESULTS.md): no;
// the prefetch's time adds to the pair's in every flavour. Not part of the
// build; needs a GPU (sm_90 for the bulk prefetch). From the repository root:
//   nvcc -O3 -std=c++20 -arch=sm_90a -diag-suppress 940,2473 -I csrc \
//     -I $(python3 -c "import jax.ffi; print(jax.ffi.include_dir())") \
//     scripts/l2_prefetch_bench.cu -o /tmp/l2_prefetch_bench && /tmp/l2_prefetch_bench
#include "../csrc/cuda/group_gemm.cu"
#include "bench_util.cuh"
#include "group_gemm_bench.cuh"

#include <cstdio>
#include <vector>

namespace jax_moe {
namespace {

constexpr int64_t kChunk = 4096;  // bytes per prefetch work item

// Mode 0: prefetch.global.L2::evict_last per 128-byte line; 1: the same with
// normal priority; 2: one cp.async.bulk.prefetch.L2 per chunk.
template <int Mode>
__global__ void PrefetchActive(const char* __restrict__ w, int64_t expert_bytes,
                               const int32_t* __restrict__ sizes, int experts) {
  const int64_t per = expert_bytes / kChunk;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t id = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
       id < experts * per; id += stride) {
    const int64_t e = id / per;
    if (sizes[e] <= 0) continue;
    const char* p = w + e * expert_bytes + (id - e * per) * kChunk;
    if constexpr (Mode == 2) {
      asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;\n" ::"l"(p), "r"(int(kChunk))
                   : "memory");
    } else {
#pragma unroll 4
      for (int q = 0; q < kChunk; q += 128) {
        if constexpr (Mode == 0)
          asm volatile("prefetch.global.L2::evict_last [%0];\n" ::"l"(p + q));
        else
          asm volatile("prefetch.global.L2 [%0];\n" ::"l"(p + q));
      }
    }
  }
}

}  // namespace
}  // namespace jax_moe

using namespace jax_moe;

int main() {
  const Layer layers[] = {
      LayerOf("q30 T1", kQwen3_30B, 1),    LayerOf("q30 T4", kQwen3_30B, 4),
      LayerOf("q30 T16", kQwen3_30B, 16),  LayerOf("q235 T1", kQwen3_235B, 1),
      LayerOf("ds T1", kDeepSeekV3, 1),
  };
  const int kRot = 16, kCalls = 20, kReps = 9;
  int sms = 0;
  CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  int l2 = 0;
  CK(cudaDeviceGetAttribute(&l2, cudaDevAttrL2CacheSize, 0));
  printf("SMs %d, L2 %.1f MB\n", sms, l2 / 1e6);
  for (const Layer& L : layers) {
    const PairBuffers b(L, kRot);
    const int64_t m = b.m, n1 = b.n1, k1 = b.k1, n2 = b.n2, k2 = b.k2, w1n = b.w1n, w2n = b.w2n;
    uint16_t *w1 = b.w1, *w2 = b.w2, *x = b.x, *h = b.h, *act = b.act, *y = b.y;
    int32_t* sizes = b.sizes;
    CK(cudaMemset(w1, 0x3c, w1n * 2));
    CK(cudaMemset(w2, 0x3c, w2n * 2));
    CK(cudaMemset(x, 0x3c, m * k1 * 2));
    CK(cudaMemset(act, 0x3c, m * k2 * 2));
    double active = 0;
    const std::vector<int32_t> hs = RandomExpertSizes(L.E, L.T, L.topk, kRot, &active);
    CK(cudaMemcpy(sizes, hs.data(), hs.size() * 4, cudaMemcpyHostToDevice));
    const int64_t e1 = n1 * k1 * 2, e2 = n2 * k2 * 2;
    const double mb1 = active * e1 / 1e6, mb2 = active * e2 / 1e6;
    printf("%s: active %.1f, w1 %.1f MB, w2 %.1f MB\n", L.name, active, mb1, mb2);
    const int tile = L.T == 1 ? 8 : 16;  // what the tuning rule picks
    auto s_of = [&](int c) { return sizes + (c % kRot) * L.E; };
    auto g1 = [&](int c) { LaunchShipped(x, w1, s_of(c), h, m, n1, k1, L.E, tile); };
    auto g2 = [&](int c) { LaunchShipped(act, w2, s_of(c), y, m, n2, k2, L.E, tile); };
    auto pf = [&](int mode, const uint16_t* w, int64_t eb, int c) {
      const char* p = reinterpret_cast<const char*>(w);
      const int32_t* s = s_of(c);
      if (mode == 0) PrefetchActive<0><<<sms, 256>>>(p, eb, s, L.E);
      if (mode == 1) PrefetchActive<1><<<sms, 256>>>(p, eb, s, L.E);
      if (mode == 2) PrefetchActive<2><<<sms, 256>>>(p, eb, s, L.E);
    };
    auto report = [&](const char* what, double us, double mb) {
      printf("  %-34s %7.1f us  %.2f TB/s\n", what, us, mb / us);
    };
    auto run = [&](auto&& fn) { return MedianLaunchMicros(fn, kCalls, kReps); };
    report("gate/up alone", run([&](int c) { g1(c); }), mb1);
    report("down alone", run([&](int c) { g2(c); }), mb2);
    report("pair", run([&](int c) { g1(c); g2(c); }), mb1 + mb2);
    const char* names[3] = {"evict_last", "normal", "bulk"};
    for (int mode = 0; mode < 3; ++mode) {
      char buf[96];
      snprintf(buf, sizeof buf, "prefetch w2 (%s) alone", names[mode]);
      report(buf, run([&](int c) { pf(mode, w2, e2, c); }), mb2);
      snprintf(buf, sizeof buf, "prefetch w2 (%s) + pair", names[mode]);
      report(buf, run([&](int c) { pf(mode, w2, e2, c); g1(c); g2(c); }), mb1 + mb2);
      snprintf(buf, sizeof buf, "prefetch w1+w2 (%s) + pair", names[mode]);
      report(buf, run([&](int c) { pf(mode, w1, e1, c); pf(mode, w2, e2, c); g1(c); g2(c); }),
             mb1 + mb2);
    }
    CK(cudaGetLastError());
  }
  return 0;
}

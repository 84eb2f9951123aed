// The decode grouped GEMMs alone, on the decode-shaped GEMMs of the issue-3
// models, against a plain streaming read of the same bytes (the bandwidth
// they could reach): the shipped dispatch for tile_m = 8 and 16, the two
// forms of the 8-row skinny kernel (block per tile, persistent) and the TMA
// kernel (tile 16) forced, each checked against an f32 reference kernel. Not
// part of the build; needs a GPU (compute capability 9.0 for the TMA kernel).
// From the repository root:
//   nvcc -O3 -std=c++20 -arch=sm_90a -diag-suppress 940,2473 -I csrc \
//     -I $(python3 -c "import jax.ffi; print(jax.ffi.include_dir())") \
//     scripts/decode_gemm_bench.cu -o /tmp/decode_gemm_bench && /tmp/decode_gemm_bench
// Bytes are the weights of the experts the routing touches (mean over the
// rotated routings); times are the median of 7 repeats of 20 launches.
#include "../csrc/cuda/group_gemm.cu"
#include "bench_util.cuh"
#include "group_gemm_bench.cuh"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>
#include <vector>

namespace jax_moe {
namespace {

// ---- reference: one thread per output, f32.
__global__ void RefKernel(const uint16_t* x, const uint16_t* w, const int32_t* sizes, int E,
                          float* out, int64_t m, int64_t n, int64_t k) {
  const int64_t id = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
  if (id >= m * n) return;
  const int64_t r = id / n, c = id % n;
  int64_t start = 0;
  int e = -1;
  for (int i = 0; i < E; ++i) {
    const int64_t s = sizes[i] > 0 ? sizes[i] : 0;
    if (r < start + s) { e = i; break; }
    start += s;
  }
  float v = 0.f;
  if (e >= 0)
    for (int64_t q = 0; q < k; ++q)
      v += __bfloat162float(__ushort_as_bfloat16(x[r * k + q])) *
           __bfloat162float(__ushort_as_bfloat16(w[(e * n + c) * k + q]));
  out[id] = v;
}

// ---- read ceiling: stream `bytes` once.
__global__ void StreamKernel(const uint4* p, int64_t n16, unsigned* sink) {
  unsigned acc = 0;
  const int64_t stride = (int64_t)gridDim.x * blockDim.x;
  int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
  for (; i + 3 * stride < n16; i += 4 * stride) {
    const uint4 a = LdgStream(p + i), b = LdgStream(p + i + stride),
                c = LdgStream(p + i + 2 * stride), d = LdgStream(p + i + 3 * stride);
    acc ^= a.x ^ b.y ^ c.z ^ d.w;
  }
  for (; i < n16; i += stride) acc ^= LdgStream(p + i).x;
  if (acc == 0x12345678u) *sink = acc;
}


struct Case {
  const char* name;
  int E, N, K, T, topk;
};

using Launch = void (*)(const uint16_t*, const uint16_t*, const int32_t*, uint16_t*, int64_t,
                        int64_t, int64_t, int64_t);

enum class Form { kShipped, kShipped16, kBlock, kPersistent };

template <Form F>
void LaunchDecode(const uint16_t* x, const uint16_t* w, const int32_t* sizes, uint16_t* out,
                  int64_t m, int64_t n, int64_t k, int64_t groups) {
  using T = __nv_bfloat16;
  if (F == Form::kShipped || F == Form::kShipped16) {
    LaunchShipped(x, w, sizes, out, m, n, k, groups, F == Form::kShipped16 ? 16 : 8);
    return;
  }
  GemmArgs a = DenseArgs(m, n, k);
  const unsigned grid = Schedule(a, groups, 8, kSBN);
  if (F == Form::kBlock) {
    GroupGemmSkinnyKernel<T><<<grid, kThreads, 0>>>(x, w, sizes, out, a);
  } else {
    const int resident = ResidentBlocks<GroupGemmSkinnyPersistentKernel<T>>(kThreads);
    GroupGemmSkinnyPersistentKernel<T><<<resident, kThreads, 0>>>(x, w, sizes, out, a);
  }
}

template <int Consumers, int Stages, int KB>
void LaunchTmaForced(const uint16_t* x, const uint16_t* w, const int32_t* sizes, uint16_t* out,
                      int64_t m, int64_t n, int64_t k, int64_t groups) {
  GemmArgs a = DenseArgs(m, n, k);
  bool ran = false;
  LaunchTma<__nv_bfloat16, Consumers, Stages, KB>(0, x, w, sizes, out, a, groups, 0, false, &ran);
  if (!ran) printf("tma kernel did not launch\n");
}

struct Variant {
  const char* name;
  Launch fn;
};

}  // namespace
}  // namespace jax_moe

using namespace jax_moe;
using B = __nv_bfloat16;

// argv[1] (optional): run only the cases whose name contains it; argv[2]
// "tma": the TMA kernel's shapes (consumers x stages x boxes) instead of the
// decode forms.
int main(int argc, char** argv) {
  const char* only = argc > 1 ? argv[1] : "";
  const bool tma_sweep = argc > 2 && std::string(argv[2]) == "tma";
  const Variant forms[] = {
      {"shipped tile 8", LaunchDecode<Form::kShipped>},
      {"shipped tile 16", LaunchDecode<Form::kShipped16>},
      {"block per tile", LaunchDecode<Form::kBlock>},
      {"persistent", LaunchDecode<Form::kPersistent>},
      {"tma forced", LaunchTmaForced<kTmaConsumers, kTmaStages, kTmaBoxes>},
  };
  const Variant tma_shapes[] = {
      {"shipped tile 16", LaunchDecode<Form::kShipped16>},
      {"tma 8x3x1", LaunchTmaForced<8, 3, 1>},  {"tma 8x4x1", LaunchTmaForced<8, 4, 1>},
      {"tma 8x5x1", LaunchTmaForced<8, 5, 1>},  {"tma 8x6x1", LaunchTmaForced<8, 6, 1>},
      {"tma 8x2x2", LaunchTmaForced<8, 2, 2>},  {"tma 8x3x2", LaunchTmaForced<8, 3, 2>},
      {"tma 4x6x1", LaunchTmaForced<4, 6, 1>},  {"tma 4x8x1", LaunchTmaForced<4, 8, 1>},
      {"tma 4x4x2", LaunchTmaForced<4, 4, 2>},  {"tma 16x3x1", LaunchTmaForced<16, 3, 1>},
      {"tma 16x4x1", LaunchTmaForced<16, 4, 1>},
  };
  const Variant* variants = tma_sweep ? tma_shapes : forms;
  const int nvar = static_cast<int>(tma_sweep ? sizeof(tma_shapes) / sizeof(Variant)
                                              : sizeof(forms) / sizeof(Variant));
  const Case cases[] = {
      {"q235 T16 up", 128, 3072, 4096, 16, 8},  {"q235 T16 dn", 128, 4096, 1536, 16, 8},
      {"q235 T128 up", 128, 3072, 4096, 128, 8}, {"q235 T128 dn", 128, 4096, 1536, 128, 8},
      {"ds T16 up", 256, 4096, 7168, 16, 8},     {"ds T16 dn", 256, 7168, 2048, 16, 8},
      {"ds T128 up", 256, 4096, 7168, 128, 8},   {"ds T128 dn", 256, 7168, 2048, 128, 8},
      {"q30 T1 up", 128, 1536, 2048, 1, 8},      {"q30 T16 up", 128, 1536, 2048, 16, 8},
      {"q30 T1 dn", 128, 2048, 768, 1, 8},       {"q235 T1 up", 128, 3072, 4096, 1, 8},
      {"q30 T128 up", 128, 1536, 2048, 128, 8},  {"q30 T128 dn", 128, 2048, 768, 128, 8},
      {"mix T1 up", 8, 28672, 4096, 1, 2},       {"q235 T64 up", 128, 3072, 4096, 64, 8},
      {"q235 T1 dn", 128, 4096, 1536, 1, 8},     {"ds T1 up", 256, 4096, 7168, 1, 8},
      {"ds T1 dn", 256, 7168, 2048, 1, 8},       {"mix T1 dn", 8, 4096, 14336, 1, 2},
      {"mix T16 up", 8, 28672, 4096, 16, 2},     {"mix T16 dn", 8, 4096, 14336, 16, 2},
      {"odd N K", 8, 200, 1000, 16, 2},
  };
  const int kRot = 4, kCalls = 20, kReps = 7;
  unsigned* sink;
  CK(cudaMalloc(&sink, 4));
  int sms = 0;
  CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  for (const Case& cs : cases) {
    if (std::string(cs.name).find(only) == std::string::npos) continue;
    const int64_t wn = (int64_t)cs.E * cs.N * cs.K;
    const int64_t m = (int64_t)cs.T * cs.topk;
    uint16_t *w, *x, *out;
    float* ref;
    int32_t* sizes;
    CK(cudaMalloc(&w, wn * 2));
    CK(cudaMalloc(&x, m * cs.K * 2));
    CK(cudaMalloc(&out, m * cs.N * 2));
    CK(cudaMalloc(&ref, m * cs.N * 4));
    CK(cudaMalloc(&sizes, kRot * cs.E * 4));
    // Random bf16 in [-1, 1) by a hash kernel-free fill: host for x, a pattern for w.
    {
      std::vector<uint16_t> hx(m * cs.K);
      std::mt19937 rng(1);
      std::uniform_real_distribution<float> U(-1.f, 1.f);
      for (auto& v : hx) v = __bfloat16_as_ushort(__float2bfloat16(U(rng)));
      CK(cudaMemcpy(x, hx.data(), hx.size() * 2, cudaMemcpyHostToDevice));
      const int64_t chunk = 1 << 24;
      std::vector<uint16_t> hw(chunk + 7000);
      for (auto& v : hw) v = __bfloat16_as_ushort(__float2bfloat16(U(rng) * 0.05f));
      for (int64_t o = 0; o < wn; o += chunk)
        CK(cudaMemcpy(w + o, hw.data() + (o / chunk % 7) * 1000,
                      std::min<int64_t>(chunk, wn - o) * 2, cudaMemcpyHostToDevice));
    }
    double act = 0;
    const std::vector<int32_t> hs = RandomExpertSizes(cs.E, cs.T, cs.topk, kRot, &act);
    CK(cudaMemcpy(sizes, hs.data(), hs.size() * 4, cudaMemcpyHostToDevice));
    const double bytes = act * cs.N * cs.K * 2.0;
    // reference on rotation 0
    RefKernel<<<(m * cs.N + 255) / 256, 256>>>(x, w, sizes, cs.E, ref, m, cs.N, cs.K);
    CK(cudaDeviceSynchronize());
    std::vector<float> href(m * cs.N);
    CK(cudaMemcpy(href.data(), ref, href.size() * 4, cudaMemcpyDeviceToHost));
    // Median over kReps of the mean time of kCalls launches of fn(call).
    auto median_us = [&](auto&& fn) { return MedianLaunchMicros(fn, kCalls, kReps); };
    // ceiling: stream the same bytes
    {
      const int64_t n16 = (int64_t)bytes / 16;  // different weights per call, like the routings
      const double us = median_us([&](int c) {
        StreamKernel<<<sms * 8, 256>>>(
            reinterpret_cast<const uint4*>(w) + (c % kRot) * ((wn / 8 - n16) / kRot), n16, sink);
      });
      printf("%-14s active %.1f  %.1f MB  stream %.1f us %.2f TB/s\n", cs.name, act, bytes / 1e6,
             us, bytes / us / 1e6);
    }
    for (int v = 0; v < nvar; ++v) {
      CK(cudaMemset(out, 0xff, m * cs.N * 2));
      variants[v].fn(x, w, sizes, out, m, cs.N, cs.K, cs.E);
      CK(cudaGetLastError());
      CK(cudaDeviceSynchronize());
      std::vector<uint16_t> ho(m * cs.N);
      CK(cudaMemcpy(ho.data(), out, ho.size() * 2, cudaMemcpyDeviceToHost));
      double maxerr = 0;
      int64_t bad = 0;
      for (int64_t i = 0; i < m * cs.N; ++i) {
        const float o = __bfloat162float(__ushort_as_bfloat16(ho[i]));
        const double err = std::fabs(o - href[i]);
        if (!(err <= 2e-2 + 1e-2 * std::fabs(href[i]))) ++bad;
        if (!(err <= maxerr)) maxerr = err;
      }
      const double us = median_us([&](int c) {
        variants[v].fn(x, w, sizes + (c % kRot) * cs.E, out, m, cs.N, cs.K, cs.E);
      });
      printf("  %-26s %8.1f us  %.2f TB/s  maxerr %.3g bad %lld\n", variants[v].name, us,
             bytes / us / 1e6, maxerr, (long long)bad);
    }
    CK(cudaFree(w));
    CK(cudaFree(x));
    CK(cudaFree(out));
    CK(cudaFree(ref));
    CK(cudaFree(sizes));
  }
  return 0;
}

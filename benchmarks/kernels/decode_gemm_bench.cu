// The decode grouped GEMMs (group_gemm with tile_m = 8 and 16, through
// LaunchGroupGemmFor in csrc/kernels/cuda/group_gemm/launch.h: the skinny
// kernel, block per tile or persistent, and on compute capability 9.0+ the
// TMA kernel, as the dispatch picks them) on the decode-shaped GEMMs of
// Qwen3-30B-A3B, Qwen3-235B-A22B, DeepSeek-V3 and Mixtral 8x7B, against a
// streaming read of the same weight bytes (the bandwidth they could reach).
// Each result is checked against an f32 reference kernel (maxerr, and "bad":
// outputs off by more than 2e-2 + 1e-2 |ref|).
//
// Bytes are the weights of the experts the routing touches (mean over 4
// rotated random routings, bf16); times are the median of 7 repeats of the
// mean of 20 launches, each launch on the next routing.
//
// Build (from the repository root; needs nvcc, runs on a Hopper GPU):
//   cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release -DJAX_MOE_BUILD_KERNEL_BENCHMARKS=ON
//   ninja -C build decode_gemm_bench
//   build/benchmarks/kernels/decode_gemm_bench [substring of the case names to run]
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include "bench_util.cuh"
#include "kernels/cuda/cuda_common.cuh"
#include "kernels/cuda/group_gemm/launch.h"

namespace {

using jax_moe::DType;
using jax_moe::GemmDims;
using jax_moe::LdgStream;

// Reference: one thread per output, f32.
__global__ void RefKernel(const uint16_t* x, const uint16_t* w, const int32_t* sizes, int E,
                          float* out, int64_t m, int64_t n, int64_t k) {
  const int64_t id = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (id >= m * n) return;
  const int64_t r = id / n, c = id % n;
  const int e = ExpertOfRow(sizes, E, r);
  float v = 0.f;
  if (e >= 0)
    for (int64_t q = 0; q < k; ++q)
      v += __bfloat162float(__ushort_as_bfloat16(x[r * k + q])) *
           __bfloat162float(__ushort_as_bfloat16(w[(e * n + c) * k + q]));
  out[id] = v;
}

// The read ceiling: stream `n16` 16-byte vectors once.
__global__ void StreamKernel(const uint4* p, int64_t n16, unsigned* sink) {
  unsigned acc = 0;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  for (; i + 3 * stride < n16; i += 4 * stride) {
    const uint4 a = LdgStream(p + i), b = LdgStream(p + i + stride),
                c = LdgStream(p + i + 2 * stride), d = LdgStream(p + i + 3 * stride);
    acc ^= a.x ^ b.y ^ c.z ^ d.w;
  }
  for (; i < n16; i += stride) acc ^= LdgStream(p + i).x;
  if (acc == 0x12345678u) *sink = acc;
}

// One GEMM: E experts of w (N, K), T tokens routed to topk experts each.
struct Case {
  const char* name;
  int E, N, K, T, topk;
};

// The dispatch for tile_m `tile`, bf16, no gather, on the default stream.
void LaunchTile(const uint16_t* x, const uint16_t* w, const int32_t* sizes, uint16_t* out,
                int64_t m, int64_t n, int64_t k, int64_t groups, int64_t tile) {
  GemmDims d{};
  d.m = m;
  d.n = n;
  d.k = k;
  d.groups = groups;
  d.x_rows = m;
  CK(jax_moe::LaunchGroupGemmFor(0, DType::BF16, x, w, sizes, out, d, nullptr, 1, tile, false));
}

}  // namespace

// argv[1] (optional): run only the cases whose name contains it.
int main(int argc, char** argv) {
  const char* only = argc > 1 ? argv[1] : "";
  const int64_t tiles[] = {8, 16};
  // q30: Qwen3-30B-A3B, q235: Qwen3-235B-A22B, ds: DeepSeek-V3, mix: Mixtral
  // 8x7B; up: the gate/up GEMM (N = 2I, K = H), dn: the down GEMM (N = H, K = I).
  const Case cases[] = {
      {"q30 T1 up", 128, 1536, 2048, 1, 8},      {"q30 T1 dn", 128, 2048, 768, 1, 8},
      {"q30 T16 up", 128, 1536, 2048, 16, 8},    {"q30 T128 up", 128, 1536, 2048, 128, 8},
      {"q30 T128 dn", 128, 2048, 768, 128, 8},   {"q235 T1 up", 128, 3072, 4096, 1, 8},
      {"q235 T1 dn", 128, 4096, 1536, 1, 8},     {"q235 T16 up", 128, 3072, 4096, 16, 8},
      {"q235 T16 dn", 128, 4096, 1536, 16, 8},   {"q235 T64 up", 128, 3072, 4096, 64, 8},
      {"q235 T128 up", 128, 3072, 4096, 128, 8}, {"q235 T128 dn", 128, 4096, 1536, 128, 8},
      {"ds T1 up", 256, 4096, 7168, 1, 8},       {"ds T1 dn", 256, 7168, 2048, 1, 8},
      {"ds T16 up", 256, 4096, 7168, 16, 8},     {"ds T16 dn", 256, 7168, 2048, 16, 8},
      {"ds T128 up", 256, 4096, 7168, 128, 8},   {"ds T128 dn", 256, 7168, 2048, 128, 8},
      {"mix T1 up", 8, 28672, 4096, 1, 2},       {"mix T1 dn", 8, 4096, 14336, 1, 2},
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
    const int64_t wn = static_cast<int64_t>(cs.E) * cs.N * cs.K;
    const int64_t m = static_cast<int64_t>(cs.T) * cs.topk;
    uint16_t *w, *x, *out;
    float* ref;
    int32_t* sizes;
    CK(cudaMalloc(&w, wn * 2));
    CK(cudaMalloc(&x, m * cs.K * 2));
    CK(cudaMalloc(&out, m * cs.N * 2));
    CK(cudaMalloc(&ref, m * cs.N * 4));
    CK(cudaMalloc(&sizes, kRot * cs.E * 4));
    // Random bf16: x uniform in [-1, 1), w a repeated pattern of 0.05 times that.
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
    double active = 0;
    const std::vector<int32_t> hs = RandomExpertSizes(cs.E, cs.T, cs.topk, kRot, &active);
    CK(cudaMemcpy(sizes, hs.data(), hs.size() * 4, cudaMemcpyHostToDevice));
    const double bytes = active * cs.N * cs.K * 2.0;
    // The reference of routing 0.
    RefKernel<<<(m * cs.N + 255) / 256, 256>>>(x, w, sizes, cs.E, ref, m, cs.N, cs.K);
    CK(cudaDeviceSynchronize());
    std::vector<float> href(m * cs.N);
    CK(cudaMemcpy(href.data(), ref, href.size() * 4, cudaMemcpyDeviceToHost));
    auto median_us = [&](auto&& fn) { return MedianLaunchMicros(fn, kCalls, kReps); };
    {
      // Different weights per call, like the routings.
      const int64_t n16 = static_cast<int64_t>(bytes) / 16;
      const double us = median_us([&](int c) {
        StreamKernel<<<sms * 8, 256>>>(
            reinterpret_cast<const uint4*>(w) + (c % kRot) * ((wn / 8 - n16) / kRot), n16, sink);
      });
      printf("%-14s active %.1f  %.1f MB  stream %.1f us %.2f TB/s\n", cs.name, active,
             bytes / 1e6, us, bytes / us / 1e6);
    }
    for (const int64_t tile : tiles) {
      CK(cudaMemset(out, 0xff, m * cs.N * 2));
      LaunchTile(x, w, sizes, out, m, cs.N, cs.K, cs.E, tile);
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
        LaunchTile(x, w, sizes + (c % kRot) * cs.E, out, m, cs.N, cs.K, cs.E, tile);
      });
      printf("  tile %-3lld %8.1f us  %.2f TB/s  maxerr %.3g bad %lld\n",
             static_cast<long long>(tile), us, bytes / us / 1e6, maxerr,
             static_cast<long long>(bad));
    }
    CK(cudaFree(w));
    CK(cudaFree(x));
    CK(cudaFree(out));
    CK(cudaFree(ref));
    CK(cudaFree(sizes));
  }
  CK(cudaFree(sink));
  return 0;
}

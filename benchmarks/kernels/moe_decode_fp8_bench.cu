// Where the one-token fp8 kernel (ops.moe_decode_fp8; csrc/kernels/cuda/
// moe_decode_fp8.cu, through LaunchMoeDecodeFp8) spends its time at
// Qwen3-235B-A22B and DeepSeek-V3, one token, bf16 x: its output checked to
// be finite and rerun bit for bit, then timed over 20-call loops (picks
// rotated over 16 draws; median of 7), and the phases of two back-to-back
// calls printed: min / median / max over blocks of globaltimer at start, ids
// read, x quantised, w13 done, past the first grid barrier, act quantised,
// w2 done, past the second barrier, end (µs from the first block's start).
// Its numerics are the tests' (tests/layer/test_fp8_decode.py); this program
// measures.
//
// The phase timestamps are compiled into this benchmark's own copy of the
// kernel (benchmarks/kernels/CMakeLists.txt builds moe_decode_fp8.cu into it
// with JAX_MOE_DECODE_FP8_STAMPS); the shipped library never has them.
//
// Build (from the repository root; needs nvcc, runs on a Hopper GPU):
//   cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release -DJAX_MOE_BUILD_KERNEL_BENCHMARKS=ON
//   ninja -C build moe_decode_fp8_bench && build/benchmarks/kernels/moe_decode_fp8_bench
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <numeric>
#include <random>
#include <vector>

#include "bench_util.cuh"
#include "kernels/common/numeric.h"
#include "kernels/cuda/moe_decode_fp8.h"

#ifndef JAX_MOE_DECODE_FP8_STAMPS
#error "moe_decode_fp8_bench needs the stamped kernel (JAX_MOE_DECODE_FP8_STAMPS; see CMakeLists.txt)"
#endif

namespace jax_moe {
namespace {

// The streaming read rate of the H200 that the floor below assumes
// (docs/performance.md).
constexpr double kStreamTBs = 4.3;

__device__ __forceinline__ uint32_t Hash(uint64_t i, uint32_t seed) {
  uint64_t z = i * 0x9e3779b97f4a7c15ull + seed;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return static_cast<uint32_t>(z ^ (z >> 31));
}

// Random e4m3 codes, never NaN (0x7f / 0xff).
__global__ void FillCodes(uint8_t* w, int64_t n, uint32_t seed) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    uint8_t b = static_cast<uint8_t>(Hash(i, seed));
    if ((b & 0x7f) == 0x7f) b ^= 1;
    w[i] = b;
  }
}

// Block scales in [0.5, 1.5) / 2^13, so that weights stay around 0.05.
__global__ void FillScales(float* s, int64_t n, uint32_t seed) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    s[i] = (0.5f + static_cast<float>(Hash(i, seed) >> 8) * (1.0f / 16777216.0f)) / 8192.0f;
}

int Run(const char* name, Model m) {
  constexpr int kRotations = 16, kPoints = kFp8StampPoints;
  int dev = 0, sms = 0;
  CK(cudaGetDevice(&dev));
  CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
  const int64_t E = m.E, H = m.H, I = m.I, k = m.topk;
  const int64_t kbh = (H + 127) / 128, kbi = (I + 127) / 128, nb13 = (2 * I + 127) / 128;
  const int64_t n13 = E * 2 * I * H, n2 = E * H * I;
  const int64_t s13 = E * nb13 * kbh, s2 = E * kbh * kbi;
  printf("%s: E=%lld H=%lld I=%lld k=%lld, %d SMs\n", name, static_cast<long long>(E),
         static_cast<long long>(H), static_cast<long long>(I), static_cast<long long>(k), sms);

  std::mt19937 rng(7);
  std::uniform_real_distribution<float> uni(-1.f, 1.f);
  std::vector<uint16_t> hx(H);
  for (auto& v : hx) v = FloatToBf16(uni(rng));
  // Each call's k distinct experts and renormalised weights.
  std::vector<int32_t> hids(kRotations * k);
  std::vector<float> hwts(kRotations * k);
  std::vector<int32_t> order(E);
  for (int r = 0; r < kRotations; ++r) {
    std::iota(order.begin(), order.end(), 0);
    std::shuffle(order.begin(), order.end(), rng);
    float sum = 0.f;
    for (int j = 0; j < k; ++j) sum += hwts[r * k + j] = 0.5f + 0.5f * (uni(rng) + 1.f);
    for (int j = 0; j < k; ++j) {
      hids[r * k + j] = order[j];
      hwts[r * k + j] /= sum;
    }
  }

  uint8_t *w13, *w2;
  float *w13s, *w2s, *wts, *act, *y;
  int32_t* ids;
  void *x, *out;
  unsigned long long* stamps;
  const int max_blocks = 4 * sms;  // the launcher's grid is at most its residency
  const size_t per_call = static_cast<size_t>(max_blocks) * kFp8StampStride;  // stamps a call
  CK(cudaMalloc(&w13, n13));
  CK(cudaMalloc(&w2, n2));
  CK(cudaMalloc(&w13s, s13 * 4));
  CK(cudaMalloc(&w2s, s2 * 4));
  CK(cudaMalloc(&x, H * 2));
  CK(cudaMalloc(&ids, hids.size() * 4));
  CK(cudaMalloc(&wts, hwts.size() * 4));
  CK(cudaMalloc(&act, k * I * 4));
  CK(cudaMalloc(&y, k * H * 4));
  CK(cudaMalloc(&out, kRotations * H * 2));
  CK(cudaMalloc(&stamps, 2 * per_call * 8));
  FillCodes<<<4 * sms, 256>>>(w13, n13, 1);
  FillCodes<<<4 * sms, 256>>>(w2, n2, 2);
  FillScales<<<4 * sms, 256>>>(w13s, s13, 3);
  FillScales<<<4 * sms, 256>>>(w2s, s2, 4);
  CK(cudaGetLastError());
  CK(cudaMemcpy(x, hx.data(), H * 2, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(ids, hids.data(), hids.size() * 4, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(wts, hwts.data(), hwts.size() * 4, cudaMemcpyHostToDevice));
  CK(SetMoeDecodeFp8Stamps(nullptr));

  auto launch = [&](int call) {
    const int r = call % kRotations;
    const MoeDecodeFp8Problem p{x,    ids + r * k, wts + r * k, w13, w13s, w2, w2s, act, y,
                                static_cast<uint16_t*>(out) + r * H, E, H, I, k, kSilu, true};
    CK(LaunchMoeDecodeFp8(0, DType::BF16, p));
  };
  for (int c = 0; c < kRotations; ++c) launch(c);
  CK(cudaDeviceSynchronize());
  std::vector<uint16_t> got(kRotations * H);
  CK(cudaMemcpy(got.data(), out, got.size() * 2, cudaMemcpyDeviceToHost));
  double scale = 0;
  bool finite = true;
  for (uint16_t v : got) {
    const float f = Bf16ToFloat(v);
    finite = finite && std::isfinite(f);
    scale = std::max(scale, static_cast<double>(std::fabs(f)));
  }
  launch(0);
  CK(cudaDeviceSynchronize());
  std::vector<uint16_t> again(H);
  CK(cudaMemcpy(again.data(), out, H * 2, cudaMemcpyDeviceToHost));
  const bool same = std::memcmp(again.data(), got.data(), H * 2) == 0;
  printf("  check: max |out| %.3g, %s; rerun %s\n", scale, finite ? "finite" : "NOT FINITE",
         same ? "bitwise equal" : "DIFFERS");

  const double us = MedianLaunchMicros(launch, 20, 7);
  const double bytes = static_cast<double>(k) * (3 * H * I + 4 * (nb13 * kbh + kbh * kbi));
  printf("  %.1f us per call, %.2f TB/s of expert weights and scales (floor %.1f us at %.1f TB/s)\n",
         us, bytes / us / 1e6, bytes / (kStreamTBs * 1e6), kStreamTBs);

  // Two calls back to back with stamps (the 3rd and 4th of a run of 4);
  // blocks that never ran keep stamp 0 at point 0.
  CK(cudaMemset(stamps, 0, 2 * per_call * 8));
  for (int c = 0; c < 4; ++c) {
    CK(SetMoeDecodeFp8Stamps(c >= 2 ? stamps + (c - 2) * per_call : nullptr));
    launch(c);
  }
  CK(cudaDeviceSynchronize());
  CK(SetMoeDecodeFp8Stamps(nullptr));
  std::vector<unsigned long long> hs(2 * per_call);
  CK(cudaMemcpy(hs.data(), stamps, hs.size() * 8, cudaMemcpyDeviceToHost));
  const char* names[kPoints] = {"start", "ids",      "x quantised", "w13 done", "barrier",
                                "act quantised", "w2 done", "barrier", "end"};
  for (int c = 0; c < 2; ++c) {
    const unsigned long long* cs = hs.data() + c * per_call;
    int blocks = 0;
    unsigned long long t0 = ~0ull;
    while (blocks < max_blocks && cs[blocks * kFp8StampStride] != 0) {
      t0 = std::min(t0, cs[blocks * kFp8StampStride]);
      ++blocks;
    }
    printf("  call %d, %d blocks (µs, min/median/max over blocks):\n", c, blocks);
    for (int q = 0; q < kPoints && blocks > 0; ++q) {
      std::vector<double> v;
      for (int b = 0; b < blocks; ++b)
        v.push_back((static_cast<double>(cs[b * kFp8StampStride + q]) - t0) / 1e3);
      std::sort(v.begin(), v.end());
      printf("    %-14s %7.1f %7.1f %7.1f\n", names[q], v.front(), v[v.size() / 2], v.back());
    }
  }
  for (void* p : {static_cast<void*>(w13), static_cast<void*>(w2), static_cast<void*>(w13s),
                  static_cast<void*>(w2s), x, static_cast<void*>(ids), static_cast<void*>(wts),
                  static_cast<void*>(act), static_cast<void*>(y), out, static_cast<void*>(stamps)})
    CK(cudaFree(p));
  return finite && same ? 0 : 1;
}

}  // namespace
}  // namespace jax_moe

int main() {
  int rc = jax_moe::Run("Qwen3-235B-A22B T=1 fp8", kQwen3_235B);
  rc |= jax_moe::Run("DeepSeek-V3 T=1 fp8", kDeepSeekV3);
  return rc;
}

// Where the one-kernel decode layer (ops.moe_decode; csrc/kernels/cuda/
// moe_decode.cu, through LaunchMoeDecode of kernels/cuda/moe_decode.h) spends
// its time at Qwen3-30B-A3B and one token, bf16: its output checked against a
// float64 host reference with the same rounding points and rerun bit for
// bit, then timed over 20-call loops (routings rotated over 16 draws; median
// of 7), and the phases of two back-to-back calls printed: min / median / max
// over blocks of globaltimer at start, routed, w13 done, past the grid
// barrier, w2 rows in, dots done, end (µs from the first block's start).
//
// The phase timestamps are compiled into this benchmark's own copy of the
// kernel (benchmarks/kernels/CMakeLists.txt builds moe_decode.cu into it with
// JAX_MOE_DECODE_STAMPS); the shipped library never has them.
//
// Build (from the repository root; needs nvcc, runs on a Hopper GPU):
//   cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release -DJAX_MOE_BUILD_KERNEL_BENCHMARKS=ON
//   ninja -C build moe_decode_bench && build/benchmarks/kernels/moe_decode_bench
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <vector>

#include "bench_util.cuh"
#include "kernels/common/numeric.h"
#include "kernels/cuda/moe_decode.h"

#ifndef JAX_MOE_DECODE_STAMPS
#error "moe_decode_bench needs the stamped kernel (JAX_MOE_DECODE_STAMPS; see CMakeLists.txt)"
#endif

namespace jax_moe {
namespace {

// The streaming read rate of the H200 that the floor below assumes
// (docs/performance.md).
constexpr double kStreamTBs = 4.3;

float Bf(uint16_t v) { return Bf16ToFloat(v); }
double RBf(double v) { return Bf(FloatToBf16(static_cast<float>(v))); }

// The kernel's rounding points with float64 sums (renormalised softmax top-k).
std::vector<double> Reference(const Model& m, const std::vector<uint16_t>& x, const float* logits,
                              const std::vector<uint16_t>& w13, const std::vector<uint16_t>& w2) {
  std::vector<int> order(m.E);
  for (int e = 0; e < m.E; ++e) order[e] = e;
  std::stable_sort(order.begin(), order.end(),
                   [&](int a, int b) { return logits[a] > logits[b]; });
  double sum = 0;
  std::vector<double> p(m.topk);
  for (int j = 0; j < m.topk; ++j) sum += p[j] = std::exp(logits[order[j]] - logits[order[0]]);
  std::vector<double> out(m.H, 0.0), act(m.I);
  for (int j = 0; j < m.topk; ++j) {
    const size_t e = order[j];
    for (int i = 0; i < m.I; ++i) {
      double g = 0, u = 0;
      const uint16_t* gr = &w13[(e * 2 * m.I + i) * m.H];
      const uint16_t* ur = gr + static_cast<size_t>(m.I) * m.H;
      for (int h = 0; h < m.H; ++h) {
        g += static_cast<double>(Bf(gr[h])) * Bf(x[h]);
        u += static_cast<double>(Bf(ur[h])) * Bf(x[h]);
      }
      g = RBf(g);
      act[i] = RBf(g / (1 + std::exp(-g)) * RBf(u));
    }
    for (int h = 0; h < m.H; ++h) {
      double y = 0;
      const uint16_t* wr = &w2[(e * m.H + h) * m.I];
      for (int i = 0; i < m.I; ++i) y += static_cast<double>(Bf(wr[i])) * act[i];
      out[h] += p[j] / sum * RBf(y);
    }
  }
  return out;
}

int Run(const char* name, Model m) {
  constexpr int kRotations = 16, kPoints = 7;
  int dev = 0, sms = 0;
  CK(cudaGetDevice(&dev));
  CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
  const int cols = (m.H + sms - 1) / sms;  // output columns a block (the launcher's split)
  const int grid = (m.H + cols - 1) / cols;
  printf("%s: E=%d H=%d I=%d k=%d, %d SMs, %d output columns a block\n", name, m.E, m.H, m.I,
         m.topk, sms, cols);
  const size_t n13 = static_cast<size_t>(m.E) * 2 * m.I * m.H;
  const size_t n2 = static_cast<size_t>(m.E) * m.H * m.I;
  uint64_t st = 0x9e3779b97f4a7c15ull;  // xorshift: uniform in [-s, s)
  auto uni = [&](float s) {
    st ^= st << 13;
    st ^= st >> 7;
    st ^= st << 17;
    return s * (static_cast<float>(st >> 40) * (2.0f / 16777216.0f) - 1.0f);
  };
  std::vector<uint16_t> hx(m.H), h13(n13), h2(n2);
  for (auto& v : hx) v = FloatToBf16(uni(1.f));
  for (auto& v : h13) v = FloatToBf16(uni(0.05f));
  for (auto& v : h2) v = FloatToBf16(uni(0.07f));
  std::vector<float> hl(static_cast<size_t>(kRotations) * m.E);
  for (auto& v : hl) v = uni(3.f);
  void *x, *w13, *w2, *out, *logits, *act;
  unsigned long long* stamps;
  CK(cudaMalloc(&x, m.H * 2));
  CK(cudaMalloc(&w13, n13 * 2));
  CK(cudaMalloc(&w2, n2 * 2));
  CK(cudaMalloc(&out, static_cast<size_t>(kRotations) * m.H * 2));
  CK(cudaMalloc(&logits, hl.size() * 4));
  CK(cudaMalloc(&act, static_cast<size_t>(m.topk) * m.I * 4));
  CK(cudaMalloc(&stamps, static_cast<size_t>(2) * sms * 8 * 8));
  CK(cudaMemcpy(x, hx.data(), m.H * 2, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(w13, h13.data(), n13 * 2, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(w2, h2.data(), n2 * 2, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(logits, hl.data(), hl.size() * 4, cudaMemcpyHostToDevice));
  CK(SetMoeDecodeStamps(nullptr));
  auto launch = [&](int call) {
    const MoeDecodeProblem p{
        x, static_cast<float*>(logits) + static_cast<size_t>(call % kRotations) * m.E, w13, w2,
        static_cast<float*>(act),
        static_cast<uint16_t*>(out) + static_cast<size_t>(call % kRotations) * m.H, DType::F32,
        m.E, m.H, m.I, m.topk, true, 1.0f};
    CK(LaunchMoeDecode(0, DType::BF16, p));
  };
  for (int c = 0; c < kRotations; ++c) launch(c);
  CK(cudaDeviceSynchronize());
  std::vector<uint16_t> got(static_cast<size_t>(kRotations) * m.H);
  CK(cudaMemcpy(got.data(), out, got.size() * 2, cudaMemcpyDeviceToHost));
  double worst = 0, scale = 0;
  for (int r = 0; r < 3; ++r) {
    const std::vector<double> want = Reference(m, hx, &hl[static_cast<size_t>(r) * m.E], h13, h2);
    for (int h = 0; h < m.H; ++h) {
      worst = std::max(worst, std::abs(Bf(got[static_cast<size_t>(r) * m.H + h]) - want[h]));
      scale = std::max(scale, std::abs(want[h]));
    }
  }
  const bool ok = worst <= 0.02 * scale;  // bf16 output after bf16 roundings of h, act and y
  launch(0);
  CK(cudaDeviceSynchronize());
  std::vector<uint16_t> again(m.H);
  CK(cudaMemcpy(again.data(), out, m.H * 2, cudaMemcpyDeviceToHost));
  const bool same = std::memcmp(again.data(), got.data(), m.H * 2) == 0;
  printf("  check (3 routings): max abs err %.3g of max |out| %.3g: %s; rerun %s\n", worst, scale,
         ok ? "ok" : "MISMATCH", same ? "bitwise equal" : "DIFFERS");
  const double us = MedianLaunchMicros(launch, 20, 7);
  const double bytes = 3.0 * m.topk * m.H * m.I * 2;
  printf("  %.1f us per call, %.2f TB/s of expert weights (floor %.1f us at %.1f TB/s)\n", us,
         bytes / us / 1e6, bytes / (kStreamTBs * 1e6), kStreamTBs);
  // Two calls back to back with stamps (the 3rd and 4th of a run of 4).
  for (int c = 0; c < 4; ++c) {
    CK(SetMoeDecodeStamps(c >= 2 ? stamps + static_cast<size_t>(c - 2) * sms * 8 : nullptr));
    launch(c);
  }
  CK(cudaDeviceSynchronize());
  CK(SetMoeDecodeStamps(nullptr));
  std::vector<unsigned long long> hs(static_cast<size_t>(2) * sms * 8);
  CK(cudaMemcpy(hs.data(), stamps, hs.size() * 8, cudaMemcpyDeviceToHost));
  unsigned long long t0 = ~0ull;
  for (int b = 0; b < grid; ++b) t0 = std::min(t0, hs[b * 8]);
  const char* names[kPoints] = {"start", "routed", "w13 done", "barrier", "w2 in", "dots", "end"};
  for (int c = 0; c < 2; ++c) {
    printf("  call %d:", c);
    for (int q = 0; q < kPoints; ++q) {
      std::vector<double> v;
      for (int b = 0; b < grid; ++b) {
        const size_t o = (static_cast<size_t>(c) * sms + b) * 8 + q;
        // Blocks without columns return after the barrier: no later stamps.
        if (q < 4 || b * cols < m.H) v.push_back((static_cast<double>(hs[o]) - t0) / 1e3);
      }
      std::sort(v.begin(), v.end());
      printf(" %s %.1f/%.1f/%.1f", names[q], v.front(), v[v.size() / 2], v.back());
    }
    printf(" us\n");
  }
  for (void* p : {x, w13, w2, out, logits, act, static_cast<void*>(stamps)}) CK(cudaFree(p));
  return ok && same ? 0 : 1;
}

}  // namespace
}  // namespace jax_moe

int main() { return jax_moe::Run("Qwen3-30B-A3B T=1", kQwen3_30B); }

// The grouped GEMM's own Hopper kernel (GroupGemmWgmma) against the CUTLASS
// sm90 kernel (GroupGemmSm90, tile_m = 256) on the prefill GEMMs of the model
// shapes: random top-k routings, both without and with the gather (x as the
// token rows and each routing's dst_to_src, an expert's slots in token order
// as the layer's token index writes them). Each output is checked against
// an f32 reference on the device (every row for the small cases, sampled
// rows of every expert otherwise) and the two kernels against each other.
// µs per call: CUDA events, the median of 5 x 10 calls, routings rotated.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

#include "bench_util.cuh"
#include "kernels/common/numeric.h"
#include "kernels/cuda/activation.h"
#include "kernels/cuda/group_gemm/gemm_sm90a.h"
#include "kernels/cuda/group_gemm/wgmma_sm90a.h"

#if JAX_MOE_WITH_SM90
namespace {

struct Case {
  const char* name;
  int E, N, K, T, topk;
};

// Deterministic pseudo-random bf16 in [-scale, scale).
__global__ void FillKernel(uint16_t* p, int64_t n, uint32_t seed, float scale) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n;
       i += int64_t{gridDim.x} * blockDim.x) {
    uint32_t h = static_cast<uint32_t>(i) * 2654435761u ^ seed ^ static_cast<uint32_t>(i >> 32);
    h ^= h >> 15;
    h *= 2246822519u;
    h ^= h >> 13;
    const float v = (static_cast<float>(h & 0xFFFFFF) / 16777216.f * 2.f - 1.f) * scale;
    p[i] = __bfloat16_as_ushort(__float2bfloat16(v));
  }
}

// ref[i, :] for the listed rows: x row (through the gather when given) times
// w[expert of the row]^T, f32; a row past the experts is zero. A warp an
// output, its lanes striding k.
__global__ void RefRowsKernel(const uint16_t* x, const uint16_t* w, const int32_t* sizes, int E,
                              const int32_t* gather, int topk, int64_t x_rows,
                              const int64_t* list, float* ref, int n, int k) {
  const int64_t r = list[blockIdx.y];
  const int c = blockIdx.x * 8 + (threadIdx.x >> 5), lane = threadIdx.x & 31;
  if (c >= n) return;
  const int e = ExpertOfRow(sizes, E, r);
  float acc = 0.f;
  if (e >= 0) {
    const int64_t src = gather ? jax_moe::ExpandSourceRow(gather[r], topk, x_rows * topk) : r;
    if (src >= 0) {
      const uint16_t* xr = x + src * k;
      const uint16_t* wr = w + (static_cast<int64_t>(e) * n + c) * k;
      for (int i = lane; i < k; i += 32)
        acc += __bfloat162float(__ushort_as_bfloat16(xr[i])) *
               __bfloat162float(__ushort_as_bfloat16(wr[i]));
    }
  }
  for (int o = 16; o > 0; o >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);
  if (lane == 0) ref[blockIdx.y * static_cast<int64_t>(n) + c] = acc;
}

float Bf(uint16_t v) { return __bfloat162float(__ushort_as_bfloat16(v)); }

}  // namespace

// argv[1] (optional): run only the cases whose name contains it. argv[2]
// (optional) "zeros": the token rows are zeros (the weights stay random), to
// time the kernels on zero-valued inputs.
int main(int argc, char** argv) {
  const char* only = argc > 1 ? argv[1] : "";
  const float row_scale = argc > 2 && std::string(argv[2]) == "zeros" ? 0.f : 1.f;
  // up: the gate/up GEMM (N = 2I, K = H), dn: the down GEMM (N = H, K = I).
  // The "edge" cases: odd sizes, an expert with every row, few rows.
  const Case cases[] = {
      {"edge odd", 5, 264, 200, 300, 2},    {"edge one", 1, 512, 128, 77, 1},
      {"edge few", 64, 256, 256, 3, 4},     {"edge wide", 8, 1000, 72, 600, 8},
      {"edge deep", 4, 272, 4104, 150, 2},
      {"q30 T1024 up", 128, 1536, 2048, 1024, 8}, {"q30 T1024 dn", 128, 2048, 768, 1024, 8},
      {"mix T128 up", 8, 28672, 4096, 128, 2},    {"mix T128 dn", 8, 4096, 14336, 128, 2},
      {"q30 T8192 up", 128, 1536, 2048, 8192, 8},
      {"q30 T8192 dn", 128, 2048, 768, 8192, 8},  {"q235 T8192 up", 128, 3072, 4096, 8192, 8},
      {"q235 T8192 dn", 128, 4096, 1536, 8192, 8}, {"ds T8192 up", 256, 4096, 7168, 8192, 8},
      {"ds T8192 dn", 256, 7168, 2048, 8192, 8},  {"mix T1024 up", 8, 28672, 4096, 1024, 2},
      {"mix T1024 dn", 8, 4096, 14336, 1024, 2},  {"mix T8192 up", 8, 28672, 4096, 8192, 2},
      {"q235 T1024 up", 128, 3072, 4096, 1024, 8}, {"q235 T1024 dn", 128, 4096, 1536, 1024, 8},
      {"ds T1024 up", 256, 4096, 7168, 1024, 8},
  };
  const int kRot = 4, kCalls = 10, kReps = 5;
  for (const Case& cs : cases) {
    if (std::string(cs.name).find(only) == std::string::npos) continue;
    const bool edge = std::string(cs.name).rfind("edge", 0) == 0;
    const int64_t m = static_cast<int64_t>(cs.T) * cs.topk, n = cs.N, k = cs.K;
    const int64_t wn = int64_t{cs.E} * n * k;
    uint16_t *w, *x, *xt, *out, *out2;
    int32_t *sizes, *gather;
    int* counter;
    CK(cudaMalloc(&counter, sizeof(int)));
    CK(cudaMalloc(&w, wn * 2));
    CK(cudaMalloc(&x, m * k * 2));
    CK(cudaMalloc(&xt, int64_t{cs.T} * k * 2));
    CK(cudaMalloc(&out, m * n * 2));
    CK(cudaMalloc(&out2, m * n * 2));
    CK(cudaMalloc(&sizes, kRot * cs.E * 4));
    CK(cudaMalloc(&gather, kRot * m * 4));
    FillKernel<<<1024, 256>>>(w, wn, 11, 1.f / std::sqrt(static_cast<float>(k)));
    FillKernel<<<1024, 256>>>(x, m * k, 12, row_scale);
    FillKernel<<<1024, 256>>>(xt, int64_t{cs.T} * k, 13, row_scale);
    double active = 0;
    std::vector<int32_t> hg;  // dst_to_src, [rotation][m]
    std::vector<int32_t> hs = RandomExpertSizes(cs.E, cs.T, cs.topk, kRot, &active, &hg);
    if (edge) {  // routing 0: the first expert empty and 5 rows fewer than m (a zero tail)
      int32_t* s0 = hs.data();
      int64_t drop = 5;
      for (int e = 0; e < cs.E && drop > 0; ++e) {
        const int32_t t = std::min<int64_t>(s0[e], drop);
        s0[e] -= t;
        drop -= t;
      }
      if (cs.E > 1) {
        s0[cs.E - 1] += s0[0];
        s0[0] = 0;
      }
    }
    CK(cudaMemcpy(sizes, hs.data(), hs.size() * 4, cudaMemcpyHostToDevice));
    if (edge) hg[m / 2] = -1;  // an invalid entry in routing 0's dst_to_src
    CK(cudaMemcpy(gather, hg.data(), kRot * m * 4, cudaMemcpyHostToDevice));
    const size_t scratch_bytes =
        static_cast<size_t>(jax_moe::GroupGemmSm90ScratchBytes(m, k, cs.E, true));
    void* scratch;
    CK(cudaMalloc(&scratch, scratch_bytes));
    // The rows checked: all (edge cases) or, per expert of routing 0, its first
    // and last row, and 4 rows past the experts when there are.
    std::vector<int64_t> list;
    {
      int64_t start = 0;
      for (int e = 0; e < cs.E; ++e) {
        const int64_t s = std::max(hs[e], 0);
        if (edge) {
          for (int64_t r = start; r < start + s; ++r) list.push_back(r);
        } else if (s > 0) {
          list.push_back(start);
          list.push_back(start + s - 1);
        }
        start += s;
      }
      for (int64_t r = start; r < m && r < start + 4; ++r) list.push_back(r);
    }
    int64_t* dlist;
    float* dref;
    CK(cudaMalloc(&dlist, list.size() * 8));
    CK(cudaMalloc(&dref, list.size() * n * 4));
    CK(cudaMemcpy(dlist, list.data(), list.size() * 8, cudaMemcpyHostToDevice));
    std::vector<float> href(list.size() * n);
    std::vector<uint16_t> ho(m * n), ho2(m * n);

    printf("%-14s E %d N %lld K %lld m %lld, rows an expert %.1f%s\n", cs.name, cs.E,
           static_cast<long long>(n), static_cast<long long>(k), static_cast<long long>(m),
           static_cast<double>(m) / active, row_scale == 0.f ? ", zero rows" : "");
    const double flops = 2.0 * m * n * k;
    for (int g = 0; g < 2; ++g) {
      const bool gath = g == 1;
      const uint16_t* xin = gath ? xt : x;
      RefRowsKernel<<<dim3((n + 7) / 8, list.size()), 256>>>(
          xin, w, sizes, cs.E, gath ? gather : nullptr, cs.topk, cs.T, dlist, dref, n, k);
      CK(cudaMemcpy(href.data(), dref, href.size() * 4, cudaMemcpyDeviceToHost));
      // The fields the two kernels' calls share (the same names in both), with
      // routing `rot`'s expert sizes and dst_to_src.
      auto fill = [&](auto& c, int rot, uint16_t* o) {
        c.bf16 = true;
        c.x = xin;
        c.w = w;
        c.sizes = sizes + rot * cs.E;
        c.rows = gath ? gather + rot * m : nullptr;
        c.topk = cs.topk;
        c.out = o;
        c.m = m;
        c.n = n;
        c.k = k;
        c.groups = cs.E;
        c.x_rows = gath ? cs.T : m;
      };
      auto run_ours = [&](int rot, uint16_t* o, int64_t act = -1) {
        jax_moe::WgmmaGemmCall c{};
        fill(c, rot, o);
        c.act = act;
        c.counter = counter;
        bool ran = false;
        CK(jax_moe::GroupGemmWgmma(c, &ran));
        if (!ran) {
          printf("  ours did not run\n");
          exit(1);
        }
      };
      auto run_cutlass = [&](int rot, uint16_t* o) {
        jax_moe::Sm90GemmCall c{};
        fill(c, rot, o);
        c.scratch = scratch;
        c.scratch_bytes = scratch_bytes;
        bool ran = false;
        CK(jax_moe::GroupGemmSm90(c, &ran));
        if (!ran) {
          printf("  cutlass did not run\n");
          exit(1);
        }
      };
      CK(cudaMemset(out, 0xff, m * n * 2));
      CK(cudaMemset(out2, 0xff, m * n * 2));
      run_ours(0, out);
      run_cutlass(0, out2);
      CK(cudaDeviceSynchronize());
      CK(cudaMemcpy(ho.data(), out, m * n * 2, cudaMemcpyDeviceToHost));
      CK(cudaMemcpy(ho2.data(), out2, m * n * 2, cudaMemcpyDeviceToHost));
      double err_ref = 0, err_ref2 = 0, err_pair = 0, scale = 0;
      int64_t bad = 0;
      for (size_t i = 0; i < list.size(); ++i)
        for (int64_t c = 0; c < n; ++c) {
          const float r = href[i * n + c];
          const float o = Bf(ho[list[i] * n + c]), o2 = Bf(ho2[list[i] * n + c]);
          const double e1 = std::fabs(o - r);
          if (!(e1 <= 1e-2 + 1e-2 * std::fabs(r))) ++bad;
          err_ref = std::max(err_ref, e1);
          err_ref2 = std::max(err_ref2, static_cast<double>(std::fabs(o2 - r)));
          scale = std::max(scale, static_cast<double>(std::fabs(r)));
        }
      for (int64_t i = 0; i < m * n; ++i) {
        const double e = std::fabs(Bf(ho[i]) - Bf(ho2[i]));
        if (!(e <= err_pair)) err_pair = e;
      }
      if (!(err_pair < 1e30)) ++bad;
      printf("  %s: max|ours-ref| %.3g (cutlass %.3g, |ref| up to %.3g) max|ours-cutlass| %.3g "
             "bad %lld %s\n",
             gath ? "gather" : "plain ", err_ref, err_ref2, scale, err_pair,
             static_cast<long long>(bad), bad ? "FAIL" : "ok");
      // The gated SiLU in the epilogue: the same bits as the activation kernel
      // on the plain output.
      const bool fused = gath && n % 16 == 0;
      if (fused) {
        CK(cudaMemset(out2, 0xff, m * n * 2));
        run_ours(0, out2, jax_moe::kSilu);
        CK(cudaMemcpy(ho2.data(), out2, m * n / 2 * 2, cudaMemcpyDeviceToHost));
        CK(jax_moe::LaunchActivation(0, jax_moe::DType::BF16, jax_moe::kSilu, true, out, m, n / 2,
                                     out2, false));
        CK(cudaDeviceSynchronize());
        CK(cudaMemcpy(ho.data(), out2, m * n / 2 * 2, cudaMemcpyDeviceToHost));
        int64_t diff = 0;
        for (int64_t i = 0; i < m * n / 2; ++i) diff += ho[i] != ho2[i];
        printf("  fused silu: %lld of %lld differ from gemm + activation kernel %s\n",
               static_cast<long long>(diff), static_cast<long long>(m * n / 2),
               diff ? "FAIL" : "ok");
      }
      if (edge) continue;
      const double us_c = MedianLaunchMicros(
          [&](int i) { run_cutlass(i % kRot, out2); }, kCalls, kReps);
      const double us_o = MedianLaunchMicros(
          [&](int i) { run_ours(i % kRot, out); }, kCalls, kReps);
      printf("  %s: cutlass %9.1f us %6.1f TFLOP/s | ours %9.1f us %6.1f TFLOP/s | %.3fx\n",
             gath ? "gather" : "plain ", us_c, flops / us_c / 1e6, us_o, flops / us_o / 1e6,
             us_c / us_o);
      if (fused) {  // w13 + activation: CUTLASS then the activation kernel, against ours fused
        uint16_t* act_out = out + m * n / 2;  // the second half of out: not read by the GEMMs
        const double us_ca = MedianLaunchMicros(
            [&](int i) {
              run_cutlass(i % kRot, out2);
              CK(jax_moe::LaunchActivation(0, jax_moe::DType::BF16, jax_moe::kSilu, true, out2, m,
                                           n / 2, act_out, false));
            },
            kCalls, kReps);
        const double us_f = MedianLaunchMicros(
            [&](int i) { run_ours(i % kRot, out2, jax_moe::kSilu); }, kCalls,
            kReps);
        printf("  +act:   cutlass + activation %9.1f us | ours fused %9.1f us | %.3fx\n", us_ca,
               us_f, us_ca / us_f);
      }
    }
    CK(cudaFree(w));
    CK(cudaFree(x));
    CK(cudaFree(xt));
    CK(cudaFree(out));
    CK(cudaFree(out2));
    CK(cudaFree(sizes));
    CK(cudaFree(gather));
    CK(cudaFree(counter));
    CK(cudaFree(scratch));
    CK(cudaFree(dlist));
    CK(cudaFree(dref));
  }
  return 0;
}
#else
int main() {
  printf("wgmma_gemm_bench needs the sm90 build (CUTLASS headers)\n");
  return 1;
}
#endif

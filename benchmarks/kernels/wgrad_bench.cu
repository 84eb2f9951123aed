// The Hopper weight-gradient grouped GEMM (GroupGemmWgradSm90,
// csrc/kernels/cuda/group_gemm/wgrad_sm90a.cu): out[e] (n, k) = dy_e^T x_e
// over each expert's rows.
//  (a) checks it against a naive f32 kernel on small shapes: empty experts
//      (first, middle, last, all), a gather with invalid entries, row counts
//      that are not multiples of 64, sizes past m, NaN rows past sum(sizes)
//      (which must not be read), more than 1024 experts, bf16 and f16; that
//      it runs twice to the same bits, and that it declines n % 8 != 0;
//  (b) times it on model-sized weight gradients (bf16, routings of
//      m / topk tokens to topk random experts) with a sampled check.
// Prints max abs error and PASS/FAIL per case; exits 1 on any failure.
// Times: the median of 5 repeats of the mean of 3 launches, after 2 warm-ups.
//
// Build (from the repository root; needs nvcc and the CUTLASS headers):
//   cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release -DJAX_MOE_BUILD_KERNEL_BENCHMARKS=ON
//   ninja -C build wgrad_bench
//   build/benchmarks/kernels/wgrad_bench [substring of the case names to run]
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "bench_util.cuh"
#include "kernels/common/numeric.h"

#ifdef JAX_MOE_WITH_SM90
#include "kernels/cuda/group_gemm/wgrad_sm90a.h"

namespace {

__device__ float Load16(const uint16_t* p, int64_t i, bool bf16) {
  return bf16 ? __bfloat162float(__ushort_as_bfloat16(p[i])) : __half2float(__ushort_as_half(p[i]));
}

// Pseudo-random 16-bit values in [-1, 1), a hash of (index, seed).
__global__ void FillKernel(uint16_t* p, int64_t count, uint32_t seed, bool bf16) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < count;
       i += stride) {
    uint32_t h = static_cast<uint32_t>(i) * 0x9E3779B1u ^ static_cast<uint32_t>(i >> 32) ^ seed;
    h ^= h >> 16;
    h *= 0x7feb352du;
    h ^= h >> 15;
    h *= 0x846ca68bu;
    h ^= h >> 16;
    const float v = static_cast<float>(h >> 8) * (2.0f / 16777216.0f) - 1.0f;
    p[i] = bf16 ? __bfloat16_as_ushort(__float2bfloat16(v)) : __half_as_ushort(__float2half(v));
  }
}

// Reference, f32, one thread per checked output: out index ids[t] (all
// outputs when ids is null) of (groups, n, k); expert e's rows [lo[e], hi[e]).
// Also copies the output there to got[t].
__global__ void RefKernel(const uint16_t* dy, const uint16_t* x, const int32_t* rows, int64_t topk,
                          int64_t limit, const int64_t* lo, const int64_t* hi, const int64_t* ids,
                          int64_t count, const uint16_t* out, float* ref, uint16_t* got, int64_t n,
                          int64_t k, bool bf16) {
  const int64_t t = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (t >= count) return;
  const int64_t id = ids != nullptr ? ids[t] : t;
  const int64_t e = id / (n * k), i = id / k % n, j = id % k;
  float v = 0.f;
  for (int64_t r = lo[e]; r < hi[e]; ++r) {
    const int64_t src = rows != nullptr ? jax_moe::ExpandSourceRow(rows[r], topk, limit) : r;
    if (src >= 0) v += Load16(dy, r * n + i, bf16) * Load16(x, src * k + j, bf16);
  }
  ref[t] = v;
  got[t] = out[id];
}

float HostFloat(uint16_t v, bool bf16) {
  return bf16 ? jax_moe::Bf16ToFloat(v) : jax_moe::HalfToFloat(v);
}

template <typename T>
T* DeviceCopy(const std::vector<T>& h) {
  T* d;
  CK(cudaMalloc(&d, std::max<size_t>(h.size(), 1) * sizeof(T)));
  if (!h.empty()) CK(cudaMemcpy(d, h.data(), h.size() * sizeof(T), cudaMemcpyHostToDevice));
  return d;
}

// One problem: dy (m, n), x (m, k) or (x_rows, k) with a gather (x_rows > 0).
struct Problem {
  bool bf16;
  int64_t n, k, m;
  std::vector<int32_t> sizes;
  int64_t x_rows = 0, topk = 1;
};

// The device buffers of a problem, filled (rows of dy and x past sum(sizes)
// are NaN), the gather random with invalid entries, out all NaN.
struct Buffers {
  const Problem& p;
  int64_t groups, rows_total = 0, xr;
  uint16_t *dy, *x, *out;
  int32_t *sizes, *rows = nullptr;
  void* scratch = nullptr;
  size_t scratch_bytes = 0;
  std::vector<int64_t> lo, hi;
  explicit Buffers(const Problem& q) : p(q), groups(static_cast<int64_t>(q.sizes.size())) {
    for (int32_t s : q.sizes) {
      lo.push_back(std::min(rows_total, p.m));
      rows_total += std::max(s, 0);
      hi.push_back(std::min(rows_total, p.m));
    }
    rows_total = std::min(rows_total, p.m);
    xr = p.x_rows > 0 ? p.x_rows : p.m;
    CK(cudaMalloc(&dy, std::max<int64_t>(p.m * p.n, 8) * 2));
    CK(cudaMalloc(&x, std::max<int64_t>(xr * p.k, 8) * 2));
    CK(cudaMalloc(&out, groups * p.n * p.k * 2));
    FillKernel<<<1024, 256>>>(dy, p.m * p.n, 1, p.bf16);
    FillKernel<<<1024, 256>>>(x, xr * p.k, 2, p.bf16);
    CK(cudaMemset(dy + rows_total * p.n, 0xff, (p.m - rows_total) * p.n * 2));
    if (p.x_rows == 0) CK(cudaMemset(x + rows_total * p.k, 0xff, (p.m - rows_total) * p.k * 2));
    CK(cudaMemset(out, 0xff, groups * p.n * p.k * 2));
    sizes = DeviceCopy(p.sizes);
    if (p.x_rows > 0) {
      std::mt19937 rng(3);
      std::uniform_int_distribution<int64_t> pick(-2, p.x_rows * p.topk + 2);
      std::vector<int32_t> h(p.m);
      for (auto& v : h) v = static_cast<int32_t>(pick(rng));
      rows = DeviceCopy(h);
    }
    scratch_bytes = static_cast<size_t>(
        jax_moe::GroupGemmWgradSm90ScratchBytes(p.m, p.k, groups, p.x_rows > 0));
    CK(cudaMalloc(&scratch, scratch_bytes));
  }
  ~Buffers() {
    for (void* v : {static_cast<void*>(dy), static_cast<void*>(x), static_cast<void*>(out),
                    static_cast<void*>(sizes), static_cast<void*>(rows), scratch})
      if (v != nullptr) CK(cudaFree(v));
  }
  Buffers(const Buffers&) = delete;
  Buffers& operator=(const Buffers&) = delete;

  // Launches the kernel on the default stream; false when it declined.
  bool Run(int64_t n_override = 0) const {
    jax_moe::Sm90WgradCall c{};
    c.stream = 0;
    c.bf16 = p.bf16;
    c.dy = dy;
    c.x = x;
    c.sizes = sizes;
    c.rows = rows;
    c.topk = p.topk;
    c.out = out;
    c.m = p.m;
    c.n = n_override > 0 ? n_override : p.n;
    c.k = p.k;
    c.groups = groups;
    c.x_rows = xr;
    c.scratch = scratch;
    c.scratch_bytes = scratch_bytes;
    bool ran = false;
    CK(jax_moe::GroupGemmWgradSm90(c, &ran));
    return ran;
  }

  // Max abs error of out against the reference at `ids` (all when empty);
  // `bad` counts outputs outside the dtype's tolerance and nonzero outputs of
  // experts without rows.
  double Check(const std::vector<int64_t>& ids, int64_t* bad) const {
    const int64_t count = ids.empty() ? groups * p.n * p.k : static_cast<int64_t>(ids.size());
    int64_t* d_ids = ids.empty() ? nullptr : DeviceCopy(ids);
    int64_t* d_lo = DeviceCopy(lo);
    int64_t* d_hi = DeviceCopy(hi);
    float* ref;
    uint16_t* got;
    CK(cudaMalloc(&ref, count * 4));
    CK(cudaMalloc(&got, count * 2));
    RefKernel<<<(count + 255) / 256, 256>>>(dy, x, rows, p.topk, xr * p.topk, d_lo, d_hi, d_ids,
                                            count, out, ref, got, p.n, p.k, p.bf16);
    CK(cudaDeviceSynchronize());
    std::vector<float> href(count);
    std::vector<uint16_t> hout(count);
    CK(cudaMemcpy(href.data(), ref, count * 4, cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(hout.data(), got, count * 2, cudaMemcpyDeviceToHost));
    const double atol = p.bf16 ? 2e-2 : 4e-3, rtol = p.bf16 ? 1e-2 : 2e-3;
    double maxerr = 0;
    *bad = 0;
    for (int64_t t = 0; t < count; ++t) {
      const int64_t id = ids.empty() ? t : ids[t];
      const float o = HostFloat(hout[t], p.bf16);
      const double err = std::fabs(static_cast<double>(o) - href[t]);
      const bool empty = lo[id / (p.n * p.k)] == hi[id / (p.n * p.k)];
      if (!(err <= atol + rtol * std::fabs(href[t])) || (empty && hout[t] != 0)) ++*bad;
      if (!(err <= maxerr)) maxerr = err;
    }
    for (void* v : {static_cast<void*>(d_ids), static_cast<void*>(d_lo),
                    static_cast<void*>(d_hi), static_cast<void*>(ref), static_cast<void*>(got)})
      if (v != nullptr) CK(cudaFree(v));
    return maxerr;
  }
};

struct CheckCase {
  const char* name;
  Problem p;
};

struct TimeCase {
  const char* name;
  int E;
  int64_t n, k, m;
  int topk;
  bool gather;
};

// Runs the cases whose name contains `only`; 0 when all passed.
int RunCases(const std::string& only) {
  bool ok = true;
  std::vector<int32_t> many(40), wide(1500);
  for (size_t e = 0; e < many.size(); ++e) many[e] = e % 5 == 0 ? 0 : static_cast<int32_t>(e * 37 % 250);
  for (size_t e = 0; e < wide.size(); ++e) wide[e] = static_cast<int32_t>(e * 7 % 4);
  const int64_t many_m = std::accumulate(many.begin(), many.end(), int64_t{0});
  const int64_t wide_m = std::accumulate(wide.begin(), wide.end(), int64_t{0});
  const CheckCase checks[] = {
      {"check basic bf16", {true, 128, 256, 337, {100, 0, 37, 200}}},
      {"check odd f16 tail", {false, 200, 328, 260, {0, 65, 0, 1, 130, 0}}},
      {"check gather bf16", {true, 64, 136, 133, {70, 0, 63}, 40, 4}},
      {"check clamp f16", {false, 96, 512, 120, {50, -5, 100, 30}}},
      {"check many gather bf16", {true, 384, 1024, many_m, many, many_m / 2, 2}},
      {"check all empty bf16", {true, 64, 64, 16, {0, 0, 0}}},
      {"check 1500 experts f16", {false, 16, 32, wide_m, wide}},
  };
  for (const CheckCase& cs : checks) {
    if (std::string(cs.name).find(only) == std::string::npos) continue;
    Buffers b(cs.p);
    const bool ran = b.Run();
    CK(cudaDeviceSynchronize());
    int64_t bad = 0;
    const double maxerr = ran ? b.Check({}, &bad) : 0.0;
    std::vector<uint16_t> first(b.groups * cs.p.n * cs.p.k), second(first.size());
    CK(cudaMemcpy(first.data(), b.out, first.size() * 2, cudaMemcpyDeviceToHost));
    b.Run();
    CK(cudaMemcpy(second.data(), b.out, second.size() * 2, cudaMemcpyDeviceToHost));
    const bool same = first == second;
    const bool pass = ran && bad == 0 && same;
    ok = ok && pass;
    printf("%-26s maxerr %.3g bad %lld rerun %s  %s\n", cs.name, maxerr,
           static_cast<long long>(bad), same ? "same" : "DIFFERS", pass ? "PASS" : "FAIL");
  }
  if (std::string("check declines n % 8").find(only) != std::string::npos) {
    Buffers b(checks[0].p);
    const bool declined = !b.Run(/*n_override=*/12);
    ok = ok && declined;
    printf("%-26s %s\n", "check declines n % 8", declined ? "PASS" : "FAIL");
  }

  // q30: Qwen3-30B-A3B, ds: DeepSeek-V3, mix: Mixtral 8x7B; w13: the gate/up
  // weights (n = 2I, k = H), w2: the down weights (n = H, k = I).
  const TimeCase times[] = {
      {"q30 w13", 128, 1536, 2048, 131072, 8, false},
      {"q30 w13 gather", 128, 1536, 2048, 131072, 8, true},
      {"q30 w2", 128, 2048, 768, 131072, 8, false},
      {"ds w13", 256, 4096, 7168, 131072, 8, false},
      {"mix w13", 8, 28672, 4096, 32768, 2, false},
      // A training step at T = 4096 tokens: few rows an expert, where writing
      // the gradient (E * n * k elements) bounds the kernel.
      {"q30 w13 t4096", 128, 1536, 2048, 32768, 8, false},
      {"q30 w2 t4096", 128, 2048, 768, 32768, 8, false},
      {"ds w13 t4096", 256, 4096, 7168, 32768, 8, false},
      {"ds w2 t4096", 256, 7168, 2048, 32768, 8, false},
      {"mix w13 t4096", 8, 28672, 4096, 8192, 2, false},
      {"mix w2 t4096", 8, 4096, 14336, 8192, 2, false},
  };
  for (const TimeCase& tc : times) {
    if (std::string(tc.name).find(only) == std::string::npos) continue;
    double active = 0;
    Problem p{true, tc.n, tc.k, tc.m,
              RandomExpertSizes(tc.E, static_cast<int>(tc.m / tc.topk), tc.topk, 1, &active)};
    if (tc.gather) {
      p.x_rows = tc.m / tc.topk;
      p.topk = tc.topk;
    }
    Buffers b(p);
    if (tc.gather) {  // a permutation of the (token, slot) entries: every row valid
      std::vector<int32_t> perm(tc.m);
      std::iota(perm.begin(), perm.end(), 0);
      std::shuffle(perm.begin(), perm.end(), std::mt19937(5));
      CK(cudaMemcpy(b.rows, perm.data(), perm.size() * 4, cudaMemcpyHostToDevice));
    }
    const bool ran = b.Run() && b.Run();  // two warm-up calls
    CK(cudaDeviceSynchronize());
    const double us = ran ? MedianLaunchMicros([&](int) { b.Run(); }, 3, 5) : 0.0;
    std::vector<int64_t> ids(4096);
    std::mt19937_64 rng(9);
    for (auto& id : ids) id = static_cast<int64_t>(rng() % (tc.E * tc.n * tc.k));
    int64_t bad = 0;
    const double maxerr = ran ? b.Check(ids, &bad) : 0.0;
    const bool pass = ran && bad == 0;
    ok = ok && pass;
    const double written = 2.0 * tc.E * tc.n * tc.k;  // the gradient, 16-bit
    printf("%-16s E %3d n %5lld k %5lld m %6lld  %9.1f us  %6.1f TFLOP/s  %5.2f TB/s written"
           "  maxerr %.3g  %s\n",
           tc.name, tc.E, static_cast<long long>(tc.n), static_cast<long long>(tc.k),
           static_cast<long long>(tc.m), us, 2.0 * tc.m * tc.n * tc.k / us / 1e6,
           written / us / 1e6, maxerr, pass ? "PASS" : "FAIL");
  }
  return ok ? 0 : 1;
}

}  // namespace
#endif  // JAX_MOE_WITH_SM90

// argv[1] (optional): run only the cases whose name contains it.
int main(int argc, char** argv) {
#ifdef JAX_MOE_WITH_SM90
  return RunCases(argc > 1 ? argv[1] : "");
#else
  (void)argc;
  (void)argv;
  printf("built without the sm90 path (no CUTLASS headers): nothing to run\n");
  return 2;
#endif
}

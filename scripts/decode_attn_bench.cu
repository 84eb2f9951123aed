// The paged decode split kernel alone on issue 7's decode shapes (bf16, Hq 32,
// Hkv 8, D 128, pages in random order), against copy-only
// kernels that move the same K/V bytes through the same per-warp cp.async
// ring with no attention math: what the ring structure itself can reach.
// Not part of the build; needs a GPU. From the repository root:
//   nvcc -O3 -std=c++20 -arch=sm_90a -diag-suppress 940,2473 -I csrc \
//     -I $(python3 -c "import jax.ffi; print(jax.ffi.include_dir())") \
//     scripts/decode_attn_bench.cu -o /tmp/decode_attn_bench && /tmp/decode_attn_bench [V] [S] [P]
// V: comma-separated variant indices (main's list), S: comma-separated splits
// (each of its cases with that split); default: all of both. P: the page
// size (default 16).
// TB/s counts the K and V bytes the lengths cover, once; times are the median
// of 7 repeats of 20 launches (split kernel and combine for the shipped one).
#ifndef ATTN_CU  // -DATTN_CU='"path"': another version of the kernels (same launch signatures)
#define ATTN_CU "../csrc/cuda/attention.cu"
#endif
#include ATTN_CU
#include "bench_util.cuh"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>

namespace jax_moe {
namespace {


constexpr int kD = 128, kHkv = 8, kHq = 32, kChunks = kD / 8;
constexpr int kTileVecs = 16 * kChunks;  // 16 rows of 256 B per tile and tensor

struct Problem {
  int64_t batch, len, page, max_pages, num_pages;
  const uint4 *k, *v;
  const int32_t *table, *lengths;
  int split;
  unsigned* sink;
};

int64_t Splits(const Problem& p) { return (p.len + p.split - 1) / p.split; }

// Copy-only: grid (batch * hkv, splits), 4 warps; each warp copies its tiles
// (16 rows of 256 B of K and of V) through a Stages-deep ring and xors one
// word per chunk. Setup: 0 = the shipped SetupSplit (slot_of in shared
// memory before any copy), 1 = its loop with all loads issued first, 2 = no
// slot_of: each lane looks its rows' pages up one tile ahead (registers).
// Rows: a block takes split / hkv tokens x all heads (whole 2 KB token rows)
// instead of one head's 256 B slice of every token of the split.
template <int Stages, int Setup, bool Rows>
__global__ void __launch_bounds__(128) CopyKernel(Problem p) {
  extern __shared__ __align__(16) unsigned char smem[];
  uint4* ring = reinterpret_cast<uint4*>(smem);
  int32_t* slot_of = reinterpret_cast<int32_t*>(smem + 4 * Stages * 2 * kTileVecs * 16);
  const int warp = threadIdx.x / 32, wl = threadIdx.x % 32;
  const int64_t b = blockIdx.x / kHkv, kvh = blockIdx.x % kHkv;
  const int64_t span = Rows ? p.split / kHkv : p.split;       // tokens of this block
  const int64_t t0 = blockIdx.y * p.split + (Rows ? kvh * span : 0);
  const int64_t len = p.lengths[b];
  if (t0 >= len) return;
  const int ntok = static_cast<int>(span < len - t0 ? span : len - t0);
  const int nrows = Rows ? ntok * kHkv : ntok;                  // 256 B rows of K (and V)
  if constexpr (Setup == 0) {
    for (int i = threadIdx.x; i < ntok; i += 128) {
      const int64_t t = t0 + i;
      slot_of[i] = static_cast<int32_t>(p.table[b * p.max_pages + t / p.page] * p.page +
                                        t % p.page);
    }
    __syncthreads();
  } else if constexpr (Setup == 1) {
    constexpr int kPer = kDecodeMaxSplitTokens / 128;
    int32_t pg[kPer];
#pragma unroll
    for (int j = 0; j < kPer; ++j) {
      const int i = threadIdx.x + 128 * j;
      pg[j] = i < ntok ? p.table[b * p.max_pages + (t0 + i) / p.page] : 0;
    }
#pragma unroll
    for (int j = 0; j < kPer; ++j) {
      const int i = threadIdx.x + 128 * j;
      if (i < ntok) slot_of[i] = static_cast<int32_t>(pg[j] * p.page + (t0 + i) % p.page);
    }
    __syncthreads();
  }
  const int ntiles = (nrows + 15) / 16;
  const int my_tiles = ntiles > warp ? (ntiles - warp + 3) / 4 : 0;
  uint4* my = ring + warp * Stages * 2 * kTileVecs;
  constexpr int kLoads = kTileVecs / 32;  // 8: rows wl / 16 + 2 j
  // Row r of tile i: token and head.
  auto tok_of = [&](int i, int r) { return Rows ? ((warp + 4 * i) * 16 + r) / kHkv : (warp + 4 * i) * 16 + r; };
  auto head_of = [&](int i, int r) { return Rows ? ((warp + 4 * i) * 16 + r) % kHkv : kvh; };
  int32_t pages[kLoads];  // Setup 2: page ids of the rows of the next tile to issue
  auto lookup = [&](int i) {
#pragma unroll
    for (int j = 0; j < kLoads; ++j) {
      const int tok = tok_of(i, wl / 16 + 2 * j);
      pages[j] = i < my_tiles && tok < ntok ? __ldg(p.table + b * p.max_pages + (t0 + tok) / p.page) : 0;
    }
  };
  auto issue = [&](int i) {
    if (i < my_tiles) {
      uint4* dk = my + (i % Stages) * 2 * kTileVecs;
#pragma unroll
      for (int j = 0; j < kLoads; ++j) {
        const int r = wl / 16 + 2 * j, c = wl % 16;
        const int tok = tok_of(i, r);
        int64_t slot = -1;
        if (tok < ntok)
          slot = Setup == 2 ? pages[j] * p.page + (t0 + tok) % p.page : slot_of[tok];
        const int64_t off = slot >= 0 ? (slot * kHkv + head_of(i, r)) * kChunks + c : 0;
        CpAsync16Zfill(dk + r * kChunks + c, p.k + off, slot >= 0 ? 16 : 0);
        CpAsync16Zfill(dk + kTileVecs + r * kChunks + c, p.v + off, slot >= 0 ? 16 : 0);
      }
    }
    CpAsyncCommit();
    if constexpr (Setup == 2) lookup(i + 1);
  };
  if constexpr (Setup == 2) lookup(0);
  unsigned acc = 0;
#pragma unroll
  for (int i = 0; i < Stages - 1; ++i) issue(i);
  for (int i = 0; i < my_tiles; ++i) {
    issue(i + Stages - 1);
    CpAsyncWait<Stages - 1>();
    __syncwarp();
    const uint4* s = my + (i % Stages) * 2 * kTileVecs;
#pragma unroll
    for (int j = 0; j < 2 * kLoads; ++j) acc ^= s[wl + 32 * j].x;
    __syncwarp();
  }
  CpAsyncWait<0>();
  if (acc == 0x12345678u) *p.sink = acc;
}

__global__ void StreamKernel(const uint4* a, const uint4* b, int64_t n16, unsigned* sink) {
  unsigned acc = 0;
  const int64_t stride = (int64_t)gridDim.x * blockDim.x;
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n16; i += stride)
    acc ^= __ldcs(a + i).x ^ __ldcs(b + i).y;
  if (acc == 0x12345678u) *sink = acc;
}

template <int Stages, int Setup, bool Rows>
void RunCopy(const Problem& p) {
  auto kern = CopyKernel<Stages, Setup, Rows>;
  const int smem = 4 * Stages * 2 * kTileVecs * 16 + (Setup == 2 ? 0 : p.split * 4);
  CK(cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  kern<<<dim3(p.batch * kHkv, Splits(p)), 128, smem>>>(p);
}

struct Shipped {
  const __nv_bfloat16* q;
  float *po, *ps;
  __nv_bfloat16* out;
};
Shipped g_ship;

void RunCombine(const Problem& p) {  // the combine kernel alone (on the last partials)
  DecodeCombineKernel<ffi::DataType::BF16, kD>
      <<<CeilDiv(p.batch * kHq, kCombineWarps), kCombineThreads>>>(
          g_ship.po, g_ship.ps, p.lengths, kHq, p.batch * kHq, p.max_pages * p.page, Splits(p),
          p.split, g_ship.out);
}

template <bool Pdl>  // Pdl: as LaunchDecode does on sm_90+
void RunShipped(const Problem& p) {  // the split kernel, then the combine
  using C = MmaDecode<kD>;
  auto kern = DecodeSplitMmaKernel<ffi::DataType::BF16, kD>;
  const int smem = C::kFixedBytes + p.split * 4;
  CK(cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, C::kSmem));
  kern<<<dim3(p.batch * kHkv, Splits(p)), kDecodeThreads, smem>>>(
      g_ship.q, reinterpret_cast<const __nv_bfloat16*>(p.k),
      reinterpret_cast<const __nv_bfloat16*>(p.v), p.table, p.lengths, kHq, kHkv, kHq / kHkv, 1,
      p.num_pages, p.page, p.max_pages, Splits(p), p.split, 0.088f, g_ship.po, g_ship.ps);
  if constexpr (!Pdl) {
    RunCombine(p);
  } else {
    CK(LaunchKernel(DecodeCombineKernel<ffi::DataType::BF16, kD>,
                    CeilDiv(p.batch * kHq, kCombineWarps), kCombineThreads, 0, 0, true,
                    static_cast<const float*>(g_ship.po), static_cast<const float*>(g_ship.ps),
                    p.lengths, int64_t{kHq}, int64_t{p.batch * kHq}, p.max_pages * p.page,
                    Splits(p), int64_t{p.split}, g_ship.out));
  }
}

void RunStream(const Problem& p) {
  const int64_t n16 = p.batch * p.len * kHkv * kChunks;
  StreamKernel<<<132 * 8, 256>>>(p.k, p.v, n16, p.sink);
}

struct Variant {
  const char* name;
  void (*fn)(const Problem&);
};

}  // namespace
}  // namespace jax_moe

using namespace jax_moe;

// Whether `list` (comma-separated integers; null: everything) holds x.
bool Listed(const char* list, long x) {
  if (list == nullptr) return true;
  for (const char* c = list; *c;) {
    char* end;
    if (std::strtol(c, &end, 10) == x && end != c) return true;
    c = *end ? end + 1 : end;
  }
  return false;
}

int main(int argc, char** argv) {
  const char* only_variants = argc > 1 ? argv[1] : nullptr;
  const char* only_splits = argc > 2 ? argv[2] : nullptr;
  const int page = argc > 3 ? std::atoi(argv[3]) : 16;
  if (page <= 0 || page > 4096 || 4096 % page != 0) {
    fprintf(stderr, "page size %d: want a divisor of 4096\n", page);
    return 2;
  }
  const Variant variants[] = {
      {"stream (contiguous)", RunStream},
      {"shipped: combine with PDL", RunShipped<true>},
      {"split + combine, no PDL", RunShipped<false>},
      {"combine alone", RunCombine},
      {"copy 2st setup-loop", RunCopy<2, 0, false>},
      {"copy 2st setup-unrolled", RunCopy<2, 1, false>},
      {"copy 2st no-setup", RunCopy<2, 2, false>},
      {"copy 3st no-setup", RunCopy<3, 2, false>},
      {"copy 2st setup-loop rows", RunCopy<2, 0, true>},
  };
  struct Case { int64_t batch, len; int split; };
  const Case cases[] = {{64, 4096, 2048}, {8, 32768, 2048}, {64, 4096, 1024}, {8, 32768, 1024},
                      {64, 4096, 512}, {8, 32768, 512}};
  const int kCalls = 20, kReps = 7;
  unsigned* sink;
  CK(cudaMalloc(&sink, 4));
  for (const Case& cs : cases) {
    if (!Listed(only_splits, cs.split)) continue;
    Problem p{};
    p.batch = cs.batch;
    p.len = cs.len;
    p.page = page;
    p.max_pages = cs.len / p.page;
    p.num_pages = cs.batch * p.max_pages;
    p.split = cs.split;
    p.sink = sink;
    const int64_t elems = p.num_pages * p.page * kHkv * kD;
    uint4 *k, *v;
    CK(cudaMalloc(&k, elems * 2));
    CK(cudaMalloc(&v, elems * 2));
    CK(cudaMemset(k, 0x3c, elems * 2));  // small bf16 values
    CK(cudaMemset(v, 0x3c, elems * 2));
    std::vector<int32_t> perm(p.num_pages);
    for (int64_t i = 0; i < p.num_pages; ++i) perm[i] = static_cast<int32_t>(i);
    std::shuffle(perm.begin(), perm.end(), std::mt19937(3));
    int32_t *table, *lengths;
    CK(cudaMalloc(&table, p.num_pages * 4));
    CK(cudaMalloc(&lengths, p.batch * 4));
    CK(cudaMemcpy(table, perm.data(), p.num_pages * 4, cudaMemcpyHostToDevice));
    std::vector<int32_t> hl(p.batch, static_cast<int32_t>(cs.len));
    CK(cudaMemcpy(lengths, hl.data(), p.batch * 4, cudaMemcpyHostToDevice));
    p.k = k;
    p.v = v;
    p.table = table;
    p.lengths = lengths;
    const int64_t splits = Splits(p);
    CK(cudaMalloc(&g_ship.q, p.batch * kHq * kD * 2));
    CK(cudaMemset((void*)g_ship.q, 0x3c, p.batch * kHq * kD * 2));
    CK(cudaMalloc(&g_ship.po, p.batch * kHq * splits * kD * 4));
    CK(cudaMalloc(&g_ship.ps, p.batch * kHq * splits * 2 * 4));
    CK(cudaMalloc(&g_ship.out, p.batch * kHq * kD * 2));
    const double bytes = 2.0 * p.batch * p.len * kHkv * kD * 2;
    printf("B=%lld L=%lld split=%d page %d: %.1f MB of K+V\n", (long long)p.batch,
           (long long)p.len, p.split, page, bytes / 1e6);
    for (const Variant& var : variants) {
      if (!Listed(only_variants, &var - variants)) continue;
      for (int i = 0; i < 3; ++i) var.fn(p);  // warm-up
      CK(cudaDeviceSynchronize());
      const double us = MedianLaunchMicros([&](int) { var.fn(p); }, kCalls, kReps);
      printf("  %-28s %8.1f us  %.2f TB/s\n", var.name, us, bytes / us / 1e6);
    }
    CK(cudaFree(k));
    CK(cudaFree(v));
    CK(cudaFree(table));
    CK(cudaFree(lengths));
    CK(cudaFree((void*)g_ship.q));
    CK(cudaFree(g_ship.po));
    CK(cudaFree(g_ship.ps));
    CK(cudaFree(g_ship.out));
  }
  return 0;
}

// Paged decode attention's kernels alone (through LaunchDecodeSplit and
// LaunchDecodeCombine of csrc/kernels/cuda/attention/launch.h: the bf16
// tensor-core split kernel, then the combine, with and without programmatic
// dependent launch, and the combine alone) on decode shapes with 32 query
// heads, 8 kv heads and head dim 128 (bf16, pages in random order), against
// copy-only kernels that move the same K/V bytes through the same kind of
// per-warp cp.async ring with no attention math (what the ring structure
// itself can reach), and a streaming read of the K/V bytes (contiguous, no
// page table).
//
// TB/s counts the K and V bytes the lengths cover, once; times are the median
// of 7 repeats of the mean of 20 launches (for the decode: split kernel and
// combine).
//
// Build (from the repository root; needs nvcc, runs on a Hopper GPU):
//   cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release -DJAX_MOE_BUILD_KERNEL_BENCHMARKS=ON
//   ninja -C build decode_attention_bench
//   build/benchmarks/kernels/decode_attention_bench [V] [S] [P]
// V: comma-separated variant indices (the list in main), S: comma-separated
// splits (each case with that split); default: all of both. P: the page size
// (a divisor of 4096; default 16).
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>

#include "bench_util.cuh"
#include "kernels/common/attention.h"
#include "kernels/common/numeric.h"
#include "kernels/cuda/attention/launch.h"
#include "kernels/cuda/cuda_common.cuh"

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
// word per chunk. Setup: 0 = the slot of every token in shared memory
// (slot_of, one page-table load per token) before any copy, 1 = the same
// with all of a thread's loads issued before any is used, 2 = no slot_of:
// each lane looks its rows' pages up one tile ahead (registers). Rows: a
// block takes split / hkv tokens x all heads (whole 2 KB token rows) instead
// of one head's 256 B slice of every token of the split.
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
  auto tok_of = [&](int i, int r) {
    return Rows ? ((warp + 4 * i) * 16 + r) / kHkv : (warp + 4 * i) * 16 + r;
  };
  auto head_of = [&](int i, int r) { return Rows ? ((warp + 4 * i) * 16 + r) % kHkv : kvh; };
  int32_t pages[kLoads];  // Setup 2: page ids of the rows of the next tile to issue
  auto lookup = [&](int i) {
#pragma unroll
    for (int j = 0; j < kLoads; ++j) {
      const int tok = tok_of(i, wl / 16 + 2 * j);
      pages[j] = i < my_tiles && tok < ntok
                     ? __ldg(p.table + b * p.max_pages + (t0 + tok) / p.page) : 0;
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

// The decode's q, scratch and output (bf16 q and output).
struct DecodeBuffers {
  void* q;
  float *po, *ps;
  void* out;
};
DecodeBuffers g_dec;

DecodeDims DimsOf(const Problem& p) {
  DecodeDims d{};
  d.batch = p.batch;
  d.hq = kHq;
  d.hkv = kHkv;
  d.group = kHq / kHkv;
  d.k_dim = kD;
  d.v_dim = kD;
  d.num_pages = p.num_pages;
  d.page_size = p.page;
  d.max_pages = p.max_pages;
  d.max_tokens = p.max_pages * p.page;
  d.split_tokens = p.split;
  d.num_splits = DecodeNumSplits(d.max_tokens, p.split);
  return d;
}

void RunCombine(const Problem& p) {  // the combine kernel alone (on the last partials)
  CK(LaunchDecodeCombine(0, DType::BF16, DimsOf(p), g_dec.po, g_dec.ps, p.lengths, g_dec.out,
                         /*allow_pdl=*/false));
}

template <bool Pdl>  // Pdl: as the handler launches it on sm_90+
void RunDecode(const Problem& p) {  // the split kernel, then the combine
  CK(LaunchDecodeSplit(0, DType::BF16, DimsOf(p), g_dec.q, p.k, p.v, p.table, p.lengths, 0.088f,
                       g_dec.po, g_dec.ps));
  CK(LaunchDecodeCombine(0, DType::BF16, DimsOf(p), g_dec.po, g_dec.ps, p.lengths, g_dec.out,
                         Pdl));
}

void RunStream(const Problem& p) {
  const int64_t n16 = p.batch * p.len * kHkv * kChunks;
  StreamKernel<<<132 * 8, 256>>>(p.k, p.v, n16, p.sink);
}

struct Variant {
  const char* name;
  void (*fn)(const Problem&);
};

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

}  // namespace
}  // namespace jax_moe

using namespace jax_moe;

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
      {"decode, combine with PDL", RunDecode<true>},
      {"decode, combine without PDL", RunDecode<false>},
      {"combine alone", RunCombine},
      {"copy 2st setup-loop", RunCopy<2, 0, false>},
      {"copy 2st setup-unrolled", RunCopy<2, 1, false>},
      {"copy 2st no-setup", RunCopy<2, 2, false>},
      {"copy 3st no-setup", RunCopy<3, 2, false>},
      {"copy 2st setup-loop rows", RunCopy<2, 0, true>},
  };
  struct Case {
    int64_t batch, len;
    int split;
  };
  const Case cases[] = {{64, 4096, 2048}, {8, 32768, 2048}, {64, 4096, 1024},
                        {8, 32768, 1024}, {64, 4096, 512},  {8, 32768, 512}};
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
    CK(cudaMalloc(&g_dec.q, p.batch * kHq * kD * 2));
    CK(cudaMemset(g_dec.q, 0x3c, p.batch * kHq * kD * 2));
    CK(cudaMalloc(&g_dec.po, p.batch * kHq * splits * kD * 4));
    CK(cudaMalloc(&g_dec.ps, p.batch * kHq * splits * 2 * 4));
    CK(cudaMalloc(&g_dec.out, p.batch * kHq * kD * 2));
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
    CK(cudaFree(g_dec.q));
    CK(cudaFree(g_dec.po));
    CK(cudaFree(g_dec.ps));
    CK(cudaFree(g_dec.out));
  }
  return 0;
}

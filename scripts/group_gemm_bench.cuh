// Shared by the standalone grouped-GEMM benches in scripts/, which include
// csrc/cuda/group_gemm.cu first: dense (no gather) launches of an
// (m, n, k) problem over `groups` experts, bf16.
#pragma once

namespace jax_moe {

// The launch arguments without gather, 16-byte aligned.
inline GemmArgs DenseArgs(int64_t m, int64_t n, int64_t k) {
  GemmArgs a{};
  a.m = m;
  a.n = n;
  a.k = k;
  a.src = RowSource{nullptr, 1, m};
  a.vec_in = a.vec_out = true;
  return a;
}

// The shipped dispatch (LaunchGroupGemm) for tile_m `tile`, on the default stream.
inline void LaunchShipped(const uint16_t* x, const uint16_t* w, const int32_t* sizes,
                          uint16_t* out, int64_t m, int64_t n, int64_t k, int64_t groups,
                          int64_t tile) {
  GemmDims d{};
  d.m = m;
  d.n = n;
  d.k = k;
  d.groups = groups;
  d.x_rows = m;
  LaunchGroupGemm<ffi::DataType::BF16>(0, x, w, sizes, out, d, nullptr, 1, tile);
}

}  // namespace jax_moe

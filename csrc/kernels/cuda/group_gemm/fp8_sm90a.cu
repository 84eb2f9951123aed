// The Hopper fp8 grouped GEMMs the library runs (fp8_sm90a.cuh): 128 x 128 x
// 128 cooperative tiles, each expert's last 64 rows or fewer then in a second
// launch of 64 x 128 x 128 ping-pong tiles; or 64 x 128 x 128 ping-pong tiles
// only (less of each expert's last tile wasted, two tiles an SM in flight),
// by the call's tile_m or, without one, where the experts average fewer than
// 128 rows; one CTA a cluster.
#include "kernels/cuda/group_gemm/fp8_sm90a.cuh"

namespace jax_moe {

using Fp8Wide = Fp8Gemm<128, 1, false>;
using Fp8Narrow = Fp8Gemm<64, 1, true>;

cudaError_t GroupGemmFp8Sm90(const Sm90Fp8Call& c, bool* ran) {
  const bool narrow = c.tile_m == 0 ? c.m < 128 * c.groups : c.tile_m == 64;
  if (narrow) return RunFp8<Fp8Narrow>(c, ran);
  return RunFp8<Fp8Wide, Fp8Narrow>(c, ran);
}

int64_t GroupGemmFp8Sm90ScratchBytes(int64_t m, int64_t n, int64_t k, int64_t groups) {
  if (m < 0 || n < 0 || k < 0 || groups < 1) return 0;
  const size_t wide = WorkspaceBytes<Fp8Wide>(groups), narrow = WorkspaceBytes<Fp8Narrow>(groups);
  const size_t one = MakeLayout(m, n, k, groups, narrow, false, 0).bytes;
  const size_t both = MakeLayout(m, n, k, groups, wide, true, narrow).bytes;
  return static_cast<int64_t>(one > both ? one : both);
}

}  // namespace jax_moe

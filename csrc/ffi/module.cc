// The nanobind module: hands XLA one capsule per (target, platform).
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>

#include "ffi/targets.h"
#include "kernels/common/attention.h"
#include "kernels/common/fp8_decode_rule.h"
#include "kernels/common/moe_decode.h"
#include "kernels/common/numeric.h"
#include "kernels/common/wgmma_rule.h"

#ifdef JAX_MOE_WITH_CUDA
#include "kernels/cuda/device_info.h"
#endif
#ifdef JAX_MOE_WITH_SM90
#include "kernels/cuda/group_gemm/fp8_sm90a.h"
#include "kernels/cuda/group_gemm/gemm_sm90a.h"
#include "kernels/cuda/group_gemm/wgrad_sm90a.h"
#endif

namespace nb = nanobind;

namespace {

template <typename T>
nb::capsule Capsule(T* fn) {
  static_assert(std::is_invocable_r_v<XLA_FFI_Error*, T, XLA_FFI_CallFrame*>,
                "an XLA FFI handler");
  return nb::capsule(reinterpret_cast<void*>(fn));
}

}  // namespace

NB_MODULE(_jax_moe, m) {
  using namespace jax_moe;
  m.def("registrations", []() {
    nb::dict platforms;
    nb::dict cpu;
#define JAX_MOE_ADD_CPU(name, stem) cpu[name] = Capsule(k##stem##Cpu);
    JAX_MOE_TARGETS(JAX_MOE_ADD_CPU)
#undef JAX_MOE_ADD_CPU
    platforms["cpu"] = cpu;
#ifdef JAX_MOE_WITH_CUDA
    nb::dict cuda;
#define JAX_MOE_ADD_CUDA(name, stem) cuda[name] = Capsule(k##stem##Cuda);
    JAX_MOE_TARGETS(JAX_MOE_ADD_CUDA)
#undef JAX_MOE_ADD_CUDA
    platforms["CUDA"] = cuda;
#endif
    return platforms;
  });
#ifdef JAX_MOE_WITH_CUDA
  m.def("device_info", [](int ordinal) -> nb::object {
    DeviceInfo i;
    if (!QueryDevice(ordinal, &i).empty()) return nb::none();  // no such device / no driver
    nb::dict d;
    d["name"] = i.name;
    d["compute_capability"] = nb::make_tuple(i.major, i.minor);
    d["sm_count"] = i.sm_count;
    d["smem_per_block_optin"] = i.smem_per_block_optin;
    d["smem_per_sm"] = i.smem_per_sm;
    d["l2_bytes"] = i.l2_bytes;
    d["global_mem_bytes"] = i.global_mem_bytes;
    d["memory_bus_bits"] = i.memory_bus_bits;
    d["memory_clock_khz"] = i.memory_clock_khz;
    return d;
  }, nb::arg("ordinal") = 0, "The CUDA device's properties (None without a usable device).");
  m.attr("has_cuda") = true;
#else
  m.attr("has_cuda") = false;
#endif
#ifdef JAX_MOE_WITH_SM90
  m.def("group_gemm_sm90_scratch_bytes", &GroupGemmSm90ScratchBytes, nb::arg("m"), nb::arg("k"),
        nb::arg("groups"), nb::arg("gather"),
        "Bytes of group_gemm's scratch output for the sm90 path (tile_m=256).");
  m.attr("HAS_SM90_GEMM") = true;
#else
  m.attr("HAS_SM90_GEMM") = false;
#endif
  // 0 where the build has no sm90 kernel: group_gemm_wgrad's scratch is then empty.
  m.def("group_gemm_wgrad_sm90_scratch_bytes",
        []([[maybe_unused]] int64_t m, [[maybe_unused]] int64_t k,
           [[maybe_unused]] int64_t groups, [[maybe_unused]] bool gather) -> int64_t {
#ifdef JAX_MOE_WITH_SM90
          return GroupGemmWgradSm90ScratchBytes(m, k, groups, gather);
#else
          return 0;
#endif
        },
        nb::arg("m"), nb::arg("k"), nb::arg("groups"), nb::arg("gather"),
        "Bytes of group_gemm_wgrad's scratch output for the sm90 path (0 without it).");
  // 0 where the build has no sm90 kernel: group_gemm_fp8's scratch is then empty.
  m.def("group_gemm_fp8_sm90_scratch_bytes",
        []([[maybe_unused]] int64_t m, [[maybe_unused]] int64_t n, [[maybe_unused]] int64_t k,
           [[maybe_unused]] int64_t groups) -> int64_t {
#ifdef JAX_MOE_WITH_SM90
          return GroupGemmFp8Sm90ScratchBytes(m, n, k, groups);
#else
          return 0;
#endif
        },
        nb::arg("m"), nb::arg("n"), nb::arg("k"), nb::arg("groups"),
        "Bytes of group_gemm_fp8's scratch output for the sm90 path (0 without it).");
  m.attr("INDEX_CHUNK") = kIndexChunk;
  m.attr("WGMMA_MAX_AVG_ROWS") = kWgmmaMaxAvgRows;
  m.def("wgmma_fits", &WgmmaShapeOk, nb::arg("m"), nb::arg("n"), nb::arg("k"), nb::arg("groups"),
        nb::arg("act"),
        "Whether the own Hopper kernel takes m rows against w (groups, n, k), by the shape alone "
        "(act: with the gated activation in its epilogue).");
  // moe_decode's limits, which both handlers enforce; Python checks against these.
  nb::dict decode;
  decode["max_topk"] = kDecodeMaxTopk;
  decode["max_experts"] = kDecodeMaxExperts;
  decode["max_hidden"] = kDecodeMaxHidden;
  decode["max_inter"] = kDecodeMaxInter;
  decode["multiple"] = kDecodeMultiple;
  m.attr("DECODE_LIMITS") = decode;
  nb::dict decode_fp8;  // moe_decode_fp8's, likewise
  decode_fp8["max_topk"] = kDecodeFp8MaxTopk;
  decode_fp8["max_hidden"] = kDecodeFp8MaxHidden;
  decode_fp8["max_inter"] = kDecodeFp8MaxInter;
  decode_fp8["multiple"] = kDecodeFp8Multiple;
  m.attr("DECODE_FP8_LIMITS") = decode_fp8;
  m.def("group_gemm_fp8_decode_fits", &Fp8DecodeShapeOk, nb::arg("groups"), nb::arg("k"),
        "Whether group_gemm_fp8's decode form (tile_m=8) takes a problem of this shape on a "
        "CUDA device: K a multiple of 16 and its shared memory within the cap.");
  m.attr("DECODE_SPLIT_UNIT") = kDecodeSplitUnit;
  m.attr("DECODE_MAX_SPLIT_TOKENS") = kDecodeMaxSplitTokens;
}

// The FFI handlers of paged attention: write_kv, paged_decode and fill_rows,
// on the CPU (kernels/cpu/attention.h) and on CUDA
// (kernels/cuda/attention/launch.h). Both platforms run the same checks
// (ffi/attention_checks.h).
#include <cstddef>
#include <cstring>

#include "ffi/attention_checks.h"
#include "ffi/ffi_common.h"
#include "ffi/targets.h"
#include "kernels/cpu/attention.h"

#ifdef JAX_MOE_WITH_CUDA
#include <cuda_runtime_api.h>

#include "kernels/cuda/attention/launch.h"
#endif

namespace jax_moe {
namespace {

// ---- CPU ---------------------------------------------------------------------

// The outputs alias the caches (input_output_aliases in Python), so only the
// rows named by slot_mapping are written.
ffi::Error WriteKvCpu(ffi::AnyBuffer k_pages, ffi::AnyBuffer v_pages, ffi::AnyBuffer k,
                      ffi::AnyBuffer v, ffi::Buffer<ffi::S32> slots,
                      ffi::Result<ffi::AnyBuffer> k_out, ffi::Result<ffi::AnyBuffer> v_out) {
  WriteKvDims d;
  if (auto err = CheckWriteKv(k_pages, v_pages, k, v, slots, *k_out, *v_out, &d); err.failure())
    return err;
  const int64_t width = static_cast<int64_t>(ffi::ByteWidth(k.element_type()));
  void* ko = k_out->untyped_data();
  void* vo = v_out->untyped_data();
  // Without donation XLA copies the cache into the output first; if it ever
  // hands us distinct buffers, copy here so the result is still complete.
  if (ko != k_pages.untyped_data()) std::memcpy(ko, k_pages.untyped_data(), k_pages.size_bytes());
  if (vo != v_pages.untyped_data()) std::memcpy(vo, v_pages.untyped_data(), v_pages.size_bytes());
  WriteKvSlots(k.untyped_data(), v.untyped_data(), slots.typed_data(), d.n,
               d.k_row_elems * width, d.v_row_elems * width, d.num_slots, ko, vo);
  return ffi::Error::Success();
}

ffi::Error PagedDecodeCpu(ffi::AnyBuffer q, ffi::AnyBuffer k_pages, ffi::AnyBuffer v_pages,
                          ffi::Buffer<ffi::S32> page_table, ffi::Buffer<ffi::S32> lengths,
                          float scale, int64_t split_tokens, ffi::Result<ffi::AnyBuffer> out,
                          ffi::Result<ffi::Buffer<ffi::F32>> part_out,
                          ffi::Result<ffi::Buffer<ffi::F32>> part_stats) {
  DecodeDims d;
  if (auto err = CheckDecode(q, k_pages, v_pages, page_table, lengths, *out, *part_out,
                             *part_stats, split_tokens, &d);
      err.failure())
    return err;
  // The scratch outputs are the CUDA kernel's; the CPU path does not need them.
  PagedDecode(ToDType(q.element_type()), q.untyped_data(), k_pages.untyped_data(),
              v_pages.untyped_data(), page_table.typed_data(), lengths.typed_data(), d, scale,
              out->untyped_data());
  return ffi::Error::Success();
}

// In place: the output aliases x.
ffi::Error FillRowsCpu(ffi::AnyBuffer x, ffi::Buffer<ffi::S32> ctrl,
                       ffi::Result<ffi::AnyBuffer> out) {
  int64_t rows = 0, row_bytes = 0;
  if (auto err = CheckFillRows(x, ctrl, *out, &rows, &row_bytes); err.failure()) return err;
  void* o = out->untyped_data();
  if (o != x.untyped_data()) std::memcpy(o, x.untyped_data(), x.size_bytes());
  FillRows(ToDType(x.element_type()), o, ctrl.typed_data(), rows, row_bytes);
  return ffi::Error::Success();
}

// ---- CUDA --------------------------------------------------------------------

#ifdef JAX_MOE_WITH_CUDA

ffi::Error WriteKvCuda(cudaStream_t stream, ffi::AnyBuffer k_pages, ffi::AnyBuffer v_pages,
                       ffi::AnyBuffer k, ffi::AnyBuffer v, ffi::Buffer<ffi::S32> slots,
                       ffi::Result<ffi::AnyBuffer> k_out, ffi::Result<ffi::AnyBuffer> v_out) {
  WriteKvDims d;
  if (auto err = CheckWriteKv(k_pages, v_pages, k, v, slots, *k_out, *v_out, &d); err.failure())
    return err;
  // The outputs alias the caches (input_output_aliases), so they already hold
  // them; should XLA ever hand over distinct buffers, copy (async, on stream).
  struct Copy {
    void* dst;
    const void* src;
    size_t bytes;
  };
  for (const Copy& c : {Copy{k_out->untyped_data(), k_pages.untyped_data(), k_pages.size_bytes()},
                        Copy{v_out->untyped_data(), v_pages.untyped_data(), v_pages.size_bytes()}}) {
    if (c.dst == c.src || c.bytes == 0) continue;
    if (cudaMemcpyAsync(c.dst, c.src, c.bytes, cudaMemcpyDeviceToDevice, stream) != cudaSuccess)
      return LastCudaError("write_kv cache copy");
  }
  const int64_t width = static_cast<int64_t>(ffi::ByteWidth(k.element_type()));
  return CudaError(LaunchWriteKv(stream, k.untyped_data(), v.untyped_data(), slots.typed_data(),
                                 d.n, d.k_row_elems * width, d.v_row_elems * width, d.num_slots,
                                 k_out->untyped_data(), v_out->untyped_data()),
                   "write_kv launch");
}

ffi::Error PagedDecodeCuda(cudaStream_t stream, ffi::AnyBuffer q, ffi::AnyBuffer k_pages,
                           ffi::AnyBuffer v_pages, ffi::Buffer<ffi::S32> page_table,
                           ffi::Buffer<ffi::S32> lengths, float scale, int64_t split_tokens,
                           ffi::Result<ffi::AnyBuffer> out,
                           ffi::Result<ffi::Buffer<ffi::F32>> part_out,
                           ffi::Result<ffi::Buffer<ffi::F32>> part_stats) {
  DecodeDims d;
  if (auto err = CheckDecode(q, k_pages, v_pages, page_table, lengths, *out, *part_out,
                             *part_stats, split_tokens, &d);
      err.failure())
    return err;
  if (d.batch == 0 || d.hq == 0) return ffi::Error::Success();
  if (d.num_splits > 65535) return InvalidArg("paged_decode: max_pages * page_size too large");
  if (d.num_pages * d.page_size >= (int64_t{1} << 31))
    return InvalidArg("paged_decode: the cache must have fewer than 2^31 slots");
  if (d.batch * d.hkv >= (int64_t{1} << 31) || d.batch * d.hq >= (int64_t{1} << 31))
    return InvalidArg("paged_decode: batch * heads must be < 2^31");
  const DType dtype = ToDType(q.element_type());
  if (auto err = CudaError(LaunchDecodeSplit(stream, dtype, d, q.untyped_data(),
                                             k_pages.untyped_data(), v_pages.untyped_data(),
                                             page_table.typed_data(), lengths.typed_data(),
                                             scale, part_out->typed_data(),
                                             part_stats->typed_data()),
                           "paged_decode split launch");
      err.failure())
    return err;
  return CudaError(LaunchDecodeCombine(stream, dtype, d, part_out->typed_data(),
                                       part_stats->typed_data(), lengths.typed_data(),
                                       out->untyped_data()),
                   "paged_decode combine launch");
}

ffi::Error FillRowsCuda(cudaStream_t stream, ffi::AnyBuffer x, ffi::Buffer<ffi::S32> ctrl,
                        ffi::Result<ffi::AnyBuffer> out) {
  int64_t rows = 0, row_bytes = 0;
  if (auto err = CheckFillRows(x, ctrl, *out, &rows, &row_bytes); err.failure()) return err;
  void* o = out->untyped_data();
  if (o != x.untyped_data() && x.size_bytes() != 0 &&
      cudaMemcpyAsync(o, x.untyped_data(), x.size_bytes(), cudaMemcpyDeviceToDevice, stream) !=
          cudaSuccess)
    return LastCudaError("fill_rows copy");
  return CudaError(
      LaunchFillRows(stream, ToDType(x.element_type()), o, ctrl.typed_data(), rows, row_bytes),
      "fill_rows launch");
}

#endif  // JAX_MOE_WITH_CUDA

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(kWriteKvCpu, WriteKvCpu, WriteKvSignature(ffi::Ffi::Bind()));

XLA_FFI_DEFINE_HANDLER_SYMBOL(kPagedDecodeCpu, PagedDecodeCpu,
                              PagedDecodeSignature(ffi::Ffi::Bind()));

XLA_FFI_DEFINE_HANDLER_SYMBOL(kFillRowsCpu, FillRowsCpu, FillRowsSignature(ffi::Ffi::Bind()));

#ifdef JAX_MOE_WITH_CUDA

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    kWriteKvCuda, WriteKvCuda,
    WriteKvSignature(ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>()),
    {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    kPagedDecodeCuda, PagedDecodeCuda,
    PagedDecodeSignature(ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>()),
    {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    kFillRowsCuda, FillRowsCuda,
    FillRowsSignature(ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>()),
    {ffi::Traits::kCmdBufferCompatible});

#endif  // JAX_MOE_WITH_CUDA

}  // namespace jax_moe

// Shape/dtype checks shared by the CPU and CUDA attention handlers
// (ffi/attention.cc), so that both platforms reject exactly the same buffers.
// Python (jax_moe/attention.py) validates first, with messages naming the
// argument; these checks only keep a kernel from indexing past what it was
// given. The limits and dims structs are the kernels' (kernels/common/attention.h).
#pragma once

#include "ffi/ffi_common.h"
#include "kernels/common/attention.h"

namespace jax_moe {

inline ffi::Error CheckWriteKv(const ffi::AnyBuffer& k_pages, const ffi::AnyBuffer& v_pages,
                               const ffi::AnyBuffer& k, const ffi::AnyBuffer& v,
                               const ffi::Buffer<ffi::S32>& slots, const ffi::AnyBuffer& k_out,
                               const ffi::AnyBuffer& v_out, WriteKvDims* d) {
  auto kp = k_pages.dimensions();
  auto vp = v_pages.dimensions();
  auto kd = k.dimensions();
  auto vd = v.dimensions();
  if (kp.size() != 4 || vp.size() != 4 || kd.size() != 3 || vd.size() != 3)
    return InvalidArg("write_kv: k_pages / v_pages must be (P, page_size, Hkv, Dk / Dv) and "
                      "k / v (N, Hkv, Dk / Dv)");
  d->num_pages = kp[0];
  d->page_size = kp[1];
  d->k_row_elems = kp[2] * kp[3];
  d->v_row_elems = vp[2] * vp[3];
  d->n = kd[0];
  d->num_slots = d->num_pages * d->page_size;
  if (vp[0] != kp[0] || vp[1] != kp[1] || vp[2] != kp[2])
    return InvalidArg("write_kv: v_pages must have the pages, page size and kv heads of k_pages");
  if (kd[1] != kp[2] || kd[2] != kp[3])
    return InvalidArg("write_kv: k must be (N, Hkv, Dk) of k_pages");
  if (vd[0] != kd[0] || vd[1] != vp[2] || vd[2] != vp[3])
    return InvalidArg("write_kv: v must be (N, Hkv, Dv) of v_pages");
  if (static_cast<int64_t>(slots.element_count()) != d->n)
    return InvalidArg("write_kv: slot_mapping must have N entries");
  const auto t = k_pages.element_type();
  if (!IsFloatType(t) || v_pages.element_type() != t || k.element_type() != t ||
      v.element_type() != t || k_out.element_type() != t || v_out.element_type() != t)
    return InvalidArg("write_kv: caches and k, v must share one float dtype");
  if (k_out.element_count() != k_pages.element_count() ||
      v_out.element_count() != v_pages.element_count())
    return InvalidArg("write_kv: outputs must have the shapes of the caches");
  return ffi::Error::Success();
}

inline ffi::Error CheckDecode(const ffi::AnyBuffer& q, const ffi::AnyBuffer& k_pages,
                              const ffi::AnyBuffer& v_pages,
                              const ffi::Buffer<ffi::S32>& page_table,
                              const ffi::Buffer<ffi::S32>& lengths, const ffi::AnyBuffer& out,
                              const ffi::Buffer<ffi::F32>& part_out,
                              const ffi::Buffer<ffi::F32>& part_stats, int64_t split_tokens,
                              DecodeDims* d) {
  auto qd = q.dimensions();
  auto kp = k_pages.dimensions();
  auto vp = v_pages.dimensions();
  auto pt = page_table.dimensions();
  if (qd.size() != 3 || kp.size() != 4 || vp.size() != 4 || pt.size() != 2)
    return InvalidArg("paged_decode: q must be (B, Hq, Dk), k_pages (P, page_size, Hkv, Dk), "
                      "v_pages (P, page_size, Hkv, Dv), page_table (B, max_pages)");
  d->batch = qd[0];
  d->hq = qd[1];
  d->k_dim = qd[2];
  d->v_dim = vp[3];
  d->num_pages = kp[0];
  d->page_size = kp[1];
  d->hkv = kp[2];
  d->max_pages = pt[1];
  d->max_tokens = d->max_pages * d->page_size;
  if (split_tokens < kDecodeSplitUnit || split_tokens > kDecodeMaxSplitTokens ||
      split_tokens % kDecodeSplitUnit != 0)
    return InvalidArg("paged_decode: split_tokens must be a multiple of 64 in [64, 2048]");
  d->split_tokens = split_tokens;
  d->num_splits = DecodeNumSplits(d->max_tokens, split_tokens);
  if (kp[3] != d->k_dim) return InvalidArg("paged_decode: head dims of q and k_pages differ");
  if (!DecodeHeadDimOk(d->k_dim) || !DecodeHeadDimOk(d->v_dim))
    return InvalidArg("paged_decode: head dims must be multiples of 8 in [8, 256]");
  if (d->hkv < 1 || d->hq % d->hkv != 0)
    return InvalidArg("paged_decode: query heads must be a multiple of kv heads");
  d->group = d->hq / d->hkv;
  if (d->page_size < 1) return InvalidArg("paged_decode: page_size must be >= 1");
  if (vp[0] != kp[0] || vp[1] != kp[1] || vp[2] != kp[2])
    return InvalidArg("paged_decode: v_pages must have the pages, page size and kv heads of "
                      "k_pages");
  if (pt[0] != d->batch || static_cast<int64_t>(lengths.element_count()) != d->batch)
    return InvalidArg("paged_decode: page_table and lengths must have B rows");
  const auto t = q.element_type();
  if (!IsFloatType(t) || k_pages.element_type() != t || v_pages.element_type() != t ||
      out.element_type() != t)
    return InvalidArg("paged_decode: q, caches and output must share one float dtype");
  if (static_cast<int64_t>(out.element_count()) != d->batch * d->hq * d->v_dim)
    return InvalidArg("paged_decode: output must be (B, Hq, Dv)");
  if (static_cast<int64_t>(part_out.element_count()) !=
          d->batch * d->hq * d->num_splits * d->v_dim ||
      static_cast<int64_t>(part_stats.element_count()) != d->batch * d->hq * d->num_splits * 2)
    return InvalidArg("paged_decode: scratch outputs have the wrong size");
  return ffi::Error::Success();
}

// fill_rows: x (N, ...) of a float dtype, ctrl (2,) int32, out like x.
inline ffi::Error CheckFillRows(const ffi::AnyBuffer& x, const ffi::Buffer<ffi::S32>& ctrl,
                                const ffi::AnyBuffer& out, int64_t* rows, int64_t* row_bytes) {
  auto xd = x.dimensions();
  if (xd.size() < 1) return InvalidArg("fill_rows: x must have a leading row axis");
  if (!IsFloatType(x.element_type()) || out.element_type() != x.element_type() ||
      out.element_count() != x.element_count())
    return InvalidArg("fill_rows: x and the output must be one float array");
  if (ctrl.element_count() != 2) return InvalidArg("fill_rows: ctrl must be (start, poison)");
  *rows = xd[0];
  *row_bytes = *rows == 0 ? 0
                          : static_cast<int64_t>(x.size_bytes()) / *rows;
  return ffi::Error::Success();
}

}  // namespace jax_moe

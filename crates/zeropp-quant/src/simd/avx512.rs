//! AVX-512F kernels (x86-64). Same operation order as [`super::scalar`]
//! (no FMA), so results are bit-identical. Compiled on x86-64 with Rust >= 1.89; used only when
//! `is_x86_feature_detected!("avx512f")` says so. The reductions, rounding and
//! dequantization are the shared bodies (`super::vector`, `super::x86`) over
//! the 16-lane vocabulary in [`lanes`]; INT4 (un)packing is AVX2's.

use std::arch::x86_64::*;

x86_kernels! {
    feature: "avx512f", width: 16, per_store: 1,
    load_store: [_mm512_loadu_ps, _mm512_storeu_ps],
    types: [__m512, __m512i],
    ops: [_mm512_add_epi32, _mm512_mullo_epi32, _mm512_set1_epi32, _mm512_srli_epi32, _mm512_xor_si512, _mm512_cvtepi32_ps, _mm512_add_ps, _mm512_sub_ps, _mm512_mul_ps, _mm512_min_ps, _mm512_max_ps, _mm512_set1_ps],
    lane_ids: _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
    round_f(y): _mm512_roundscale_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(y),
    floor_f(y): _mm512_roundscale_ps::<{ _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC }>(y),
    // A masked add: `f` itself in the other lanes.
    add_one_if_lt(f, u, frac, one): _mm512_mask_add_ps(f, _mm512_cmp_ps_mask::<_CMP_LT_OQ>(u, frac), f, one),
    mask: [__mmask16, 0xFFFF],
    abs_f(v): _mm512_abs_ps(v),
    le_f(a, b): _mm512_cmp_ps_mask::<_CMP_LE_OQ>(a, b),
    and_m(a, b): a & b,
    all_set(ok): ok == 0xFFFF,
    horizontal: [std::arch::x86_64::_mm512_reduce_max_ps, std::arch::x86_64::_mm512_reduce_min_ps],
    accumulators: [2, 1],
    store: store_i8,
    deq: [_mm_loadu_si128, _mm512_cvtepi8_epi32],
}

vector_fwht!("avx512f");

/// Stores 16 words to `out[at..at + 16]`.
#[inline]
#[target_feature(enable = "avx512f")]
fn store_u32(out: &mut [u32], at: usize, v: __m512i) {
    assert!(at + 16 <= out.len());
    // SAFETY: the assert keeps the 64-byte unaligned store in bounds.
    unsafe { _mm512_storeu_si512(out.as_mut_ptr().add(at).cast::<__m512i>(), v) }
}

/// Flips the sign of lane `k` where bit `k` of `bits` is set (an exact xor of
/// the sign bit, masked).
#[inline]
#[target_feature(enable = "avx512f")]
fn fwht_flip(v: __m512, bits: u32) -> __m512 {
    let vi = _mm512_castps_si512(v);
    _mm512_castsi512_ps(_mm512_mask_xor_epi32(vi, bits as __mmask16, vi, _mm512_set1_epi32(i32::MIN)))
}

/// One butterfly stage inside a vector: `p` is `v` with each lane swapped for
/// its partner; lanes in `mask` (the upper of each pair) take `p - v` (the
/// scalar `a - b`), the others `v + p` (`a + b`).
#[inline]
#[target_feature(enable = "avx512f")]
fn fwht_stage(v: __m512, p: __m512, mask: __mmask16) -> __m512 {
    _mm512_mask_blend_ps(mask, _mm512_add_ps(v, p), _mm512_sub_ps(p, v))
}

/// The butterfly stages h = 1, 2, 4, 8 inside one vector of 16 lanes.
#[inline]
#[target_feature(enable = "avx512f")]
fn fwht_lanes(v: __m512) -> __m512 {
    let v = fwht_stage(v, _mm512_permute_ps::<0b10_11_00_01>(v), 0xAAAA);
    let v = fwht_stage(v, _mm512_permute_ps::<0b01_00_11_10>(v), 0xCCCC);
    let v = fwht_stage(v, _mm512_shuffle_f32x4::<0b10_11_00_01>(v, v), 0xF0F0);
    fwht_stage(v, _mm512_shuffle_f32x4::<0b01_00_11_10>(v, v), 0xFF00)
}

/// Stores 16 clamped integral floats as i8 to `out[at..at + 16]`.
#[inline]
#[target_feature(enable = "avx512f")]
fn store_i8(r: [__m512; 1], out: &mut [u8], at: usize) {
    let b = _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(r[0]));
    assert!(at + 16 <= out.len());
    // SAFETY: the assert above keeps the 16-byte unaligned store in bounds.
    unsafe { _mm_storeu_si128(out.as_mut_ptr().add(at).cast::<__m128i>(), b) }
}

/// INT4 packing: the AVX2 kernel. AVX-512F implies AVX2 (rustc and LLVM
/// enable `avx2` with `avx512f`, so this call needs no `unsafe`), and AVX2's
/// 32-byte shuffles already keep up with memory here.
#[target_feature(enable = "avx512f")]
pub(super) fn pack4(q: &[u8], out: &mut [u8]) {
    super::avx2::pack4(q, out);
}

/// INT4 unpacking: the AVX2 kernel (see [`pack4`]).
#[target_feature(enable = "avx512f")]
pub(super) fn unpack4(data: &[u8], out: &mut [u8]) {
    super::avx2::unpack4(data, out);
}

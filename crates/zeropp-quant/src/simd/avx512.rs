//! AVX-512F kernels (x86-64). Same operation order as [`super::scalar`]
//! (no FMA), so results are bit-identical. Compiled on x86-64 with Rust >= 1.89; used only when
//! `is_x86_feature_detected!("avx512f")` says so. The rounding kernels are
//! the shared x86 bodies (`super::x86`) over the 16-lane vocabulary in
//! [`lanes`]; INT4 (un)packing is AVX2's.

use super::scalar;
use std::arch::x86_64::*;

x86_rounding!("avx512f");

/// The lane vocabulary of the shared x86 rounding bodies, on 16 lanes.
mod lanes {
    pub(super) use super::load16 as load;
    use std::arch::x86_64::*;
    pub(super) use std::arch::x86_64::{
        __m512 as F, __m512i as I, _mm512_add_epi32 as add_i, _mm512_cvtepi32_ps as i_to_f,
        _mm512_max_ps as max_f, _mm512_min_ps as min_f, _mm512_mul_ps as mul_f,
        _mm512_mullo_epi32 as mullo_i, _mm512_set1_epi32 as splat_i, _mm512_set1_ps as splat_f,
        _mm512_srli_epi32 as shr_i, _mm512_sub_ps as sub_f, _mm512_xor_si512 as xor_i,
    };

    /// Lanes in a vector.
    pub(super) const WIDTH: usize = 16;
    /// Vectors [`store`] takes at once (16 bytes).
    pub(super) const PER_STORE: usize = 1;

    /// Lane indices 0..16 as i32.
    #[inline]
    #[target_feature(enable = "avx512f")]
    pub(super) fn lane_ids() -> I {
        _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15)
    }

    /// Round to nearest, ties to even (as `f32::round_ties_even`).
    #[inline]
    #[target_feature(enable = "avx512f")]
    pub(super) fn round_f(y: F) -> F {
        _mm512_roundscale_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(y)
    }

    /// Round toward negative infinity (as `f32::floor`).
    #[inline]
    #[target_feature(enable = "avx512f")]
    pub(super) fn floor_f(y: F) -> F {
        _mm512_roundscale_ps::<{ _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC }>(y)
    }

    /// `f + 1` in the lanes where `u < frac`, `f` elsewhere.
    #[inline]
    #[target_feature(enable = "avx512f")]
    pub(super) fn add_one_if_lt(f: F, u: F, frac: F, one: F) -> F {
        _mm512_mask_add_ps(f, _mm512_cmp_ps_mask::<_CMP_LT_OQ>(u, frac), f, one)
    }

    /// Stores 16 clamped integral floats as i8 to `out[at..at + 16]`.
    #[inline]
    #[target_feature(enable = "avx512f")]
    pub(super) fn store(r: [F; PER_STORE], out: &mut [u8], at: usize) {
        super::store_i8(out, at, r[0]);
    }
}

/// Loads 16 floats from `c[at..at + 16]`.
#[inline]
#[target_feature(enable = "avx512f")]
fn load16(c: &[f32], at: usize) -> __m512 {
    assert!(at + 16 <= c.len());
    // SAFETY: the assert above keeps the 16-float unaligned load in bounds.
    unsafe { _mm512_loadu_ps(c.as_ptr().add(at)) }
}

/// Stores 16 floats to `c[at..at + 16]`.
#[inline]
#[target_feature(enable = "avx512f")]
fn store16(c: &mut [f32], at: usize, v: __m512) {
    assert!(at + 16 <= c.len());
    // SAFETY: the assert above keeps the 16-float unaligned store in bounds.
    unsafe { _mm512_storeu_ps(c.as_mut_ptr().add(at), v) }
}

/// Stores 16 clamped integral floats as i8 to `out[at..at + 16]`.
#[inline]
#[target_feature(enable = "avx512f")]
fn store_i8(out: &mut [u8], at: usize, r: __m512) {
    let b = _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(r));
    assert!(at + 16 <= out.len());
    // SAFETY: the assert above keeps the 16-byte unaligned store in bounds.
    unsafe { _mm_storeu_si128(out.as_mut_ptr().add(at).cast::<__m128i>(), b) }
}

#[target_feature(enable = "avx512f")]
pub(super) fn abs_max(x: &[f32]) -> Option<f32> {
    let fmax = _mm512_set1_ps(f32::MAX);
    let mut m0 = _mm512_setzero_ps();
    let mut m1 = _mm512_setzero_ps();
    let mut ok: __mmask16 = 0xFFFF;
    let chunks = x.chunks_exact(32);
    let rem = chunks.remainder();
    for c in chunks {
        let a = _mm512_abs_ps(load16(c, 0));
        let b = _mm512_abs_ps(load16(c, 16));
        ok &= _mm512_cmp_ps_mask::<_CMP_LE_OQ>(a, fmax) & _mm512_cmp_ps_mask::<_CMP_LE_OQ>(b, fmax);
        m0 = _mm512_max_ps(m0, a);
        m1 = _mm512_max_ps(m1, b);
    }
    if ok != 0xFFFF {
        return None;
    }
    let t = scalar::abs_max(rem)?;
    Some(_mm512_reduce_max_ps(_mm512_max_ps(m0, m1)).max(t))
}

#[target_feature(enable = "avx512f")]
pub(super) fn min_max(x: &[f32]) -> Option<(f32, f32)> {
    let fmax = _mm512_set1_ps(f32::MAX);
    let mut lo = _mm512_set1_ps(f32::INFINITY);
    let mut hi = _mm512_set1_ps(f32::NEG_INFINITY);
    let mut ok: __mmask16 = 0xFFFF;
    let chunks = x.chunks_exact(16);
    let rem = chunks.remainder();
    for c in chunks {
        let v = load16(c, 0);
        ok &= _mm512_cmp_ps_mask::<_CMP_LE_OQ>(_mm512_abs_ps(v), fmax);
        lo = _mm512_min_ps(lo, v);
        hi = _mm512_max_ps(hi, v);
    }
    if ok != 0xFFFF {
        return None;
    }
    let (tl, th) = scalar::min_max(rem)?;
    Some((_mm512_reduce_min_ps(lo).min(tl), _mm512_reduce_max_ps(hi).max(th)))
}

/// Converts `q[at..at + 16]` to f32 and applies `* scale + offset`.
#[inline]
#[target_feature(enable = "avx512f")]
fn deq16(q: &[u8], at: usize, vs: __m512, vo: __m512) -> __m512 {
    assert!(at + 16 <= q.len());
    // SAFETY: the assert keeps the 16-byte unaligned load in bounds.
    let b = unsafe { _mm_loadu_si128(q.as_ptr().add(at).cast::<__m128i>()) };
    let f = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b));
    _mm512_add_ps(_mm512_mul_ps(f, vs), vo)
}

/// Dequantizes `q` into `dst` (`ADD`: adds into it) — the one loop behind
/// [`dequant`] and [`dequant_add`]; the remainder goes through the scalar kernel.
#[inline]
#[target_feature(enable = "avx512f")]
fn dequant_into<const ADD: bool>(q: &[u8], scale: f32, offset: f32, dst: &mut [f32]) {
    let n = q.len().min(dst.len());
    let body = n - n % 16;
    let vs = _mm512_set1_ps(scale);
    let vo = _mm512_set1_ps(offset);
    let mut i = 0;
    while i < body {
        let v = deq16(q, i, vs, vo);
        let r = if ADD { _mm512_add_ps(load16(dst, i), v) } else { v };
        store16(dst, i, r);
        i += 16;
    }
    scalar::dequant_into::<ADD>(&q[body..n], scale, offset, &mut dst[body..n]);
}

dequant_entry_points!("avx512f");

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

//! AVX-512F kernels (x86-64). Same operation order as [`super::scalar`]
//! (no FMA), so results are bit-identical. Compiled on x86-64 with Rust >= 1.89; used only when
//! `is_x86_feature_detected!("avx512f")` says so.

use super::{RoundParams, Stoch, scalar};
use std::arch::x86_64::*;

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

#[target_feature(enable = "avx512f")]
pub(super) fn round_nearest(x: &[f32], p: &RoundParams, out: &mut [u8]) {
    let n = x.len().min(out.len());
    let body = n - n % 16;
    let vs = _mm512_set1_ps(p.s);
    let vo = _mm512_set1_ps(p.offset);
    let vlo = _mm512_set1_ps(p.qmin);
    let vhi = _mm512_set1_ps(p.qmax);
    let mut i = 0;
    while i < body {
        let y = _mm512_mul_ps(_mm512_sub_ps(load16(x, i), vo), vs);
        let y = _mm512_roundscale_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(y);
        store_i8(out, i, _mm512_min_ps(_mm512_max_ps(y, vlo), vhi));
        i += 16;
    }
    scalar::round_nearest(&x[body..n], p, &mut out[body..n]);
}

/// lowbias32 on 16 lanes.
#[inline]
#[target_feature(enable = "avx512f")]
fn lowbias32(mut x: __m512i) -> __m512i {
    x = _mm512_xor_si512(x, _mm512_srli_epi32::<16>(x));
    x = _mm512_mullo_epi32(x, _mm512_set1_epi32(0x7feb_352d));
    x = _mm512_xor_si512(x, _mm512_srli_epi32::<15>(x));
    x = _mm512_mullo_epi32(x, _mm512_set1_epi32(0x846c_a68b_u32 as i32));
    _mm512_xor_si512(x, _mm512_srli_epi32::<16>(x))
}

#[target_feature(enable = "avx512f")]
pub(super) fn round_stochastic(x: &[f32], p: &RoundParams, st: Stoch, out: &mut [u8]) {
    let n = x.len().min(out.len());
    let body = n - n % 16;
    let vs = _mm512_set1_ps(p.s);
    let vo = _mm512_set1_ps(p.offset);
    let vlo = _mm512_set1_ps(p.qmin);
    let vhi = _mm512_set1_ps(p.qmax);
    let one = _mm512_set1_ps(1.0);
    let inv24 = _mm512_set1_ps(1.0 / 16_777_216.0);
    let k1 = _mm512_set1_epi32(st.k1 as i32);
    let k2 = _mm512_set1_epi32(st.k2 as i32);
    let ids = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    let mut i = 0;
    while i < body {
        let lo = st.lo.wrapping_add(i as u32);
        let idx = _mm512_add_epi32(_mm512_set1_epi32(lo as i32), ids);
        let h = lowbias32(_mm512_xor_si512(lowbias32(_mm512_xor_si512(idx, k1)), k2));
        let u = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32::<8>(h)), inv24);
        let y = _mm512_mul_ps(_mm512_sub_ps(load16(x, i), vo), vs);
        let f = _mm512_roundscale_ps::<{ _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC }>(y);
        let frac = _mm512_sub_ps(y, f);
        let up = _mm512_cmp_ps_mask::<_CMP_LT_OQ>(u, frac);
        let y = _mm512_mask_add_ps(f, up, f, one);
        store_i8(out, i, _mm512_min_ps(_mm512_max_ps(y, vlo), vhi));
        i += 16;
    }
    let tail = Stoch { lo: st.lo.wrapping_add(body as u32), ..st };
    scalar::round_stochastic(&x[body..n], p, tail, &mut out[body..n]);
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

#[target_feature(enable = "avx512f")]
pub(super) fn dequant(q: &[u8], scale: f32, offset: f32, out: &mut [f32]) {
    let n = q.len().min(out.len());
    let body = n - n % 16;
    let vs = _mm512_set1_ps(scale);
    let vo = _mm512_set1_ps(offset);
    let mut i = 0;
    while i < body {
        store16(out, i, deq16(q, i, vs, vo));
        i += 16;
    }
    scalar::dequant(&q[body..n], scale, offset, &mut out[body..n]);
}

#[target_feature(enable = "avx512f")]
pub(super) fn dequant_add(q: &[u8], scale: f32, offset: f32, acc: &mut [f32]) {
    let n = q.len().min(acc.len());
    let body = n - n % 16;
    let vs = _mm512_set1_ps(scale);
    let vo = _mm512_set1_ps(offset);
    let mut i = 0;
    while i < body {
        let r = _mm512_add_ps(load16(acc, i), deq16(q, i, vs, vo));
        store16(acc, i, r);
        i += 16;
    }
    scalar::dequant_add(&q[body..n], scale, offset, &mut acc[body..n]);
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

//! NEON kernels (aarch64). Each function mirrors its [`super::scalar`]
//! counterpart operation for operation (separate multiply and add, never
//! `vfma`), so results are bit-identical. Vector loops handle whole chunks;
//! remainders go through the scalar code.

use super::{RoundParams, Stoch, scalar};
use std::arch::aarch64::*;

float_load_store!("neon", float32x4_t, 4, load4: vld1q_f32, store4: vst1q_f32);

/// Whether every lane of the all-ones/all-zeros mask `ok` is set.
#[inline]
#[target_feature(enable = "neon")]
fn all_set(ok: uint32x4_t) -> bool {
    vminvq_u32(ok) == u32::MAX
}

#[target_feature(enable = "neon")]
pub(super) fn abs_max(x: &[f32]) -> Option<f32> {
    let fmax = vdupq_n_f32(f32::MAX);
    let mut m = [vdupq_n_f32(0.0); 4];
    let mut ok = vdupq_n_u32(u32::MAX);
    let chunks = x.chunks_exact(16);
    let rem = chunks.remainder();
    for c in chunks {
        for (j, mj) in m.iter_mut().enumerate() {
            let a = vabsq_f32(load4(c, 4 * j));
            // `a <= MAX` is false for ±Inf and NaN.
            ok = vandq_u32(ok, vcleq_f32(a, fmax));
            *mj = vmaxq_f32(*mj, a);
        }
    }
    if !all_set(ok) {
        return None;
    }
    let v = vmaxq_f32(vmaxq_f32(m[0], m[1]), vmaxq_f32(m[2], m[3]));
    let t = scalar::abs_max(rem)?;
    Some(vmaxvq_f32(v).max(t))
}

#[target_feature(enable = "neon")]
pub(super) fn min_max(x: &[f32]) -> Option<(f32, f32)> {
    let fmax = vdupq_n_f32(f32::MAX);
    let mut lo = [vdupq_n_f32(f32::INFINITY); 2];
    let mut hi = [vdupq_n_f32(f32::NEG_INFINITY); 2];
    let mut ok = vdupq_n_u32(u32::MAX);
    let chunks = x.chunks_exact(8);
    let rem = chunks.remainder();
    for c in chunks {
        for j in 0..2 {
            let v = load4(c, 4 * j);
            ok = vandq_u32(ok, vcleq_f32(vabsq_f32(v), fmax));
            lo[j] = vminq_f32(lo[j], v);
            hi[j] = vmaxq_f32(hi[j], v);
        }
    }
    if !all_set(ok) {
        return None;
    }
    let (tl, th) = scalar::min_max(rem)?;
    let l = vminvq_f32(vminq_f32(lo[0], lo[1])).min(tl);
    let h = vmaxvq_f32(vmaxq_f32(hi[0], hi[1])).max(th);
    Some((l, h))
}

/// Narrows four vectors of 4 clamped integral floats to 16 i8 at `out[at..]`.
#[inline]
#[target_feature(enable = "neon")]
fn store16(r: [float32x4_t; 4], out: &mut [u8], at: usize) {
    // The values are integral and within i8, so the conversions are exact.
    let h0 = vcombine_s16(vqmovn_s32(vcvtq_s32_f32(r[0])), vqmovn_s32(vcvtq_s32_f32(r[1])));
    let h1 = vcombine_s16(vqmovn_s32(vcvtq_s32_f32(r[2])), vqmovn_s32(vcvtq_s32_f32(r[3])));
    let b = vreinterpretq_u8_s8(vcombine_s8(vqmovn_s16(h0), vqmovn_s16(h1)));
    assert!(at + 16 <= out.len());
    // SAFETY: the assert keeps the 16-byte unaligned store in bounds.
    unsafe { vst1q_u8(out.as_mut_ptr().add(at), b) }
}

/// `[s, offset, qmin, qmax]` on every lane.
#[inline]
#[target_feature(enable = "neon")]
fn splat_params(p: &RoundParams) -> [float32x4_t; 4] {
    [vdupq_n_f32(p.s), vdupq_n_f32(p.offset), vdupq_n_f32(p.qmin), vdupq_n_f32(p.qmax)]
}

#[target_feature(enable = "neon")]
pub(super) fn round_nearest(x: &[f32], p: &RoundParams, out: &mut [u8]) {
    let n = x.len().min(out.len());
    let body = n - n % 16;
    let [vs, vo, vlo, vhi] = splat_params(p);
    let mut i = 0;
    while i < body {
        let mut r = [vdupq_n_f32(0.0); 4];
        for (j, rj) in r.iter_mut().enumerate() {
            let y = vmulq_f32(vsubq_f32(load4(x, i + 4 * j), vo), vs);
            // Round to nearest, ties to even (as `f32::round_ties_even`).
            let y = vrndnq_f32(y);
            *rj = vminq_f32(vmaxq_f32(y, vlo), vhi);
        }
        store16(r, out, i);
        i += 16;
    }
    scalar::round_nearest(&x[body..n], p, &mut out[body..n]);
}

/// lowbias32 on 4 lanes.
#[inline]
#[target_feature(enable = "neon")]
fn lowbias32(mut x: uint32x4_t) -> uint32x4_t {
    x = veorq_u32(x, vshrq_n_u32::<16>(x));
    x = vmulq_u32(x, vdupq_n_u32(0x7feb_352d));
    x = veorq_u32(x, vshrq_n_u32::<15>(x));
    x = vmulq_u32(x, vdupq_n_u32(0x846c_a68b));
    veorq_u32(x, vshrq_n_u32::<16>(x))
}

#[target_feature(enable = "neon")]
pub(super) fn round_stochastic(x: &[f32], p: &RoundParams, st: Stoch, out: &mut [u8]) {
    let n = x.len().min(out.len());
    let body = n - n % 16;
    let [vs, vo, vlo, vhi] = splat_params(p);
    let one = vreinterpretq_u32_f32(vdupq_n_f32(1.0));
    let inv24 = vdupq_n_f32(1.0 / 16_777_216.0);
    let k1 = vdupq_n_u32(st.k1);
    let k2 = vdupq_n_u32(st.k2);
    let ids_arr: [u32; 4] = [0, 1, 2, 3];
    // SAFETY: `ids_arr` holds exactly the 4 u32 read.
    let ids = unsafe { vld1q_u32(ids_arr.as_ptr()) };
    let mut i = 0;
    while i < body {
        let mut r = [vdupq_n_f32(0.0); 4];
        for (j, rj) in r.iter_mut().enumerate() {
            let lo = st.lo.wrapping_add((i + 4 * j) as u32);
            let idx = vaddq_u32(vdupq_n_u32(lo), ids);
            let h = lowbias32(veorq_u32(lowbias32(veorq_u32(idx, k1)), k2));
            let u = vmulq_f32(vcvtq_f32_u32(vshrq_n_u32::<8>(h)), inv24);
            let y = vmulq_f32(vsubq_f32(load4(x, i + 4 * j), vo), vs);
            let f = vrndmq_f32(y);
            let frac = vsubq_f32(y, f);
            let up = vreinterpretq_f32_u32(vandq_u32(vcltq_f32(u, frac), one));
            let y = vaddq_f32(f, up);
            *rj = vminq_f32(vmaxq_f32(y, vlo), vhi);
        }
        store16(r, out, i);
        i += 16;
    }
    let tail = Stoch { lo: st.lo.wrapping_add(body as u32), ..st };
    scalar::round_stochastic(&x[body..n], p, tail, &mut out[body..n]);
}

/// Converts `q[at..at + 16]` to f32 and applies `* scale + offset`.
#[inline]
#[target_feature(enable = "neon")]
fn deq16(q: &[u8], at: usize, vs: float32x4_t, vo: float32x4_t) -> [float32x4_t; 4] {
    assert!(at + 16 <= q.len());
    // SAFETY: the assert keeps the 16-byte unaligned load in bounds.
    let b = vreinterpretq_s8_u8(unsafe { vld1q_u8(q.as_ptr().add(at)) });
    let w0 = vmovl_s8(vget_low_s8(b));
    let w1 = vmovl_s8(vget_high_s8(b));
    let d = [
        vmovl_s16(vget_low_s16(w0)),
        vmovl_s16(vget_high_s16(w0)),
        vmovl_s16(vget_low_s16(w1)),
        vmovl_s16(vget_high_s16(w1)),
    ];
    // Separate multiply and add (no fused multiply-add), as in the scalar code.
    d.map(|v| vaddq_f32(vmulq_f32(vcvtq_f32_s32(v), vs), vo))
}

/// Dequantizes `q` into `dst` (`ADD`: adds into it) — the one loop behind
/// [`dequant`] and [`dequant_add`]; the remainder goes through the scalar kernel.
#[inline]
#[target_feature(enable = "neon")]
fn dequant_into<const ADD: bool>(q: &[u8], scale: f32, offset: f32, dst: &mut [f32]) {
    let n = q.len().min(dst.len());
    let body = n - n % 16;
    let vs = vdupq_n_f32(scale);
    let vo = vdupq_n_f32(offset);
    let mut i = 0;
    while i < body {
        for (j, v) in deq16(q, i, vs, vo).into_iter().enumerate() {
            let at = i + 4 * j;
            let r = if ADD { vaddq_f32(load4(dst, at), v) } else { v };
            store4(dst, at, r);
        }
        i += 16;
    }
    scalar::dequant_into::<ADD>(&q[body..n], scale, offset, &mut dst[body..n]);
}

dequant_entry_points!("neon");

/// INT4 packing: `out[k] = (q[2k] << 4) | (q[2k+1] & 0xF)` for every `k`
/// of `out` (`q` holds at least `2 * out.len()` bytes).
#[target_feature(enable = "neon")]
pub(super) fn pack4(q: &[u8], out: &mut [u8]) {
    let n = out.len().min(q.len() / 2);
    let body = n - n % 16;
    let mask = vdupq_n_u8(0x0F);
    let mut i = 0;
    while i < body {
        assert!(2 * i + 32 <= q.len());
        // SAFETY: the assert keeps the 32-byte deinterleaving load in bounds.
        let v = unsafe { vld2q_u8(q.as_ptr().add(2 * i)) };
        let p = vorrq_u8(vshlq_n_u8::<4>(v.0), vandq_u8(v.1, mask));
        assert!(i + 16 <= out.len());
        // SAFETY: the assert keeps the 16-byte unaligned store in bounds.
        unsafe { vst1q_u8(out.as_mut_ptr().add(i), p) };
        i += 16;
    }
    scalar::pack4(&q[2 * body..2 * n], &mut out[body..n]);
}

/// INT4 unpacking: `out[2k]` and `out[2k+1]` are the sign-extended high and
/// low nibbles of `data[k]` (`out` holds at least `2 * data.len()` bytes).
#[target_feature(enable = "neon")]
pub(super) fn unpack4(data: &[u8], out: &mut [u8]) {
    let n = data.len().min(out.len() / 2);
    let body = n - n % 16;
    let mut i = 0;
    while i < body {
        assert!(i + 16 <= data.len());
        // SAFETY: the assert keeps the 16-byte unaligned load in bounds.
        let b = vreinterpretq_s8_u8(unsafe { vld1q_u8(data.as_ptr().add(i)) });
        let even = vshrq_n_s8::<4>(b);
        let odd = vshrq_n_s8::<4>(vshlq_n_s8::<4>(b));
        let r = uint8x16x2_t(vreinterpretq_u8_s8(even), vreinterpretq_u8_s8(odd));
        assert!(2 * i + 32 <= out.len());
        // SAFETY: the assert keeps the 32-byte interleaving store in bounds.
        unsafe { vst2q_u8(out.as_mut_ptr().add(2 * i), r) };
        i += 16;
    }
    scalar::unpack4(&data[body..n], &mut out[2 * body..2 * n]);
}

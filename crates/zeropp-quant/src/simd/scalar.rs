//! Portable scalar reference kernels. Every SIMD kernel must match these
//! bit for bit.

use super::params::{RoundParams, Stoch};
use crate::rng;

/// See [`super::Dispatch::abs_max`].
pub(crate) fn abs_max(x: &[f32]) -> Option<f32> {
    let mut m = 0.0f32;
    let mut ok = true;
    for &v in x {
        let a = v.abs();
        ok &= a <= f32::MAX;
        if a > m {
            m = a;
        }
    }
    ok.then_some(m)
}

/// See [`super::Dispatch::min_max`].
pub(crate) fn min_max(x: &[f32]) -> Option<(f32, f32)> {
    let mut lo = f32::INFINITY;
    let mut hi = f32::NEG_INFINITY;
    let mut ok = true;
    for &v in x {
        ok &= v.abs() <= f32::MAX;
        if v < lo {
            lo = v;
        }
        if v > hi {
            hi = v;
        }
    }
    ok.then_some((lo, hi))
}

/// Round-to-nearest-even of [`super::Dispatch::round`] (`p.stochastic` is
/// not read).
pub(crate) fn round_nearest(x: &[f32], p: &RoundParams, out: &mut [u8]) {
    for (o, &v) in out.iter_mut().zip(x) {
        let r = ((v - p.offset) * p.s).round_ties_even();
        *o = r.max(p.qmin).min(p.qmax) as i8 as u8;
    }
}

/// The uniform in `[0, 1)` used for element `lo` (24 random bits).
#[inline]
pub(crate) fn uniform(k1: u32, k2: u32, lo: u32) -> f32 {
    (rng::hash32(k1, k2, lo) >> 8) as f32 * (1.0 / 16_777_216.0)
}

/// Stochastic rounding of [`super::Dispatch::round`] with `st` (in place
/// of `p.stochastic`, which is not read): element `i` rounds up when its
/// uniform is below the fractional part.
pub(crate) fn round_stochastic(x: &[f32], p: &RoundParams, st: Stoch, out: &mut [u8]) {
    for (i, (o, &v)) in out.iter_mut().zip(x).enumerate() {
        let y = (v - p.offset) * p.s;
        let f = y.floor();
        let frac = y - f;
        let u = uniform(st.k1, st.k2, st.lo.wrapping_add(i as u32));
        let r = if u < frac { f + 1.0 } else { f };
        *o = r.max(p.qmin).min(p.qmax) as i8 as u8;
    }
}

/// See [`super::Dispatch::dequant`].
pub(crate) fn dequant(q: &[u8], scale: f32, offset: f32, out: &mut [f32]) {
    for (o, &v) in out.iter_mut().zip(q) {
        *o = f32::from(v as i8) * scale + offset;
    }
}

/// See [`super::Dispatch::dequant_add`].
pub(crate) fn dequant_add(q: &[u8], scale: f32, offset: f32, acc: &mut [f32]) {
    for (o, &v) in acc.iter_mut().zip(q) {
        *o += f32::from(v as i8) * scale + offset;
    }
}

/// [`dequant`] (`ADD` false) or [`dequant_add`] (`ADD` true): the remainder
/// of every vector kernel's `dequant_into`.
pub(crate) fn dequant_into<const ADD: bool>(q: &[u8], scale: f32, offset: f32, dst: &mut [f32]) {
    if ADD {
        dequant_add(q, scale, offset, dst);
    } else {
        dequant(q, scale, offset, dst);
    }
}

/// See [`super::Dispatch::pack4`].
pub(crate) fn pack4(q: &[u8], out: &mut [u8]) {
    for (d, p) in out.iter_mut().zip(q.chunks_exact(2)) {
        *d = (p[0] << 4) | (p[1] & 0x0F);
    }
}

/// See [`super::Dispatch::unpack4`].
pub(crate) fn unpack4(data: &[u8], out: &mut [u8]) {
    for (o, &b) in out.chunks_exact_mut(2).zip(data) {
        o[0] = ((b as i8) >> 4) as u8;
        o[1] = (((b << 4) as i8) >> 4) as u8;
    }
}

/// Flips the sign of `x[k]` where bit `k` of `signs` (bit `k % 32` of word
/// `k / 32`) is set: an exact operation (the sign bit alone changes).
pub(crate) fn flip_signs(x: &mut [f32], signs: &[u32]) {
    for (k, v) in x.iter_mut().enumerate() {
        let bit = (signs.get(k / 32).copied().unwrap_or(0) >> (k % 32)) & 1;
        *v = f32::from_bits(v.to_bits() ^ (bit << 31));
    }
}

/// See [`super::Dispatch::fwht`]: the randomized Walsh–Hadamard transform of
/// one group of a power-of-two length. Forward: flip the signs, butterfly
/// stages `h = 1, 2, 4, …, n/2` (`(a, b) → (a + b, a − b)`), multiply by
/// `scale`. Inverse: the stages, the scale, then the flip.
pub(crate) fn fwht(x: &mut [f32], signs: &[u32], scale: f32, inverse: bool) {
    if !inverse {
        flip_signs(x, signs);
    }
    let n = x.len();
    let mut h = 1;
    while h < n {
        for block in x.chunks_exact_mut(2 * h) {
            let (lo, hi) = block.split_at_mut(h);
            for (a, b) in lo.iter_mut().zip(hi.iter_mut()) {
                let (x0, x1) = (*a, *b);
                *a = x0 + x1;
                *b = x0 - x1;
            }
        }
        h *= 2;
    }
    for v in x.iter_mut() {
        *v *= scale;
    }
    if inverse {
        flip_signs(x, signs);
    }
}

/// See [`super::Dispatch::hash_words`].
pub(crate) fn hash_words(k1: u32, k2: u32, lo: u32, out: &mut [u32]) {
    for (i, o) in out.iter_mut().enumerate() {
        *o = rng::hash32(k1, k2, lo.wrapping_add(i as u32));
    }
}

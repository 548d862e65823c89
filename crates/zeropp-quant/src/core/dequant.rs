//! The dequantizing drivers: INT4 unpacking, dequantize-write and
//! dequantize-accumulate over a range of groups, converted outputs through an
//! f32 tile, and the rayon split of an output slice.

use super::{CHUNK, QBLK, TILE};
use crate::element::Element;
use crate::quantized::QuantizedRef;
use crate::simd::Dispatch;
use crate::spec::Bits;

/// Unpacks INT4 elements `start..start + out.len()` into sign-extended bytes.
fn unpack4(d: Dispatch, data: &[u8], start: usize, out: &mut [u8]) {
    let mut out = out;
    let mut e = start;
    if e % 2 == 1 {
        let Some((first, rest)) = out.split_first_mut() else {
            return;
        };
        *first = (((data[e / 2] << 4) as i8) >> 4) as u8;
        out = rest;
        e += 1;
    }
    let pairs = out.len() / 2;
    d.unpack4(&data[e / 2..e / 2 + pairs], &mut out[..2 * pairs]);
    if out.len() % 2 == 1 {
        let b = data[e / 2 + pairs];
        out[out.len() - 1] = ((b as i8) >> 4) as u8;
    }
}

/// Dequantize-write or dequantize-accumulate.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Mode {
    Write,
    Add,
}

/// Dequantizes elements `start..start + out.len()` of `q` into `out`.
pub(crate) fn dequant_range(
    d: Dispatch,
    q: QuantizedRef<'_>,
    start: usize,
    out: &mut [f32],
    mode: Mode,
    scratch: &mut [u8; QBLK],
) {
    let spec = q.spec();
    let gs = spec.group_size();
    let data = q.data();
    let end = start + out.len();
    let mut pos = start;
    while pos < end {
        let g = pos / gs;
        let ge = (g * gs).saturating_add(gs).min(end);
        let scale = q.scale_unchecked(g);
        let offset = q.offset_unchecked(g);
        let mut a = pos;
        while a < ge {
            let (b, qs): (usize, &[u8]) = match spec.bits() {
                Bits::Int4 => {
                    let b = (a + QBLK).min(ge);
                    unpack4(d, data, a, &mut scratch[..b - a]);
                    (b, &scratch[..b - a])
                }
                Bits::Int8 => (ge, &data[a..ge]),
            };
            let o = &mut out[a - start..b - start];
            match mode {
                Mode::Write => d.dequant(qs, scale, offset, o),
                Mode::Add => d.dequant_add(qs, scale, offset, o),
            }
            a = b;
        }
        pos = ge;
    }
}

/// Runs `f(base, chunk)` over `out` split into pieces (in parallel when `par`).
pub(crate) fn par_slices<T, F>(out: &mut [T], base: usize, par: bool, f: &F)
where
    T: Send,
    F: Fn(usize, &mut [T]) + Sync,
{
    if !par || out.len() < 2 * CHUNK {
        f(base, out);
        return;
    }
    let mid = (out.len() / 2) & !63;
    let (a, b) = out.split_at_mut(mid);
    rayon::join(|| par_slices(a, base, true, f), || par_slices(b, base + mid, true, f));
}

/// Dequantizes `q[base..base + out.len()]` into `out` of any element type.
pub(crate) fn dequant_chunk<T: Element>(
    d: Dispatch,
    q: QuantizedRef<'_>,
    base: usize,
    out: &mut [T],
    mode: Mode,
) {
    let mut scratch = [0u8; QBLK];
    if let Some(o) = T::as_f32_mut(out) {
        dequant_range(d, q, base, o, mode, &mut scratch);
        return;
    }
    let mut tile = [0f32; TILE];
    for (k, sub) in out.chunks_mut(TILE).enumerate() {
        let t = &mut tile[..sub.len()];
        dequant_range(d, q, base + k * TILE, t, Mode::Write, &mut scratch);
        T::from_f32_slice(t, sub);
    }
}

//! Quantizing one shard for the wire: rotated first with the Hadamard option,
//! and through the hop-1 error-feedback residual when there is one.

use zeropp_quant::hadamard::quantize_hadamard_to_wire;
use zeropp_quant::{Hadamard, Options, QuantSpec, QuantizedRef, dequantize_into, quantize_to_wire};

use super::PartSource;
use crate::CommError;
use crate::collectives::qgz::feedback::{Residual, ResidualMut};

/// How one part is encoded: its spec, its kernel options, and (with the
/// Hadamard rotation) the rotation and the part's stream position.
pub(super) struct Encode<'a> {
    pub(super) spec: QuantSpec,
    pub(super) opts: &'a Options,
    pub(super) rot: Option<(Hadamard, u64)>,
}

/// Quantizes `x` into `out` (rotated first when `enc.rot` says so); with a
/// residual `res` (same length as `x`), quantizes `c = x' + res` instead, `x'`
/// the (rotated) input, and updates `res ← β·res + (1 − β)·(c − deq)` (in f32,
/// stored in the residual's precision).
pub(super) fn encode_with_feedback(
    x: &[f32],
    enc: Encode<'_>,
    out: &mut [u8],
    feedback: Option<(ResidualMut<'_>, f32)>,
) -> Result<(), CommError> {
    let Encode { spec, opts, rot } = enc;
    match (feedback, rot) {
        (None, None) => {
            quantize_to_wire(x, spec, opts, out)?;
        }
        (None, Some((h, at))) => {
            quantize_hadamard_to_wire(x, spec, &h, at, opts, out)?;
        }
        (Some((mut res, beta)), rot) => {
            if res.len() != x.len() {
                return Err(CommError::Mismatch(format!(
                    "qgz: error-feedback residual of {} elements for {} gradient elements",
                    res.len(),
                    x.len()
                )));
            }
            let mut comp = x.to_vec();
            if let Some((h, at)) = rot {
                h.forward(&mut comp, at, opts)?;
            }
            comp.iter_mut().enumerate().for_each(|(i, c)| *c += res.get(i));
            quantize_to_wire(&comp, spec, opts, out)?;
            let mut deq = vec![0.0f32; comp.len()];
            dequantize_into(&QuantizedRef::from_bytes(out)?, &mut deq, opts)?;
            for (i, (c, d)) in comp.iter().zip(&deq).enumerate() {
                res.set(i, beta * res.get(i) + (1.0 - beta) * (c - d));
            }
        }
    }
    Ok(())
}

/// Encodes shard `part` of `grad` (padded to `s`) into `out`, with the hop-1
/// residual of that shard when there is one.
pub(super) fn encode_part(
    grad: &dyn PartSource,
    s: usize,
    part: usize,
    enc: Encode<'_>,
    out: &mut [u8],
    residual: Option<&mut Residual>,
    beta: f32,
) -> Result<(), CommError> {
    let mut res = match residual {
        Some(r) => Some((r.slice_mut(part * s..(part + 1) * s).ok_or_else(|| residual_oob(part, s))?, beta)),
        None => None,
    };
    let mut enc = Some(enc);
    grad.with_part(part, s, &mut |x| match enc.take() {
        Some(e) => encode_with_feedback(x, e, out, res.take()),
        None => Err(CommError::Mismatch("qgz: a gradient source handed out one shard twice".into())),
    })
}

/// The error for a residual without shard `part` of `s` elements.
pub(super) fn residual_oob(part: usize, s: usize) -> CommError {
    CommError::Mismatch(format!("qgz: error-feedback residual has no shard {part} of {s} elements"))
}

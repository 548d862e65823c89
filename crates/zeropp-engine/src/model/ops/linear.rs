//! Linear layers, with the weight stored `[in, out]` (`y = x W + b`) or
//! `[out, in]` (PyTorch's `nn.Linear` layout, `y = x Wᵀ + b`): one body per
//! direction for both layouts ([`linear_with`], [`linear_backward_with`]), and
//! the `[in, out]` shorthands the blocks use.

use super::{check_len, col_sum};
use crate::EngineError;
use crate::model::gemm::{Trans, matmul};

/// `y (rows x dout) = x (rows x din) W (din x dout) + b`.
pub fn linear_forward(
    x: &[f32],
    w: &[f32],
    b: &[f32],
    rows: usize,
    din: usize,
    dout: usize,
    y: &mut [f32],
) -> Result<(), EngineError> {
    linear_with(WeightLayout::InOut, x, w, b, [rows, din, dout], y)
}

/// Backward of [`linear_forward`]: overwrites `dw = x^T dy`, `db = colsum(dy)`
/// and, when given, `dx = dy W^T`.
#[allow(clippy::too_many_arguments)]
pub fn linear_backward(
    x: &[f32],
    w: &[f32],
    dy: &[f32],
    rows: usize,
    din: usize,
    dout: usize,
    dw: &mut [f32],
    db: &mut [f32],
    dx: Option<&mut [f32]>,
) -> Result<(), EngineError> {
    linear_backward_with(WeightLayout::InOut, x, w, dy, [rows, din, dout], dw, db, dx)
}

/// How a linear layer's weight is stored, row-major.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WeightLayout {
    /// `[din, dout]`: `y = x W + b` (the blocks' linears).
    InOut,
    /// `[dout, din]`, PyTorch's `nn.Linear` layout: `y = x Wᵀ + b`. Each
    /// output's weights are contiguous, so a quantization group of the flat
    /// weight never spans two outputs when `din` is a multiple of the group
    /// (the GPT's LM head keeps a token's weights together this way).
    OutIn,
}

/// `y (rows x dout) = x (rows x din) W + b` with `W` stored as `layout` says;
/// `[rows, din, dout]` are the shapes.
pub fn linear_with(
    layout: WeightLayout,
    x: &[f32],
    w: &[f32],
    b: &[f32],
    [rows, din, dout]: [usize; 3],
    y: &mut [f32],
) -> Result<(), EngineError> {
    check_len("linear x", x.len(), rows * din)?;
    check_len("linear weight", w.len(), din * dout)?;
    check_len("linear bias", b.len(), dout)?;
    check_len("linear y", y.len(), rows * dout)?;
    for row in y.chunks_exact_mut(dout.max(1)) {
        row.copy_from_slice(b);
    }
    let tw = if layout == WeightLayout::InOut { Trans::No } else { Trans::Yes };
    matmul(Trans::No, tw, rows, din, dout, x, w, 1.0, y)
}

/// Backward of [`linear_with`] with the same layout: overwrites `dw` (stored
/// as `W` is), `db = colsum(dy)` and, when given, `dx`.
#[allow(clippy::too_many_arguments)]
pub fn linear_backward_with(
    layout: WeightLayout,
    x: &[f32],
    w: &[f32],
    dy: &[f32],
    [rows, din, dout]: [usize; 3],
    dw: &mut [f32],
    db: &mut [f32],
    dx: Option<&mut [f32]>,
) -> Result<(), EngineError> {
    check_len("linear x", x.len(), rows * din)?;
    check_len("linear weight", w.len(), din * dout)?;
    check_len("linear dy", dy.len(), rows * dout)?;
    check_len("linear dw", dw.len(), din * dout)?;
    match layout {
        WeightLayout::InOut => matmul(Trans::Yes, Trans::No, din, rows, dout, x, dy, 0.0, dw)?, // xᵀ dy
        WeightLayout::OutIn => matmul(Trans::Yes, Trans::No, dout, rows, din, dy, x, 0.0, dw)?, // dyᵀ x
    }
    col_sum(dy, rows, dout, db)?;
    if let Some(dx) = dx {
        check_len("linear dx", dx.len(), rows * din)?;
        // dx = dy Wᵀ for [din, dout], dy W for [dout, din].
        let tw = if layout == WeightLayout::InOut { Trans::Yes } else { Trans::No };
        matmul(Trans::No, tw, rows, dout, din, dy, w, 0.0, dx)?;
    }
    Ok(())
}

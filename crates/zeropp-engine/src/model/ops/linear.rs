//! Linear layers, with the weight stored `[in, out]` (`y = x W + b`) or
//! `[out, in]` (PyTorch's `nn.Linear` layout, `y = x Wᵀ + b`), forward and
//! backward over one shared body per direction.

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
    linear_fwd(Trans::No, x, w, b, [rows, din, dout], y)
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
    linear_bwd(Trans::No, x, w, dy, [rows, din, dout], dw, db, dx)
}

/// `y (rows x dout) = x (rows x din) Wᵀ + b`, with `W` stored `[dout, din]`
/// row-major: each output's weights are contiguous, so a quantization group of
/// the flat weight never spans two outputs when `din` is a multiple of the
/// group (the GPT's LM head keeps a token's weights together this way).
pub fn linear_out_in_forward(
    x: &[f32],
    w: &[f32],
    b: &[f32],
    rows: usize,
    din: usize,
    dout: usize,
    y: &mut [f32],
) -> Result<(), EngineError> {
    linear_fwd(Trans::Yes, x, w, b, [rows, din, dout], y)
}

/// Backward of [`linear_out_in_forward`]: overwrites `dw = dyᵀ x` (`[dout,
/// din]`), `db = colsum(dy)` and, when given, `dx = dy W`.
#[allow(clippy::too_many_arguments)]
pub fn linear_out_in_backward(
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
    linear_bwd(Trans::Yes, x, w, dy, [rows, din, dout], dw, db, dx)
}

/// The linear layer with the weight stored `[din, dout]` (`out_in ==
/// Trans::No`) or `[dout, din]` (`Trans::Yes`).
fn linear_fwd(
    out_in: Trans,
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
    matmul(Trans::No, out_in, rows, din, dout, x, w, 1.0, y)
}

/// Backward of [`linear_fwd`] with the same layout.
#[allow(clippy::too_many_arguments)]
fn linear_bwd(
    out_in: Trans,
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
    match out_in {
        Trans::No => matmul(Trans::Yes, Trans::No, din, rows, dout, x, dy, 0.0, dw)?,
        Trans::Yes => matmul(Trans::Yes, Trans::No, dout, rows, din, dy, x, 0.0, dw)?,
    }
    col_sum(dy, rows, dout, db)?;
    if let Some(dx) = dx {
        check_len("linear dx", dx.len(), rows * din)?;
        // dx = dy Wᵀ for [din, dout], dy W for [dout, din].
        let tw = if out_in == Trans::No { Trans::Yes } else { Trans::No };
        matmul(Trans::No, tw, rows, dout, din, dy, w, 0.0, dx)?;
    }
    Ok(())
}

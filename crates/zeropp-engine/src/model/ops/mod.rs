//! Forward/backward kernels shared by the models: linear layers, LayerNorm,
//! GELU (tanh approximation), causal multi-head attention and softmax
//! cross-entropy.
//!
//! Layout conventions: activations are row-major `rows x features`; a linear
//! weight is stored `[in, out]` row-major so that `y = x W + b`
//! ([`linear_forward`]), or as [`WeightLayout`] says ([`linear_with`]).
//!
//! Determinism: every parallel loop writes disjoint outputs, and every
//! reduction over rows (bias, LayerNorm and loss sums) runs sequentially in
//! row order, so results do not depend on the number of rayon threads.

use rayon::prelude::*;

use super::gemm::{MatView, sgemm_strided};
use crate::EngineError;

mod linear;

pub use linear::{WeightLayout, linear_backward, linear_backward_with, linear_forward, linear_with};

/// Minimum rows per rayon task for row-wise kernels (keeps tasks worth their overhead).
const ROW_MIN: usize = 32;
/// `sqrt(2 / pi)`, the GELU tanh-approximation constant.
const GELU_C: f32 = 0.797_884_6;
/// The cubic coefficient of the GELU tanh approximation.
const GELU_A: f32 = 0.044_715;
/// LayerNorm epsilon.
pub const LN_EPS: f32 = 1e-5;

fn check_len(what: &'static str, got: usize, expected: usize) -> Result<(), EngineError> {
    if got == expected { Ok(()) } else { Err(EngineError::LengthMismatch { what, expected, got }) }
}

/// `out[c] = sum over rows r of m[r, c]`, summed in row order.
pub fn col_sum(m: &[f32], rows: usize, cols: usize, out: &mut [f32]) -> Result<(), EngineError> {
    check_len("col_sum input", m.len(), rows * cols)?;
    check_len("col_sum output", out.len(), cols)?;
    out.fill(0.0);
    for row in m.chunks_exact(cols.max(1)).take(rows) {
        for (o, &v) in out.iter_mut().zip(row) {
            *o += v;
        }
    }
    Ok(())
}

/// LayerNorm over the last dimension: `y = xhat * g + b`, with
/// `xhat = (x - mean) * rstd`, `rstd = 1 / sqrt(var + eps)` (biased variance).
/// Saves `xhat` and `rstd` for the backward pass.
#[allow(clippy::too_many_arguments)]
pub fn layernorm_forward(
    x: &[f32],
    g: &[f32],
    b: &[f32],
    rows: usize,
    d: usize,
    y: &mut [f32],
    xhat: &mut [f32],
    rstd: &mut [f32],
) -> Result<(), EngineError> {
    check_len("layernorm x", x.len(), rows * d)?;
    check_len("layernorm gamma", g.len(), d)?;
    check_len("layernorm beta", b.len(), d)?;
    check_len("layernorm y", y.len(), rows * d)?;
    check_len("layernorm xhat", xhat.len(), rows * d)?;
    check_len("layernorm rstd", rstd.len(), rows)?;
    if d == 0 {
        return Ok(());
    }
    let inv_d = 1.0 / d as f32;
    y.par_chunks_mut(d)
        .zip(xhat.par_chunks_mut(d))
        .zip(rstd.par_iter_mut())
        .zip(x.par_chunks(d))
        .with_min_len(ROW_MIN)
        .for_each(|(((y, xh), rs), x)| {
            let mean = x.iter().sum::<f32>() * inv_d;
            let var = x.iter().map(|&v| (v - mean) * (v - mean)).sum::<f32>() * inv_d;
            let r = 1.0 / (var + LN_EPS).sqrt();
            *rs = r;
            for ((((yv, xv), &xi), &gi), &bi) in y.iter_mut().zip(xh.iter_mut()).zip(x).zip(g).zip(b) {
                *xv = (xi - mean) * r;
                *yv = *xv * gi + bi;
            }
        });
    Ok(())
}

/// Backward of [`layernorm_forward`]: overwrites `dg`, `db` and ADDS the
/// input gradient into `dx` (residual streams accumulate).
#[allow(clippy::too_many_arguments)]
pub fn layernorm_backward(
    dy: &[f32],
    xhat: &[f32],
    rstd: &[f32],
    g: &[f32],
    rows: usize,
    d: usize,
    dx: &mut [f32],
    dg: &mut [f32],
    db: &mut [f32],
) -> Result<(), EngineError> {
    check_len("layernorm dy", dy.len(), rows * d)?;
    check_len("layernorm xhat", xhat.len(), rows * d)?;
    check_len("layernorm rstd", rstd.len(), rows)?;
    check_len("layernorm gamma", g.len(), d)?;
    check_len("layernorm dx", dx.len(), rows * d)?;
    check_len("layernorm dgamma", dg.len(), d)?;
    check_len("layernorm dbeta", db.len(), d)?;
    dg.fill(0.0);
    db.fill(0.0);
    if d == 0 {
        return Ok(());
    }
    // Parameter gradients: sequential sums in row order (deterministic).
    for (dyr, xr) in dy.chunks_exact(d).zip(xhat.chunks_exact(d)) {
        for (((dgj, dbj), &dyv), &xv) in dg.iter_mut().zip(db.iter_mut()).zip(dyr).zip(xr) {
            *dgj += dyv * xv;
            *dbj += dyv;
        }
    }
    let inv_d = 1.0 / d as f32;
    dx.par_chunks_mut(d)
        .zip(dy.par_chunks(d))
        .zip(xhat.par_chunks(d))
        .zip(rstd.par_iter())
        .with_min_len(ROW_MIN)
        .for_each(|(((dx, dy), xh), &r)| {
            let mut mean_dxh = 0.0_f32;
            let mut mean_dxh_x = 0.0_f32;
            for ((&dyv, &gv), &xv) in dy.iter().zip(g).zip(xh) {
                let dxh = dyv * gv;
                mean_dxh += dxh;
                mean_dxh_x += dxh * xv;
            }
            mean_dxh *= inv_d;
            mean_dxh_x *= inv_d;
            for (((dxv, &dyv), &gv), &xv) in dx.iter_mut().zip(dy).zip(g).zip(xh) {
                *dxv += r * (dyv * gv - mean_dxh - xv * mean_dxh_x);
            }
        });
    Ok(())
}

/// `e^x` in f32 without a libm call, so loops over slices vectorise: `x`
/// clamped to `[-87, 88]` (the normal range of the result), `x = n·ln 2 + r`
/// with `n` the nearest integer (the `1.5·2^23` rounding trick) and `r` from a
/// two-part `ln 2` (exact for the `n` here), `e^r` from its degree-6 Taylor
/// polynomial (`|r| <= ln 2 / 2`: truncation below `2^-24`), and `2^n` built in
/// the exponent bits. Relative error within 3e-7 of `f64::exp` on the range
/// (test `exp_fast_is_within_3e_7_of_f64`).
#[inline]
pub(crate) fn exp_fast(x: f32) -> f32 {
    const LN2_HI: f32 = 0.693_359_4; // 355/512: n·LN2_HI is exact for |n| < 2^15
    const LN2_LO: f32 = -2.121_944_4e-4; // ln 2 - LN2_HI
    const MAGIC: f32 = 12_582_912.0; // 1.5·2^23: x + MAGIC rounds x to an integer
    let x = x.clamp(-87.0, 88.0);
    let t = x * std::f32::consts::LOG2_E + MAGIC;
    let n = t - MAGIC;
    let r = (x - n * LN2_HI) - n * LN2_LO;
    let p = 1.0
        + r * (1.0 + r * (0.5 + r * (1.0 / 6.0 + r * (1.0 / 24.0 + r * (1.0 / 120.0 + r * (1.0 / 720.0))))));
    // t's bits are MAGIC's plus n (|n| < 2^22 keeps t in MAGIC's binade).
    let k = t.to_bits().wrapping_sub(MAGIC.to_bits()) as i32;
    p * f32::from_bits(((k + 127) as u32) << 23)
}

/// `v[i] <- e^(v[i] - shift)` ([`exp_fast`]) over a slice, in one vectorisable loop.
fn exp_shifted(v: &mut [f32], shift: f32) {
    for x in v.iter_mut() {
        *x = exp_fast(*x - shift);
    }
}

/// `tanh` through one `exp` (`(1 - e) / (1 + e)`, `e = exp(-2|z|)`): about
/// 3x faster than libm's `tanhf`, absolute error a few ulp of 1.
#[inline]
fn tanh_fast(z: f32) -> f32 {
    let e = exp_fast(-2.0 * z.abs());
    ((1.0 - e) / (1.0 + e)).copysign(z)
}

/// GELU, tanh approximation: `0.5 u (1 + tanh(sqrt(2/pi) (u + 0.044715 u^3)))`.
#[inline]
pub fn gelu(u: f32) -> f32 {
    0.5 * u * (1.0 + tanh_fast(GELU_C * (u + GELU_A * u * u * u)))
}

/// Derivative of [`gelu`].
#[inline]
pub fn gelu_grad(u: f32) -> f32 {
    let t = tanh_fast(GELU_C * (u + GELU_A * u * u * u));
    0.5 * (1.0 + t) + 0.5 * u * (1.0 - t * t) * GELU_C * (1.0 + 3.0 * GELU_A * u * u)
}

/// `a = gelu(u)` elementwise.
pub fn gelu_forward(u: &[f32], a: &mut [f32]) -> Result<(), EngineError> {
    check_len("gelu output", a.len(), u.len())?;
    a.par_chunks_mut(4096).zip(u.par_chunks(4096)).for_each(|(a, u)| {
        for (av, &uv) in a.iter_mut().zip(u) {
            *av = gelu(uv);
        }
    });
    Ok(())
}

/// In place: `da <- da * gelu'(u)`.
pub fn gelu_backward(u: &[f32], da: &mut [f32]) -> Result<(), EngineError> {
    check_len("gelu grad", da.len(), u.len())?;
    da.par_chunks_mut(4096).zip(u.par_chunks(4096)).for_each(|(da, u)| {
        for (dv, &uv) in da.iter_mut().zip(u) {
            *dv *= gelu_grad(uv);
        }
    });
    Ok(())
}

/// Softmax cross-entropy: turns `logits` (rows x vocab) into probabilities in
/// place and returns the mean of `-ln p[target]` over the rows (accumulated
/// in f64, in row order).
pub fn softmax_xent_forward(logits: &mut [f32], targets: &[u32], vocab: usize) -> Result<f64, EngineError> {
    let rows = targets.len();
    check_len("softmax logits", logits.len(), rows * vocab)?;
    if rows == 0 || vocab == 0 {
        return Ok(0.0);
    }
    let mut row_loss = vec![0.0_f64; rows];
    logits
        .par_chunks_mut(vocab)
        .zip(targets.par_iter())
        .zip(row_loss.par_iter_mut())
        .with_min_len(ROW_MIN)
        .for_each(|((row, &t), loss)| {
            let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            exp_shifted(row, max);
            let sum: f64 = row.iter().map(|&v| f64::from(v)).sum();
            let t = t as usize;
            let pt = row.get(t).copied().unwrap_or(0.0);
            // -ln p_t = -(l_t - max) + ln(sum) with l_t - max = ln(e_t).
            *loss = sum.ln() - f64::from(pt).ln();
            let inv = (1.0 / sum) as f32;
            for v in row.iter_mut() {
                *v *= inv;
            }
        });
    let total: f64 = row_loss.iter().sum();
    Ok(total / rows as f64)
}

/// Backward of [`softmax_xent_forward`] for the MEAN loss: in place,
/// `probs <- (probs - onehot(target)) / rows`.
pub fn softmax_xent_backward(probs: &mut [f32], targets: &[u32], vocab: usize) -> Result<(), EngineError> {
    let rows = targets.len();
    check_len("softmax probs", probs.len(), rows * vocab)?;
    if rows == 0 || vocab == 0 {
        return Ok(());
    }
    let scale = 1.0 / rows as f32;
    probs.par_chunks_mut(vocab).zip(targets.par_iter()).with_min_len(ROW_MIN).for_each(|(row, &t)| {
        if let Some(p) = row.get_mut(t as usize) {
            *p -= 1.0;
        }
        for v in row.iter_mut() {
            *v *= scale;
        }
    });
    Ok(())
}

/// Shapes of a causal multi-head attention call.
#[derive(Debug, Clone, Copy)]
pub struct AttnShape {
    /// Sequences.
    pub batch: usize,
    /// Positions per sequence.
    pub seq: usize,
    /// Heads.
    pub heads: usize,
    /// Width of one head.
    pub head_dim: usize,
}

impl AttnShape {
    fn d(&self) -> usize {
        self.heads * self.head_dim
    }
    fn rows(&self) -> usize {
        self.batch * self.seq
    }
}

/// Causal multi-head self-attention forward.
///
/// `qkv` is `rows x 3d` with each row `[q | k | v]` and head `h` in columns
/// `h*hd..(h+1)*hd` of each part. Writes the softmax probabilities to
/// `probs` (`batch x heads x seq x seq`, zero above the diagonal) and the
/// concatenated head outputs to `out` (`rows x d`). Parallel over
/// `batch x heads`; each task writes only its own outputs.
pub fn attention_forward(
    qkv: &[f32],
    s: AttnShape,
    probs: &mut [f32],
    out: &mut [f32],
) -> Result<(), EngineError> {
    let (t, hd, d) = (s.seq, s.head_dim, s.d());
    check_len("attention qkv", qkv.len(), s.rows() * 3 * d)?;
    check_len("attention probs", probs.len(), s.batch * s.heads * t * t)?;
    check_len("attention out", out.len(), s.rows() * d)?;
    if s.rows() == 0 || d == 0 {
        return Ok(());
    }
    let scale = 1.0 / (hd as f32).sqrt();
    let mut head_out = vec![0.0_f32; s.batch * s.heads * t * hd];
    probs.par_chunks_mut(t * t).zip(head_out.par_chunks_mut(t * hd)).enumerate().try_for_each(
        |(bh, (p, o))| -> Result<(), EngineError> {
            let base = (bh / s.heads) * t * 3 * d + (bh % s.heads) * hd;
            let q = MatView { data: &qkv[base..], rs: 3 * d, cs: 1 };
            let k_t = MatView { data: &qkv[base + d..], rs: 1, cs: 3 * d };
            sgemm_strided(t, hd, t, scale, q, k_t, 0.0, p, t, 1)?;
            for (i, row) in p.chunks_exact_mut(t).enumerate() {
                let (live, masked) = row.split_at_mut(i + 1);
                masked.fill(0.0);
                let max = live.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                exp_shifted(live, max);
                let sum: f32 = live.iter().sum();
                let inv = 1.0 / sum;
                for v in live.iter_mut() {
                    *v *= inv;
                }
            }
            let pv = MatView { data: p, rs: t, cs: 1 };
            let v = MatView { data: &qkv[base + 2 * d..], rs: 3 * d, cs: 1 };
            sgemm_strided(t, t, hd, 1.0, pv, v, 0.0, o, hd, 1)
        },
    )?;
    // Scatter head-major outputs into rows x d.
    out.par_chunks_mut(d).enumerate().with_min_len(ROW_MIN).for_each(|(r, row)| {
        let (b, ti) = (r / t, r % t);
        for (h, dst) in row.chunks_exact_mut(hd).enumerate() {
            let src = ((b * s.heads + h) * t + ti) * hd;
            dst.copy_from_slice(&head_out[src..src + hd]);
        }
    });
    Ok(())
}

/// Backward of [`attention_forward`]: from `dout` (`rows x d`) and the saved
/// `qkv` and `probs`, OVERWRITES `dqkv` (`rows x 3d`).
pub fn attention_backward(
    qkv: &[f32],
    probs: &[f32],
    dout: &[f32],
    s: AttnShape,
    dqkv: &mut [f32],
) -> Result<(), EngineError> {
    let (t, hd, d) = (s.seq, s.head_dim, s.d());
    check_len("attention qkv", qkv.len(), s.rows() * 3 * d)?;
    check_len("attention probs", probs.len(), s.batch * s.heads * t * t)?;
    check_len("attention dout", dout.len(), s.rows() * d)?;
    check_len("attention dqkv", dqkv.len(), s.rows() * 3 * d)?;
    if s.rows() == 0 || d == 0 {
        return Ok(());
    }
    let scale = 1.0 / (hd as f32).sqrt();
    // Per (b, h): [dQ | dK | dV], each t x hd.
    let mut head_grads = vec![0.0_f32; s.batch * s.heads * 3 * t * hd];
    head_grads.par_chunks_mut(3 * t * hd).enumerate().try_for_each(|(bh, g)| -> Result<(), EngineError> {
        let (b, h) = (bh / s.heads, bh % s.heads);
        let base = b * t * 3 * d + h * hd;
        let (dq, rest) = g.split_at_mut(t * hd);
        let (dk, dv) = rest.split_at_mut(t * hd);
        let p = &probs[bh * t * t..(bh + 1) * t * t];
        let d_o = MatView { data: &dout[b * t * d + h * hd..], rs: d, cs: 1 };
        // dV = P^T dO
        let p_t = MatView { data: p, rs: 1, cs: t };
        sgemm_strided(t, t, hd, 1.0, p_t, d_o, 0.0, dv, hd, 1)?;
        // dP = dO V^T
        let mut ds = vec![0.0_f32; t * t];
        let v_t = MatView { data: &qkv[base + 2 * d..], rs: 1, cs: 3 * d };
        sgemm_strided(t, hd, t, 1.0, d_o, v_t, 0.0, &mut ds, t, 1)?;
        // dS = P * (dP - rowsum(P * dP)) * scale, causal rows only.
        for (i, (dsr, pr)) in ds.chunks_exact_mut(t).zip(p.chunks_exact(t)).enumerate() {
            let (live, masked) = dsr.split_at_mut(i + 1);
            let dot: f32 = live.iter().zip(pr).map(|(&a, &b)| a * b).sum();
            for (v, &pv) in live.iter_mut().zip(pr) {
                *v = pv * (*v - dot) * scale;
            }
            masked.fill(0.0);
        }
        let ds_v = MatView { data: &ds, rs: t, cs: 1 };
        let k = MatView { data: &qkv[base + d..], rs: 3 * d, cs: 1 };
        // dQ = dS K
        sgemm_strided(t, t, hd, 1.0, ds_v, k, 0.0, dq, hd, 1)?;
        // dK = dS^T Q
        let ds_t = MatView { data: &ds, rs: 1, cs: t };
        let q = MatView { data: &qkv[base..], rs: 3 * d, cs: 1 };
        sgemm_strided(t, t, hd, 1.0, ds_t, q, 0.0, dk, hd, 1)
    })?;
    dqkv.par_chunks_mut(3 * d).enumerate().with_min_len(ROW_MIN).for_each(|(r, row)| {
        let (b, ti) = (r / t, r % t);
        for part in 0..3 {
            for h in 0..s.heads {
                let src = ((b * s.heads + h) * 3 + part) * t * hd + ti * hd;
                let dst = part * d + h * hd;
                row[dst..dst + hd].copy_from_slice(&head_grads[src..src + hd]);
            }
        }
    });
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::exp_fast;

    /// `exp_fast` against `f64::exp` over its range, at a dense grid and at the
    /// rounding trick's edges (half-integers of `x·log2 e`): within 3e-7 relative.
    /// (Dropping the polynomial's last term gives 3.3e-6 here.)
    #[test]
    fn exp_fast_is_within_3e_7_of_f64() {
        let mut worst = 0.0f64;
        // (`i * 1e-3` rounds just past the ends at ±87/88; those points are clamped.)
        let grid = (-87_000..=88_000).map(|i| i as f32 * 1e-3).filter(|x| (-87.0..=88.0).contains(x));
        let edges = (-125..=126).map(|k| (k as f32 + 0.5) * std::f32::consts::LN_2);
        for x in grid.chain(edges) {
            let want = f64::from(x).exp();
            let got = f64::from(exp_fast(x));
            worst = worst.max(((got - want) / want).abs());
        }
        assert!(worst < 3e-7, "worst relative error {worst:e}");
        // Clamped outside the normal range, never inf or NaN from overflow.
        assert!(exp_fast(-200.0) > 0.0 && exp_fast(-200.0) < 1e-37);
        assert!(exp_fast(200.0).is_finite());
    }
}

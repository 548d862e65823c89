//! candle-nn's fused ops, with a backward pass.
//!
//! candle-nn's fused kernels (`ops::softmax_last_dim`, `ops::rms_norm`,
//! `ops::layer_norm`, `rotary_emb::rope`, `rope_i`, `rope_thd`) record no
//! backward graph, so a weight behind one of them gets no gradient. The
//! functions here take the same arguments and give the same values, computed
//! by candle-nn's own kernel, and add the closed-form gradient:
//!
//! | op | gradient |
//! |----|----------|
//! | `softmax_last_dim(x)` = y | dx = y ⊙ (g − Σ g⊙y) |
//! | `rms_norm(x, α)`, x̂ = x·r, r = 1/√(mean x² + ε) | dx = r·(gα − x̂·mean(gα⊙x̂)), dα = Σ g⊙x̂ |
//! | `layer_norm(x, α, β)`, x̂ = (x − μ)·r | dx = r·(gα − mean gα − x̂·mean(gα⊙x̂)), dα = Σ g⊙x̂, dβ = Σ g |
//! | `rope*(x, cos, sin)` (a rotation per pair) | dx = rope*(g, cos, −sin) (its transpose) |
//!
//! (Σ and mean run over the last dimension for dx, over every other one for
//! dα and dβ.) [`causal_attention`] is a whole causal attention (scores,
//! mask, softmax, values) in one op each way. [`softmax_causal`] adds the scale and the causal mask of
//! attention scores to the softmax, in one pass, with its own kernels. RoPE's `cos` and `sin` are tables, not weights: they get no
//! gradient. The gradient is computed in f32 for bf16 and f16 inputs, as the
//! kernels compute their forward.
//!
//! Where no input is tracked (a forward with no `Var` on the path) the result
//! is candle-nn's own, untouched; otherwise the op copies it once into a
//! tracked tensor.
//!
//! [`crate::nn`] has candle-nn's `LayerNorm` and `RmsNorm` modules on these
//! ops, drop-in replacements. candle offers no way to
//! swap the kernels under unchanged `candle_nn::*` calls (its fused ops call
//! `apply_op*_no_bwd` on private types), so a model switches by importing
//! these instead; the build-time gradient check
//! ([`CandleModelBuilder::build`](crate::CandleModelBuilder::build)) names
//! every parameter a candle-nn fused op still cuts off.
//!
//! ```
//! use candle_core::{Device, Tensor, Var};
//! let x = Var::from_tensor(&Tensor::new(&[[1f32, 2.0, 3.0]], &Device::Cpu)?)?;
//! let y = zeropp_candle::ops::softmax_last_dim(x.as_tensor())?;
//! let g = (y.narrow(1, 0, 1)?.sum_all()?).backward()?;
//! let dx = g.get(x.as_tensor()).expect("softmax_last_dim has a backward").to_vec2::<f32>()?;
//! let p: Vec<f32> = y.to_vec2::<f32>()?.remove(0);
//! // d y0 / d x = y0 (e0 - y)
//! assert!((dx[0][0] - p[0] * (1.0 - p[0])).abs() < 1e-6);
//! assert!((dx[0][1] + p[0] * p[1]).abs() < 1e-6);
//! # Ok::<(), candle_core::Error>(())
//! ```

use std::sync::{Mutex, PoisonError};

use candle_core::{CpuStorage, D, DType, Layout, Shape, Tensor};

mod attention;
mod attention_kernel;
mod kernels;

pub use attention::{causal_attention, causal_attention_composite};
pub use kernels::{silu_mul, softmax_causal};

type CResult<T> = candle_core::Result<T>;

/// Which fused op a [`Fused`] stands for.
#[derive(Debug, Clone, Copy)]
enum Kind {
    Softmax,
    RmsNorm { eps: f32 },
    LayerNorm { eps: f32 },
    Rope(Rope),
}

/// The three RoPE layouts of candle-nn's `rotary_emb`.
#[derive(Debug, Clone, Copy)]
enum Rope {
    /// `rope`: halves of the head are the pairs, `[b, h, t, d]`.
    Half,
    /// `rope_i`: interleaved pairs, `[b, h, t, d]`.
    Interleaved,
    /// `rope_thd`: halves, `[b, t, h, d]`.
    Thd,
}

impl Rope {
    fn apply(self, x: &Tensor, cos: &Tensor, sin: &Tensor) -> CResult<Tensor> {
        match self {
            Rope::Half => candle_nn::rotary_emb::rope(x, cos, sin),
            Rope::Interleaved => candle_nn::rotary_emb::rope_i(x, cos, sin),
            Rope::Thd => candle_nn::rotary_emb::rope_thd(x, cos, sin),
        }
    }
}

/// A candle-nn result, computed ahead, handed to autograd with its gradient.
struct Fused {
    kind: Kind,
    /// candle-nn's output; taken (copied into the op's result) by the forward.
    out: Mutex<Option<Tensor>>,
}

impl Fused {
    fn new(kind: Kind, out: &Tensor) -> Self {
        Self { kind, out: Mutex::new(Some(out.clone())) }
    }

    /// The precomputed output as fresh CPU storage.
    fn storage(&self, shape: &Shape) -> CResult<(CpuStorage, Shape)> {
        let out = self
            .out
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take()
            .ok_or_else(|| candle_core::Error::Msg("zeropp fused op: forward run twice".into()))?;
        if out.shape() != shape {
            candle_core::bail!("zeropp fused op: output {:?} for input {:?}", out.shape(), shape);
        }
        let flat = out.flatten_all()?;
        let storage = match flat.dtype() {
            DType::F32 => CpuStorage::F32(flat.to_vec1()?),
            DType::F64 => CpuStorage::F64(flat.to_vec1()?),
            DType::BF16 => CpuStorage::BF16(flat.to_vec1()?),
            DType::F16 => CpuStorage::F16(flat.to_vec1()?),
            d => candle_core::bail!("zeropp fused op: dtype {d:?} is not a float"),
        };
        Ok((storage, out.shape().clone()))
    }
}

/// The dtype a gradient is computed in: f32 for the half types.
fn work(x: &Tensor) -> CResult<Tensor> {
    match x.dtype() {
        DType::BF16 | DType::F16 => x.to_dtype(DType::F32),
        _ => Ok(x.clone()),
    }
}

/// `t` summed over every dimension but the last, as a `[d]` tensor in `like`'s dtype.
fn sum_rows(t: &Tensor, like: &Tensor) -> CResult<Tensor> {
    let d = t.dim(D::Minus1)?;
    t.reshape(((), d))?.sum(0)?.to_dtype(like.dtype())
}

/// The normalised input `x̂` and `r = 1/√(var + ε)` (`[.., 1]`), in the work dtype.
fn normalised(x: &Tensor, eps: f32, centre: bool) -> CResult<(Tensor, Tensor)> {
    let x = work(x)?;
    let x = if centre { x.broadcast_sub(&x.mean_keepdim(D::Minus1)?)? } else { x };
    let r = (x.sqr()?.mean_keepdim(D::Minus1)? + f64::from(eps))?.sqrt()?.recip()?;
    Ok((x.broadcast_mul(&r)?, r))
}

/// dx and dα of a normalisation with `x̂`, `r`, weight `alpha` and output gradient `g`.
fn norm_backward(
    x: &Tensor,
    alpha: &Tensor,
    g: &Tensor,
    eps: f32,
    centre: bool,
) -> CResult<(Tensor, Tensor, Tensor)> {
    let (xhat, r) = normalised(x, eps, centre)?;
    let g = work(g)?;
    let ga = g.broadcast_mul(&work(alpha)?)?;
    let mut inner = ga.broadcast_sub(&xhat.broadcast_mul(&(&ga * &xhat)?.mean_keepdim(D::Minus1)?)?)?;
    if centre {
        inner = inner.broadcast_sub(&ga.mean_keepdim(D::Minus1)?)?;
    }
    let dx = inner.broadcast_mul(&r)?.to_dtype(x.dtype())?;
    let dalpha = sum_rows(&(&g * &xhat)?, alpha)?;
    Ok((dx, dalpha, g))
}

impl candle_core::CustomOp1 for Fused {
    fn name(&self) -> &'static str {
        "zeropp-softmax-last-dim"
    }

    fn cpu_fwd(&self, _: &CpuStorage, layout: &Layout) -> CResult<(CpuStorage, Shape)> {
        self.storage(layout.shape())
    }

    fn bwd(&self, _x: &Tensor, y: &Tensor, g: &Tensor) -> CResult<Option<Tensor>> {
        let (y32, g32) = (work(y)?, work(g)?);
        let gy = (&g32 * &y32)?;
        let dx = gy.broadcast_sub(&y32.broadcast_mul(&gy.sum_keepdim(D::Minus1)?)?)?;
        Ok(Some(dx.to_dtype(y.dtype())?))
    }
}

impl candle_core::CustomOp2 for Fused {
    fn name(&self) -> &'static str {
        "zeropp-rms-norm"
    }

    fn cpu_fwd(
        &self,
        _: &CpuStorage,
        l1: &Layout,
        _: &CpuStorage,
        _: &Layout,
    ) -> CResult<(CpuStorage, Shape)> {
        self.storage(l1.shape())
    }

    fn bwd(
        &self,
        x: &Tensor,
        alpha: &Tensor,
        _y: &Tensor,
        g: &Tensor,
    ) -> CResult<(Option<Tensor>, Option<Tensor>)> {
        let Kind::RmsNorm { eps } = self.kind else {
            candle_core::bail!("zeropp fused op: {:?} is not a two-input op", self.kind)
        };
        let (dx, dalpha, _) = norm_backward(x, alpha, g, eps, false)?;
        Ok((Some(dx), Some(dalpha)))
    }
}

impl candle_core::CustomOp3 for Fused {
    fn name(&self) -> &'static str {
        match self.kind {
            Kind::Rope(_) => "zeropp-rope",
            _ => "zeropp-layer-norm",
        }
    }

    fn cpu_fwd(
        &self,
        _: &CpuStorage,
        l1: &Layout,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
    ) -> CResult<(CpuStorage, Shape)> {
        self.storage(l1.shape())
    }

    fn bwd(
        &self,
        a1: &Tensor,
        a2: &Tensor,
        a3: &Tensor,
        _y: &Tensor,
        g: &Tensor,
    ) -> CResult<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        match self.kind {
            Kind::LayerNorm { eps } => {
                let (dx, dalpha, g32) = norm_backward(a1, a2, g, eps, true)?;
                Ok((Some(dx), Some(dalpha), Some(sum_rows(&g32, a3)?)))
            }
            // A rotation's transpose is the rotation by the opposite angle.
            Kind::Rope(r) => Ok((Some(r.apply(&g.contiguous()?, a2, &a3.neg()?)?), None, None)),
            _ => candle_core::bail!("zeropp fused op: {:?} is not a three-input op", self.kind),
        }
    }
}

/// candle-nn's `ops::softmax_last_dim`, with a backward pass (any layout).
pub fn softmax_last_dim(x: &Tensor) -> CResult<Tensor> {
    let x = x.contiguous()?;
    let y = candle_nn::ops::softmax_last_dim(&x)?;
    if !x.track_op() {
        return Ok(y);
    }
    x.apply_op1(Fused::new(Kind::Softmax, &y))
}

/// candle-nn's `ops::rms_norm`, `x / √(mean(x²) + eps) · alpha` over the last
/// dimension, with a backward pass for `x` and `alpha` (any layout).
pub fn rms_norm(x: &Tensor, alpha: &Tensor, eps: f32) -> CResult<Tensor> {
    let x = x.contiguous()?;
    let y = if x.dtype() == DType::F64 {
        // candle-nn's kernel has no f64: the formula in tensor ops (the build's
        // gradient check runs stages in f64).
        let xd = x.detach();
        let r = (xd.sqr()?.mean_keepdim(D::Minus1)? + f64::from(eps))?.sqrt()?.recip()?;
        xd.broadcast_mul(&r)?.broadcast_mul(&alpha.detach())?
    } else {
        candle_nn::ops::rms_norm(&x, alpha, eps)?
    };
    if !x.track_op() && !alpha.track_op() {
        return Ok(y);
    }
    x.apply_op2(alpha, Fused::new(Kind::RmsNorm { eps }, &y))
}

/// candle-nn's `ops::layer_norm`, `(x − mean) / √(var + eps) · alpha + beta`
/// over the last dimension, with a backward pass for all three (any layout).
pub fn layer_norm(x: &Tensor, alpha: &Tensor, beta: &Tensor, eps: f32) -> CResult<Tensor> {
    let x = x.contiguous()?;
    let y = if x.dtype() == DType::F64 {
        // As in `rms_norm`: no f64 kernel in candle-nn.
        let xd = x.detach();
        let c = xd.broadcast_sub(&xd.mean_keepdim(D::Minus1)?)?;
        let r = (c.sqr()?.mean_keepdim(D::Minus1)? + f64::from(eps))?.sqrt()?.recip()?;
        c.broadcast_mul(&r)?.broadcast_mul(&alpha.detach())?.broadcast_add(&beta.detach())?
    } else {
        candle_nn::ops::layer_norm(&x, alpha, beta, eps)?
    };
    if !x.track_op() && !alpha.track_op() && !beta.track_op() {
        return Ok(y);
    }
    x.apply_op3(alpha, beta, Fused::new(Kind::LayerNorm { eps }, &y))
}

fn rope_with(r: Rope, x: &Tensor, cos: &Tensor, sin: &Tensor) -> CResult<Tensor> {
    let (x, cos, sin) = (x.contiguous()?, cos.contiguous()?, sin.contiguous()?);
    let y = r.apply(&x, &cos, &sin)?;
    if !x.track_op() {
        return Ok(y);
    }
    x.apply_op3(&cos, &sin, Fused::new(Kind::Rope(r), &y))
}

/// candle-nn's `rotary_emb::rope` ("rotate half", `x` `[b, h, t, d]`), with a
/// backward pass for `x` (any layout).
pub fn rope(x: &Tensor, cos: &Tensor, sin: &Tensor) -> CResult<Tensor> {
    rope_with(Rope::Half, x, cos, sin)
}

/// candle-nn's `rotary_emb::rope_i` (interleaved pairs, `x` `[b, h, t, d]`),
/// with a backward pass for `x` (any layout).
pub fn rope_i(x: &Tensor, cos: &Tensor, sin: &Tensor) -> CResult<Tensor> {
    rope_with(Rope::Interleaved, x, cos, sin)
}

/// candle-nn's `rotary_emb::rope_thd` ("rotate half", `x` `[b, t, h, d]`),
/// with a backward pass for `x` (any layout).
pub fn rope_thd(x: &Tensor, cos: &Tensor, sin: &Tensor) -> CResult<Tensor> {
    rope_with(Rope::Thd, x, cos, sin)
}

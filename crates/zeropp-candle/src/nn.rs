//! candle-nn's normalisation modules with a backward pass: [`layer_norm`] and
//! [`rms_norm`] build them exactly as `candle_nn::layer_norm` and
//! `candle_nn::rms_norm` do (names, init hints, configuration), so switching
//! is one import. candle-nn's own `LayerNorm` runs the fused kernel without a
//! backward pass when it has a bias (and `RmsNorm` on contiguous input); these
//! run [`crate::ops`]' kernels, which have one.
//!
//! ```
//! use candle_core::{DType, Device, Module, Tensor};
//! use candle_nn::{VarBuilder, VarMap};
//! let map = VarMap::new();
//! let vb = VarBuilder::from_varmap(&map, DType::F32, &Device::Cpu);
//! let ln = zeropp_candle::nn::layer_norm(4, 1e-5, vb.pp("ln"))?;
//! let x = Tensor::new(&[[1f32, 2.0, 3.0, 6.0]], &Device::Cpu)?;
//! let grads = ln.forward(&x)?.sqr()?.sum_all()?.backward()?;
//! // Both the weight and the bias are reached (candle-nn's own would give neither).
//! assert_eq!(map.all_vars().iter().filter(|v| grads.get(v.as_tensor()).is_some()).count(), 2);
//! # Ok::<(), candle_core::Error>(())
//! ```

use candle_core::{Module, Tensor};

use crate::ops;

type CResult<T> = candle_core::Result<T>;

/// candle-nn's `LayerNorm` (with or without a bias) and RMSNorm, on this
/// module's ops: every configuration has a backward pass.
#[derive(Debug, Clone)]
pub struct LayerNorm {
    inner: candle_nn::LayerNorm,
}

impl LayerNorm {
    /// Wraps a candle-nn `LayerNorm` (its weight, bias, eps and mean removal).
    pub fn new(inner: candle_nn::LayerNorm) -> Self {
        Self { inner }
    }

    /// The wrapped candle-nn module.
    pub fn inner(&self) -> &candle_nn::LayerNorm {
        &self.inner
    }
}

impl Module for LayerNorm {
    fn forward(&self, x: &Tensor) -> CResult<Tensor> {
        let (w, eps) = (self.inner.weight(), self.inner.eps() as f32);
        if !self.inner.remove_mean() {
            let y = ops::rms_norm(x, w, eps)?;
            return match self.inner.bias() {
                Some(b) => y.broadcast_add(b),
                None => Ok(y),
            };
        }
        match self.inner.bias() {
            Some(b) => ops::layer_norm(x, w, b, eps),
            None => ops::layer_norm(x, w, &w.zeros_like()?.detach(), eps),
        }
    }
}

/// candle-nn's `layer_norm(size, config, vb)` (same names, hints and
/// configuration: `weight`/`gamma`, `bias`/`beta`, `affine`, `remove_mean`) as
/// a [`LayerNorm`] with a backward pass.
pub fn layer_norm<C: Into<candle_nn::LayerNormConfig>>(
    size: usize,
    config: C,
    vb: candle_nn::VarBuilder<'_>,
) -> CResult<LayerNorm> {
    Ok(LayerNorm::new(candle_nn::layer_norm(size, config, vb)?))
}

/// candle-nn's `RmsNorm` with a backward pass.
#[derive(Debug, Clone)]
pub struct RmsNorm(LayerNorm);

impl RmsNorm {
    /// An RMSNorm of weight `weight` and epsilon `eps`.
    pub fn new(weight: Tensor, eps: f64) -> Self {
        Self(LayerNorm::new(candle_nn::LayerNorm::rms_norm(weight, eps)))
    }
}

impl Module for RmsNorm {
    fn forward(&self, x: &Tensor) -> CResult<Tensor> {
        self.0.forward(x)
    }
}

/// candle-nn's `rms_norm(size, eps, vb)` (weight `weight`, init 1) as an
/// [`RmsNorm`] with a backward pass.
pub fn rms_norm(size: usize, eps: f64, vb: candle_nn::VarBuilder<'_>) -> CResult<RmsNorm> {
    Ok(RmsNorm(LayerNorm::new(candle_nn::rms_norm(size, eps, vb)?.into_inner())))
}

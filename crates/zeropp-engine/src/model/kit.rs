//! Helpers for writing a [`Model`](super::Model): what the built-in GPT and
//! MLP use, public so a model of your own does not re-implement them.
//!
//! - [`validate_batch`]: a micro-batch's shape and token ids against the
//!   model's vocabulary and maximum sequence length (call it in `start`);
//! - [`split_params`] / [`split_params_mut`]: a layer's flat buffer as one
//!   slice per [`TensorSpec`](super::TensorSpec);
//! - [`fill_normal`]: a deterministic `N(0, std²)` init keyed by
//!   `(seed, layer, param)`, the same on every rank (call it in `init_layer`);
//! - [`CallOrder`]: the `start → forward(0..L) → loss → backward(L-1..=0)`
//!   protocol, checked (or [`check_forward_order`] / [`check_backward_order`]
//!   on counters of your own).
//!
//! See the example implementation on [`Model`](super::Model).

use super::{Batch, LayerSpec, rng};
use crate::EngineError;

/// Checks a batch's shape and token ids against a model's vocabulary and maximum sequence length.
pub fn validate_batch(batch: &Batch, vocab: usize, max_seq: usize) -> Result<(), EngineError> {
    if batch.batch == 0 || batch.seq_len == 0 {
        return Err(EngineError::InvalidBatch(format!(
            "batch {} x seq_len {} is empty",
            batch.batch, batch.seq_len
        )));
    }
    if batch.seq_len > max_seq {
        return Err(EngineError::InvalidBatch(format!(
            "seq_len {} exceeds the model's maximum {max_seq}",
            batch.seq_len
        )));
    }
    batch.check_lengths()?;
    if let Some(&token) = batch.inputs.iter().chain(&batch.targets).find(|&&t| t as usize >= vocab) {
        return Err(EngineError::TokenOutOfRange { token, vocab });
    }
    Ok(())
}

/// Splits a layer's flat buffer into one slice per parameter, checking the total length.
pub fn split_params<'a>(spec: &LayerSpec, flat: &'a [f32]) -> Result<Vec<&'a [f32]>, EngineError> {
    check_layer_len(spec, flat.len(), "layer parameters")?;
    let mut off = 0;
    Ok(spec
        .params
        .iter()
        .map(|p| {
            let part = &flat[off..off + p.numel()];
            off += p.numel();
            part
        })
        .collect())
}

/// The error of a flat buffer (`what`) of `got` values for a layer of another size.
fn check_layer_len(spec: &LayerSpec, got: usize, what: &'static str) -> Result<(), EngineError> {
    if got != spec.numel() {
        return Err(EngineError::LengthMismatch { what, expected: spec.numel(), got });
    }
    Ok(())
}

/// Mutable version of [`split_params`].
pub fn split_params_mut<'a>(
    spec: &LayerSpec,
    flat: &'a mut [f32],
) -> Result<Vec<&'a mut [f32]>, EngineError> {
    check_layer_len(spec, flat.len(), "layer gradient")?;
    let mut rest = flat;
    let mut out = Vec::with_capacity(spec.params.len());
    for p in &spec.params {
        let (head, tail) = rest.split_at_mut(p.numel());
        out.push(head);
        rest = tail;
    }
    Ok(out)
}

/// Fills `out` with `N(0, std^2)` samples from a stream keyed by (seed, layer, param).
pub fn fill_normal(out: &mut [f32], std: f64, seed: u64, layer: usize, param: usize) {
    let mut rng = rng::SplitMix64::from_keys(&[seed, 0x1417, layer as u64, param as u64]);
    for v in out {
        *v = (rng.normal() * std) as f32;
    }
}

/// Checks the call order of a forward: `layer` must be the next one.
pub fn check_forward_order(layer: usize, next_fwd: usize, layers: usize) -> Result<(), EngineError> {
    if layer >= layers {
        return Err(EngineError::LayerOutOfRange { layer, layers });
    }
    if layer != next_fwd {
        return Err(EngineError::CallOrder(format!("forward({layer}) called, expected forward({next_fwd})")));
    }
    Ok(())
}

/// Checks the call order of a backward: all forwards done, `layer` is the next in reverse order.
pub fn check_backward_order(
    layer: usize,
    next_fwd: usize,
    remaining_bwd: usize,
    layers: usize,
) -> Result<(), EngineError> {
    if layer >= layers {
        return Err(EngineError::LayerOutOfRange { layer, layers });
    }
    if next_fwd != layers {
        return Err(EngineError::CallOrder(format!(
            "backward({layer}) called after only {next_fwd} of {layers} forwards"
        )));
    }
    if remaining_bwd == 0 || layer != remaining_bwd - 1 {
        return Err(EngineError::CallOrder(format!(
            "backward({layer}) called, expected {}",
            if remaining_bwd == 0 {
                "no more backward calls".to_string()
            } else {
                format!("backward({})", remaining_bwd - 1)
            }
        )));
    }
    Ok(())
}

/// The call protocol of one micro-batch, checked: keep one in the model's tape
/// (from `start`), call [`CallOrder::forward`] at the top of `forward` and
/// [`CallOrder::backward`] at the top of `backward`; out-of-order calls are
/// [`EngineError::CallOrder`] (or [`EngineError::LayerOutOfRange`]).
///
/// ```
/// use zeropp_engine::model::kit::CallOrder;
/// let mut order = CallOrder::new(2);
/// assert!(order.backward(1).is_err()); // forward first
/// order.forward(0)?;
/// assert!(order.forward(0).is_err()); // layer 1 is next
/// order.forward(1)?;
/// assert!(order.finished_forward());
/// order.backward(1)?;
/// order.backward(0)?;
/// assert!(order.backward(0).is_err()); // nothing left
/// # Ok::<(), zeropp_engine::EngineError>(())
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CallOrder {
    layers: usize,
    next_fwd: usize,
    remaining_bwd: usize,
}

impl CallOrder {
    /// A fresh micro-batch of a model of `layers` layers.
    pub fn new(layers: usize) -> Self {
        Self { layers, next_fwd: 0, remaining_bwd: layers }
    }

    /// Checks that `forward(layer)` is the next call, and records it.
    pub fn forward(&mut self, layer: usize) -> Result<(), EngineError> {
        check_forward_order(layer, self.next_fwd, self.layers)?;
        self.next_fwd += 1;
        Ok(())
    }

    /// Checks that `backward(layer)` is the next call, and records it.
    pub fn backward(&mut self, layer: usize) -> Result<(), EngineError> {
        check_backward_order(layer, self.next_fwd, self.remaining_bwd, self.layers)?;
        self.remaining_bwd -= 1;
        Ok(())
    }

    /// Whether every forward has run (the loss is defined).
    pub fn finished_forward(&self) -> bool {
        self.next_fwd == self.layers
    }
}

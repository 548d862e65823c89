//! What [`Gpt`](super::Gpt) and [`Mlp`](super::Mlp) share: a stack of gather
//! units (embedding, hidden layers, head), the part of the tape every such
//! model keeps, and the forward/backward call scaffolding around a layer.

use super::{
    Batch, LayerSpec, check_backward_order, check_forward_order, split_params, split_params_mut,
    validate_batch,
};
use crate::EngineError;

/// Where a layer sits in the stack.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Part {
    /// Layer 0, the embedding.
    Embed,
    /// A layer between the embedding and the head.
    Hidden,
    /// The last layer, the head and the loss.
    Head,
}

impl Part {
    fn of(layer: usize, layers: usize) -> Self {
        if layer == 0 {
            Part::Embed
        } else if layer + 1 == layers {
            Part::Head
        } else {
            Part::Hidden
        }
    }
}

/// The tape fields every stacked model keeps: the micro-batch, the loss, the
/// gradient flowing back through the stack and the call-order counters.
#[derive(Debug)]
pub(crate) struct TapeCore {
    pub(crate) batch: usize,
    pub(crate) seq: usize,
    pub(crate) inputs: Vec<u32>,
    pub(crate) targets: Vec<u32>,
    pub(crate) loss: f32,
    /// Gradient of the loss w.r.t. the output of the layer whose backward is next.
    pub(crate) dx: Vec<f32>,
    next_fwd: usize,
    remaining_bwd: usize,
}

impl TapeCore {
    /// A fresh tape core for `batch` (validated against `vocab` and `max_seq`)
    /// on a stack of `layers` layers.
    pub(crate) fn start(
        batch: &Batch,
        vocab: usize,
        max_seq: usize,
        layers: usize,
    ) -> Result<Self, EngineError> {
        validate_batch(batch, vocab, max_seq)?;
        Ok(Self {
            batch: batch.batch,
            seq: batch.seq_len,
            inputs: batch.inputs.clone(),
            targets: batch.targets.clone(),
            loss: f32::NAN,
            dx: Vec::new(),
            next_fwd: 0,
            remaining_bwd: layers,
        })
    }

    /// The loss once all `layers` forwards ran, else NaN.
    pub(crate) fn loss(&self, layers: usize) -> f32 {
        if self.next_fwd == layers { self.loss } else { f32::NAN }
    }
}

/// A model's tape that holds a [`TapeCore`].
pub(crate) trait StackTape {
    /// The shared part.
    fn core(&mut self) -> &mut TapeCore;
}

/// Forward of `layer`: checks the call order, splits `params` by tensor and
/// runs `f(part, spec, params, tape)`.
pub(crate) fn forward_layer<T: StackTape>(
    layers: &[LayerSpec],
    layer: usize,
    params: &[f32],
    tape: &mut T,
    f: impl FnOnce(Part, &LayerSpec, &[&[f32]], &mut T) -> Result<(), EngineError>,
) -> Result<(), EngineError> {
    check_forward_order(layer, tape.core().next_fwd, layers.len())?;
    let spec = &layers[layer];
    let p = split_params(spec, params)?;
    f(Part::of(layer, layers.len()), spec, &p, tape)?;
    tape.core().next_fwd += 1;
    Ok(())
}

/// Backward of `layer`: checks the call order, splits `params` and `grad` by
/// tensor and runs `f(part, spec, params, grads, tape)`.
pub(crate) fn backward_layer<T: StackTape>(
    layers: &[LayerSpec],
    layer: usize,
    params: &[f32],
    tape: &mut T,
    grad: &mut [f32],
    f: impl FnOnce(Part, &LayerSpec, &[&[f32]], &mut [&mut [f32]], &mut T) -> Result<(), EngineError>,
) -> Result<(), EngineError> {
    let core = tape.core();
    check_backward_order(layer, core.next_fwd, core.remaining_bwd, layers.len())?;
    let spec = &layers[layer];
    let p = split_params(spec, params)?;
    let mut g = split_params_mut(spec, grad)?;
    f(Part::of(layer, layers.len()), spec, &p, &mut g, tape)?;
    tape.core().remaining_bwd -= 1;
    Ok(())
}

/// Checks a model config's sizes: `vocab` and every one of `sizes` must be
/// positive (the error names the first that is not), and `vocab` must fit token
/// ids (`u32`).
pub(crate) fn check_sizes(model: &str, vocab: usize, sizes: &[(&str, usize)]) -> Result<(), EngineError> {
    let zero = std::iter::once(("vocab", vocab)).chain(sizes.iter().copied()).find(|&(_, v)| v == 0);
    if let Some((name, _)) = zero {
        return Err(EngineError::InvalidConfig(format!("{model}: {name} must be > 0")));
    }
    match u32::try_from(vocab) {
        Ok(_) => Ok(()),
        Err(_) => {
            Err(EngineError::InvalidConfig(format!("{model}: vocab {vocab} does not fit token ids (u32)")))
        }
    }
}

/// Layer `layer`'s spec and `out` split by tensor, for `init_layer`.
pub(crate) fn init_parts<'a>(
    layers: &'a [LayerSpec],
    layer: usize,
    out: &'a mut [f32],
) -> Result<(&'a LayerSpec, Vec<&'a mut [f32]>), EngineError> {
    let spec = layers.get(layer).ok_or(EngineError::LayerOutOfRange { layer, layers: layers.len() })?;
    Ok((spec, split_params_mut(spec, out)?))
}

/// The [`Model`](super::Model) items a stacked model derives from its
/// `cfg.vocab`, `cfg.seq_len`, `layers` and its tape's `core`.
macro_rules! stack_model_items {
    ($name:literal) => {
        fn name(&self) -> &str {
            $name
        }

        fn vocab_size(&self) -> usize {
            self.cfg.vocab
        }

        fn seq_len(&self) -> usize {
            self.cfg.seq_len
        }

        fn layers(&self) -> &[LayerSpec] {
            &self.layers
        }

        fn loss(&self, tape: &Self::Tape) -> f32 {
            tape.core.loss(self.layers.len())
        }
    };
}
pub(crate) use stack_model_items;

//! [`BuiltIn`]: the built-in models as one [`Model`] type, so a run of either
//! goes through the same [`launch`](crate::launch) call.

use super::{Batch, Gpt, GptTape, LayerSpec, Mlp, MlpTape, Model};
use crate::EngineError;

/// A built-in model: the character GPT or the context-window MLP.
///
/// ```
/// use zeropp_engine::model::{BuiltIn, Model};
/// use zeropp_engine::{Gpt, GptConfig};
/// let m = BuiltIn::Gpt(Gpt::new(GptConfig::tiny().with_vocab(16))?);
/// assert_eq!(m.vocab_size(), 16);
/// # Ok::<(), zeropp_engine::EngineError>(())
/// ```
#[derive(Debug)]
pub enum BuiltIn {
    /// The character GPT.
    Gpt(Gpt),
    /// The context-window MLP language model.
    Mlp(Mlp),
}

/// The tape of a [`BuiltIn`]: its model's own.
#[derive(Debug)]
pub enum BuiltInTape {
    /// A [`Gpt`]'s tape.
    Gpt(GptTape),
    /// An [`Mlp`]'s tape.
    Mlp(MlpTape),
}

/// The error of a tape handed to the other model.
fn foreign_tape() -> EngineError {
    EngineError::InvalidConfig("a tape of one built-in model was given to the other".into())
}

impl Model for BuiltIn {
    type Tape = BuiltInTape;

    fn name(&self) -> &str {
        match self {
            Self::Gpt(m) => m.name(),
            Self::Mlp(m) => m.name(),
        }
    }

    fn vocab_size(&self) -> usize {
        match self {
            Self::Gpt(m) => m.vocab_size(),
            Self::Mlp(m) => m.vocab_size(),
        }
    }

    fn seq_len(&self) -> usize {
        match self {
            Self::Gpt(m) => m.seq_len(),
            Self::Mlp(m) => m.seq_len(),
        }
    }

    fn layers(&self) -> &[LayerSpec] {
        match self {
            Self::Gpt(m) => m.layers(),
            Self::Mlp(m) => m.layers(),
        }
    }

    fn init_layer(&self, layer: usize, seed: u64, out: &mut [f32]) -> Result<(), EngineError> {
        match self {
            Self::Gpt(m) => m.init_layer(layer, seed, out),
            Self::Mlp(m) => m.init_layer(layer, seed, out),
        }
    }

    fn start(&self, batch: &Batch) -> Result<BuiltInTape, EngineError> {
        match self {
            Self::Gpt(m) => m.start(batch).map(BuiltInTape::Gpt),
            Self::Mlp(m) => m.start(batch).map(BuiltInTape::Mlp),
        }
    }

    fn forward(&self, layer: usize, params: &[f32], tape: &mut BuiltInTape) -> Result<(), EngineError> {
        match (self, tape) {
            (Self::Gpt(m), BuiltInTape::Gpt(t)) => m.forward(layer, params, t),
            (Self::Mlp(m), BuiltInTape::Mlp(t)) => m.forward(layer, params, t),
            _ => Err(foreign_tape()),
        }
    }

    fn loss(&self, tape: &BuiltInTape) -> f32 {
        match (self, tape) {
            (Self::Gpt(m), BuiltInTape::Gpt(t)) => m.loss(t),
            (Self::Mlp(m), BuiltInTape::Mlp(t)) => m.loss(t),
            _ => f32::NAN,
        }
    }

    fn backward(
        &self,
        layer: usize,
        params: &[f32],
        tape: &mut BuiltInTape,
        grad: &mut [f32],
    ) -> Result<(), EngineError> {
        match (self, tape) {
            (Self::Gpt(m), BuiltInTape::Gpt(t)) => m.backward(layer, params, t, grad),
            (Self::Mlp(m), BuiltInTape::Mlp(t)) => m.backward(layer, params, t, grad),
            _ => Err(foreign_tape()),
        }
    }

    fn activation_bytes(&self, batch: usize, seq: usize) -> usize {
        match self {
            Self::Gpt(m) => m.activation_bytes(batch, seq),
            Self::Mlp(m) => m.activation_bytes(batch, seq),
        }
    }
}

//! [`BuiltIn`]: the built-in models as one [`Model`] type, so a run of either
//! goes through the same [`launch`](crate::launch()) call.

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

/// `$call` on the model inside `$model` (a [`BuiltIn`]), bound to `$m`.
macro_rules! on_model {
    ($model:expr, $m:ident => $call:expr) => {
        match $model {
            BuiltIn::Gpt($m) => $call,
            BuiltIn::Mlp($m) => $call,
        }
    };
}

/// `$call` on the model and its own tape, bound to `$m` and `$t`; `$foreign`
/// when the tape is the other model's.
macro_rules! on_model_tape {
    ($model:expr, $tape:expr, $m:ident, $t:ident => $call:expr, else $foreign:expr) => {
        match ($model, $tape) {
            (BuiltIn::Gpt($m), BuiltInTape::Gpt($t)) => $call,
            (BuiltIn::Mlp($m), BuiltInTape::Mlp($t)) => $call,
            _ => $foreign,
        }
    };
}

impl Model for BuiltIn {
    type Tape = BuiltInTape;

    fn name(&self) -> &str {
        on_model!(self, m => m.name())
    }

    fn vocab_size(&self) -> usize {
        on_model!(self, m => m.vocab_size())
    }

    fn seq_len(&self) -> usize {
        on_model!(self, m => m.seq_len())
    }

    fn layers(&self) -> &[LayerSpec] {
        on_model!(self, m => m.layers())
    }

    fn init_layer(&self, layer: usize, seed: u64, out: &mut [f32]) -> Result<(), EngineError> {
        on_model!(self, m => m.init_layer(layer, seed, out))
    }

    fn start(&self, batch: &Batch) -> Result<BuiltInTape, EngineError> {
        match self {
            Self::Gpt(m) => m.start(batch).map(BuiltInTape::Gpt),
            Self::Mlp(m) => m.start(batch).map(BuiltInTape::Mlp),
        }
    }

    fn start_eval(&self, batch: &Batch) -> Result<BuiltInTape, EngineError> {
        match self {
            Self::Gpt(m) => m.start_eval(batch).map(BuiltInTape::Gpt),
            Self::Mlp(m) => m.start_eval(batch).map(BuiltInTape::Mlp),
        }
    }

    fn start_train(&self, batch: &Batch, step: u64, micro: usize) -> Result<BuiltInTape, EngineError> {
        match self {
            Self::Gpt(m) => m.start_train(batch, step, micro).map(BuiltInTape::Gpt),
            Self::Mlp(m) => m.start_train(batch, step, micro).map(BuiltInTape::Mlp),
        }
    }

    fn forward(&self, layer: usize, params: &[f32], tape: &mut BuiltInTape) -> Result<(), EngineError> {
        on_model_tape!(self, tape, m, t => m.forward(layer, params, t), else Err(foreign_tape()))
    }

    fn loss(&self, tape: &BuiltInTape) -> f32 {
        on_model_tape!(self, tape, m, t => m.loss(t), else f32::NAN)
    }

    fn backward(
        &self,
        layer: usize,
        p: &[f32],
        tape: &mut BuiltInTape,
        g: &mut [f32],
    ) -> Result<(), EngineError> {
        on_model_tape!(self, tape, m, t => m.backward(layer, p, t, g), else Err(foreign_tape()))
    }

    fn activation_bytes(&self, batch: usize, seq: usize) -> usize {
        on_model!(self, m => m.activation_bytes(batch, seq))
    }
}

//! [`Either`]: one of two models as one [`Model`] type, chosen at run time, so
//! a run of either goes through the same [`launch`](crate::launch()) call
//! (zeropp-run's built-in models are `Either`s: the GPT or the MLP, or those or
//! the candle Llama).

use super::{Batch, LayerSpec, Model};
use crate::EngineError;

/// One of two models (or, as [`Model::Tape`], one of their two tapes). Every
/// call goes to the model inside.
///
/// ```
/// use zeropp_engine::model::{Either, Model};
/// use zeropp_engine::{Gpt, GptConfig, Mlp, MlpConfig};
/// let pick_gpt = true;
/// let m: Either<Gpt, Mlp> = if pick_gpt {
///     Either::Left(Gpt::new(GptConfig::tiny().with_vocab(16))?)
/// } else {
///     Either::Right(Mlp::new(MlpConfig::tiny().with_vocab(16))?)
/// };
/// assert_eq!(m.vocab_size(), 16);
/// # Ok::<(), zeropp_engine::EngineError>(())
/// ```
#[derive(Debug, Clone, PartialEq)]
pub enum Either<A, B> {
    /// The first kind.
    Left(A),
    /// The second kind.
    Right(B),
}

/// The error of a tape handed to the other kind of model.
fn foreign_tape() -> EngineError {
    EngineError::InvalidConfig("a tape of one kind of model was given to the other".into())
}

/// `$call` on the model inside `$model`, bound to `$m`.
macro_rules! on_model {
    ($model:expr, $m:ident => $call:expr) => {
        match $model {
            Either::Left($m) => $call,
            Either::Right($m) => $call,
        }
    };
}

/// `$call` on the model and its own tape, bound to `$m` and `$t`; `$foreign`
/// when the tape is the other kind's.
macro_rules! on_model_tape {
    ($model:expr, $tape:expr, $m:ident, $t:ident => $call:expr, else $foreign:expr) => {
        match ($model, $tape) {
            (Either::Left($m), Either::Left($t)) => $call,
            (Either::Right($m), Either::Right($t)) => $call,
            _ => $foreign,
        }
    };
}

/// `$call` (a `start*` call of the model bound to `$m`), its tape wrapped.
macro_rules! on_model_start {
    ($model:expr, $m:ident => $call:expr) => {
        match $model {
            Either::Left($m) => $call.map(Either::Left),
            Either::Right($m) => $call.map(Either::Right),
        }
    };
}

impl<A: Model, B: Model> Model for Either<A, B> {
    type Tape = Either<A::Tape, B::Tape>;

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

    fn start(&self, batch: &Batch) -> Result<Self::Tape, EngineError> {
        on_model_start!(self, m => m.start(batch))
    }

    fn start_eval(&self, batch: &Batch) -> Result<Self::Tape, EngineError> {
        on_model_start!(self, m => m.start_eval(batch))
    }

    fn start_train(&self, batch: &Batch, step: u64, micro: usize) -> Result<Self::Tape, EngineError> {
        on_model_start!(self, m => m.start_train(batch, step, micro))
    }

    fn forward(&self, layer: usize, params: &[f32], tape: &mut Self::Tape) -> Result<(), EngineError> {
        on_model_tape!(self, tape, m, t => m.forward(layer, params, t), else Err(foreign_tape()))
    }

    fn loss(&self, tape: &Self::Tape) -> f32 {
        on_model_tape!(self, tape, m, t => m.loss(t), else f32::NAN)
    }

    fn backward(
        &self,
        layer: usize,
        p: &[f32],
        tape: &mut Self::Tape,
        g: &mut [f32],
    ) -> Result<(), EngineError> {
        on_model_tape!(self, tape, m, t => m.backward(layer, p, t, g), else Err(foreign_tape()))
    }

    fn activation_bytes(&self, batch: usize, seq: usize) -> usize {
        on_model!(self, m => m.activation_bytes(batch, seq))
    }
}

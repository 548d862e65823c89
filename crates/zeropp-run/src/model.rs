//! [`RunModel`]: whichever built-in model a [`ModelChoice`](crate::train::ModelChoice)
//! builds (the engine's GPT or MLP, or zeropp-candle's Llama) as one
//! [`Model`], so one `launch` call trains any of them.

use zeropp_candle::{CandleModel, CandleTape};
use zeropp_engine::EngineError;
use zeropp_engine::model::{Batch, BuiltIn, BuiltInTape, LayerSpec, Model};

/// A built-in model of any kind.
#[derive(Debug)]
pub enum RunModel {
    /// The engine's GPT or MLP.
    Native(BuiltIn),
    /// zeropp-candle's Llama decoder.
    Llama(Box<CandleModel>),
}

/// The tape of a [`RunModel`]: its model's own.
#[derive(Debug)]
pub enum RunTape {
    /// A native model's tape.
    Native(BuiltInTape),
    /// The Llama's tape.
    Llama(CandleTape),
}

/// The error of a tape handed to the other kind of model.
fn foreign_tape() -> EngineError {
    EngineError::InvalidConfig("a tape of one kind of model was given to another".into())
}

/// `$call` on the model inside `$model`, bound to `$m`.
macro_rules! on_model {
    ($model:expr, $m:ident => $call:expr) => {
        match $model {
            RunModel::Native($m) => $call,
            RunModel::Llama($m) => $call,
        }
    };
}

/// `$call` on the model and its own tape, bound to `$m` and `$t`; `$foreign`
/// when the tape is another kind's.
macro_rules! on_model_tape {
    ($model:expr, $tape:expr, $m:ident, $t:ident => $call:expr, else $foreign:expr) => {
        match ($model, $tape) {
            (RunModel::Native($m), RunTape::Native($t)) => $call,
            (RunModel::Llama($m), RunTape::Llama($t)) => $call,
            _ => $foreign,
        }
    };
}

/// `$call` (a `start*` call of the model bound to `$m`), its tape wrapped.
macro_rules! on_model_start {
    ($model:expr, $m:ident => $call:expr) => {
        match $model {
            RunModel::Native($m) => $call.map(RunTape::Native),
            RunModel::Llama($m) => $call.map(RunTape::Llama),
        }
    };
}

impl Model for RunModel {
    type Tape = RunTape;

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

    fn start(&self, batch: &Batch) -> Result<RunTape, EngineError> {
        on_model_start!(self, m => m.start(batch))
    }

    fn start_eval(&self, batch: &Batch) -> Result<RunTape, EngineError> {
        on_model_start!(self, m => m.start_eval(batch))
    }

    fn start_train(&self, batch: &Batch, step: u64, micro: usize) -> Result<RunTape, EngineError> {
        on_model_start!(self, m => m.start_train(batch, step, micro))
    }

    fn forward(&self, layer: usize, params: &[f32], tape: &mut RunTape) -> Result<(), EngineError> {
        on_model_tape!(self, tape, m, t => m.forward(layer, params, t), else Err(foreign_tape()))
    }

    fn loss(&self, tape: &RunTape) -> f32 {
        on_model_tape!(self, tape, m, t => m.loss(t), else f32::NAN)
    }

    fn backward(
        &self,
        layer: usize,
        p: &[f32],
        tape: &mut RunTape,
        g: &mut [f32],
    ) -> Result<(), EngineError> {
        on_model_tape!(self, tape, m, t => m.backward(layer, p, t, g), else Err(foreign_tape()))
    }

    fn activation_bytes(&self, batch: usize, seq: usize) -> usize {
        on_model!(self, m => m.activation_bytes(batch, seq))
    }
}

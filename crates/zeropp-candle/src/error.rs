//! The crate's error type.

use zeropp_engine::EngineError;

/// Everything that can go wrong in a candle model driven by the engine.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum CandleError {
    /// candle itself failed (a shape mismatch in a stage, a missing tensor, ...).
    #[error("candle: {0}")]
    Candle(#[from] candle_core::Error),
    /// A parameter of a stage received no gradient in its backward pass. Some
    /// candle-nn ops build no backward graph (the fused `ops::rms_norm`,
    /// `ops::softmax_last_dim`, `ops::layer_norm` and `LayerNorm` with a bias,
    /// the `rotary_emb::rope*` kernels): a parameter behind one of them would
    /// train on a silent zero, so this is an error instead.
    #[error(
        "stage {stage:?}: parameter {param:?} received no gradient: an op on its path builds no backward graph \
         (candle-nn's fused ops do not: ops::rms_norm, ops::softmax_last_dim, ops::layer_norm and LayerNorm \
         with a bias, RmsNorm, the rotary_emb::rope* kernels); use zeropp_candle::ops and zeropp_candle::nn, \
         which have a backward, or differentiable tensor ops"
    )]
    MissingGradient {
        /// The stage (gather unit).
        stage: String,
        /// The parameter, as the stage's VarBuilder named it.
        param: String,
    },
    /// Some elements of a parameter get no gradient in the build's trial
    /// backward (others do): part of it sits behind an op with no backward
    /// pass, such as the query and key rows of a fused q/k/v weight whose
    /// scores go through candle-nn's `ops::softmax_last_dim`.
    #[error(
        "stage {stage:?}: parameter {param:?} {shape:?} has elements no gradient reaches: {zeros}; an op on \
         their path builds no backward graph (candle-nn's fused ops: use zeropp_candle::ops and \
         zeropp_candle::nn instead); if they are meant to get none (rows frozen by `detach`), declare it with \
         `.allow_partial_gradient(\"{stage}.{param}\")`"
    )]
    PartialGradient {
        /// The stage.
        stage: String,
        /// The parameter, as the stage's VarBuilder named it.
        param: String,
        /// Its shape.
        shape: Vec<usize>,
        /// How many elements, and which ranges (rows where whole rows).
        zeros: String,
    },
    /// A parameter's gradient disagrees with finite differences of the stage
    /// along a random direction in the build's trial: every element gets a
    /// gradient, but one of the paths from the parameter to the output has no
    /// backward pass (a weight used twice, once through candle-nn's
    /// `ops::softmax_last_dim`, say), so part of the gradient is missing.
    #[error(
        "stage {stage:?}: parameter {param:?}: the backward's derivative along a random direction is          {backward:.6e}, finite differences give {differences:.6e}: a path from it to the output builds no          backward graph (candle-nn's fused ops: use zeropp_candle::ops and zeropp_candle::nn instead); if that          is meant (a `detach` on purpose), declare it with `.allow_partial_gradient(\"{stage}.{param}\")`"
    )]
    WrongGradient {
        /// The stage.
        stage: String,
        /// The parameter, as the stage's VarBuilder named it.
        param: String,
        /// `g · u` from the backward pass.
        backward: f64,
        /// `(F(w + εu) − F(w − εu)) / 2ε`.
        differences: f64,
    },
    /// The input of a stage past the first received no gradient: the stages
    /// below it would train on zeros. Same causes as [`CandleError::MissingGradient`].
    #[error(
        "stage {stage:?}: its input received no gradient, so the stages before it would get none: an op on \
         the path builds no backward graph (candle-nn's fused ops do not); write it with differentiable ops"
    )]
    MissingInputGradient {
        /// The stage.
        stage: String,
    },
    /// A model definition that cannot work (no stages, a last stage that does
    /// not return `[batch, seq, vocab]` logits, a parameter asked for twice with
    /// two shapes, ...).
    #[error("invalid candle model: {0}")]
    Config(String),
    /// An engine error (training, checkpoints, data).
    #[error(transparent)]
    Engine(#[from] EngineError),
}

/// Shorthand for `Result<T, CandleError>`.
pub type Result<T, E = CandleError> = std::result::Result<T, E>;

/// `e` as the engine's error for model `model`, layer `layer` (the source kept).
pub(crate) fn to_engine(model: &str, layer: &str, e: CandleError) -> EngineError {
    match e {
        CandleError::Engine(e) => e,
        other => {
            EngineError::Model { model: model.to_string(), layer: layer.to_string(), source: Box::new(other) }
        }
    }
}

//! The model contract and the models.
//!
//! A [`Model`] is a list of gather units ([`LayerSpec`]). It never owns its
//! weights: the engine all-gathers layer `i`'s flat parameters (the layer's
//! [`TensorSpec`]s concatenated in order, each row-major) and hands them to
//! [`Model::forward`] / [`Model::backward`]. Everything a micro-batch needs
//! between forward and backward lives in the model's [`Model::Tape`].
//!
//! Call protocol for one micro-batch of a model with `L` layers:
//! `start`, `forward(0..L)` in order, `loss`, `backward(L-1..=0)` in reverse
//! order. Out-of-order calls return [`EngineError::CallOrder`]. See [`Model`]
//! for a runnable example.

pub mod gemm;
pub mod gpt;
pub mod mlp;
pub mod ops;
pub(crate) mod rng;
mod stack;

pub use gpt::{Gpt, GptConfig, GptTape};
pub use mlp::{Mlp, MlpConfig, MlpTape};

use crate::EngineError;

/// One parameter tensor of a layer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorSpec {
    /// Name, unique within its layer (e.g. `attn.qkv.weight`).
    pub name: String,
    /// Shape, row-major. Linear weights are `[in, out]`.
    pub shape: Vec<usize>,
}

impl TensorSpec {
    /// A parameter spec.
    pub fn new(name: impl Into<String>, shape: Vec<usize>) -> Self {
        Self { name: name.into(), shape }
    }

    /// Number of elements (product of the shape).
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }
}

/// One gather unit (bucket): the parameters all-gathered together.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LayerSpec {
    /// Name, unique within the model (e.g. `block0`).
    pub name: String,
    /// The parameters, in flat-layout order.
    pub params: Vec<TensorSpec>,
}

impl LayerSpec {
    /// Total elements; the flat layout is the params concatenated in order.
    pub fn numel(&self) -> usize {
        self.params.iter().map(TensorSpec::numel).sum()
    }

    /// Offset of each parameter in the flat layout (same order as `params`).
    pub fn offsets(&self) -> Vec<usize> {
        let mut off = 0;
        self.params
            .iter()
            .map(|p| {
                let o = off;
                off += p.numel();
                o
            })
            .collect()
    }
}

/// A micro-batch of token sequences: `inputs[b*seq_len + t]` predicts `targets[b*seq_len + t]`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Batch {
    /// Input token ids, `batch * seq_len`, row-major by sequence.
    pub inputs: Vec<u32>,
    /// Target token ids, same layout as `inputs`.
    pub targets: Vec<u32>,
    /// Number of sequences.
    pub batch: usize,
    /// Tokens per sequence.
    pub seq_len: usize,
}

impl Batch {
    /// Number of tokens (`batch * seq_len`).
    pub fn tokens(&self) -> usize {
        self.batch * self.seq_len
    }

    /// Checks that `inputs` and `targets` both hold `batch * seq_len` tokens.
    pub fn check_lengths(&self) -> Result<(), EngineError> {
        let n = self.tokens();
        if self.inputs.len() != n || self.targets.len() != n {
            return Err(EngineError::InvalidBatch(format!(
                "{} inputs and {} targets for {} x {} tokens",
                self.inputs.len(),
                self.targets.len(),
                self.batch,
                self.seq_len
            )));
        }
        Ok(())
    }
}

/// A model with hand-written forward and backward passes, split into gather units.
///
/// See the [module docs](self) for the call protocol.
///
/// ```
/// use zeropp_engine::model::{Batch, Gpt, GptConfig, Model, full_forward_backward, init_params};
///
/// let model = Gpt::new(GptConfig::tiny())?;
/// let params = init_params(&model, 42)?;
/// let t = model.seq_len();
/// let batch = Batch {
///     inputs: (0..2 * t as u32).map(|i| i % 7).collect(),
///     targets: (1..=2 * t as u32).map(|i| i % 7).collect(),
///     batch: 2,
///     seq_len: t,
/// };
/// // Layer by layer, as the engine does it:
/// let mut tape = model.start(&batch)?;
/// for (i, p) in params.iter().enumerate() {
///     model.forward(i, p, &mut tape)?;
/// }
/// let loss = model.loss(&tape);
/// let mut grads: Vec<Vec<f32>> = model.layers().iter().map(|l| vec![0.0; l.numel()]).collect();
/// for i in (0..params.len()).rev() {
///     model.backward(i, &params[i], &mut tape, &mut grads[i])?;
/// }
/// // ... or in one call, the single-process reference:
/// let (loss2, grads2) = full_forward_backward(&model, &params, &batch)?;
/// assert_eq!(loss.to_bits(), loss2.to_bits());
/// assert_eq!(grads, grads2);
/// // At init the loss is close to ln(vocab).
/// assert!((loss - (model.vocab_size() as f32).ln()).abs() < 0.5);
/// # Ok::<(), zeropp_engine::EngineError>(())
/// ```
pub trait Model: Send + Sync {
    /// Per-micro-batch activation storage (what forward saves for backward).
    type Tape: Send;
    /// Human-readable model name.
    fn name(&self) -> &str;
    /// Vocabulary size: token ids must be below it.
    fn vocab_size(&self) -> usize;
    /// Maximum (and default) sequence length of a batch.
    fn seq_len(&self) -> usize;
    /// Ordered layers; the engine gathers layer i's flat parameters before forward(i)/backward(i).
    fn layers(&self) -> &[LayerSpec];
    /// Deterministic init of layer `layer` (flat, TensorSpec order) from `seed`; same seed => same values on every rank.
    fn init_layer(&self, layer: usize, seed: u64, out: &mut [f32]) -> Result<(), EngineError>;
    /// Starts a micro-batch (validates token ids < vocab, shapes).
    fn start(&self, batch: &Batch) -> Result<Self::Tape, EngineError>;
    /// Runs layer `layer` forward with its gathered flat params; layers are called in order 0..L.
    fn forward(&self, layer: usize, params: &[f32], tape: &mut Self::Tape) -> Result<(), EngineError>;
    /// After the last forward: the mean softmax cross-entropy over all tokens
    /// of the micro-batch (NaN if the forward pass has not finished).
    fn loss(&self, tape: &Self::Tape) -> f32;
    /// Backward of layer `layer` (called in order L-1..0 after loss): WRITES
    /// (overwrites) d(mean loss)/d(params) into `grad` (len =
    /// `layers()[layer].numel()`), and propagates the activation gradient
    /// inside the tape.
    fn backward(
        &self,
        layer: usize,
        params: &[f32],
        tape: &mut Self::Tape,
        grad: &mut [f32],
    ) -> Result<(), EngineError>;

    /// Bytes of activations one rank keeps for a micro-batch of `batch`
    /// sequences of `seq` tokens: the tape of the forward pass plus the largest
    /// temporaries of one layer's backward (for the memory model; 0 when the
    /// model does not say).
    fn activation_bytes(&self, batch: usize, seq: usize) -> usize {
        let _ = (batch, seq);
        0
    }
}

/// Initialises every layer of `model` from `seed` (one flat vector per layer).
pub fn init_params<M: Model>(model: &M, seed: u64) -> Result<Vec<Vec<f32>>, EngineError> {
    model
        .layers()
        .iter()
        .enumerate()
        .map(|(i, l)| {
            let mut v = vec![0.0; l.numel()];
            model.init_layer(i, seed, &mut v)?;
            Ok(v)
        })
        .collect()
}

/// Single-process forward pass over all layers: the mean loss of `batch`.
pub fn full_forward<M: Model>(
    model: &M,
    params: &[Vec<f32>],
    batch: &Batch,
) -> Result<(f32, M::Tape), EngineError> {
    check_param_count(model, params)?;
    let mut tape = model.start(batch)?;
    for (i, p) in params.iter().enumerate() {
        model.forward(i, p, &mut tape)?;
    }
    Ok((model.loss(&tape), tape))
}

/// Single-process reference: forward over all layers, loss, backward over
/// all layers. Returns the mean loss and one gradient vector per layer.
pub fn full_forward_backward<M: Model>(
    model: &M,
    params: &[Vec<f32>],
    batch: &Batch,
) -> Result<(f32, Vec<Vec<f32>>), EngineError> {
    let (loss, mut tape) = full_forward(model, params, batch)?;
    let mut grads: Vec<Vec<f32>> = model.layers().iter().map(|l| vec![0.0; l.numel()]).collect();
    for i in (0..params.len()).rev() {
        model.backward(i, &params[i], &mut tape, &mut grads[i])?;
    }
    Ok((loss, grads))
}

fn check_param_count<M: Model>(model: &M, params: &[Vec<f32>]) -> Result<(), EngineError> {
    if params.len() != model.layers().len() {
        return Err(EngineError::LengthMismatch {
            what: "per-layer parameter vectors",
            expected: model.layers().len(),
            got: params.len(),
        });
    }
    Ok(())
}

/// Checks a batch's shape and token ids against a model's vocabulary and maximum sequence length.
pub(crate) fn validate_batch(batch: &Batch, vocab: usize, max_seq: usize) -> Result<(), EngineError> {
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
pub(crate) fn split_params<'a>(spec: &LayerSpec, flat: &'a [f32]) -> Result<Vec<&'a [f32]>, EngineError> {
    if flat.len() != spec.numel() {
        return Err(EngineError::LengthMismatch {
            what: "layer parameters",
            expected: spec.numel(),
            got: flat.len(),
        });
    }
    let mut rest = flat;
    let mut out = Vec::with_capacity(spec.params.len());
    for p in &spec.params {
        let (head, tail) = rest.split_at(p.numel());
        out.push(head);
        rest = tail;
    }
    Ok(out)
}

/// Mutable version of [`split_params`].
pub(crate) fn split_params_mut<'a>(
    spec: &LayerSpec,
    flat: &'a mut [f32],
) -> Result<Vec<&'a mut [f32]>, EngineError> {
    if flat.len() != spec.numel() {
        return Err(EngineError::LengthMismatch {
            what: "layer gradient",
            expected: spec.numel(),
            got: flat.len(),
        });
    }
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
pub(crate) fn fill_normal(out: &mut [f32], std: f64, seed: u64, layer: usize, param: usize) {
    let mut rng = rng::SplitMix64::from_keys(&[seed, 0x1417, layer as u64, param as u64]);
    for v in out {
        *v = (rng.normal() * std) as f32;
    }
}

/// Checks the call order of a forward: `layer` must be the next one.
pub(crate) fn check_forward_order(layer: usize, next_fwd: usize, layers: usize) -> Result<(), EngineError> {
    if layer >= layers {
        return Err(EngineError::LayerOutOfRange { layer, layers });
    }
    if layer != next_fwd {
        return Err(EngineError::CallOrder(format!("forward({layer}) called, expected forward({next_fwd})")));
    }
    Ok(())
}

/// Checks the call order of a backward: all forwards done, `layer` is the next in reverse order.
pub(crate) fn check_backward_order(
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

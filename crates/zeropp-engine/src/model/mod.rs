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

pub mod either;
pub mod gemm;
pub mod gpt;
pub mod kit;
pub mod mlp;
pub mod ops;
pub(crate) mod rng;
mod stack;

pub use either::Either;
pub use gpt::{Gpt, GptConfig, GptTape};
pub use kit::{
    CallOrder, check_backward_order, check_forward_order, fill_normal, split_params, split_params_mut,
    validate_batch,
};
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

/// A model with its own forward and backward passes, split into gather units:
/// the contract between a model and the engine.
///
/// See the [module docs](self) for the call protocol.
///
/// # The contract, for authors of a model
///
/// - **Layers are gather units.** [`Model::layers`] lists them in forward order;
///   the engine all-gathers a layer's parameters before each of its calls and
///   frees them after, so only one or two layers are whole at a time. Names:
///   layer names unique and not `persistent` (reserved for the bucket of
///   DeepSpeed's persistent parameters), parameter names unique within their
///   layer; `{layer}.{param}` is the tensor's name in checkpoints and exports.
/// - **The weight layout is the model's own.** A layer's flat buffer is its
///   [`TensorSpec`]s back to back, each row-major in the shape the model
///   declares; the engine never looks inside (beyond quantizing groups that never
///   straddle two tensors, and treating 1-D tensors as biases and norms for
///   qgZ's 1-D exclusion). [`kit::split_params`] splits the buffer.
/// - **Init is deterministic.** [`Model::init_layer`] must give the same values
///   for the same seed on every rank and in every process
///   ([`kit::fill_normal`] does).
/// - **Calls come in order.** `start`, `forward(0..L)`, `loss`,
///   `backward(L-1..=0)`; refuse anything else ([`kit::CallOrder`]).
///   `backward` *overwrites* `grad` with d(mean loss)/d(params) and leaves the
///   gradient of the layer's input in the tape for the layer below.
/// - **The tape holds what a micro-batch needs between forward and backward**
///   (activations), never the weights: keeping a gathered layer alive defeats
///   ZeRO-3. [`Model::activation_bytes`] tells the memory model its size.
///
/// # Example: a model of your own, trained sharded
///
/// A bigram language model in two gather units, written against this trait
/// and the [`kit`] helpers, then trained with ZeRO++ on 4 ranks:
///
/// ```
/// use zeropp_engine::EngineError;
/// use zeropp_engine::data::TextDataset;
/// use zeropp_engine::model::kit::{CallOrder, fill_normal, split_params, split_params_mut, validate_batch};
/// use zeropp_engine::model::{Batch, LayerSpec, Model, TensorSpec};
/// use zeropp_engine::{RunConfig, launch};
///
/// /// Layer 0 looks up an embedding; layer 1 maps it to logits (softmax cross-entropy).
/// struct Bigram { vocab: usize, dim: usize, seq: usize, layers: Vec<LayerSpec> }
///
/// struct Tape { order: CallOrder, inputs: Vec<u32>, targets: Vec<u32>, h: Vec<f32>, probs: Vec<f32>, loss: f32, dh: Vec<f32> }
///
/// impl Bigram {
///     fn new(vocab: usize, dim: usize, seq: usize) -> Self {
///         let layers = vec![
///             LayerSpec { name: "embed".into(), params: vec![TensorSpec::new("weight", vec![vocab, dim])] },
///             LayerSpec {
///                 name: "head".into(),
///                 params: vec![TensorSpec::new("weight", vec![dim, vocab]), TensorSpec::new("bias", vec![vocab])],
///             },
///         ];
///         Self { vocab, dim, seq, layers }
///     }
/// }
///
/// impl Model for Bigram {
///     type Tape = Tape;
///     fn name(&self) -> &str { "bigram" }
///     fn vocab_size(&self) -> usize { self.vocab }
///     fn seq_len(&self) -> usize { self.seq }
///     fn layers(&self) -> &[LayerSpec] { &self.layers }
///
///     fn init_layer(&self, layer: usize, seed: u64, out: &mut [f32]) -> Result<(), EngineError> {
///         let spec = &self.layers[layer];
///         for (i, p) in split_params_mut(spec, out)?.into_iter().enumerate() {
///             if spec.params[i].shape.len() == 2 { fill_normal(p, 0.1, seed, layer, i) } else { p.fill(0.0) }
///         }
///         Ok(())
///     }
///
///     fn start(&self, b: &Batch) -> Result<Tape, EngineError> {
///         validate_batch(b, self.vocab, self.seq)?;
///         Ok(Tape { order: CallOrder::new(2), inputs: b.inputs.clone(), targets: b.targets.clone(),
///                   h: Vec::new(), probs: Vec::new(), loss: f32::NAN, dh: Vec::new() })
///     }
///
///     fn forward(&self, layer: usize, params: &[f32], t: &mut Tape) -> Result<(), EngineError> {
///         t.order.forward(layer)?;
///         let p = split_params(&self.layers[layer], params)?;
///         let (d, v) = (self.dim, self.vocab);
///         if layer == 0 {
///             t.h = t.inputs.iter().flat_map(|&tok| p[0][tok as usize * d..][..d].to_vec()).collect();
///             return Ok(());
///         }
///         let n = t.inputs.len();
///         t.probs = vec![0.0; n * v];
///         let mut loss = 0.0f64;
///         for i in 0..n {
///             let row = &mut t.probs[i * v..][..v];
///             for o in 0..v {
///                 row[o] = p[1][o] + (0..d).map(|k| t.h[i * d + k] * p[0][k * v + o]).sum::<f32>();
///             }
///             let m = row.iter().cloned().fold(f32::MIN, f32::max);
///             let z: f32 = row.iter_mut().map(|x| { *x = (*x - m).exp(); *x }).sum();
///             row.iter_mut().for_each(|x| *x /= z);
///             loss -= f64::from(row[t.targets[i] as usize].ln());
///         }
///         t.loss = (loss / n as f64) as f32;
///         Ok(())
///     }
///
///     fn loss(&self, t: &Tape) -> f32 { if t.order.finished_forward() { t.loss } else { f32::NAN } }
///
///     fn backward(&self, layer: usize, params: &[f32], t: &mut Tape, grad: &mut [f32]) -> Result<(), EngineError> {
///         t.order.backward(layer)?;
///         let spec = &self.layers[layer];
///         let p = split_params(spec, params)?;
///         let mut g = split_params_mut(spec, grad)?;
///         g.iter_mut().for_each(|x| x.fill(0.0));
///         let (d, v, n) = (self.dim, self.vocab, t.inputs.len());
///         if layer == 1 {
///             t.dh = vec![0.0; n * d];
///             for i in 0..n {
///                 for o in 0..v {
///                     let y = if o == t.targets[i] as usize { 1.0 } else { 0.0 };
///                     let dl = (t.probs[i * v + o] - y) / n as f32;
///                     g[1][o] += dl;
///                     for k in 0..d {
///                         g[0][k * v + o] += t.h[i * d + k] * dl;
///                         t.dh[i * d + k] += p[0][k * v + o] * dl;
///                     }
///                 }
///             }
///         } else {
///             for (i, &tok) in t.inputs.iter().enumerate() {
///                 for k in 0..d { g[0][tok as usize * d + k] += t.dh[i * d + k]; }
///             }
///         }
///         Ok(())
///     }
/// }
///
/// // Token ids from any tokenizer; ZeRO++ on 2 simulated nodes x 2 ranks.
/// let tokens: Vec<u32> = (0..8000u32).map(|i| (i * 7 + i / 3) % 16).collect();
/// let data = TextDataset::from_tokens(16, tokens, 0.1)?;
/// let model = Bigram::new(16, 8, 8);
/// let report = launch(&model, &data, &RunConfig::on(4, 2).with_steps(30))?;
/// assert!(report.steps[29].loss < report.steps[0].loss, "it learns");
/// assert_eq!(report.summary.bytes_per_step, report.summary.model_bytes_per_step);
/// # Ok::<(), EngineError>(())
/// ```
///
/// # The call protocol, on the built-in GPT
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
    /// Starts a micro-batch that is only evaluated (forward, no backward): a
    /// model with train-only behaviour (dropout) switches it off here. The
    /// default is [`Model::start`].
    fn start_eval(&self, batch: &Batch) -> Result<Self::Tape, EngineError> {
        self.start(batch)
    }
    /// Starts a training micro-batch: micro-batch `micro` of optimizer step
    /// `step` (the engine's step count, restored on resume; the same on
    /// every rank). A model with per-step randomness (dropout) keys it on
    /// these, so a batch seen again in a later step draws fresh randomness.
    /// The engine calls this; [`full_forward_backward`] calls
    /// [`Model::start`]. The default is [`Model::start`].
    fn start_train(&self, batch: &Batch, step: u64, micro: usize) -> Result<Self::Tape, EngineError> {
        let _ = (step, micro);
        self.start(batch)
    }
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
    check_param_count(model, params)?;
    backward_all(model, params, model.start(batch)?)
}

/// [`full_forward_backward`] of micro-batch `micro` of step `step`, started
/// as the engine starts it ([`Model::start_train`]).
pub fn full_forward_backward_at<M: Model>(
    model: &M,
    params: &[Vec<f32>],
    batch: &Batch,
    step: u64,
    micro: usize,
) -> Result<(f32, Vec<Vec<f32>>), EngineError> {
    check_param_count(model, params)?;
    backward_all(model, params, model.start_train(batch, step, micro)?)
}

fn backward_all<M: Model>(
    model: &M,
    params: &[Vec<f32>],
    mut tape: M::Tape,
) -> Result<(f32, Vec<Vec<f32>>), EngineError> {
    for (i, p) in params.iter().enumerate() {
        model.forward(i, p, &mut tape)?;
    }
    let loss = model.loss(&tape);
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

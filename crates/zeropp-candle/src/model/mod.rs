//! [`CandleModel`]: candle stages as an engine [`Model`], stage by stage.
//!
//! A stage is one gather unit: a function from a candle-nn `VarBuilder` and the
//! stage's input to its output, written with ordinary candle-nn code. The first
//! stage takes the token ids (`[batch, seq]`, `u32`), every other stage the
//! previous stage's output, and the last stage returns the logits
//! (`[batch, seq, vocab]`); the loss is the mean softmax cross-entropy over all
//! tokens (`candle_nn::loss::cross_entropy`).
//!
//! **Forward** runs a stage on the gathered weights as plain tensors (no graph
//! is recorded) and keeps only the stage's input in the tape. **Backward**, by
//! default, recomputes the stage from its input and the re-gathered weights,
//! now as candle `Var`s, seeds its output with the upstream gradient (the
//! scalar `sum(output ⊙ upstream)`, whose gradient is the vector-Jacobian
//! product) and reads the weight and input gradients from candle's `GradStore`.
//! So a stage's full weights are alive only while the engine holds them
//! gathered, which is the point of ZeRO-3. [`CandleModelBuilder::keep_graph`]
//! keeps the forward's graph instead (no recompute, but every stage's weights
//! stay alive until its backward).
//!
//! **No silent zero gradient.** candle-nn's fused ops build no backward graph
//! ([`crate::ops`] and [`crate::nn`] have the same ops with one). `build()`
//! runs a trial forward and backward of every stage, on perturbed weights, a
//! batch that uses every token id and a random upstream gradient, and fails
//! with [`CandleError::PartialGradient`] when elements of a weight get an
//! exact zero gradient although moving them changes the stage's output (a
//! fused q/k/v weight whose query and key rows go through
//! `candle_nn::ops::softmax_last_dim`, say), naming the stage, the parameter
//! and the elements. A zero of an element that changes nothing (an attention
//! key bias, whose shift the softmax cancels) is the true gradient and
//! passes. Then each weight's gradient along a random normal direction is
//! compared with finite differences of the stage along it, run in f64
//! (one-sided; central in f32 where a stage cannot run in f64, which
//! [`CandleModel::gradient_check_notes`] names): a weight used twice, once
//! behind an op with no backward, gets a gradient on every element but a wrong
//! one, and fails with [`CandleError::WrongGradient`] when the cut use carries
//! more than 5% of that derivative. The check runs in evaluation mode, and in
//! training mode too (masks fixed) for a stage that reads its
//! `StageContext`. During training, a weight (or, past the first stage, the
//! stage input) that receives no gradient at all is an error naming the stage
//! and the parameter ([`CandleError::MissingGradient`]).
//!
//! **Tied weights.** [`CandleModelBuilder::tie`] makes two names one
//! parameter, such as an input embedding and an LM head: it is stored and
//! sharded once, in the earlier stage, lent to the later stage from the
//! earlier stage's gather (so it stays alive from the first stage's forward to
//! the last use's backward, and the memory model counts it), and its gradient
//! is the sum of both uses. Asking for one name twice within a stage without
//! declaring it ([`CandleModelBuilder::shared`]) is an error: it is what a
//! copy-pasted `vb.pp("fc")` does.
//!
//! **Dropout.** A stage written with [`CandleModelBuilder::stage_with`] gets a
//! [`StageContext`]: the mode (evaluation in [`CandleModel::logits`] and the
//! engine's validation) and a seed that the backward's recompute replays.

use candle_core::{DType, Device, Tensor, Var};
use candle_nn::VarBuilder;
use zeropp_engine::EngineError;
use zeropp_engine::model::kit::{CallOrder, split_params_mut, validate_batch};
use zeropp_engine::model::{Batch, LayerSpec, Model};

use crate::error::{CandleError, Result, to_engine};
use crate::params::{ParamInfo, gathered, init_param};

mod builder;
mod context;
mod gradcheck;
mod run;
mod tape;

pub use context::StageContext;
use context::{batch_key, stage_key};
use run::{loss_of, on_pool};
pub use tape::CandleTape;
use tape::Kept;

/// A stage: builds its modules from `vb` and runs them on its input, in the
/// run that `ctx` describes.
pub type StageFn =
    dyn for<'a> Fn(VarBuilder<'a>, &Tensor, &StageContext) -> candle_core::Result<Tensor> + Send + Sync;

/// The activation bytes of one micro-batch of `(batch, seq)` when the last
/// `kept` stages keep their forward graphs until their backward (for the
/// memory model; see [`CandleModelBuilder::activation_bytes`]).
pub type ActivationFn = dyn Fn(usize, usize, usize) -> usize + Send + Sync;

/// The default of [`CandleModelBuilder::keep_graph_bytes`]: 64 MiB of kept
/// weights per rank.
pub const DEFAULT_KEEP_GRAPH_BYTES: usize = 64 << 20;

struct StageDef {
    name: String,
    run: Box<StageFn>,
    params: Vec<ParamInfo>,
    /// Output elements per token, from the build's trial run.
    width: usize,
    /// Parameters of earlier stages this stage uses under its own names (ties).
    borrows: Vec<Borrow>,
    /// Indices into `params` of the parameters later stages borrow.
    lends: Vec<usize>,
    /// Other names of this stage's own parameters (ties within the stage).
    aliases: Vec<(String, usize)>,
}

/// A tied parameter as the later stage sees it: its own name for parameter
/// `param` of stage `owner`.
#[derive(Debug, Clone)]
struct Borrow {
    local: String,
    owner: usize,
    param: usize,
}

/// A candle model as an engine [`Model`] (see the [module docs](self)); make
/// one with [`CandleModel::builder`].
pub struct CandleModel {
    name: String,
    vocab: usize,
    seq_len: usize,
    stages: Vec<StageDef>,
    layers: Vec<LayerSpec>,
    /// The first stage whose forward graph is kept for its backward (the
    /// stages from here to the last; `stages.len() - 1` keeps the last only).
    kept_from: usize,
    threads: usize,
    activation: Option<Box<ActivationFn>>,
    dropout_seed: u64,
    /// What the build's gradient check could not check in f64.
    check_notes: Vec<String>,
    /// `(part, parts)`: the share of the weights this process's check tested.
    check_share: (usize, usize),
}

impl std::fmt::Debug for CandleModel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CandleModel")
            .field("name", &self.name)
            .field("vocab", &self.vocab)
            .field("seq_len", &self.seq_len)
            .field("layers", &self.layers)
            .field("kept_from", &self.kept_from)
            .field("threads", &self.threads)
            .finish_non_exhaustive()
    }
}

/// Builds a [`CandleModel`] stage by stage.
pub struct CandleModelBuilder {
    name: String,
    vocab: usize,
    seq_len: usize,
    stages: Vec<(String, Box<StageFn>)>,
    keep_bytes: usize,
    threads: usize,
    activation: Option<Box<ActivationFn>>,
    ties: Vec<(String, String)>,
    shared: Vec<String>,
    partial_ok: Vec<String>,
    dropout_seed: u64,
    /// `(part, parts)` of the weights this process's gradient check tests;
    /// `None`: from the job's launcher variables, the whole model outside one.
    check_share: Option<(usize, usize)>,
}

impl CandleModel {
    /// A builder for a model named `name` over `vocab` token ids and sequences
    /// of at most `seq_len` tokens.
    ///
    /// ```
    /// use candle_nn::Module;
    /// use zeropp_candle::CandleModel;
    /// let (vocab, d) = (32, 16);
    /// let model = CandleModel::builder("tiny", vocab, 8)
    ///     .stage("embed", move |vb, ids| candle_nn::embedding(vocab, d, vb)?.forward(ids))
    ///     .stage("block", move |vb, x| {
    ///         let h = candle_nn::linear(d, 4 * d, vb.pp("up"))?.forward(x)?.relu()?;
    ///         x + candle_nn::linear(4 * d, d, vb.pp("down"))?.forward(&h)?
    ///     })
    ///     .stage("head", move |vb, x| candle_nn::linear(d, vocab, vb)?.forward(x))
    ///     .build()?;
    /// use zeropp_engine::Model;
    /// assert_eq!(model.layers().len(), 3);
    /// assert_eq!(model.layers()[1].params[0].name, "up.weight");
    /// assert_eq!(model.layers()[1].params[0].shape, [4 * d, d]);
    /// # Ok::<(), zeropp_candle::CandleError>(())
    /// ```
    pub fn builder(name: impl Into<String>, vocab: usize, seq_len: usize) -> CandleModelBuilder {
        CandleModelBuilder {
            name: name.into(),
            vocab,
            seq_len,
            stages: Vec::new(),
            keep_bytes: DEFAULT_KEEP_GRAPH_BYTES,
            threads: 1,
            activation: None,
            ties: Vec::new(),
            shared: Vec::new(),
            partial_ok: Vec::new(),
            dropout_seed: 0,
            check_share: None,
        }
    }

    /// What the build's gradient check could only check in f32 (a stage that
    /// does not run in f64, such as one making an f32 tensor of its own), one
    /// line per weight and mode; empty when every weight was checked in f64.
    /// An f32 check's finite differences carry rounding that grows with the
    /// stage, so a small cut path can pass unseen there.
    pub fn gradient_check_notes(&self) -> &[String] {
        &self.check_notes
    }

    /// `(part, parts)`: which share of the weights this process's build
    /// tested against finite differences (weight `i`, counted over the stages
    /// in order, when `i % parts == part`); `(0, 1)` is every weight. See
    /// [`CandleModelBuilder::check_share`].
    pub fn gradient_check_share(&self) -> (usize, usize) {
        self.check_share
    }

    /// Whether backward keeps every stage's forward graph (none is recomputed).
    pub fn keeps_graph(&self) -> bool {
        self.kept_from == 0
    }

    /// The stages whose forward graph a training step keeps for their
    /// backward (a suffix, always holding the last stage); the others are
    /// recomputed. See [`CandleModelBuilder::keep_graph_bytes`].
    pub fn kept_stages(&self) -> std::ops::Range<usize> {
        self.kept_from..self.stages.len()
    }

    /// The bytes of gathered weights the kept graphs hold past the engine's
    /// gather (every kept stage's but the last, whose backward follows its
    /// forward at once).
    pub fn kept_weight_bytes(&self) -> usize {
        let last = self.stages.len().saturating_sub(1);
        self.layers
            .iter()
            .enumerate()
            .filter(|(i, _)| *i >= self.kept_from && *i < last)
            .map(|(_, l)| stage_bytes(l))
            .sum()
    }

    /// Threads of candle's CPU matmuls per rank.
    pub fn matmul_threads(&self) -> usize {
        self.threads
    }

    /// Output elements per token of each stage (from the build's trial run).
    pub fn stage_widths(&self) -> Vec<usize> {
        self.stages.iter().map(|s| s.width).collect()
    }

    /// The logits of `batch` sequences of `seq` tokens (`inputs`, row-major) on
    /// `params` (one flat vector per stage, as `TrainReport::params` holds
    /// them): `[batch, seq, vocab]` values, row-major. For evaluation and
    /// generation with a trained model; no graph is recorded.
    pub fn logits(&self, params: &[Vec<f32>], inputs: &[u32], batch: usize, seq: usize) -> Result<Vec<f32>> {
        let b = Batch { inputs: inputs.to_vec(), targets: inputs.to_vec(), batch, seq_len: seq };
        validate_batch(&b, self.vocab, self.seq_len)?;
        if params.len() != self.stages.len() {
            return Err(CandleError::Config(format!(
                "{} parameter vectors for {} stages",
                params.len(),
                self.stages.len()
            )));
        }
        let key = batch_key(self.dropout_seed, inputs, batch, seq, (0, 0));
        let mut x = Tensor::from_slice(inputs, (batch, seq), &Device::Cpu)?;
        for (l, (stage, p)) in self.stages.iter().zip(params).enumerate() {
            let (mut g, _) = gathered(&stage.name, &stage.params, p, false)?;
            self.add_ties(stage, &mut g, |b| self.lent_slice(params, b))?;
            let ctx = StageContext::new(false, stage_key(key, l));
            x = (stage.run)(VarBuilder::from_backend(Box::new(g), DType::F32, Device::Cpu), &x, &ctx)?;
        }
        Ok(x.flatten_all()?.to_vec1::<f32>()?)
    }

    /// The single-process reference: every stage in **one** candle graph over
    /// `params` (one flat vector per stage), the mean cross-entropy of `batch`,
    /// and `loss.backward()`; returns the loss and one gradient vector per
    /// stage. What the stage-by-stage protocol must reproduce.
    pub fn reference_gradients(&self, params: &[Vec<f32>], batch: &Batch) -> Result<(f32, Vec<Vec<f32>>)> {
        validate_batch(batch, self.vocab, self.seq_len)?;
        if params.len() != self.stages.len() {
            return Err(CandleError::Config(format!(
                "{} parameter vectors for {} stages",
                params.len(),
                self.stages.len()
            )));
        }
        let key = batch_key(self.dropout_seed, &batch.inputs, batch.batch, batch.seq_len, (0, 0));
        let mut x = Tensor::from_slice(&batch.inputs, (batch.batch, batch.seq_len), &Device::Cpu)?;
        let targets = Tensor::from_slice(&batch.targets, batch.batch * batch.seq_len, &Device::Cpu)?;
        let mut all_vars: Vec<Vec<Var>> = Vec::with_capacity(self.stages.len());
        for (l, (stage, p)) in self.stages.iter().zip(params).enumerate() {
            let (mut g, vars) = gathered(&stage.name, &stage.params, p, true)?;
            // A tied parameter is the owner's own Var: autograd sums both uses.
            self.add_ties(stage, &mut g, |b| {
                all_vars
                    .get(b.owner)
                    .and_then(|v| v.get(b.param))
                    .map(|v| v.as_tensor().clone())
                    .ok_or_else(|| CandleError::Config(format!("tie {:?}: owner not built", b.local)))
            })?;
            let ctx = StageContext::new(true, stage_key(key, l));
            x = (stage.run)(VarBuilder::from_backend(Box::new(g), DType::F32, Device::Cpu), &x, &ctx)?;
            all_vars.push(vars);
        }
        let loss = loss_of(&x, &targets)?;
        let grads = loss.backward()?;
        let mut out = Vec::with_capacity(self.stages.len());
        for (stage, vars) in self.stages.iter().zip(&all_vars) {
            let mut flat = Vec::new();
            for (v, info) in vars.iter().zip(&stage.params) {
                let g = grads.get(v.as_tensor()).ok_or_else(|| CandleError::MissingGradient {
                    stage: stage.name.clone(),
                    param: info.name.clone(),
                })?;
                flat.extend(g.flatten_all()?.to_vec1::<f32>()?);
            }
            out.push(flat);
        }
        Ok((loss.to_scalar::<f32>()?, out))
    }
}

/// f32 bytes of a stage's own weights.
fn stage_bytes(l: &LayerSpec) -> usize {
    4 * l.params.iter().map(|p| p.shape.iter().product::<usize>()).sum::<usize>()
}

/// The first stage to keep: walking down from the last stage (always kept:
/// its weights are still gathered when its backward starts), each earlier
/// stage is kept while the kept weights stay within `budget` bytes.
fn kept_from(layers: &[LayerSpec], budget: usize) -> usize {
    let mut used = 0usize;
    let mut from = layers.len().saturating_sub(1);
    while from > 0 {
        used = used.saturating_add(stage_bytes(&layers[from - 1]));
        if used > budget {
            break;
        }
        from -= 1;
    }
    from
}

impl CandleModel {
    /// A fresh tape for `batch`: training or evaluation, at `(step, micro-batch)`.
    fn start_tape(
        &self,
        batch: &Batch,
        train: bool,
        at: (u64, usize),
    ) -> std::result::Result<CandleTape, EngineError> {
        validate_batch(batch, self.vocab, self.seq_len)?;
        let model = |e: candle_core::Error| to_engine(&self.name, "start", e.into());
        let ids =
            Tensor::from_slice(&batch.inputs, (batch.batch, batch.seq_len), &Device::Cpu).map_err(model)?;
        let targets =
            Tensor::from_slice(&batch.targets, batch.batch * batch.seq_len, &Device::Cpu).map_err(model)?;
        let n = self.stages.len();
        Ok(CandleTape {
            order: CallOrder::new(n),
            ids,
            targets,
            inputs: (0..n).map(|_| None).collect(),
            act: None,
            kept: (0..n).map(|_| None).collect(),
            upstream: None,
            loss: f32::NAN,
            train,
            key: batch_key(self.dropout_seed, &batch.inputs, batch.batch, batch.seq_len, at),
            lent: Default::default(),
            lent_grads: Default::default(),
        })
    }
}

impl Model for CandleModel {
    type Tape = CandleTape;

    fn name(&self) -> &str {
        &self.name
    }

    fn vocab_size(&self) -> usize {
        self.vocab
    }

    fn seq_len(&self) -> usize {
        self.seq_len
    }

    fn layers(&self) -> &[LayerSpec] {
        &self.layers
    }

    fn init_layer(&self, layer: usize, seed: u64, out: &mut [f32]) -> std::result::Result<(), EngineError> {
        let stage = self.stage(layer)?;
        let parts = split_params_mut(&self.layers[layer], out)?;
        for (i, (p, dst)) in stage.params.iter().zip(parts).enumerate() {
            init_param(&p.init, &p.shape, seed, layer, i, dst);
        }
        Ok(())
    }

    /// A training micro-batch at step 0, micro-batch 0 (the masks
    /// [`CandleModel::reference_gradients`] draws).
    fn start(&self, batch: &Batch) -> std::result::Result<CandleTape, EngineError> {
        self.start_tape(batch, true, (0, 0))
    }

    /// Evaluation: the stages run with [`StageContext::is_train`] false.
    fn start_eval(&self, batch: &Batch) -> std::result::Result<CandleTape, EngineError> {
        self.start_tape(batch, false, (0, 0))
    }

    /// Training micro-batch `micro` of step `step`: its dropout masks are
    /// keyed on both, so a batch seen again draws new ones.
    fn start_train(
        &self,
        batch: &Batch,
        step: u64,
        micro: usize,
    ) -> std::result::Result<CandleTape, EngineError> {
        self.start_tape(batch, true, (step, micro))
    }

    fn forward(
        &self,
        layer: usize,
        params: &[f32],
        tape: &mut CandleTape,
    ) -> std::result::Result<(), EngineError> {
        tape.order.forward(layer)?;
        let name = self.stage(layer)?.name.as_str();
        on_pool(self.threads, || self.forward_stage(layer, params, tape))?
            .map_err(|e| to_engine(&self.name, name, e))
    }

    fn loss(&self, tape: &CandleTape) -> f32 {
        if tape.order.finished_forward() { tape.loss } else { f32::NAN }
    }

    fn backward(
        &self,
        layer: usize,
        params: &[f32],
        tape: &mut CandleTape,
        grad: &mut [f32],
    ) -> std::result::Result<(), EngineError> {
        tape.order.backward(layer)?;
        let name = self.stage(layer)?.name.as_str();
        on_pool(self.threads, || self.backward_stage(layer, params, tape, grad))?
            .map_err(|e| to_engine(&self.name, name, e))
    }

    /// The tape's stage inputs, a stage's recompute and the kept graphs (the
    /// builder's `activation_bytes`, else the stage inputs and the logits),
    /// the weights the kept graphs hold, the tied
    /// parameters the tape holds (values and gradients), plus candle's matmul
    /// workspace ([`CandleModel::matmul_workspace_bytes`]).
    fn activation_bytes(&self, batch: usize, seq: usize) -> usize {
        let own = match &self.activation {
            Some(f) => f(batch, seq, self.kept_stages().len()),
            None => self.boundary_bytes(batch, seq),
        };
        own + self.kept_weight_bytes() + self.lent_bytes() + self.matmul_workspace_bytes()
    }
}

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
//! A weight (or, past the first stage, the stage input) that receives no
//! gradient is an error naming the stage and the parameter
//! ([`CandleError::MissingGradient`]): candle-nn's fused ops build no backward
//! graph, and a silent zero gradient would train nothing.

use candle_core::{DType, Device, Tensor, Var};
use candle_nn::VarBuilder;
use zeropp_engine::EngineError;
use zeropp_engine::model::kit::{CallOrder, split_params_mut, validate_batch};
use zeropp_engine::model::{Batch, LayerSpec, Model};

use crate::error::{CandleError, Result, to_engine};
use crate::params::{ParamInfo, gathered, init_param};

mod builder;
mod run;

use run::{loss_of, on_pool};

/// A stage: builds its modules from `vb` and runs them on its input.
pub type StageFn = dyn for<'a> Fn(VarBuilder<'a>, &Tensor) -> candle_core::Result<Tensor> + Send + Sync;

/// The activation bytes of one micro-batch of `(batch, seq)` (for the memory model).
pub type ActivationFn = dyn Fn(usize, usize) -> usize + Send + Sync;

struct StageDef {
    name: String,
    run: Box<StageFn>,
    params: Vec<ParamInfo>,
    /// Output elements per token, from the build's trial run.
    width: usize,
}

/// A candle model as an engine [`Model`] (see the [module docs](self)); make
/// one with [`CandleModel::builder`].
pub struct CandleModel {
    name: String,
    vocab: usize,
    seq_len: usize,
    stages: Vec<StageDef>,
    layers: Vec<LayerSpec>,
    keep_graph: bool,
    threads: usize,
    activation: Option<Box<ActivationFn>>,
}

impl std::fmt::Debug for CandleModel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CandleModel")
            .field("name", &self.name)
            .field("vocab", &self.vocab)
            .field("seq_len", &self.seq_len)
            .field("layers", &self.layers)
            .field("keep_graph", &self.keep_graph)
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
    keep_graph: bool,
    threads: usize,
    activation: Option<Box<ActivationFn>>,
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
            keep_graph: false,
            threads: 1,
            activation: None,
        }
    }

    /// Whether backward keeps the forward's graph instead of recomputing.
    pub fn keeps_graph(&self) -> bool {
        self.keep_graph
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
        let mut x = Tensor::from_slice(inputs, (batch, seq), &Device::Cpu)?;
        for (stage, p) in self.stages.iter().zip(params) {
            let (g, _) = gathered(&stage.name, &stage.params, p, false)?;
            x = (stage.run)(VarBuilder::from_backend(Box::new(g), DType::F32, Device::Cpu), &x)?;
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
        let mut x = Tensor::from_slice(&batch.inputs, (batch.batch, batch.seq_len), &Device::Cpu)?;
        let targets = Tensor::from_slice(&batch.targets, batch.batch * batch.seq_len, &Device::Cpu)?;
        let mut all_vars = Vec::with_capacity(self.stages.len());
        for (stage, p) in self.stages.iter().zip(params) {
            let (g, vars) = gathered(&stage.name, &stage.params, p, true)?;
            x = (stage.run)(VarBuilder::from_backend(Box::new(g), DType::F32, Device::Cpu), &x)?;
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

/// What the forward of one stage keeps with [`CandleModelBuilder::keep_graph`].
#[derive(Debug)]
struct Kept {
    out: Tensor,
    vars: Vec<Var>,
    input: Option<Var>,
}

/// One micro-batch's state between forward and backward (its `Debug` shows
/// the tensors' shapes, the batch's among them, not their values).
#[derive(Debug)]
pub struct CandleTape {
    order: CallOrder,
    ids: Tensor,
    targets: Tensor,
    /// Stage `l`'s input (`l >= 1`) until its backward.
    inputs: Vec<Option<Tensor>>,
    /// The output of the last forward so far.
    act: Option<Tensor>,
    kept: Vec<Option<Kept>>,
    /// d(loss)/d(output) of the stage whose backward is next.
    upstream: Option<Tensor>,
    loss: f32,
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

    fn start(&self, batch: &Batch) -> std::result::Result<CandleTape, EngineError> {
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
        })
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

    /// The tape's stage inputs and a stage's recompute (the builder's
    /// `activation_bytes`, else the stage inputs and the logits), plus candle's
    /// matmul workspace ([`CandleModel::matmul_workspace_bytes`]).
    fn activation_bytes(&self, batch: usize, seq: usize) -> usize {
        let own = match &self.activation {
            Some(f) => f(batch, seq),
            None => self.boundary_bytes(batch, seq),
        };
        own + self.matmul_workspace_bytes()
    }
}

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

use std::cell::RefCell;
use std::sync::Arc;

use candle_core::{DType, Device, Tensor, Var};
use candle_nn::VarBuilder;
use zeropp_engine::EngineError;
use zeropp_engine::model::kit::{CallOrder, split_params_mut, validate_batch};
use zeropp_engine::model::{Batch, LayerSpec, Model};

use crate::error::{CandleError, Result, to_engine};
use crate::params::{ParamInfo, Recorder, gathered, init_param};

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

impl CandleModelBuilder {
    /// Appends a stage (one gather unit) named `name`: `run(vb, input)` builds
    /// the stage's modules from `vb` (ordinary candle-nn code; parameter names
    /// are relative to the stage, so `{name}.{param}` is the tensor's name in
    /// checkpoints) and applies them to `input`.
    pub fn stage<F>(mut self, name: impl Into<String>, run: F) -> Self
    where
        F: for<'a> Fn(VarBuilder<'a>, &Tensor) -> candle_core::Result<Tensor> + Send + Sync + 'static,
    {
        self.stages.push((name.into(), Box::new(run)));
        self
    }

    /// Keep the forward's graph for backward instead of recomputing each stage
    /// (faster, but every stage's gathered weights stay alive from its forward
    /// to its backward: not ZeRO-3's memory). Off by default.
    pub fn keep_graph(mut self, on: bool) -> Self {
        self.keep_graph = on;
        self
    }

    /// Threads for candle's CPU matmuls on each rank (default 1): each rank
    /// runs its stages on a rayon pool of its own of this many threads. The
    /// thread backend runs one OS thread per rank, so more than
    /// `cores / ranks in the process` oversubscribes the cores; under MPI (one
    /// rank per process) a rank may use its share of the node's cores. 0 means
    /// no pool of ours: candle's own threading (every rank's matmuls split over
    /// all cores), which oversubscribes as soon as ranks run side by side.
    pub fn matmul_threads(mut self, threads: usize) -> Self {
        self.threads = threads;
        self
    }

    /// The activation bytes of a micro-batch of `(batch, seq)`, for the memory
    /// model. Without it the model counts the stage inputs the tape keeps and
    /// the logits, not a stage's own temporaries while it recomputes.
    pub fn activation_bytes(mut self, f: impl Fn(usize, usize) -> usize + Send + Sync + 'static) -> Self {
        self.activation = Some(Box::new(f));
        self
    }

    /// Builds the model: runs every stage once on zeros (a batch of one
    /// sequence of `seq_len` tokens) to learn its parameters (names, shapes,
    /// candle-nn's init hints) and output widths. Errors: no stages, an empty
    /// vocabulary or sequence length, a stage that fails, or a last stage that
    /// does not return `[batch, seq, vocab]` logits.
    pub fn build(self) -> Result<CandleModel> {
        if self.stages.is_empty() {
            return Err(CandleError::Config(format!("model {:?} has no stages", self.name)));
        }
        if self.vocab == 0 || self.seq_len == 0 || u32::try_from(self.vocab).is_err() {
            return Err(CandleError::Config(format!(
                "model {:?}: vocabulary {} and sequence length {} must be positive (and the vocabulary fit u32 ids)",
                self.name, self.vocab, self.seq_len
            )));
        }
        let mut x = Tensor::zeros((1, self.seq_len), DType::U32, &Device::Cpu)?;
        let mut stages = Vec::with_capacity(self.stages.len());
        let n = self.stages.len();
        for (i, (name, run)) in self.stages.into_iter().enumerate() {
            let rec = Recorder::default();
            let vb = VarBuilder::from_backend(Box::new(rec.clone()), DType::F32, Device::Cpu);
            let y = run(vb, &x)
                .map_err(|e| CandleError::Config(format!("stage {name:?} failed on zeros: {e}")))?;
            let dims = y.dims().to_vec();
            if dims.len() < 2 || dims[0] != 1 || dims[1] != self.seq_len {
                return Err(CandleError::Config(format!(
                    "stage {name:?} returned shape {dims:?}; stages keep the [batch, seq, ...] layout"
                )));
            }
            if i + 1 == n && dims != [1, self.seq_len, self.vocab] {
                return Err(CandleError::Config(format!(
                    "the last stage {name:?} returned shape {dims:?}, not logits [batch, seq, vocab] = [1, {}, {}]",
                    self.seq_len, self.vocab
                )));
            }
            let width = dims[2..].iter().product();
            stages.push(StageDef { name, run, params: rec.params(), width });
            x = y;
        }
        let layers = stages
            .iter()
            .map(|s| LayerSpec {
                name: s.name.clone(),
                params: s.params.iter().map(ParamInfo::spec).collect(),
            })
            .collect();
        let model = CandleModel {
            name: self.name,
            vocab: self.vocab,
            seq_len: self.seq_len,
            stages,
            layers,
            keep_graph: self.keep_graph,
            threads: self.threads,
            activation: self.activation,
        };
        zeropp_engine::engine::check_layers(&model)?;
        Ok(model)
    }
}

/// What the forward of one stage keeps with [`CandleModelBuilder::keep_graph`].
struct Kept {
    out: Tensor,
    vars: Vec<Var>,
    input: Option<Var>,
}

/// One micro-batch's state between forward and backward.
pub struct CandleTape {
    order: CallOrder,
    batch: usize,
    seq: usize,
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

impl std::fmt::Debug for CandleTape {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CandleTape")
            .field("order", &self.order)
            .field("batch", &self.batch)
            .field("seq", &self.seq)
            .field("loss", &self.loss)
            .finish_non_exhaustive()
    }
}

thread_local! {
    /// This thread's pool for candle's matmuls, and its size.
    static POOL: RefCell<Option<(usize, Arc<rayon::ThreadPool>)>> = const { RefCell::new(None) };
}

/// Runs `f` on this thread's pool of `threads` threads (candle's gemm splits
/// its work over the current rayon pool); with 0 threads, on this thread.
fn on_pool<T: Send>(threads: usize, f: impl FnOnce() -> T + Send) -> std::result::Result<T, EngineError> {
    if threads == 0 {
        return Ok(f());
    }
    let pool = POOL.with(|p| -> std::result::Result<Arc<rayon::ThreadPool>, EngineError> {
        let mut p = p.borrow_mut();
        if let Some((n, pool)) = p.as_ref()
            && *n == threads
        {
            return Ok(Arc::clone(pool));
        }
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build()
            .map_err(|e| EngineError::Training(format!("cannot start candle's matmul threads: {e}")))?;
        let pool = Arc::new(pool);
        *p = Some((threads, Arc::clone(&pool)));
        Ok(pool)
    })?;
    Ok(pool.install(f))
}

/// One core's L2 cache in bytes (Linux sysfs, `cpu0`), else 2 MiB.
fn l2_cache_bytes() -> usize {
    let dir = std::path::Path::new("/sys/devices/system/cpu/cpu0/cache");
    let read = |p: std::path::PathBuf| std::fs::read_to_string(p).ok().map(|s| s.trim().to_string());
    (0..8)
        .map(|i| dir.join(format!("index{i}")))
        .find(|d| read(d.join("level")).as_deref() == Some("2"))
        .and_then(|d| read(d.join("size")))
        .and_then(|s| {
            let (num, mult) = match s.strip_suffix('K') {
                Some(n) => (n, 1 << 10),
                None => match s.strip_suffix('M') {
                    Some(n) => (n, 1 << 20),
                    None => (s.as_str(), 1),
                },
            };
            num.parse::<usize>().ok().map(|n| n * mult)
        })
        .unwrap_or(2 << 20)
}

/// The mean softmax cross-entropy of `logits` (`[b, t, v]`) against `targets` (`[b·t]`).
fn loss_of(logits: &Tensor, targets: &Tensor) -> candle_core::Result<Tensor> {
    let (b, t, v) = logits.dims3()?;
    candle_nn::loss::cross_entropy(&logits.reshape((b * t, v))?, targets)
}

impl CandleModel {
    fn stage(&self, layer: usize) -> std::result::Result<&StageDef, EngineError> {
        self.stages.get(layer).ok_or(EngineError::LayerOutOfRange { layer, layers: self.stages.len() })
    }

    fn forward_stage(&self, layer: usize, params: &[f32], tape: &mut CandleTape) -> Result<()> {
        let stage = self.stage(layer)?;
        let last = layer + 1 == self.stages.len();
        let input = if layer == 0 {
            tape.ids.clone()
        } else {
            tape.act
                .take()
                .ok_or_else(|| CandleError::Config("forward without the previous stage's output".into()))?
        };
        let out = if self.keep_graph {
            let (g, vars) = gathered(&stage.name, &stage.params, params, true)?;
            let input_var = if layer == 0 { None } else { Some(Var::from_tensor(&input)?) };
            let x = input_var.as_ref().map_or(&input, |v| v.as_tensor());
            let out = (stage.run)(VarBuilder::from_backend(Box::new(g), DType::F32, Device::Cpu), x)?;
            if let Some(k) = tape.kept.get_mut(layer) {
                *k = Some(Kept { out: out.clone(), vars, input: input_var });
            }
            out
        } else {
            let (g, _) = gathered(&stage.name, &stage.params, params, false)?;
            let out = (stage.run)(VarBuilder::from_backend(Box::new(g), DType::F32, Device::Cpu), &input)?;
            if layer > 0
                && let Some(slot) = tape.inputs.get_mut(layer)
            {
                *slot = Some(input);
            }
            out
        };
        if last {
            tape.loss = loss_of(&out, &tape.targets)?.to_scalar::<f32>()?;
        } else {
            tape.act = Some(out.detach());
        }
        Ok(())
    }

    fn backward_stage(
        &self,
        layer: usize,
        params: &[f32],
        tape: &mut CandleTape,
        grad: &mut [f32],
    ) -> Result<()> {
        let stage = self.stage(layer)?;
        let last = layer + 1 == self.stages.len();
        let (out, vars, input) = match tape.kept.get_mut(layer).and_then(Option::take) {
            Some(k) => (k.out, k.vars, k.input),
            None => {
                let (g, vars) = gathered(&stage.name, &stage.params, params, true)?;
                let input = if layer == 0 {
                    None
                } else {
                    let x = tape.inputs.get_mut(layer).and_then(Option::take).ok_or_else(|| {
                        CandleError::Config(format!("stage {:?}: backward without its forward", stage.name))
                    })?;
                    Some(Var::from_tensor(&x)?)
                };
                let x = input.as_ref().map_or(&tape.ids, |v| v.as_tensor());
                let out = (stage.run)(VarBuilder::from_backend(Box::new(g), DType::F32, Device::Cpu), x)?;
                (out, vars, input)
            }
        };
        let objective = if last {
            loss_of(&out, &tape.targets)?
        } else {
            let up = tape.upstream.take().ok_or_else(|| {
                CandleError::Config(format!(
                    "stage {:?}: backward without the gradient from above",
                    stage.name
                ))
            })?;
            if up.dims() != out.dims() {
                return Err(CandleError::Config(format!(
                    "stage {:?}: output {:?}, upstream gradient {:?}",
                    stage.name,
                    out.dims(),
                    up.dims()
                )));
            }
            (&out * &up)?.sum_all()?
        };
        let grads = objective.backward()?;
        let mut parts = split_params_mut(&self.layers[layer], grad)?;
        for ((var, info), dst) in vars.iter().zip(&stage.params).zip(parts.iter_mut()) {
            let g = grads.get(var.as_tensor()).ok_or_else(|| CandleError::MissingGradient {
                stage: stage.name.clone(),
                param: info.name.clone(),
            })?;
            let v = g.flatten_all()?.to_vec1::<f32>()?;
            dst.copy_from_slice(&v);
        }
        if let Some(input) = input {
            let g = grads
                .get(input.as_tensor())
                .ok_or_else(|| CandleError::MissingInputGradient { stage: stage.name.clone() })?;
            tape.upstream = Some(g.detach());
        }
        Ok(())
    }

    /// The activation bytes of the stage inputs the tape keeps (every stage but
    /// the first) and of the logits with their softmax, for `(batch, seq)`.
    fn boundary_bytes(&self, batch: usize, seq: usize) -> usize {
        let tokens = batch * seq;
        let inputs: usize = self.stages.iter().rev().skip(1).map(|s| s.width).sum();
        4 * tokens * (inputs + 3 * self.vocab)
    }

    /// The memory candle's CPU matmuls hold on each of a rank's matmul
    /// threads: the `gemm` crate keeps one packing slab the size of a core's L2
    /// cache per thread that has run a matmul (read from Linux's sysfs; 2 MiB
    /// where it cannot be read). With candle's own threading (0), one slab.
    pub fn matmul_workspace_bytes(&self) -> usize {
        self.threads.max(1) * l2_cache_bytes()
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
            batch: batch.batch,
            seq: batch.seq_len,
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

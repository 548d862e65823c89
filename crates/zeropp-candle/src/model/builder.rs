//! [`CandleModelBuilder`]: stages in order, then `build`, which learns every
//! stage's parameters from one recorded run.

use candle_core::{DType, Device, Tensor};
use candle_nn::VarBuilder;
use zeropp_engine::model::LayerSpec;

use super::{CandleModel, CandleModelBuilder, StageDef};
use crate::error::{CandleError, Result};
use crate::params::{ParamInfo, Recorder};

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

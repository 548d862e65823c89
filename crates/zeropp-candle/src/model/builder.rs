//! [`CandleModelBuilder`]: stages in order, then `build`, which learns every
//! stage's parameters from one recorded run.

use candle_core::{DType, Device, Tensor};
use candle_nn::VarBuilder;
use zeropp_engine::model::LayerSpec;

use super::{Borrow, CandleModel, CandleModelBuilder, StageContext, StageDef};
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
        self.stages.push((name.into(), Box::new(move |vb, x, _: &StageContext| run(vb, x))));
        self
    }

    /// [`CandleModelBuilder::stage`] for a stage that needs its
    /// [`StageContext`]: the mode (training or evaluation) and a seed that the
    /// backward's recompute replays, for dropout ([`StageContext::dropout`])
    /// or any other randomness.
    pub fn stage_with<F>(mut self, name: impl Into<String>, run: F) -> Self
    where
        F: for<'a> Fn(VarBuilder<'a>, &Tensor, &StageContext) -> candle_core::Result<Tensor>
            + Send
            + Sync
            + 'static,
    {
        self.stages.push((name.into(), Box::new(run)));
        self
    }

    /// Ties two parameters, each named `{stage}.{param}` (an input embedding
    /// and an LM head, say): they become one parameter, stored and sharded
    /// in the earlier stage under its name, whose gradient is the sum of both
    /// uses. The later name disappears from the layers (and from checkpoints,
    /// as Hugging Face exports tied weights). Both must be asked for with one
    /// shape. Within one stage, the second name is an alias of the first.
    ///
    /// ```
    /// use candle_nn::Module;
    /// use zeropp_candle::CandleModel;
    /// use zeropp_engine::Model;
    /// let (vocab, d) = (16, 8);
    /// let model = CandleModel::builder("tied", vocab, 4)
    ///     .stage("embed", move |vb, ids| candle_nn::embedding(vocab, d, vb)?.forward(ids))
    ///     .stage("head", move |vb, x| candle_nn::Linear::new(vb.get((vocab, d), "weight")?, None).forward(x))
    ///     .tie("embed.weight", "head.weight")
    ///     .build()?;
    /// assert_eq!(model.layers()[0].params[0].name, "weight");
    /// assert!(model.layers()[1].params.is_empty());
    /// # Ok::<(), zeropp_candle::CandleError>(())
    /// ```
    pub fn tie(mut self, a: impl Into<String>, b: impl Into<String>) -> Self {
        self.ties.push((a.into(), b.into()));
        self
    }

    /// Declares that a stage asks for parameter `{stage}.{param}` more than
    /// once on purpose (two modules on one `VarBuilder` path share it).
    /// Undeclared, a repeated name is an error at `build()`: it is what a
    /// copy-pasted `vb.pp(..)` does.
    pub fn shared(mut self, name: impl Into<String>) -> Self {
        self.shared.push(name.into());
        self
    }

    /// Accepts elements of parameter `{stage}.{param}` that change the output
    /// yet get no gradient on purpose (rows of a weight frozen by `detach`,
    /// say), which `build()` otherwise refuses ([`CandleError::PartialGradient`]).
    /// Elements that change nothing (masked by a pruning mask) need no
    /// declaration: their zero gradient is the true one.
    pub fn allow_partial_gradient(mut self, name: impl Into<String>) -> Self {
        self.partial_ok.push(name.into());
        self
    }

    /// Splits the build's gradient check over the `parts` processes of a job:
    /// this one tests weight `i` (counted over the stages in order) against
    /// finite differences when `i % parts == part`. Every process still runs
    /// each stage's trial forward and backward (a weight with no gradient is
    /// found everywhere); the differences, nearly all of the check's time, are
    /// split, so the job as a whole checks every weight once.
    ///
    /// By default the share comes from the launcher's variables (OpenMPI,
    /// MPICH/PMI, Slurm `srun`: [`zeropp_engine::launch::detect_job`]): under
    /// `mpirun -np 4` each process tests a quarter of the weights, and a
    /// defect makes the process that finds it fail its build (the job then
    /// ends: its peers' collectives fail within their timeout). Outside a job
    /// every weight is tested. `check_share(0, 1)` tests every weight in any
    /// case; `parts` 0 or `part >= parts` is an error at `build()`.
    ///
    /// ```
    /// use candle_nn::Module;
    /// use zeropp_candle::CandleModel;
    /// let model = CandleModel::builder("half", 16, 4)
    ///     .stage("embed", |vb, ids| candle_nn::embedding(16, 8, vb)?.forward(ids))
    ///     .stage("head", |vb, x| candle_nn::linear(8, 16, vb)?.forward(x))
    ///     .check_share(1, 2)
    ///     .build()?;
    /// assert_eq!(model.gradient_check_share(), (1, 2));
    /// # Ok::<(), zeropp_candle::CandleError>(())
    /// ```
    pub fn check_share(mut self, part: usize, parts: usize) -> Self {
        self.check_share = Some((part, parts));
        self
    }

    /// The seed behind every stage's [`StageContext::seed`] (default 0).
    pub fn dropout_seed(mut self, seed: u64) -> Self {
        self.dropout_seed = seed;
        self
    }

    /// Keep every stage's forward graph for its backward (`true`: no
    /// recompute, but every stage's gathered weights stay alive from its
    /// forward to its backward, which is not ZeRO-3's memory), or none but the
    /// last stage's (`false`: ZeRO-3's memory, every stage recomputed).
    /// Shorthand for [`CandleModelBuilder::keep_graph_bytes`] with no limit
    /// or 0.
    pub fn keep_graph(self, on: bool) -> Self {
        self.keep_graph_bytes(if on { usize::MAX } else { 0 })
    }

    /// Keep the forward graphs of the last stages, whose backward comes
    /// first, as long as the weights they hold fit in `bytes` per rank
    /// (default [`DEFAULT_KEEP_GRAPH_BYTES`](super::DEFAULT_KEEP_GRAPH_BYTES),
    /// 64 MiB); the stages before them are recomputed in backward. A kept
    /// stage skips its recompute (a forward, about a sixth of a step each),
    /// at the cost of its gathered weights (f32) and its graph's activations
    /// staying alive from its forward to its backward. The values are the
    /// same either way, bit for bit: only memory and time change. The memory
    /// model counts the kept weights exactly; the graphs' activations come
    /// from [`CandleModelBuilder::activation_bytes`].
    ///
    /// ```
    /// use candle_nn::Module;
    /// use zeropp_candle::CandleModel;
    /// let stage = |vb: candle_nn::VarBuilder, x: &candle_core::Tensor| {
    ///     candle_nn::linear_no_bias(8, 8, vb)?.forward(x)
    /// };
    /// let builder = || {
    ///     CandleModel::builder("kept", 8, 4)
    ///         .stage("embed", |vb, ids| candle_nn::embedding(8, 8, vb)?.forward(ids))
    ///         .stage("a", stage)
    ///         .stage("b", stage)
    /// };
    /// // 256 bytes per 8x8 weight: room for stage b only; a and embed recompute.
    /// let m = builder().keep_graph_bytes(300).build()?;
    /// assert_eq!(m.kept_stages(), 1..3);
    /// assert_eq!(m.kept_weight_bytes(), 256);
    /// assert_eq!(builder().keep_graph(false).build()?.kept_stages(), 2..3);
    /// assert!(builder().build()?.keeps_graph());
    /// # Ok::<(), zeropp_candle::CandleError>(())
    /// ```
    pub fn keep_graph_bytes(mut self, bytes: usize) -> Self {
        self.keep_bytes = bytes;
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
    /// model: `f(batch, seq, kept)`, where the last `kept` stages keep their
    /// forward graphs (activations included) until their backward and the
    /// others recompute ([`CandleModel::kept_stages`]). The kept weights are
    /// counted apart. Without it the model counts the stage inputs the tape
    /// keeps and the logits, not a stage's own temporaries while it
    /// recomputes, nor the kept graphs' activations.
    pub fn activation_bytes(
        mut self,
        f: impl Fn(usize, usize, usize) -> usize + Send + Sync + 'static,
    ) -> Self {
        self.activation = Some(Box::new(f));
        self
    }

    /// Builds the model: runs every stage once on zeros (a batch of one
    /// sequence of `seq_len` tokens) to learn its parameters (names, shapes,
    /// candle-nn's init hints) and output widths, resolves the ties, then runs
    /// the gradient check (a trial forward and backward of every stage, see
    /// the [module docs](super)). Errors: no stages, an empty vocabulary or
    /// sequence length, a stage that fails, a last stage that does not return
    /// `[batch, seq, vocab]` logits, a bad tie, a name asked for twice
    /// undeclared, and a parameter with elements no gradient reaches.
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
        let ctx = StageContext::new(false, 0);
        for (i, (name, run)) in self.stages.into_iter().enumerate() {
            let rec = Recorder::default();
            let vb = VarBuilder::from_backend(Box::new(rec.clone()), DType::F32, Device::Cpu);
            let y = run(vb, &x, &ctx)
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
            if let Some(r) = rec.repeats().into_iter().find(|r| !self.shared.contains(&format!("{name}.{r}")))
            {
                return Err(CandleError::Config(format!(
                    "stage {name:?} asks for parameter {r:?} more than once, so the modules built on that path \
                     share one weight (a copy-pasted `vb.pp(..)`?): give them different paths, or declare the \
                     sharing with `.shared(\"{name}.{r}\")`"
                )));
            }
            let width = dims[2..].iter().product();
            stages.push(StageDef {
                name,
                run,
                params: rec.params(),
                width,
                borrows: Vec::new(),
                lends: Vec::new(),
                aliases: Vec::new(),
            });
            x = y;
        }
        let share = match self.check_share {
            Some((part, parts)) if parts == 0 || part >= parts => {
                return Err(CandleError::Config(format!(
                    "check_share({part}, {parts}): the share must be one of 0..{parts} (and parts at least 1)"
                )));
            }
            Some(share) => share,
            None => zeropp_engine::launch::detect_job(&|k| std::env::var(k).ok())?
                .map_or((0, 1), |job| (job.rank, job.world)),
        };
        resolve_ties(&mut stages, &self.ties)?;
        let layers: Vec<LayerSpec> = stages
            .iter()
            .map(|s| LayerSpec {
                name: s.name.clone(),
                params: s.params.iter().map(ParamInfo::spec).collect(),
            })
            .collect();
        let kept_from = super::kept_from(&layers, self.keep_bytes);
        let mut model = CandleModel {
            name: self.name,
            vocab: self.vocab,
            seq_len: self.seq_len,
            stages,
            layers,
            kept_from,
            threads: self.threads,
            activation: self.activation,
            dropout_seed: self.dropout_seed,
            check_notes: Vec::new(),
            check_share: share,
        };
        zeropp_engine::engine::check_layers(&model)?;
        model.check_notes = model.check_gradient_paths(&self.partial_ok, share)?;
        // The check's buffers are free now; out of the resident set with them.
        crate::alloc::release_freed_memory();
        Ok(model)
    }
}

/// `(stage, param)` of the full name `{stage}.{param}`.
fn find(stages: &[StageDef], full: &str) -> Result<(usize, usize)> {
    stages
        .iter()
        .enumerate()
        .find_map(|(s, st)| {
            let rest = full.strip_prefix(st.name.as_str())?.strip_prefix('.')?;
            st.params.iter().position(|p| p.name == rest).map(|p| (s, p))
        })
        .ok_or_else(|| {
            CandleError::Config(format!(
                "tie: no stage asks for a parameter named {full:?} (names are `{{stage}}.{{param}}`)"
            ))
        })
}

/// Turns each tie into a borrow (across stages) or an alias (within one):
/// the later parameter leaves its stage's list.
fn resolve_ties(stages: &mut [StageDef], ties: &[(String, String)]) -> Result<()> {
    // Resolve every name first: removing parameters shifts the indices.
    let mut pairs = Vec::with_capacity(ties.len());
    for (a, b) in ties {
        let (pa, pb) = (find(stages, a)?, find(stages, b)?);
        if pa == pb {
            return Err(CandleError::Config(format!("tie: {a:?} is tied to itself")));
        }
        let (sa, sb) = (&stages[pa.0].params[pa.1], &stages[pb.0].params[pb.1]);
        if sa.shape != sb.shape {
            return Err(CandleError::Config(format!(
                "tie: {a:?} has shape {:?} and {b:?} has shape {:?}",
                sa.shape, sb.shape
            )));
        }
        let (owner, user) = if pa < pb { (pa, pb) } else { (pb, pa) };
        pairs.push((owner, user, if pa < pb { b } else { a }));
    }
    for (i, (_, user, name)) in pairs.iter().enumerate() {
        if pairs.iter().enumerate().any(|(j, (o, u, _))| (j != i && u == user) || o == user) {
            return Err(CandleError::Config(format!(
                "tie: {name:?} is tied more than once or both ways; tie each parameter to one owner directly"
            )));
        }
    }
    // Remove the users, highest index first within a stage.
    let mut users: Vec<(usize, usize)> = pairs.iter().map(|(_, u, _)| *u).collect();
    users.sort_unstable_by(|x, y| y.cmp(x));
    let removed: Vec<(usize, usize, String)> =
        users.iter().map(|&(s, p)| (s, p, stages[s].params.remove(p).name)).collect();
    // An owner's index after the removals in its own stage.
    let shifted = |(s, p): (usize, usize)| p - users.iter().filter(|&&(us, up)| us == s && up < p).count();
    for (owner, user, _) in pairs {
        let local = removed
            .iter()
            .find(|(s, p, _)| (*s, *p) == user)
            .map(|(_, _, n)| n.clone())
            .ok_or_else(|| CandleError::Config("tie: lost a parameter".into()))?;
        let param = shifted(owner);
        if owner.0 == user.0 {
            stages[owner.0].aliases.push((local, param));
        } else {
            stages[user.0].borrows.push(Borrow { local, owner: owner.0, param });
            if !stages[owner.0].lends.contains(&param) {
                stages[owner.0].lends.push(param);
            }
        }
    }
    Ok(())
}

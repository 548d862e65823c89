//! The per-rank ZeRO-3 / ZeRO++ engine.
//!
//! [`ZeroEngine`] holds one rank's share of the model states: the f32 master
//! shard, the AdamW moments and the gradient accumulator of every layer (the
//! primary shards of the [`PartitionPlan`]), plus the hpZ secondary shards while
//! they are valid. [`ZeroEngine::train_step`] runs one optimizer step over a
//! rank's micro-batches, following the data flow of ARCHITECTURE.md:
//!
//! 1. forward, layer by layer: gather the layer (qwZ INT8 or 16/32-bit over the
//!    world; from the hpZ secondary shards once they exist), prefetching the next
//!    layer's gather on a second communicator, keeping the hpZ secondary slice,
//!    releasing the full weights after use;
//! 2. backward in reverse: re-gather (hpZ: intra-node from the secondary shards),
//!    prefetching the next layer down on the second communicator, compute the gradient, reduce-scatter it (qgZ or baseline) into the owner's
//!    shard, accumulate over micro-batches;
//! 3. step: global gradient norm (all-reduce of a scalar), skip on non-finite,
//!    clip, AdamW on the master shard, invalidate the secondary shards.
//!
//! Traffic is tagged `fwd_gather`, `bwd_gather`, `grad_reduce`, `grad_norm`
//! (evaluation gathers: `eval`). The engine is generic over
//! `C: Communicator + ?Sized`, so any backend can drive it.

pub mod bytes;
pub mod checkpoint;
mod layer_comm;
pub mod memory;

use zeropp_comm::{CommError, CommExt, Communicator, Group, Topology};
use zeropp_partition::{DType, ParamRegistry, ParamSpec, PartitionPlan, PlanConfig};

use crate::EngineError;
use crate::config::EngineConfig;
use crate::model::{Batch, Model};
use crate::optim::{AdamW, clip_factor};

pub use layer_comm::Prefetcher;
use layer_comm::{LayerComm, PendingGather, Secondary};

/// Operation tags of the traffic counters.
pub mod tags {
    /// Forward weight all-gathers.
    pub const FWD_GATHER: &str = "fwd_gather";
    /// Backward weight re-gathers.
    pub const BWD_GATHER: &str = "bwd_gather";
    /// Gradient reduce-scatters.
    pub const GRAD_REDUCE: &str = "grad_reduce";
    /// The all-reduce of the squared gradient norm.
    pub const GRAD_NORM: &str = "grad_norm";
    /// Evaluation gathers (outside training steps).
    pub const EVAL: &str = "eval";
    /// The once-per-step gather of the persistent parameters
    /// ([`BucketKnobs::param_persistence_threshold`](crate::config::BucketKnobs)).
    pub const PERSIST_GATHER: &str = "persist_gather";
    /// Everything else.
    pub const OTHER: &str = "other";
}

/// A failure injected into a step with [`ZeroEngine::inject_fault`], to test
/// fault handling (never used in normal runs).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Inject {
    /// Nothing injected.
    #[default]
    None,
    /// The rank fails with an error after its first forward pass.
    FailMidStep,
    /// The rank's local gradient of the first layer reduced in the step (the last
    /// layer, in the first micro-batch) gets a NaN *before* the reduce, where a
    /// real overflow appears; every rank must then skip the step.
    NanGradient,
}

/// Where one step's wall time went on this rank, in seconds. The four parts are
/// disjoint: `quant_s` is the quantization work the collectives did on this
/// rank's thread (comm's [`quant_time`](zeropp_comm::TrafficCounter::quant_time)),
/// taken out of the communication time it happened in. Gathers prefetched on the
/// worker thread overlap compute and are not counted here.
#[derive(Debug, Clone, Copy, PartialEq, Default, serde::Serialize, serde::Deserialize)]
pub struct StepTimes {
    /// The model's forward and backward passes (with the layout copies around them).
    pub compute_s: f64,
    /// Gathers, reduces and the norm exchange, and waits for prefetched gathers,
    /// without their quantization (`quant_s`).
    pub comm_s: f64,
    /// Quantizing, dequantizing and the fused qgZ reduce inside the collectives
    /// (qwZ, hpZ INT8, qgZ); zero for ZeRO-3.
    #[serde(default)]
    pub quant_s: f64,
    /// The optimizer update (clipping and AdamW on the shards).
    pub optim_s: f64,
}

/// What one optimizer step did on this rank.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct StepOutcome {
    /// Mean loss of this rank's micro-batches.
    pub loss: f32,
    /// Global gradient norm before clipping (non-finite when skipped).
    pub grad_norm: f32,
    /// True when the update was skipped (non-finite gradient somewhere).
    pub skipped: bool,
    /// Where the step's time went.
    pub times: StepTimes,
    /// Gathers issued on the prefetch stream in this step.
    pub prefetched: usize,
}

/// A bucket of [`StepTimes`].
#[derive(Debug, Clone, Copy)]
enum Lap {
    Compute,
    Comm,
    Optim,
}

/// Replaces every non-finite value of `grad` by zero; true when there was one.
fn sanitize(grad: &mut [f32]) -> bool {
    if grad.iter().all(|g| g.is_finite()) {
        return false;
    }
    grad.iter_mut().filter(|g| !g.is_finite()).for_each(|g| *g = 0.0);
    true
}

/// The sum over `group` of one f64 per rank, identical on every rank: an
/// all-gather of the 8-byte values, summed in group order (NaN and infinities
/// propagate). Sends 8 bytes to each other member.
pub(crate) fn global_sum_f64<C: Communicator + ?Sized>(
    comm: &mut C,
    group: &Group,
    value: f64,
) -> Result<f64, CommError> {
    let mut all = vec![0.0f64; group.size()];
    comm.all_gather(group, &[value], &mut all)?;
    Ok(all.iter().sum())
}

/// Name of the bucket that holds the persistent parameters (the last bucket,
/// after one bucket per model layer), when there are any.
pub const PERSISTENT_BUCKET: &str = "persistent";

/// Builds the [`PartitionPlan`] the engine uses for `model` on `topology`:
/// one bucket per model layer, shards aligned to the quantization groups.
/// With a persistence threshold (`cfg.zero.buckets.param_persistence_threshold`),
/// the parameters of at most that many elements leave their layer's bucket for
/// one last bucket, [`PERSISTENT_BUCKET`] (a layer's bucket may then be empty).
pub fn build_plan<M: Model + ?Sized>(
    model: &M,
    cfg: &EngineConfig,
    topology: Topology,
) -> Result<PartitionPlan, EngineError> {
    let mut reg = ParamRegistry::new();
    let threshold = cfg.zero.buckets.param_persistence_threshold;
    let mut persistent = Vec::new();
    for layer in model.layers() {
        let mut params = Vec::new();
        for p in &layer.params {
            let spec = ParamSpec::new(format!("{}.{}", layer.name, p.name), p.shape.clone(), DType::F32);
            if p.numel() <= threshold {
                persistent.push(spec);
            } else {
                params.push(spec);
            }
        }
        reg.push_bucket(layer.name.clone(), params)?;
    }
    if !persistent.is_empty() {
        reg.push_bucket(PERSISTENT_BUCKET, persistent)?;
    }
    let align = shard_align(cfg);
    let mut plan_cfg = PlanConfig::new(align, cfg.zero.hpz_size);
    if cfg.zero.per_tensor_groups {
        // Every parameter starts a quantization group (of qwZ and of qgZ), so no
        // group mixes two tensors: per-tensor scales, as DeepSpeed quantizes.
        plan_cfg = plan_cfg.with_param_align(align);
    }
    Ok(PartitionPlan::new(&reg, topology, plan_cfg)?)
}

/// Shard alignment: a common multiple of the qwZ and qgZ group sizes, taking
/// the default group size for a technique that is off
/// ([`ZeroConfig::group_sizes`](crate::ZeroConfig::group_sizes)), so every mode
/// of a comparison with the default specs pads the model the same way.
pub fn shard_align(cfg: &EngineConfig) -> usize {
    fn gcd(a: usize, b: usize) -> usize {
        if b == 0 { a } else { gcd(b, a % b) }
    }
    let (a, b) = cfg.zero.group_sizes();
    let (a, b) = (a.max(2), b.max(2));
    let l = a / gcd(a, b) * b;
    if l.is_multiple_of(2) { l } else { 2 * l }
}

/// Where each model parameter lives in a plan: per model layer, per parameter,
/// `(bucket, index of the parameter in that bucket)`.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Placement {
    params: Vec<Vec<(usize, usize)>>,
    /// The persistent bucket (the one after the layers), if any.
    persistent: Option<usize>,
}

impl Placement {
    fn of<M: Model + ?Sized>(model: &M, plan: &PartitionPlan) -> Result<Self, EngineError> {
        let layers = model.layers();
        let persistent =
            plan.buckets().iter().position(|b| b.name == PERSISTENT_BUCKET).filter(|&b| b == layers.len());
        let pos = |b: usize, name: &str| -> Option<usize> {
            plan.bucket(b).ok()?.params.iter().position(|p| p.name == name)
        };
        let params = layers
            .iter()
            .enumerate()
            .map(|(l, layer)| {
                layer
                    .params
                    .iter()
                    .map(|p| {
                        let name = format!("{}.{}", layer.name, p.name);
                        pos(l, &name)
                            .map(|i| (l, i))
                            .or_else(|| persistent.and_then(|pb| pos(pb, &name).map(|i| (pb, i))))
                            .ok_or_else(|| {
                                EngineError::Training(format!("parameter {name} is in no bucket of the plan"))
                            })
                    })
                    .collect::<Result<Vec<_>, _>>()
            })
            .collect::<Result<Vec<_>, _>>()?;
        Ok(Self { params, persistent })
    }

    /// True when some parameter of layer `l` is persistent.
    fn has_persistent(&self, l: usize) -> bool {
        self.params.get(l).is_some_and(|ps| ps.iter().any(|&(b, _)| b != l))
    }
}

/// One rank's ZeRO-3 / ZeRO++ state and step (see the [module docs](self)).
#[derive(Debug)]
pub struct ZeroEngine<'m, M: Model> {
    model: &'m M,
    cfg: EngineConfig,
    plan: PartitionPlan,
    rank: usize,
    world: Group,
    hpz_group: Option<Group>,
    master: Vec<Vec<f32>>,
    optim: Vec<AdamW>,
    grad_acc: Vec<Vec<f32>>,
    secondary: Vec<Option<Secondary>>,
    comms: LayerComm,
    steps: usize,
    skipped: usize,
    /// The fault [`Self::inject_fault`] set for the next step (tests only).
    inject: Inject,
    placement: Placement,
    /// The persistent bucket, gathered (padded flat layout); `None` until the
    /// first gather of a step, and again after each update.
    persist_full: Option<Vec<f32>>,
    /// Gathers issued on the prefetch stream so far.
    prefetched: usize,
    /// Time split of the step in progress.
    times: StepTimes,
}

impl<'m, M: Model> ZeroEngine<'m, M> {
    /// The state of `rank`: master shards initialised from `cfg.seed` (every rank
    /// initialises each layer the same way and keeps its own shard), zero moments.
    pub fn new(
        model: &'m M,
        cfg: &EngineConfig,
        topology: Topology,
        rank: usize,
    ) -> Result<Self, EngineError> {
        cfg.validate(topology.world(), topology.local_size())?;
        if rank >= topology.world() {
            return Err(EngineError::InvalidConfig(format!(
                "rank {rank} outside a world of {}",
                topology.world()
            )));
        }
        let plan = build_plan(model, cfg, topology)?;
        let placement = Placement::of(model, &plan)?;
        let mut master = Vec::with_capacity(plan.num_buckets());
        // The persistent parameters, back to back in bucket order.
        let mut persist = Vec::new();
        for (l, layer) in model.layers().iter().enumerate() {
            let mut full = vec![0.0f32; layer.numel()];
            model.init_layer(l, cfg.seed, &mut full)?;
            if placement.has_persistent(l) {
                let mut mine = Vec::with_capacity(full.len());
                let mut at = 0;
                for (p, &(b, _)) in layer.params.iter().zip(&placement.params[l]) {
                    let part = full.get(at..at + p.numel()).unwrap_or_default();
                    if b == l {
                        mine.extend_from_slice(part)
                    } else {
                        persist.extend_from_slice(part)
                    }
                    at += p.numel();
                }
                full = mine;
            }
            master.push(plan.shard_of(l, rank, &full)?);
        }
        if let Some(pb) = placement.persistent {
            master.push(plan.shard_of(pb, rank, &persist)?);
        }
        let hpz_group = if cfg.zero.hpz() {
            let g = plan.hpz_group(rank)?;
            Some(Group::new(&topology, g.ranks).map_err(EngineError::InvalidTopology)?)
        } else {
            None
        };
        let optim = master.iter().map(|m| AdamW::new(cfg.optim, m.len())).collect();
        let comms = LayerComm::new(cfg, rank, &plan)?;
        let grad_acc = master.iter().map(|m| vec![0.0; m.len()]).collect();
        let n = master.len();
        Ok(Self {
            model,
            cfg: cfg.clone(),
            world: Group::world(&topology),
            hpz_group,
            comms,
            plan,
            rank,
            master,
            optim,
            grad_acc,
            secondary: vec![None; n],
            steps: 0,
            skipped: 0,
            inject: Inject::None,
            placement,
            persist_full: None,
            prefetched: 0,
            times: StepTimes::default(),
        })
    }

    /// The partition plan.
    pub fn plan(&self) -> &PartitionPlan {
        &self.plan
    }

    /// This rank.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// The configuration.
    pub fn config(&self) -> &EngineConfig {
        &self.cfg
    }

    /// The f32 master shard of every layer (padded primary shards).
    pub fn master_shards(&self) -> &[Vec<f32>] {
        &self.master
    }

    /// The AdamW state of every layer's shard.
    pub fn optimizer_states(&self) -> &[AdamW] {
        &self.optim
    }

    /// Optimizer steps run so far (including skipped ones).
    pub fn steps(&self) -> usize {
        self.steps
    }

    /// Steps skipped because of a non-finite gradient.
    pub fn skipped_steps(&self) -> usize {
        self.skipped
    }

    /// Gathers issued on the prefetch stream so far (forward and backward), as
    /// the prefetch knobs allow ([`Self::may_prefetch`]).
    pub fn prefetched_gathers(&self) -> usize {
        self.prefetched
    }

    /// Whether the gather of layer `next` may be prefetched while layer `cur`
    /// computes: `next` has a non-empty bucket of at most
    /// `stage3_prefetch_bucket_size` padded elements, and the two gathered layers
    /// together stay within `stage3_max_live_parameters`.
    pub fn may_prefetch(&self, cur: usize, next: usize) -> bool {
        let k = self.cfg.zero.buckets;
        let size = |l: usize| self.plan.bucket(l).map_or(0, |b| b.padded_len);
        let (c, n) = (size(cur), size(next));
        n > 0
            && k.prefetch_bucket_size.is_none_or(|m| n <= m)
            && k.max_live_parameters.is_none_or(|m| c + n <= m)
    }

    /// The persistent parameters gathered (padded flat layout of the persistent
    /// bucket), when held.
    pub fn persistent_params(&self) -> Option<&[f32]> {
        self.persist_full.as_deref()
    }

    /// Gathers the persistent bucket when it is not held (once per step, and
    /// before an evaluation), tagged `tag`.
    fn refresh_persistent<C: Communicator + ?Sized>(
        &mut self,
        comm: &mut C,
        tag: &str,
    ) -> Result<(), EngineError> {
        let Some(pb) = self.placement.persistent else { return Ok(()) };
        if self.persist_full.is_some() {
            return Ok(());
        }
        comm.traffic_mut().set_op(tag);
        let full = self.comms.gather_persistent(comm, &self.master[pb])?;
        comm.traffic_mut().set_op(tags::OTHER);
        self.persist_full = Some(full);
        Ok(())
    }

    /// Adds the time since `since` to `lap`; returns now.
    fn lap(&mut self, since: std::time::Instant, lap: Lap) -> std::time::Instant {
        let now = std::time::Instant::now();
        let dt = now.duration_since(since).as_secs_f64();
        match lap {
            Lap::Compute => self.times.compute_s += dt,
            Lap::Comm => self.times.comm_s += dt,
            Lap::Optim => self.times.optim_s += dt,
        }
        now
    }

    /// The number of model layers (buckets without the persistent one).
    fn num_layers(&self) -> usize {
        self.placement.params.len()
    }

    /// True when layer `l`'s bucket holds anything to gather.
    fn gathered(&self, l: usize) -> bool {
        self.plan.bucket(l).is_ok_and(|b| b.padded_len > 0)
    }

    /// True while hpZ secondary shards are held (between a forward and the step).
    pub fn has_secondary(&self) -> bool {
        self.secondary.iter().any(Option::is_some)
    }

    /// Replaces the model states (from a checkpoint): master shards, optimizer
    /// states, step counters. Secondary shards are invalidated.
    pub fn load_state(
        &mut self,
        master: Vec<Vec<f32>>,
        optim: Vec<AdamW>,
        steps: usize,
        skipped: usize,
    ) -> Result<(), EngineError> {
        if master.len() != self.master.len() || optim.len() != self.master.len() {
            return Err(EngineError::LengthMismatch {
                what: "checkpoint layers",
                expected: self.master.len(),
                got: master.len().min(optim.len()),
            });
        }
        for (l, (m, o)) in master.iter().zip(&optim).enumerate() {
            let want = self.master[l].len();
            if m.len() != want || o.m().len() != want {
                return Err(EngineError::LengthMismatch {
                    what: "checkpoint shard",
                    expected: want,
                    got: m.len(),
                });
            }
        }
        self.master = master;
        self.optim = optim;
        self.steps = steps;
        self.skipped = skipped;
        self.invalidate_secondary();
        self.persist_full = None;
        Ok(())
    }

    /// Restores a rank's state from a checkpoint (see [`checkpoint::load`]): the
    /// model and optimizer states, the step counters and, when saved on this
    /// topology, the qgZ error-feedback residuals.
    pub fn restore(&mut self, state: &checkpoint::RankState) -> Result<(), EngineError> {
        self.load_state(state.master.clone(), state.optim.clone(), state.steps, state.skipped)?;
        if let Some(fb) = &state.feedback {
            self.comms.restore_feedback(fb.clone())?;
        }
        Ok(())
    }

    /// The qgZ error-feedback residuals of every layer, `(hop 1, hop 2)` (empty
    /// without error feedback).
    pub(crate) fn feedback_state(&self) -> Vec<layer_comm::FeedbackState<'_>> {
        self.comms.feedback_state()
    }

    fn invalidate_secondary(&mut self) {
        for s in &mut self.secondary {
            *s = None;
        }
    }

    /// The range of layer `l` this rank keeps as its hpZ secondary shard, when a
    /// forward gather (not an evaluation) should keep one.
    fn keep_range(&self, l: usize, eval: bool) -> Result<Option<std::ops::Range<usize>>, EngineError> {
        if eval || self.hpz_group.is_none() {
            return Ok(None);
        }
        Ok(self.plan.secondary_range(self.rank, l)?)
    }

    /// Gathers layer `l` for the forward pass (or evaluation when `eval`): from
    /// the hpZ secondary shards once they exist, else over the world (keeping the
    /// secondary shard).
    fn gather_forward<C: Communicator + ?Sized>(
        &mut self,
        comm: &mut C,
        l: usize,
        eval: bool,
    ) -> Result<Vec<f32>, EngineError> {
        if !self.gathered(l) {
            return Ok(Vec::new());
        }
        if !eval && let (Some(g), Some(sec)) = (&self.hpz_group, &self.secondary[l]) {
            comm.traffic_mut().set_op(tags::FWD_GATHER);
            return self.comms.gather_secondary(comm, g, sec);
        }
        comm.traffic_mut().set_op(if eval { tags::EVAL } else { tags::FWD_GATHER });
        let keep = self.keep_range(l, eval)?;
        let (full, sec) = self.comms.gather_weights(comm, &self.master[l], keep)?;
        if sec.is_some() {
            self.secondary[l] = sec;
        }
        Ok(full)
    }

    /// Layer `l`'s parameters back to back, as the model takes them, from the
    /// gathered flat buffer (borrowed when the layout is packed), and the
    /// persistent parameters when the layer has any.
    fn model_view<'a>(&self, l: usize, full: &'a [f32]) -> Result<std::borrow::Cow<'a, [f32]>, EngineError> {
        let layout = self.plan.bucket(l)?;
        if self.placement.has_persistent(l) {
            let pb = self.placement.persistent.unwrap_or(l);
            let persistent = self.plan.bucket(pb)?;
            let held = self.persist_full.as_deref().ok_or_else(|| {
                EngineError::CallOrder("persistent parameters used before their gather".into())
            })?;
            let mut out = Vec::with_capacity(self.model.layers()[l].numel());
            for &(b, i) in &self.placement.params[l] {
                let (src, slots) = if b == l { (full, layout) } else { (held, persistent) };
                let part = slots.params.get(i).and_then(|p| src.get(p.range())).ok_or(
                    EngineError::LengthMismatch {
                        what: "gathered layer",
                        expected: slots.padded_len,
                        got: src.len(),
                    },
                )?;
                out.extend_from_slice(part);
            }
            return Ok(std::borrow::Cow::Owned(out));
        }
        if layout.is_packed() {
            let numel = layout.numel;
            full.get(..numel).map(std::borrow::Cow::Borrowed).ok_or(EngineError::LengthMismatch {
                what: "gathered layer",
                expected: numel,
                got: full.len(),
            })
        } else {
            Ok(std::borrow::Cow::Owned(layout.compact(full)?))
        }
    }

    /// Gathers layer `l` for the backward pass.
    fn gather_backward<C: Communicator + ?Sized>(
        &mut self,
        comm: &mut C,
        l: usize,
    ) -> Result<Vec<f32>, EngineError> {
        comm.traffic_mut().set_op(tags::BWD_GATHER);
        match (&self.hpz_group, &self.secondary[l]) {
            (Some(g), Some(sec)) => self.comms.gather_secondary(comm, g, sec),
            (Some(_), None) => Err(EngineError::Training(format!(
                "hpZ secondary shard of layer {l} missing in backward (forward did not run?)"
            ))),
            _ => Ok(self.comms.gather_weights(comm, &self.master[l], None)?.0),
        }
    }

    /// Submits layer `l`'s backward re-gather to the prefetch stream.
    fn prefetch_backward(&mut self, pf: &mut Prefetcher, l: usize) -> Result<PendingGather, EngineError> {
        match (&self.hpz_group, &self.secondary[l]) {
            (Some(g), Some(sec)) => Ok(self.comms.prefetch_secondary(pf, g, sec, tags::BWD_GATHER)),
            (Some(_), None) => Err(EngineError::Training(format!(
                "hpZ secondary shard of layer {l} missing in backward (forward did not run?)"
            ))),
            _ => Ok(self.comms.prefetch_weights(pf, &self.master[l], None, tags::BWD_GATHER)),
        }
    }

    /// Forward pass of one micro-batch, with prefetch of the next layer's gather
    /// on `prefetch` when given. Returns the tape.
    fn forward_pass<C: Communicator + ?Sized>(
        &mut self,
        comm: &mut C,
        mut prefetch: Option<&mut Prefetcher>,
        batch: &Batch,
        eval: bool,
    ) -> Result<M::Tape, EngineError> {
        let model = self.model;
        let n = self.num_layers();
        self.refresh_persistent(comm, if eval { tags::EVAL } else { tags::PERSIST_GATHER })?;
        let mut tape = model.start(batch)?;
        // Prefetch only world gathers of the primary shards (hpZ-sourced gathers
        // are intra-node and cheap; they run inline).
        let can_prefetch =
            |this: &Self, l: usize| eval || this.hpz_group.is_none() || this.secondary[l].is_none();
        let mut pending: Option<(usize, PendingGather)> = None;
        for l in 0..n {
            let t = std::time::Instant::now();
            let full = match pending.take() {
                Some((pl, p)) if pl == l => {
                    let (full, sec) = p.wait()?;
                    if sec.is_some() {
                        self.secondary[l] = sec;
                    }
                    full
                }
                _ => self.gather_forward(comm, l, eval)?,
            };
            if let Some(pf) = prefetch.as_deref_mut()
                && l + 1 < n
                && can_prefetch(self, l + 1)
                && self.may_prefetch(l, l + 1)
            {
                let tag = if eval { tags::EVAL } else { tags::FWD_GATHER };
                let keep = self.keep_range(l + 1, eval)?;
                let p = self.comms.prefetch_weights(pf, &self.master[l + 1], keep, tag);
                self.prefetched += 1;
                pending = Some((l + 1, p));
            }
            let t = self.lap(t, Lap::Comm);
            model.forward(l, &self.model_view(l, &full)?, &mut tape)?;
            drop(full);
            self.lap(t, Lap::Compute);
        }
        if let Some((_, p)) = pending {
            p.wait()?;
        }
        Ok(tape)
    }

    /// Mean loss of `batch` (this rank's share of an evaluation batch), forward only.
    pub fn evaluate<C: Communicator + ?Sized>(
        &mut self,
        comm: &mut C,
        prefetch: Option<&mut Prefetcher>,
        batch: &Batch,
    ) -> Result<f32, EngineError> {
        self.comms.start_step(self.steps, false);
        let tape = self.forward_pass(comm, prefetch, batch, true)?;
        comm.traffic_mut().set_op(tags::OTHER);
        Ok(self.model.loss(&tape))
    }

    /// Test hook: injects `fault` into the next [`Self::train_step`] only (it is
    /// cleared when that step starts). Normal runs never call it.
    pub fn inject_fault(&mut self, fault: Inject) {
        self.inject = fault;
    }

    /// One optimizer step over this rank's `micro_batches` (one per gradient
    /// accumulation step). Every rank must call it with the same number of
    /// micro-batches; `prefetch` (a [`Prefetcher`] on a duplicated communicator)
    /// overlaps the next layer's gather (forward and backward) with compute.
    pub fn train_step<C: Communicator + ?Sized>(
        &mut self,
        comm: &mut C,
        mut prefetch: Option<&mut Prefetcher>,
        micro_batches: &[Batch],
    ) -> Result<StepOutcome, EngineError> {
        let inject = std::mem::take(&mut self.inject);
        if micro_batches.is_empty() {
            return Err(EngineError::InvalidBatch("a step needs at least one micro-batch".into()));
        }
        let model = self.model;
        let n = self.num_layers();
        self.comms.start_step(self.steps, true);
        self.times = StepTimes::default();
        let quant_before = comm.traffic().quant_time();
        let prefetched_before = self.prefetched;
        let mut loss_sum = 0.0f32;
        // Set when this rank's local gradient (before any reduce) held a NaN or an
        // infinity: the non-finite values are replaced by zeros so the collectives
        // (and their quantizers, which reject non-finite input) run normally on
        // every rank, and the flag travels in the norm exchange below, so that all
        // ranks agree to skip the step.
        let mut non_finite = false;
        for (mi, batch) in micro_batches.iter().enumerate() {
            let mut tape = self.forward_pass(comm, prefetch.as_deref_mut(), batch, false)?;
            if inject == Inject::FailMidStep && mi == 0 {
                return Err(EngineError::Training("injected failure in the middle of a step".into()));
            }
            loss_sum += model.loss(&tape);
            // Backward: while layer l computes, the prefetch stream gathers layer
            // l-1 (from the hpZ secondary shards when they exist).
            let mut pending: Option<(usize, PendingGather)> = None;
            let mut persist_grad: Option<Vec<f32>> = None;
            for l in (0..n).rev() {
                let t = std::time::Instant::now();
                let full = match pending.take() {
                    Some((pl, p)) if pl == l => p.wait()?.0,
                    _ if !self.gathered(l) => Vec::new(),
                    _ => self.gather_backward(comm, l)?,
                };
                if let Some(pf) = prefetch.as_deref_mut()
                    && l > 0
                    && self.may_prefetch(l, l - 1)
                {
                    pending = Some((l - 1, self.prefetch_backward(pf, l - 1)?));
                    self.prefetched += 1;
                }
                let t = self.lap(t, Lap::Comm);
                let mut grad = vec![0.0f32; full.len()];
                let layout = self.plan.bucket(l)?;
                if self.placement.has_persistent(l) {
                    let mut compact = vec![0.0f32; model.layers()[l].numel()];
                    model.backward(l, &self.model_view(l, &full)?, &mut tape, &mut compact)?;
                    let pb = self.placement.persistent.unwrap_or(l);
                    let persistent = self.plan.bucket(pb)?;
                    let pgrad = persist_grad.get_or_insert_with(|| vec![0.0f32; persistent.padded_len]);
                    let mut at = 0;
                    for &(b, i) in &self.placement.params[l] {
                        let (dst, slots): (&mut [f32], _) =
                            if b == l { (&mut grad, layout) } else { (pgrad.as_mut_slice(), persistent) };
                        let slot = slots.params.get(i).map(|p| p.range()).unwrap_or_default();
                        let src = compact.get(at..at + slot.len()).unwrap_or_default();
                        if let Some(d) = dst.get_mut(slot) {
                            d.copy_from_slice(src);
                        }
                        at += src.len();
                    }
                } else if layout.is_packed() {
                    let numel = layout.numel;
                    model.backward(l, &full[..numel], &mut tape, &mut grad[..numel])?;
                } else {
                    let mut compact = vec![0.0f32; layout.numel];
                    model.backward(l, &self.model_view(l, &full)?, &mut tape, &mut compact)?;
                    layout.expand_into(&compact, &mut grad)?;
                }
                drop(full);
                if inject == Inject::NanGradient
                    && mi == 0
                    && l == n - 1
                    && let Some(g) = grad.first_mut()
                {
                    *g = f32::NAN;
                }
                non_finite |= sanitize(&mut grad);
                let t = self.lap(t, Lap::Compute);
                if grad.is_empty() {
                    continue;
                }
                comm.traffic_mut().set_op(tags::GRAD_REDUCE);
                let mut shard = vec![0.0f32; self.master[l].len()];
                self.comms.reduce_grads(comm, l, &mut grad, &mut shard)?;
                for (a, g) in self.grad_acc[l].iter_mut().zip(&shard) {
                    *a += g;
                }
                self.lap(t, Lap::Comm);
            }
            // The persistent parameters' gradients, reduced together once per
            // micro-batch (DeepSpeed coalesces small gradients the same way).
            if let (Some(pb), Some(mut grad)) = (self.placement.persistent, persist_grad.take()) {
                let t = std::time::Instant::now();
                non_finite |= sanitize(&mut grad);
                comm.traffic_mut().set_op(tags::GRAD_REDUCE);
                let mut shard = vec![0.0f32; self.master[pb].len()];
                self.comms.reduce_grads(comm, pb, &mut grad, &mut shard)?;
                for (a, g) in self.grad_acc[pb].iter_mut().zip(&shard) {
                    *a += g;
                }
                self.lap(t, Lap::Comm);
            }
        }
        let accum = micro_batches.len() as f32;
        if micro_batches.len() > 1 {
            for g in self.grad_acc.iter_mut().flatten() {
                *g /= accum;
            }
        }
        // Global gradient norm: every rank all-gathers its local sum of squares in
        // f64 (NaN when its local gradient was non-finite) and sums them in rank
        // order, so every rank gets the same f64 total and the same skip decision.
        let local_sq: f64 = if non_finite {
            f64::NAN
        } else {
            self.grad_acc.iter().flatten().map(|&g| f64::from(g) * f64::from(g)).sum()
        };
        let t = std::time::Instant::now();
        comm.traffic_mut().set_op(tags::GRAD_NORM);
        let total_sq = global_sum_f64(comm, &self.world, local_sq)?;
        let t = self.lap(t, Lap::Comm);
        comm.traffic_mut().set_op(tags::OTHER);
        let norm = total_sq.sqrt() as f32;
        let skipped = !norm.is_finite();
        if skipped {
            self.skipped += 1;
            self.comms.skipped_step();
        } else {
            let factor = clip_factor(norm, self.cfg.gradient_clipping);
            for ((p, g), opt) in self.master.iter_mut().zip(&self.grad_acc).zip(&mut self.optim) {
                opt.step(p, g, factor)?;
            }
        }
        for g in &mut self.grad_acc {
            g.fill(0.0);
        }
        self.lap(t, Lap::Optim);
        self.invalidate_secondary();
        self.persist_full = None;
        self.steps += 1;
        let mut times = std::mem::take(&mut self.times);
        times.quant_s = comm.traffic().quant_time().saturating_sub(quant_before).as_secs_f64();
        times.comm_s = (times.comm_s - times.quant_s).max(0.0);
        let prefetched = self.prefetched - prefetched_before;
        Ok(StepOutcome { loss: loss_sum / accum, grad_norm: norm, skipped, times, prefetched })
    }
}

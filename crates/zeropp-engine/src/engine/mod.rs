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
pub mod comm_plan;
mod delta;
mod gather;
mod layer_comm;
pub mod memory;
mod plan;
mod step;

use zeropp_comm::{Group, Topology};
use zeropp_partition::PartitionPlan;

use crate::EngineError;
use crate::config::EngineConfig;
use crate::model::Model;
use crate::optim::AdamW;

pub use comm_plan::{CommPlan, LayerPlan, ReduceCall, WeightGather};
pub use layer_comm::Prefetcher;
use layer_comm::{LayerComm, Secondary};
use plan::Placement;
pub use plan::{PERSISTENT_BUCKET, build_plan, check_layers, shard_align};

/// Operation tags of the traffic counters.
pub mod tags {
    /// Forward weight all-gathers.
    pub const FWD_GATHER: &str = "fwd_gather";
    /// qwZ-Δ's exchange of quantized weight differences into the hpZ copies
    /// (before a forward gather from them).
    pub const FWD_DELTA: &str = "fwd_delta";
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
    /// qwZ-Δ: this rank's `Ŵ` of each layer's primary shard (what every hpZ copy
    /// holds of it), kept across steps; `None` until a full gather sets it.
    w_hat: Vec<Option<Secondary>>,
    /// qwZ-Δ: whether layer `l`'s hpZ copy was brought up to date this step.
    synced: Vec<bool>,
    /// qwZ-Δ: the next step rebuilds the hpZ copies by a full gather (after a
    /// skipped step or a checkpoint).
    refresh_next: bool,
    /// Per bucket, the ranges of this rank's primary shard that hold no
    /// parameter (padding): their reduced gradients are set to zero, so the
    /// padding weights stay zero whatever a reduction leaves there (qgZ's
    /// Hadamard rotation spreads quantization noise over whole groups).
    padding: Vec<Vec<std::ops::Range<usize>>>,
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

/// The ranges of `rank`'s primary shard of `bucket` that no parameter covers.
fn padding_of(
    plan: &PartitionPlan,
    rank: usize,
    bucket: usize,
) -> Result<Vec<std::ops::Range<usize>>, EngineError> {
    let s = plan.shard_len(bucket)?;
    let mut out = Vec::new();
    let mut at = 0;
    for p in plan.shard_pieces(rank, bucket)? {
        if p.in_shard.start > at {
            out.push(at..p.in_shard.start);
        }
        at = at.max(p.in_shard.end);
    }
    if at < s {
        out.push(at..s);
    }
    Ok(out)
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
        let comms = LayerComm::new(cfg, rank, &CommPlan::new(&plan, cfg)?)?;
        let grad_acc = master.iter().map(|m| vec![0.0; m.len()]).collect();
        let n = master.len();
        let padding = (0..n).map(|b| padding_of(&plan, rank, b)).collect::<Result<Vec<_>, _>>()?;
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
            w_hat: vec![None; n],
            synced: vec![false; n],
            refresh_next: true,
            padding,
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
        self.refresh_next = true;
        self.persist_full = None;
        Ok(())
    }

    /// Tells the engine a checkpoint of its state was just saved: with qwZ-Δ,
    /// the next step rebuilds the hpZ copies by a full gather, as a run resumed
    /// from that checkpoint does, so the two stay bit-identical. A no-op
    /// otherwise.
    pub fn note_checkpoint(&mut self) {
        self.refresh_next = true;
    }

    /// Bytes of qwZ-Δ's `Ŵ` held now (0 without qwZ-Δ), for the memory report.
    pub fn delta_bytes(&self) -> usize {
        self.w_hat.iter().flatten().map(Secondary::bytes).sum()
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
}

//! How the engine moves a layer over the network: its weight gathers (forward,
//! backward, hpZ) and its gradient reduction.
//!
//! Each is one collective of `zeropp_comm::collectives`, chosen once from the
//! config in the plan of collectives ([`CommPlan`]), which [`LayerComm::new`]
//! reads: the engine builds no collective of its own and knows no byte formula
//! (the analytic model, [`super::bytes`], composes comm's over the same plan).
//!
//! | what | collective |
//! |---|---|
//! | weight gather (forward; backward without hpZ) | `world_all_gather` (dense) or `world_qwz_gather_encoded` + `dequantize_encodings` (qwZ), with the config's [`Routing`] |
//! | hpZ secondary gather (backward; forward of later micro-batches) | `all_gather_f32` / `all_gather_bf16` over the hpZ group, or the qwZ encodings by `all_gather_bytes` ([`HpzWire::Int8`]) |
//! | gradient reduce-scatter | `world_reduce_scatter` (dense, with the config's routing) or qgZ (`qgz_reduce_scatter[_with_feedback]`), plus an all-to-all-v of the 1-D parameters when they are excluded from qgZ |
//!
//! One file per part: this one chooses the collectives and holds the qgZ state
//! and the stochastic-rounding streams ([`LayerComm`]); `gather.rs` moves
//! weights (world gathers, hpZ secondary shards, the prefetch stream); `dense.rs`
//! reduces the 1-D parameters excluded from qgZ and splits reduces into calls.

use std::borrow::Cow;
use std::ops::Range;

use zeropp_comm::collectives::{
    self, ErrorFeedback, LocoConfig, QgzConfig, QgzSeeds, Reduce, qgz_reduce_scatter,
    qgz_reduce_scatter_with_feedback,
};
use zeropp_comm::{Communicator, Group};

use crate::EngineError;
use crate::config::EngineConfig;
use crate::engine::comm_plan::{CommPlan, DenseSlices};

mod delta;
mod dense;
mod gather;

pub(crate) use delta::Delta;
use dense::{exchange_dense_slices, slice_values};
pub use gather::Prefetcher;
use gather::{GatherSpec, PendingKind, WeightGather, gather_secondary, gather_world};
pub(crate) use gather::{PendingGather, Secondary};

/// The stochastic-rounding streams of one rank: every quantizing collective gets
/// its own seed, keyed by `(base seed, kind, optimizer step, call within the
/// step)` — the same on every rank, since all ranks call the collectives in the
/// same order; the rank (and, in qgZ, the hop) is keyed in below that. Keying by
/// the step (not a running counter) makes a resumed run draw exactly what the
/// uninterrupted one drew.
#[derive(Debug, Clone, Copy)]
struct Streams {
    base: Option<u64>,
    step: u64,
    call: u64,
}

impl Streams {
    const QWZ: u64 = 1;
    const QGZ: u64 = 2;
    /// The shared per-call seed of qgZ (its rotation, `QgzSeeds::rotation`).
    const ROTATION: u64 = 3;

    fn next(&mut self, kind: u64) -> Option<u64> {
        let base = self.base?;
        self.call += 1;
        Some(zeropp_quant::rng::stream_seed(base, &[kind, self.step, self.call]))
    }
}

/// One reduce call's qgZ residuals `(hop 1, hop 2)` as f32 (copies when stored in bf16).
pub(crate) type FeedbackState<'a> = (Cow<'a, [f32]>, Cow<'a, [f32]>);

/// qgZ with its per-layer LoCo state.
#[derive(Debug)]
struct Qgz {
    /// The settings; every call's options come from [`QgzConfig::options`].
    config: QgzConfig,
    /// One residual pair per reduce call (empty without error feedback). No
    /// copy is kept to undo a step: a skipped step resets them instead.
    feedback: Vec<ErrorFeedback>,
    /// Whether qgZ's quantizers round stochastically (its own setting, or the
    /// config's stochastic rounding everywhere).
    stochastic: bool,
}

impl Qgz {
    fn loco(&self) -> Option<LocoConfig> {
        self.config.error_feedback
    }
}

/// One rank's layer traffic: the collectives chosen from the config, the qgZ
/// error-feedback state and the stochastic-rounding streams.
#[derive(Debug)]
pub(crate) struct LayerComm {
    rank: usize,
    gather: GatherSpec,
    qgz: Option<Qgz>,
    /// The 1-D elements of every reduce call (flat over buckets and chunks).
    dense_slices: Vec<DenseSlices>,
    /// The reduce calls of every bucket ([`reduce_chunks`]).
    chunks: Vec<Vec<Range<usize>>>,
    /// Index of each bucket's first reduce call in the flat per-call vectors
    /// (`dense_slices`, the qgZ residuals).
    first_call: Vec<usize>,
    streams: Streams,
    /// Whether qwZ's quantizer rounds stochastically.
    qwz_stochastic: bool,
    /// The base of the seeds that every rank derives alike (qgZ's rotation).
    shared_seed: u64,
    /// qwZ-Δ: the differences' options and the hpZ group size.
    delta: Option<Delta>,
}

impl LayerComm {
    /// The collectives of `plan` (built from `cfg`) for `rank`.
    pub(crate) fn new(cfg: &EngineConfig, rank: usize, plan: &CommPlan) -> Result<Self, EngineError> {
        let z = &cfg.zero;
        let gather = GatherSpec {
            routing: plan.routing(),
            weights: plan.weights(),
            dense: plan.dense(),
            hpz_int8: plan.hpz_int8(),
            stochastic: None,
        };
        let layers = plan.layers();
        let chunks: Vec<Vec<Range<usize>>> =
            layers.iter().map(|l| l.reduces.iter().map(|c| c.chunk.clone()).collect()).collect();
        let first_call = chunks
            .iter()
            .scan(0, |at, c| {
                let first = *at;
                *at += c.len();
                Some(first)
            })
            .collect();
        let qgz = plan.qgz().map(|&config| Qgz {
            config,
            feedback: match config.error_feedback {
                Some(l) => (0..plan.reduce_calls()).map(|_| l.feedback()).collect(),
                None => Vec::new(),
            },
            stochastic: z.qgz_stochastic(),
        });
        let dense_slices = layers.iter().flat_map(|l| l.reduces.iter().map(|c| c.dense_1d.clone())).collect();
        let streams = Streams {
            base: (z.stochastic_rounding || z.qgz_stochastic()).then_some(cfg.seed ^ 0x9E37_79B9_7F4A_7C15),
            step: 0,
            call: 0,
        };
        let qwz_stochastic = z.stochastic_rounding;
        let shared_seed = cfg.seed ^ 0x5A5A_0DE1_7A00_0000;
        let delta = plan.delta().map(|d| Delta {
            opts: zeropp_comm::collectives::DeltaOptions {
                spec: d.spec,
                quant: zeropp_quant::Options::default(),
            },
            hpz: plan.hpz_size(),
        });
        Ok(Self {
            rank,
            gather,
            qgz,
            dense_slices,
            chunks,
            first_call,
            streams,
            qwz_stochastic,
            shared_seed,
            delta,
        })
    }

    /// Starts optimizer step `step` (also before an evaluation): restarts the
    /// stochastic-rounding streams and resets the qgZ residuals every LoCo
    /// `reset_t` steps.
    pub(crate) fn start_step(&mut self, step: usize, training: bool) {
        self.streams.step = step as u64;
        self.streams.call = 0;
        if !training {
            return;
        }
        if let Some(q) = &mut self.qgz
            && let Some(l) = q.loco()
            && l.reset_t > 0
            && step > 0
            && step.is_multiple_of(l.reset_t)
        {
            q.feedback.iter_mut().for_each(ErrorFeedback::reset);
        }
    }

    /// Called when the step was skipped: the qgZ residuals are reset to zero, so
    /// the skipped gradient leaves no trace (without a second copy of the
    /// residuals to restore: a skip costs the accumulated compensation, as a
    /// LoCo `reset_t` does, and skips are rare).
    pub(crate) fn skipped_step(&mut self) {
        if let Some(q) = &mut self.qgz {
            q.feedback.iter_mut().for_each(ErrorFeedback::reset);
        }
    }

    /// The gather spec of the next world gather, with its own stochastic-rounding
    /// stream (keyed by this rank too: a rank quantizes only its own shard).
    fn next_gather(&mut self) -> GatherSpec {
        let mut g = self.gather;
        if let WeightGather::Qwz { .. } = g.weights
            && self.qwz_stochastic
        {
            g.stochastic = self
                .streams
                .next(Streams::QWZ)
                .map(|s| zeropp_quant::rng::stream_seed(s, &[self.rank as u64]));
        }
        g
    }

    /// World gather of a primary `shard`; with `keep`, the hpZ secondary shard of
    /// that range is returned too.
    pub(crate) fn gather_weights<C: Communicator + ?Sized>(
        &mut self,
        comm: &mut C,
        shard: &[f32],
        keep: Option<Range<usize>>,
    ) -> Result<(Vec<f32>, Option<Secondary>), EngineError> {
        let g = self.next_gather();
        Ok(gather_world(comm, g, shard, keep)?)
    }

    /// World gather of the persistent bucket's primary `shard`: always dense, in
    /// the baseline type (DeepSpeed gathers persistent parameters unquantized).
    pub(crate) fn gather_persistent<C: Communicator + ?Sized>(
        &mut self,
        comm: &mut C,
        shard: &[f32],
    ) -> Result<Vec<f32>, EngineError> {
        let g =
            GatherSpec { weights: WeightGather::Dense(self.gather.dense), stochastic: None, ..self.gather };
        Ok(gather_world(comm, g, shard, None)?.0)
    }

    /// Submits a world gather to the prefetch stream.
    pub(crate) fn prefetch_weights(
        &mut self,
        pf: &mut Prefetcher,
        shard: &[f32],
        keep: Option<Range<usize>>,
        tag: &str,
    ) -> PendingGather {
        let g = self.next_gather();
        let shard = shard.to_vec();
        let pending = pf.submit_tagged(tag, move |c| gather_world(c, g, &shard, keep));
        PendingGather { pending: PendingKind::World(pending) }
    }

    /// All-gathers the hpZ secondary shards of `group`.
    pub(crate) fn gather_secondary<C: Communicator + ?Sized>(
        &self,
        comm: &mut C,
        group: &Group,
        shard: &Secondary,
    ) -> Result<Vec<f32>, EngineError> {
        Ok(gather_secondary(comm, group, shard)?)
    }

    /// Submits the all-gather of the hpZ secondary shards of `group` to the
    /// prefetch stream.
    pub(crate) fn prefetch_secondary(
        &self,
        pf: &mut Prefetcher,
        group: &Group,
        shard: &Secondary,
        tag: &str,
    ) -> PendingGather {
        let (shard, group) = (shard.clone(), group.clone());
        let pending = pf.submit_tagged(tag, move |c| gather_secondary(c, &group, &shard));
        PendingGather { pending: PendingKind::Secondary(pending) }
    }

    /// Gradient reduce-scatter of layer `layer`: `out` = this rank's shard of the
    /// mean over the world of every rank's padded gradient `full` (which the call
    /// may modify: the 1-D parameters excluded from qgZ are zeroed in it).
    pub(crate) fn reduce_grads<C: Communicator + ?Sized>(
        &mut self,
        comm: &mut C,
        layer: usize,
        full: &mut [f32],
        out: &mut [f32],
    ) -> Result<(), EngineError> {
        let chunks = self.chunks.get(layer).cloned().unwrap_or_default();
        let first = self.first_call.get(layer).copied().unwrap_or_default();
        if chunks.len() <= 1 {
            return self.reduce_call(comm, first, full, out);
        }
        // Each piece: elements `c` of every rank's shard, reduced on its own.
        let (s, w) = (out.len(), comm.topology().world());
        for (i, c) in chunks.into_iter().enumerate() {
            let mut buf = Vec::with_capacity(c.len() * w);
            for r in 0..w {
                buf.extend_from_slice(full.get(r * s + c.start..r * s + c.end).unwrap_or_default());
            }
            let dst = out.get_mut(c.clone()).ok_or_else(|| {
                EngineError::Training(format!("reduce piece {c:?} outside a shard of {s} elements"))
            })?;
            self.reduce_call(comm, first + i, &mut buf, dst)?;
        }
        Ok(())
    }

    /// One reduce call: reduce call number `call` (flat over buckets and pieces).
    fn reduce_call<C: Communicator + ?Sized>(
        &mut self,
        comm: &mut C,
        call: usize,
        full: &mut [f32],
        out: &mut [f32],
    ) -> Result<(), EngineError> {
        let layer = call;
        let seed =
            self.streams.next(Streams::QGZ).filter(|_| self.qgz.as_ref().is_some_and(|q| q.stochastic));
        let dense = self.gather.dense;
        let Some(q) = &mut self.qgz else {
            collectives::world_reduce_scatter(comm, self.gather.routing, dense, full, out, Reduce::Mean)?;
            return Ok(());
        };
        let slices = self.dense_slices.get(layer).filter(|d| !d.is_empty());
        // The 1-D parameters go to their owners densely; qgZ carries zeros there.
        let dense_part = match slices {
            Some(d) => {
                let part = slice_values(full, &d.per_rank);
                for r in d.per_rank.iter().flatten() {
                    if let Some(x) = full.get_mut(r.clone()) {
                        x.fill(0.0);
                    }
                }
                Some(part)
            }
            None => None,
        };
        let keys = [Streams::ROTATION, self.streams.step, call as u64];
        let rotation = zeropp_quant::rng::stream_seed(self.shared_seed, &keys);
        let opts = q.config.options(QgzSeeds { rounding: seed, rotation })?;
        let res = match q.feedback.get_mut(layer) {
            Some(fb) => qgz_reduce_scatter_with_feedback(comm, full, out, &opts, fb),
            None => qgz_reduce_scatter(comm, full, out, &opts),
        };
        res?;
        if let (Some(d), Some(send)) = (slices, dense_part) {
            exchange_dense_slices(comm, d, &send, dense, self.gather.routing, out)?;
        }
        Ok(())
    }

    /// The qgZ residuals of every layer, `(hop 1, hop 2)`, for checkpoints (empty
    /// without error feedback).
    pub(crate) fn feedback_state(&self) -> Vec<FeedbackState<'_>> {
        self.qgz.as_ref().map(|q| q.feedback.iter().map(ErrorFeedback::state).collect()).unwrap_or_default()
    }

    /// Restores the qgZ residuals of every layer (from [`Self::feedback_state`]).
    pub(crate) fn restore_feedback(&mut self, state: Vec<(Vec<f32>, Vec<f32>)>) -> Result<(), EngineError> {
        let Some(q) = &mut self.qgz else { return Ok(()) };
        if q.feedback.is_empty() {
            return Ok(());
        }
        if state.len() != q.feedback.len() {
            return Err(EngineError::LengthMismatch {
                what: "error-feedback layers in the checkpoint",
                expected: q.feedback.len(),
                got: state.len(),
            });
        }
        for (fb, (h1, h2)) in q.feedback.iter_mut().zip(state) {
            fb.restore(h1, h2);
        }
        Ok(())
    }
}

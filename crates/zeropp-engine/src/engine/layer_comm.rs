//! How the engine moves a layer over the network: its weight gathers (forward,
//! backward, hpZ) and its gradient reduction.
//!
//! Each is one collective of `zeropp_comm::collectives`, chosen once from the
//! config in [`LayerComm::new`]: the engine builds no collective of its own and
//! knows no byte formula (the analytic model, [`super::bytes`], composes comm's).
//!
//! | what | collective |
//! |---|---|
//! | weight gather (forward; backward without hpZ) | `world_all_gather` (dense) or `world_qwz_gather_encoded` + `dequantize_encodings` (qwZ), with the config's [`Routing`] |
//! | hpZ secondary gather (backward; forward of later micro-batches) | `all_gather_f32` / `all_gather_bf16` over the hpZ group, or the qwZ encodings by `all_gather_bytes` ([`HpzWire::Int8`]) |
//! | gradient reduce-scatter | `world_reduce_scatter` (dense, with the config's routing) or qgZ (`qgz_reduce_scatter[_with_feedback]`), plus an all-to-all-v of the 1-D parameters when they are excluded from qgZ |

use std::borrow::Cow;
use std::ops::Range;
use std::time::Instant;

use zeropp_comm::collectives::{
    self, DenseWire, ErrorFeedback, QgzOptions, QwzOptions, Reduce, Routing, qgz_reduce_scatter,
    qgz_reduce_scatter_with_feedback,
};
use zeropp_comm::{AsyncComm, CommError, Communicator, Group, Pending, TrafficSnapshot};
use zeropp_partition::PartitionPlan;
use zeropp_quant::half::bf16;
use zeropp_quant::{Options, QuantSpec};

use crate::EngineError;
use crate::config::{EngineConfig, HpzWire, LocoConfig};

fn options(stochastic: Option<u64>) -> Options {
    match stochastic {
        Some(seed) => Options::default().stochastic(seed),
        None => Options::default(),
    }
}

/// Dequantizes a gathered layer's encodings (`shard_len` elements each) into
/// `out`, rounded to bf16 values when `round`; the time counts as `comm`'s
/// quantization time, like the collectives' own kernels.
fn dequantize_layer<C: Communicator + ?Sized>(
    comm: &mut C,
    encodings: &[u8],
    shard_len: usize,
    out: &mut [f32],
    opts: &Options,
    round: bool,
) -> Result<(), CommError> {
    let t = Instant::now();
    collectives::dequantize_encodings(encodings, shard_len, out, opts)?;
    if round {
        round_bf16(out);
    }
    comm.traffic_mut().add_quant_time(t.elapsed());
    Ok(())
}

/// Rounds every value to the nearest bfloat16 (ties to even), in place.
fn round_bf16(xs: &mut [f32]) {
    xs.iter_mut().for_each(|x| *x = bf16::from_f32(*x).to_f32());
}

/// How a layer's primary shards travel in a world gather.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) enum WeightGather {
    /// Dense elements of the baseline type.
    Dense(DenseWire),
    /// qwZ: block-quantized, dequantized on arrival (and rounded to bf16 when the
    /// working precision is bf16, as DeepSpeed dequantizes into its 16-bit dtype,
    /// so the forward and the backward see the same weights).
    Qwz { spec: QuantSpec, round_bf16: bool },
}

/// Everything a world weight gather needs; `Copy`, so a prefetch job can take it.
#[derive(Debug, Clone, Copy)]
pub(crate) struct GatherSpec {
    routing: Routing,
    weights: WeightGather,
    dense: DenseWire,
    hpz_int8: bool,
    stochastic: Option<u64>,
}

/// An hpZ secondary shard: the slice of the gathered layer this rank serves to
/// its hpZ group until the optimizer step.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Secondary {
    /// f32 values (exact mode).
    F32(Vec<f32>),
    /// bf16 values: the gathered weights are bf16 values already, so this is exact
    /// and costs the `2·Ψ/hpz` bytes the memory report counts.
    Bf16(Vec<bf16>),
    /// The qwZ encodings of the primary shards the slice covers (each of
    /// `shard_len` elements), as received: about `Ψ/hpz` bytes, the same weights.
    Encoded { bytes: Vec<u8>, shard_len: usize, round_bf16: bool },
}

/// Gathers `shard` over the world as `g` says; with `keep`, also returns the hpZ
/// secondary shard covering that range of the gathered layer.
fn gather_world<C: Communicator + ?Sized>(
    comm: &mut C,
    g: GatherSpec,
    shard: &[f32],
    keep: Option<Range<usize>>,
) -> Result<(Vec<f32>, Option<Secondary>), CommError> {
    let w = comm.topology().world();
    let s = shard.len();
    let mut full = vec![0.0f32; s * w];
    let mut secondary = None;
    match g.weights {
        WeightGather::Dense(wire) => collectives::world_all_gather(comm, g.routing, wire, shard, &mut full)?,
        WeightGather::Qwz { spec, round_bf16: round } => {
            let opts = QwzOptions { spec, quant: options(g.stochastic) };
            let enc = collectives::world_qwz_gather_encoded(comm, g.routing, shard, &opts)?;
            dequantize_layer(comm, &enc, s, &mut full, &opts.quant, round)?;
            if g.hpz_int8
                && let Some(r) = &keep
                && s > 0
            {
                let e = enc.len() / w;
                let bytes = enc.get(r.start / s * e..r.end / s * e).ok_or_else(|| {
                    CommError::Mismatch(format!("hpZ range {r:?} outside a layer of {} elements", full.len()))
                })?;
                secondary =
                    Some(Secondary::Encoded { bytes: bytes.to_vec(), shard_len: s, round_bf16: round });
            }
        }
    }
    if secondary.is_none()
        && let Some(r) = keep
    {
        let len = full.len();
        let slice = full.get(r.clone()).ok_or_else(|| {
            CommError::Mismatch(format!("hpZ range {r:?} outside a layer of {len} elements"))
        })?;
        secondary = Some(match g.dense {
            DenseWire::F32 => Secondary::F32(slice.to_vec()),
            DenseWire::Bf16 => Secondary::Bf16(slice.iter().map(|&x| bf16::from_f32(x)).collect()),
        });
    }
    Ok((full, secondary))
}

/// All-gathers the hpZ secondary shards of `group` (the layer, as f32).
fn gather_secondary<C: Communicator + ?Sized>(
    comm: &mut C,
    group: &Group,
    shard: &Secondary,
) -> Result<Vec<f32>, CommError> {
    let h = group.size();
    match shard {
        Secondary::F32(s) => {
            let mut out = vec![0.0f32; s.len() * h];
            collectives::all_gather_f32(comm, group, s, &mut out)?;
            Ok(out)
        }
        Secondary::Bf16(s) => {
            let mut bits = vec![bf16::ZERO; s.len() * h];
            collectives::all_gather_bf16(comm, group, s, &mut bits)?;
            Ok(bits.iter().map(|b| b.to_f32()).collect())
        }
        Secondary::Encoded { bytes, shard_len, round_bf16: round } => {
            let mut gathered = vec![0u8; bytes.len() * h];
            comm.all_gather_bytes(group, bytes, &mut gathered)?;
            let count = comm.topology().world();
            let mut out = vec![0.0f32; shard_len * count];
            dequantize_layer(comm, &gathered, *shard_len, &mut out, &Options::default(), *round)?;
            Ok(out)
        }
    }
}

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
    opts: QgzOptions,
    loco: Option<LocoConfig>,
    /// One residual pair per reduce call (empty without error feedback). No
    /// copy is kept to undo a step: a skipped step resets them instead.
    feedback: Vec<ErrorFeedback>,
    /// Whether qgZ's quantizers round stochastically.
    stochastic: bool,
}

/// The elements of one layer that are reduced densely instead of by qgZ (the 1-D
/// parameters): for every rank, the flat ranges of those elements inside its
/// primary shard, in order.
#[derive(Debug, Clone, Default)]
pub(crate) struct DenseSlices {
    per_rank: Vec<Vec<Range<usize>>>,
}

impl DenseSlices {
    /// The 1-D parameters (biases, norm gains and shifts) of layer `layer` of
    /// `plan` in one reduce call of the layer, the one that carries elements
    /// `chunk` of every rank's shard ([`reduce_chunks`]; `0..shard_len` when the
    /// layer is reduced whole): ranges are positions in that call's buffer (`W`
    /// pieces of `chunk.len()` elements, in rank order). Used by the exchange and
    /// by the byte model, so both see the same elements.
    pub(crate) fn of_chunk(
        plan: &PartitionPlan,
        layer: usize,
        chunk: Range<usize>,
    ) -> Result<Self, EngineError> {
        let layout = plan.bucket(layer)?;
        let s = plan.shard_len(layer)?;
        let len = chunk.len();
        let one_d: Vec<Range<usize>> =
            layout.params.iter().filter(|p| p.shape.len() == 1).map(|p| p.range()).collect();
        let per_rank = (0..plan.world())
            .map(|r| {
                let own = r * s + chunk.start..r * s + chunk.end;
                let shift = own.start - r * len;
                one_d
                    .iter()
                    .map(|x| x.start.max(own.start)..x.end.min(own.end))
                    .filter(|x| x.start < x.end)
                    .map(|x| x.start - shift..x.end - shift)
                    .collect()
            })
            .collect();
        Ok(Self { per_rank })
    }

    /// Elements of rank `rank`'s shard that are reduced densely.
    pub(crate) fn count(&self, rank: usize) -> usize {
        self.per_rank.get(rank).map_or(0, |rs| rs.iter().map(Range::len).sum())
    }

    /// True when no rank has any.
    pub(crate) fn is_empty(&self) -> bool {
        self.per_rank.iter().all(Vec::is_empty)
    }
}

/// The reduce calls of bucket `layer`: ranges of every rank's shard, each
/// reduced by its own collective. One call for the whole shard, unless
/// `reduce_bucket_size` (in padded elements over all ranks) is smaller than
/// the bucket: then pieces of `W·k` elements, `k` a multiple of the shard
/// alignment (at least one alignment unit per rank).
pub(crate) fn reduce_chunks(
    plan: &PartitionPlan,
    cfg: &EngineConfig,
    layer: usize,
) -> Result<Vec<Range<usize>>, EngineError> {
    let s = plan.shard_len(layer)?;
    let w = plan.world();
    match cfg.zero.buckets.reduce_bucket_size {
        Some(r) if r < s * w => {
            let align = super::shard_align(cfg);
            let k = (r / w / align).max(1) * align;
            Ok((0..s).step_by(k).map(|c| c..(c + k).min(s)).collect())
        }
        _ => Ok(std::iter::once(0..s).collect()),
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
}

impl LayerComm {
    /// The collectives of `cfg` for `rank` on `plan`.
    pub(crate) fn new(cfg: &EngineConfig, rank: usize, plan: &PartitionPlan) -> Result<Self, EngineError> {
        let z = &cfg.zero;
        let dense = z.comm_dtype.wire();
        let round = dense == DenseWire::Bf16;
        let weights = match z.qwz {
            Some(spec) => WeightGather::Qwz { spec, round_bf16: round },
            None => WeightGather::Dense(dense),
        };
        let gather = GatherSpec {
            routing: z.routing,
            weights,
            dense,
            hpz_int8: z.qwz.is_some() && z.hpz_wire == HpzWire::Int8,
            stochastic: None,
        };
        let chunks =
            (0..plan.num_buckets()).map(|l| reduce_chunks(plan, cfg, l)).collect::<Result<Vec<_>, _>>()?;
        let first_call = chunks
            .iter()
            .scan(0, |at, c| {
                let first = *at;
                *at += c.len();
                Some(first)
            })
            .collect();
        let layers = chunks.iter().map(Vec::len).sum();
        let qgz = if let Some(q) = z.qgz {
            let wire = q.spec;
            let local = QuantSpec::int8(wire.group_size()).map_err(EngineError::InvalidQuantSpec)?;
            let opts =
                QgzOptions { intra_spec: wire, inter_spec: wire, local_spec: local, ..QgzOptions::default() };
            let fb = |l: LocoConfig| ErrorFeedback::loco(l.err_beta).with_precision(l.residual_precision());
            let feedback: Vec<ErrorFeedback> = match q.error_feedback {
                Some(l) => (0..layers).map(|_| fb(l)).collect(),
                None => Vec::new(),
            };
            Some(Qgz { opts, loco: q.error_feedback, feedback, stochastic: z.qgz_stochastic() })
        } else {
            None
        };
        let dense_slices = if z.exclude_1d() {
            chunks
                .iter()
                .enumerate()
                .flat_map(|(l, cs)| cs.iter().map(move |c| DenseSlices::of_chunk(plan, l, c.clone())))
                .collect::<Result<Vec<_>, _>>()?
        } else {
            Vec::new()
        };
        let streams = Streams {
            base: (z.stochastic_rounding || z.qgz_stochastic()).then_some(cfg.seed ^ 0x9E37_79B9_7F4A_7C15),
            step: 0,
            call: 0,
        };
        let qwz_stochastic = z.stochastic_rounding;
        Ok(Self { rank, gather, qgz, dense_slices, chunks, first_call, streams, qwz_stochastic })
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
            && let Some(l) = q.loco
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
        let tag = tag.to_string();
        let pending = pf.comm.submit(move |c| {
            c.traffic_mut().set_op(&tag);
            gather_world(c, g, &shard, keep)
        });
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
        let shard = shard.clone();
        let group = group.clone();
        let tag = tag.to_string();
        let pending = pf.comm.submit(move |c| {
            c.traffic_mut().set_op(&tag);
            gather_secondary(c, &group, &shard)
        });
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
        let mut opts = q.opts;
        opts.quant = options(seed);
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

/// The values of `full` in each rank's ranges (one vector per owner rank).
fn slice_values(full: &[f32], per_rank: &[Vec<Range<usize>>]) -> Vec<Vec<f32>> {
    per_rank
        .iter()
        .map(|rs| rs.iter().flat_map(|r| full.get(r.clone()).unwrap_or_default().iter().copied()).collect())
        .collect()
}

/// Appends `vals` in the wire type.
fn encode_into(vals: &[f32], wire: DenseWire, out: &mut Vec<u8>) {
    match wire {
        DenseWire::F32 => vals.iter().for_each(|x| out.extend_from_slice(&x.to_le_bytes())),
        DenseWire::Bf16 => vals.iter().for_each(|&x| out.extend_from_slice(&bf16::from_f32(x).to_le_bytes())),
    }
}

/// Adds the wire-type values of `bytes` into `acc` (element by element, in order).
fn decode_add(bytes: &[u8], wire: DenseWire, acc: &mut [f32]) {
    for (a, x) in acc.iter_mut().zip(bytes.chunks_exact(wire.bytes())) {
        *a += match (wire, x) {
            (DenseWire::F32, &[b0, b1, b2, b3]) => f32::from_le_bytes([b0, b1, b2, b3]),
            (DenseWire::Bf16, &[b0, b1]) => bf16::from_le_bytes([b0, b1]).to_f32(),
            _ => 0.0,
        };
    }
}

/// Splits `buf` into consecutive chunks of `counts` bytes.
fn split_counts<'a>(buf: &'a [u8], counts: &[usize]) -> Vec<&'a [u8]> {
    let mut at = 0;
    counts
        .iter()
        .map(|&c| {
            let chunk = buf.get(at..at + c).unwrap_or_default();
            at += c;
            chunk
        })
        .collect()
}

/// The dense reduction of the 1-D parameters excluded from qgZ: each owner gets
/// the sum over all ranks of its elements (in the wire type on the wire, summed in
/// f32), divided by the world size, written into its shard.
///
/// Flat routing: one all-to-all-v over the world, `count(r)·b` bytes to each rank
/// `r`. Hierarchical (as the dense baselines): an intra-node all-to-all-v that
/// sends local peer `j` the elements of ranks `(m', j)` for every node `m'`, a sum
/// per destination node, then a rail all-to-all-v of those partials: the same
/// shape as qgZ, so only `count((m', l))·b` bytes per other node cross.
fn exchange_dense_slices<C: Communicator + ?Sized>(
    comm: &mut C,
    d: &DenseSlices,
    vals: &[Vec<f32>],
    wire: DenseWire,
    routing: Routing,
    out: &mut [f32],
) -> Result<(), CommError> {
    let topo = *comm.topology();
    let (w, me, n, l) = (topo.world(), comm.rank(), topo.nodes(), topo.local_size());
    let b = wire.bytes();
    let mine = d.count(me);
    let mut sum = vec![0.0f32; mine];
    let empty = Vec::new();
    let vals_of = |r: usize| vals.get(r).unwrap_or(&empty);
    if routing == Routing::Flat || n == 1 || l == 1 {
        let mut send = Vec::new();
        let send_counts: Vec<usize> = (0..w)
            .map(|r| {
                encode_into(vals_of(r), wire, &mut send);
                d.count(r) * b
            })
            .collect();
        let recv_counts = vec![mine * b; w];
        let mut recv = vec![0u8; mine * b * w];
        comm.all_to_all_v_bytes(&Group::world(&topo), &send, &send_counts, &mut recv, &recv_counts)?;
        for chunk in split_counts(&recv, &recv_counts) {
            decode_add(chunk, wire, &mut sum);
        }
    } else {
        let me_l = topo.local_rank(me);
        // Hop 1, inside the node.
        let mut send = Vec::new();
        let send_counts: Vec<usize> = (0..l)
            .map(|j| {
                let start = send.len();
                (0..n).for_each(|m| encode_into(vals_of(topo.rank_of(m, j)), wire, &mut send));
                send.len() - start
            })
            .collect();
        let dest: Vec<usize> = (0..n).map(|m| d.count(topo.rank_of(m, me_l))).collect();
        let per_peer: usize = dest.iter().sum::<usize>() * b;
        let recv_counts = vec![per_peer; l];
        let mut recv = vec![0u8; per_peer * l];
        comm.all_to_all_v_bytes(&Group::intra_node(&topo, me), &send, &send_counts, &mut recv, &recv_counts)?;
        let mut partial: Vec<Vec<f32>> = dest.iter().map(|&c| vec![0.0f32; c]).collect();
        let node_counts: Vec<usize> = dest.iter().map(|c| c * b).collect();
        for chunk in split_counts(&recv, &recv_counts) {
            for (p, part) in partial.iter_mut().zip(split_counts(chunk, &node_counts)) {
                decode_add(part, wire, p);
            }
        }
        // Hop 2, over the rail: the partial for node m goes to rank (m, me_l).
        let mut send2 = Vec::new();
        partial.iter().for_each(|p| encode_into(p, wire, &mut send2));
        let recv2_counts = vec![mine * b; n];
        let mut recv2 = vec![0u8; mine * b * n];
        comm.all_to_all_v_bytes(&Group::rail(&topo, me), &send2, &node_counts, &mut recv2, &recv2_counts)?;
        for chunk in split_counts(&recv2, &recv2_counts) {
            decode_add(chunk, wire, &mut sum);
        }
    }
    let (base, len) = (me * out.len(), out.len());
    let mut it = sum.into_iter().map(|x| x / w as f32);
    for r in d.per_rank.get(me).into_iter().flatten() {
        let local = r.start - base..r.end - base;
        let dst = out
            .get_mut(local.clone())
            .ok_or_else(|| CommError::Mismatch(format!("1-D range {local:?} outside a shard of {len}")))?;
        for x in dst {
            *x = it.next().unwrap_or(0.0);
        }
    }
    Ok(())
}

/// Bytes the 1-D exchange of one layer sends from `rank` to each link class
/// (see [`exchange_dense_slices`]): flat, `count(r)·b` to every other rank `r`;
/// hierarchical, `Σ_m' count((m', j))·b` to each other local peer `j` and
/// `count((m', l))·b` to each other rail peer `m'`.
pub(crate) fn dense_slices_bytes(
    topology: &zeropp_comm::Topology,
    routing: Routing,
    rank: usize,
    slices: &DenseSlices,
    b: usize,
) -> zeropp_comm::LinkBytes {
    let t = topology;
    let (n, l) = (t.nodes(), t.local_size());
    let count = |r: usize| slices.count(r) as u64 * b as u64;
    let mut out = zeropp_comm::LinkBytes::default();
    if routing == Routing::Flat || n == 1 || l == 1 {
        for r in (0..t.world()).filter(|&r| r != rank) {
            if t.node_of(r) == t.node_of(rank) {
                out.intra += count(r);
            } else {
                out.inter += count(r);
            }
        }
    } else {
        let (me_m, me_l) = (t.node_of(rank), t.local_rank(rank));
        out.intra =
            (0..l).filter(|&j| j != me_l).map(|j| (0..n).map(|m| count(t.rank_of(m, j))).sum::<u64>()).sum();
        out.inter = (0..n).filter(|&m| m != me_m).map(|m| count(t.rank_of(m, me_l))).sum();
    }
    out
}

/// A gather running on the prefetch stream.
pub(crate) struct PendingGather {
    pending: PendingKind,
}

enum PendingKind {
    World(Pending<(Vec<f32>, Option<Secondary>)>),
    Secondary(Pending<Vec<f32>>),
}

impl PendingGather {
    /// Waits for the gathered layer (and the hpZ secondary shard a world gather kept).
    pub(crate) fn wait(self) -> Result<(Vec<f32>, Option<Secondary>), EngineError> {
        match self.pending {
            PendingKind::World(p) => Ok(p.wait()?),
            PendingKind::Secondary(p) => Ok((p.wait()?, None)),
        }
    }
}

/// The prefetch stream: a duplicated communicator on its own worker thread
/// (`zeropp_comm::AsyncComm`), on which the engine runs the next layer's gather
/// while the current layer computes.
pub struct Prefetcher {
    comm: AsyncComm,
    rank: usize,
}

impl std::fmt::Debug for Prefetcher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Prefetcher").field("rank", &self.rank).finish()
    }
}

impl Prefetcher {
    /// Collective over the world: duplicates `comm` onto a worker thread.
    pub fn new<C: Communicator + ?Sized>(comm: &mut C) -> Result<Self, EngineError> {
        let rank = comm.rank();
        let comm = AsyncComm::duplicate_from(comm)?;
        Ok(Self { comm, rank })
    }

    /// The prefetch stream's traffic counters (after the jobs submitted so far).
    pub fn traffic(&self) -> Result<TrafficSnapshot, EngineError> {
        Ok(self.comm.traffic().wait()?)
    }

    /// Finishes the queued jobs and stops the worker.
    pub fn shutdown(self) -> Result<(), EngineError> {
        Ok(self.comm.shutdown()?)
    }
}

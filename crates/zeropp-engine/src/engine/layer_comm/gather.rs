//! Moving weights: a layer's world gather (dense or qwZ, with the config's
//! routing), the hpZ secondary shard it keeps and the gathers from it, and the
//! prefetch stream those run on.

use std::ops::Range;
use std::time::Instant;

use zeropp_comm::collectives::{self, DenseWire, QwzOptions, Routing};
use zeropp_comm::{AsyncComm, CommError, Communicator, Group, Pending, TrafficSnapshot};
use zeropp_quant::Options;
use zeropp_quant::half::bf16;

use crate::EngineError;
pub(crate) use crate::engine::comm_plan::WeightGather;

pub(super) fn options(stochastic: Option<u64>) -> Options {
    match stochastic {
        Some(seed) => Options::default().stochastic(seed),
        None => Options::default(),
    }
}

/// Dequantizes a gathered layer's encodings (`shard_len` elements each) into
/// `out`, rounded to bf16 values when `round`; the time counts as `comm`'s
/// quantization time, like the collectives' own kernels.
pub(super) fn dequantize_layer<C: Communicator + ?Sized>(
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
pub(super) fn round_bf16(xs: &mut [f32]) {
    xs.iter_mut().for_each(|x| *x = bf16::from_f32(*x).to_f32());
}

/// Everything a world weight gather needs; `Copy`, so a prefetch job can take it.
#[derive(Debug, Clone, Copy)]
pub(crate) struct GatherSpec {
    pub(super) routing: Routing,
    pub(super) weights: WeightGather,
    pub(super) dense: DenseWire,
    pub(super) hpz_int8: bool,
    pub(super) stochastic: Option<u64>,
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

impl Secondary {
    /// The values of a dense copy, as f32 (empty for the INT8 encodings, which
    /// qwZ-Δ does not use).
    pub(crate) fn values(&self) -> Vec<f32> {
        match self {
            Secondary::F32(v) => v.clone(),
            Secondary::Bf16(v) => v.iter().map(|x| x.to_f32()).collect(),
            Secondary::Encoded { .. } => Vec::new(),
        }
    }

    /// Bytes held.
    pub(crate) fn bytes(&self) -> usize {
        match self {
            Secondary::F32(v) => 4 * v.len(),
            Secondary::Bf16(v) => 2 * v.len(),
            Secondary::Encoded { bytes, .. } => bytes.len(),
        }
    }
}

/// Gathers `shard` over the world as `g` says; with `keep`, also returns the hpZ
/// secondary shard covering that range of the gathered layer.
pub(super) fn gather_world<C: Communicator + ?Sized>(
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
pub(super) fn gather_secondary<C: Communicator + ?Sized>(
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

/// A gather running on the prefetch stream.
pub(crate) struct PendingGather {
    pub(super) pending: PendingKind,
}

pub(super) enum PendingKind {
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
    pub(super) comm: AsyncComm,
    pub(super) rank: usize,
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

    /// Submits `job` to the prefetch stream, its traffic counted under the op `tag`.
    pub(super) fn submit_tagged<T: Send + 'static>(
        &self,
        tag: &str,
        job: impl FnOnce(&mut dyn Communicator) -> Result<T, CommError> + Send + 'static,
    ) -> Pending<T> {
        let tag = tag.to_string();
        self.comm.submit(move |c| {
            c.traffic_mut().set_op(&tag);
            job(c)
        })
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

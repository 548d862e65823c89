//! What the engine puts on the wire: weight gathers and gradient reductions,
//! baseline (bf16 / f32) or quantized (qwZ / qgZ), and the prefetch stream.

use zeropp_comm::collectives::{self, Reduce};
use zeropp_comm::{AsyncComm, CommError, CommExt, Communicator, Group, Pending, TrafficSnapshot};
use zeropp_quant::QuantSpec;

use super::comm_err;
use crate::EngineError;
use crate::config::{CommDtype, EngineConfig};

/// Rounds an f32 to the nearest bfloat16 (ties to even) and returns its bits.
pub(crate) fn f32_to_bf16(x: f32) -> u16 {
    let b = x.to_bits();
    if x.is_nan() {
        return ((b >> 16) as u16) | 0x40;
    }
    let round = 0x7FFF + ((b >> 16) & 1);
    (b.wrapping_add(round) >> 16) as u16
}

/// The f32 value of bfloat16 bits.
pub(crate) fn bf16_to_f32(h: u16) -> f32 {
    f32::from_bits(u32::from(h) << 16)
}

/// An hpZ secondary shard, held in the precision the baseline communicates in:
/// 16-bit when that is bf16 (the gathered weights are bf16 values already, so this
/// is exact and the shard costs the `2·Ψ/hpz` bytes the memory report counts), f32
/// in the exact f32 mode.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Secondary {
    /// f32 elements (`CommDtype::F32`).
    F32(Vec<f32>),
    /// bfloat16 bits (`CommDtype::Bf16`).
    Bf16(Vec<u16>),
}

/// How the weights of one gather travel.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) enum WeightWire {
    /// Dense elements of the given type.
    Dense(CommDtype),
    /// qwZ: block-quantized, then dequantized (and rounded to `CommDtype`) on arrival.
    Quant { spec: QuantSpec, stochastic: Option<u64>, round_to: CommDtype },
}

/// Dense all-gather of `shard` over `group` into `out` (`shard.len() * group.size()`).
pub(crate) fn gather_dense<C: Communicator + ?Sized>(
    comm: &mut C,
    group: &Group,
    dtype: CommDtype,
    shard: &[f32],
    out: &mut [f32],
) -> Result<(), CommError> {
    match dtype {
        CommDtype::F32 => collectives::all_gather_f32(comm, group, shard, out),
        CommDtype::Bf16 => collectives::all_gather_f32_via_bf16(comm, group, shard, out),
    }
}

/// Weight all-gather of the primary `shard` over `group`.
pub(crate) fn gather_weights<C: Communicator + ?Sized>(
    comm: &mut C,
    group: &Group,
    wire: WeightWire,
    shard: &[f32],
    out: &mut [f32],
) -> Result<(), CommError> {
    match wire {
        WeightWire::Dense(d) => gather_dense(comm, group, d, shard, out),
        WeightWire::Quant { spec, stochastic, round_to } => {
            super::quant::qwz_all_gather(comm, group, spec, stochastic, shard, out)?;
            // Dequantize into the 16-bit working precision, as DeepSpeed does, so the
            // forward and the (hpZ, 16-bit) backward see the same weights.
            if round_to == CommDtype::Bf16 {
                for o in out.iter_mut() {
                    *o = bf16_to_f32(f32_to_bf16(*o));
                }
            }
            Ok(())
        }
    }
}

/// Baseline gradient reduce-scatter over `group`: `out` = mean over the members
/// (f32 on the wire, or bf16 through an all-to-all summed in f32).
pub(crate) fn reduce_scatter_dense<C: Communicator + ?Sized>(
    comm: &mut C,
    group: &Group,
    dtype: CommDtype,
    full: &[f32],
    out: &mut [f32],
) -> Result<(), CommError> {
    match dtype {
        CommDtype::F32 => collectives::reduce_scatter(comm, group, full, out, Reduce::Mean),
        CommDtype::Bf16 => collectives::reduce_scatter_bf16_wire(comm, group, full, out, Reduce::Mean),
    }
}

/// The stochastic-rounding streams of one rank: every quantizing collective gets
/// its own seed, keyed by `(base seed, kind, optimizer step, call within the
/// step)` — the same on every rank, since all ranks call the collectives in the
/// same order; comm adds the rank and the hop. Keying by the step (not a running
/// counter) makes a resumed run draw exactly what the uninterrupted one drew.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Streams {
    base: Option<u64>,
    step: u64,
    call: u64,
}

impl Streams {
    /// Weight gathers (qwZ).
    pub(crate) const QWZ: u64 = 1;
    /// Gradient reductions (qgZ).
    pub(crate) const QGZ: u64 = 2;

    /// The seed of the next collective of `kind`, or `None` without stochastic rounding.
    pub(crate) fn next(&mut self, kind: u64) -> Option<u64> {
        let base = self.base?;
        self.call += 1;
        Some(zeropp_quant::rng::stream_seed(base, &[kind, self.step, self.call]))
    }

    /// Starts optimizer step `step`.
    pub(crate) fn start_step(&mut self, step: u64) {
        self.step = step;
        self.call = 0;
    }
}

/// The engine's wire configuration and the per-layer qgZ error-feedback state.
#[derive(Debug)]
pub(crate) struct Wire {
    rank: usize,
    dtype: CommDtype,
    weights: WeightWire,
    qgz: Option<super::quant::QgzState>,
    streams: Streams,
}

impl Wire {
    pub(crate) fn new(cfg: &EngineConfig, rank: usize, layers: usize) -> Result<Self, EngineError> {
        let z = &cfg.zero;
        let stochastic = z.stochastic_rounding.then_some(cfg.seed ^ 0x9E37_79B9_7F4A_7C15);
        let weights = if z.qwz {
            WeightWire::Quant {
                spec: super::quant::spec(z.qwz_bits, z.qwz_group_size)?,
                stochastic: None,
                round_to: z.comm_dtype,
            }
        } else {
            WeightWire::Dense(z.comm_dtype)
        };
        let qgz = if z.qgz {
            Some(super::quant::QgzState::new(z.qgz_bits, z.qgz_group_size, z.error_feedback, layers, rank)?)
        } else {
            None
        };
        let streams = Streams { base: stochastic, step: 0, call: 0 };
        Ok(Self { rank, dtype: z.comm_dtype, weights, qgz, streams })
    }

    /// Keeps `slice` of gathered weights as an hpZ secondary shard.
    pub(crate) fn keep_secondary(&self, slice: &[f32]) -> Secondary {
        match self.dtype {
            CommDtype::F32 => Secondary::F32(slice.to_vec()),
            CommDtype::Bf16 => Secondary::Bf16(slice.iter().map(|&x| f32_to_bf16(x)).collect()),
        }
    }

    /// All-gathers the hpZ secondary shards of `group` into `out` (as f32): the
    /// same bytes on the wire as [`Self::gather_dense`] of the shard's values.
    pub(crate) fn gather_secondary<C: Communicator + ?Sized>(
        &self,
        comm: &mut C,
        group: &Group,
        shard: &Secondary,
        out: &mut [f32],
    ) -> Result<(), EngineError> {
        match shard {
            Secondary::F32(s) => self.gather_dense(comm, group, s, out),
            Secondary::Bf16(s) => {
                let mut bits = vec![0u16; out.len()];
                comm.all_gather(group, s, &mut bits).map_err(comm_err(self.rank))?;
                for (o, &h) in out.iter_mut().zip(&bits) {
                    *o = bf16_to_f32(h);
                }
                Ok(())
            }
        }
    }

    /// Dense gather (hpZ secondary shards) over `group`.
    pub(crate) fn gather_dense<C: Communicator + ?Sized>(
        &self,
        comm: &mut C,
        group: &Group,
        shard: &[f32],
        out: &mut [f32],
    ) -> Result<(), EngineError> {
        gather_dense(comm, group, self.dtype, shard, out).map_err(comm_err(self.rank))
    }

    /// Weight gather (qwZ or dense) of layer `_layer`'s primary shard over `group`.
    pub(crate) fn gather_weights<C: Communicator + ?Sized>(
        &mut self,
        comm: &mut C,
        group: &Group,
        _layer: usize,
        shard: &[f32],
        out: &mut [f32],
    ) -> Result<(), EngineError> {
        let w = self.weights_for_call();
        gather_weights(comm, group, w, shard, out).map_err(comm_err(self.rank))
    }

    /// The weight wire for the next gather, with its own stochastic-rounding stream
    /// (keyed by this rank too: a rank quantizes only its own shard).
    fn weights_for_call(&mut self) -> WeightWire {
        let mut w = self.weights;
        if let WeightWire::Quant { stochastic, .. } = &mut w {
            *stochastic = self
                .streams
                .next(Streams::QWZ)
                .map(|s| zeropp_quant::rng::stream_seed(s, &[self.rank as u64]));
        }
        w
    }

    /// Submits layer `layer`'s weight gather to the prefetch stream.
    pub(crate) fn prefetch_weights(
        &mut self,
        pf: &mut Prefetcher,
        _layer: usize,
        shard: &[f32],
        tag: &str,
    ) -> Result<PendingGather, EngineError> {
        let w = self.weights_for_call();
        let shard = shard.to_vec();
        let tag = tag.to_string();
        let world = pf.world.clone();
        let len = shard.len() * world.size();
        let pending = pf.comm.submit(move |c| {
            c.traffic_mut().set_op(&tag);
            let mut out = vec![0.0f32; len];
            gather_weights(c, &world, w, &shard, &mut out)?;
            Ok(out)
        });
        Ok(PendingGather { pending })
    }

    /// Submits an all-gather of the hpZ secondary shards of `group` to the prefetch
    /// stream (the backward re-gather of the next layer down).
    pub(crate) fn prefetch_secondary(
        &self,
        pf: &mut Prefetcher,
        group: &Group,
        shard: &Secondary,
        tag: &str,
    ) -> PendingGather {
        let shard = shard.clone();
        let tag = tag.to_string();
        let group = group.clone();
        let len = match &shard {
            Secondary::F32(s) => s.len(),
            Secondary::Bf16(s) => s.len(),
        } * group.size();
        let dtype = self.dtype;
        let pending = pf.comm.submit(move |c| {
            c.traffic_mut().set_op(&tag);
            let mut out = vec![0.0f32; len];
            match &shard {
                Secondary::F32(s) => gather_dense(c, &group, dtype, s, &mut out)?,
                Secondary::Bf16(s) => {
                    let mut bits = vec![0u16; len];
                    c.all_gather(&group, s, &mut bits)?;
                    for (o, &h) in out.iter_mut().zip(&bits) {
                        *o = bf16_to_f32(h);
                    }
                }
            }
            Ok(out)
        });
        PendingGather { pending }
    }

    /// Gradient reduce-scatter of layer `layer` (qgZ or dense): `out` = mean over the world.
    pub(crate) fn reduce_scatter_grads<C: Communicator + ?Sized>(
        &mut self,
        comm: &mut C,
        world: &Group,
        layer: usize,
        full: &[f32],
        out: &mut [f32],
    ) -> Result<(), EngineError> {
        match &mut self.qgz {
            Some(q) => q.reduce_scatter(comm, layer, self.streams.next(Streams::QGZ), full, out),
            None => reduce_scatter_dense(comm, world, self.dtype, full, out).map_err(comm_err(self.rank)),
        }
    }

    /// Called before every optimizer step (and evaluation) with the engine's step count.
    pub(crate) fn start_step(&mut self, step: usize) {
        self.streams.start_step(step as u64);
    }
}

/// A gather running on the prefetch stream.
pub(crate) struct PendingGather {
    pending: Pending<Vec<f32>>,
}

impl PendingGather {
    /// Waits for the gathered layer.
    pub(crate) fn wait(self, rank: usize) -> Result<Vec<f32>, EngineError> {
        self.pending.wait().map_err(comm_err(rank))
    }
}

/// The prefetch stream: a duplicated communicator on its own worker thread
/// (`zeropp_comm::AsyncComm`), on which the engine runs the next layer's gather
/// while the current layer computes.
pub struct Prefetcher {
    comm: AsyncComm,
    world: Group,
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
        let world = Group::world(comm.topology());
        let comm = AsyncComm::duplicate_from(comm).map_err(comm_err(rank))?;
        Ok(Self { comm, world, rank })
    }

    /// The prefetch stream's traffic counters (after the jobs submitted so far).
    pub fn traffic(&self) -> Result<TrafficSnapshot, EngineError> {
        self.comm.traffic().wait().map_err(comm_err(self.rank))
    }

    /// Finishes the queued jobs and stops the worker.
    pub fn shutdown(self) -> Result<(), EngineError> {
        self.comm.shutdown().map_err(comm_err(self.rank))
    }
}

//! qwZ-Δ's moves of a layer: the owner's difference encoding (which updates its
//! `Ŵ`), the exchange to the holders of every hpZ copy
//! (`zeropp_comm::collectives::qwz_delta_exchange`), their update, and the
//! intra-node gather of the updated copy; inline or on the prefetch stream.

use zeropp_comm::collectives::{DeltaOptions, delta_apply_timed, delta_encode, qwz_delta_exchange};
use zeropp_comm::quant::encoded_len;
use zeropp_comm::{CommError, Communicator, Group};

use super::gather::{PendingKind, Secondary, gather_secondary};
use super::{LayerComm, PendingGather, Prefetcher};
use crate::EngineError;
use crate::engine::tags;

/// qwZ-Δ's settings on one rank: the differences' format and the hpZ group size.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Delta {
    pub(crate) opts: DeltaOptions,
    pub(crate) hpz: usize,
}

impl Secondary {
    /// The values of `full` in `range` held as this kind of copy holds them
    /// (for `Ŵ`: what the holders of a freshly gathered layer keep of the range).
    pub(crate) fn like(&self, full: &[f32], range: std::ops::Range<usize>) -> Result<Secondary, CommError> {
        let part = full.get(range.clone()).ok_or_else(|| {
            CommError::Mismatch(format!("qwz delta: range {range:?} outside a layer of {}", full.len()))
        })?;
        match self {
            Secondary::F32(_) => Ok(Secondary::F32(part.to_vec())),
            Secondary::Bf16(_) => Ok(Secondary::Bf16(
                part.iter().map(|&x| zeropp_comm::quant::half::bf16::from_f32(x)).collect(),
            )),
            Secondary::Encoded { .. } => Err(not_dense()),
        }
    }

    /// Applies the differences `encs` (one encoding per shard of `s` elements,
    /// in order) to this copy.
    fn apply_deltas<C: Communicator + ?Sized>(
        &mut self,
        comm: &mut C,
        encs: &[u8],
        s: usize,
        opts: &DeltaOptions,
    ) -> Result<(), CommError> {
        let e = encoded_len(opts.spec, s);
        match self {
            Secondary::F32(v) => {
                for (part, enc) in v.chunks_mut(s.max(1)).zip(encs.chunks(e)) {
                    delta_apply_timed(comm, part, enc, opts)?;
                }
            }
            Secondary::Bf16(v) => {
                for (part, enc) in v.chunks_mut(s.max(1)).zip(encs.chunks(e)) {
                    delta_apply_timed(comm, part, enc, opts)?;
                }
            }
            Secondary::Encoded { .. } => return Err(not_dense()),
        }
        Ok(())
    }
}

fn not_dense() -> CommError {
    CommError::Mismatch("qwz delta needs a dense hpZ copy (f32 or bf16), not INT8 encodings".into())
}

/// The exchange, the update of `sec` and the gather of the copy over `group`
/// (the difference under the `fwd_delta` tag, the gather under `fwd_gather`).
fn exchange_and_gather<C: Communicator + ?Sized>(
    comm: &mut C,
    d: Delta,
    group: &Group,
    enc: &[u8],
    sec: &mut Secondary,
    s: usize,
) -> Result<Vec<f32>, CommError> {
    comm.traffic_mut().set_op(tags::FWD_DELTA);
    let got = qwz_delta_exchange(comm, d.hpz, enc)?;
    sec.apply_deltas(comm, &got, s, &d.opts)?;
    comm.traffic_mut().set_op(tags::FWD_GATHER);
    gather_secondary(comm, group, sec)
}

impl LayerComm {
    /// Whether qwZ-Δ is on.
    pub(crate) fn delta_on(&self) -> bool {
        self.delta.is_some()
    }

    /// The owner's half of a difference step: `Q(master − Ŵ)`, with `w_hat`
    /// updated as every holder will update its copy (timed as quantization).
    pub(crate) fn delta_encode<C: Communicator + ?Sized>(
        &self,
        comm: &mut C,
        master: &[f32],
        w_hat: &mut Secondary,
    ) -> Result<Vec<u8>, EngineError> {
        let d = self.delta.ok_or_else(|| EngineError::Training("qwZ-delta is off".into()))?;
        let t = std::time::Instant::now();
        let mut enc = vec![0u8; encoded_len(d.opts.spec, master.len())];
        match w_hat {
            Secondary::F32(v) => delta_encode(master, v, &d.opts, &mut enc),
            Secondary::Bf16(v) => delta_encode(master, v, &d.opts, &mut enc),
            Secondary::Encoded { .. } => Err(not_dense()),
        }?;
        comm.traffic_mut().add_quant_time(t.elapsed());
        Ok(enc)
    }

    /// Brings the hpZ copy `sec` up to date with this rank's difference `enc`
    /// and every other owner's, then gathers the layer from it over `group`.
    pub(crate) fn delta_gather<C: Communicator + ?Sized>(
        &self,
        comm: &mut C,
        group: &Group,
        enc: &[u8],
        sec: &mut Secondary,
        shard_len: usize,
    ) -> Result<Vec<f32>, EngineError> {
        let d = self.delta.ok_or_else(|| EngineError::Training("qwZ-delta is off".into()))?;
        Ok(exchange_and_gather(comm, d, group, enc, sec, shard_len)?)
    }

    /// [`Self::delta_gather`] on the prefetch stream: the updated copy comes
    /// back with the gathered layer.
    pub(crate) fn prefetch_delta(
        &self,
        pf: &mut Prefetcher,
        group: &Group,
        enc: Vec<u8>,
        mut sec: Secondary,
        shard_len: usize,
    ) -> Result<PendingGather, EngineError> {
        let d = self.delta.ok_or_else(|| EngineError::Training("qwZ-delta is off".into()))?;
        let group = group.clone();
        let pending = pf.submit_tagged(tags::FWD_DELTA, move |c| {
            let full = exchange_and_gather(c, d, &group, &enc, &mut sec, shard_len)?;
            Ok((full, Some(sec)))
        });
        Ok(PendingGather { pending: PendingKind::World(pending) })
    }
}

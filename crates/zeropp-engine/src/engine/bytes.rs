//! The analytic communication-volume model: bytes sent per rank per optimizer
//! step, by operation tag and link class.
//!
//! It follows the engine's schedule exactly (see [`super`]) and the per-message
//! byte formulas of the comm crate, so the traffic counters of a run must equal
//! it to the byte. With `W` ranks, `L` per node, `H` the hpZ group size, a layer
//! padded to `P` elements (`s = P / W` per rank), `b` bytes per baseline element
//! and `A` micro-batches per step:
//!
//! | op | ZeRO-3 (per layer) | ZeRO++ (per layer) |
//! |---|---|---|
//! | `fwd_gather` | `A · s·b` to each of the `W-1` peers | once `q(s)` to each of the `W-1` peers (qwZ payload), then `A-1` times `(P/H)·b` to each of the `H-1` hpZ peers |
//! | `bwd_gather` | `A · s·b` to each of `W-1` peers | `A · (P/H)·b` to each of the `H-1` hpZ peers |
//! | `grad_reduce` | `A · s·b` to each of `W-1` peers (f32: reduce-scatter; bf16: all-to-all) | `A` × qgZ: intra all-to-all of `N` quantized slices to each of `L-1` local peers, inter all-to-all of one slice to each of `N-1` rail peers |
//! | `grad_norm` | one f32 all-reduce: 8 bytes to each of `W-1` peers | same |
//!
//! A peer on the same node counts as intra-node, others as inter-node.

use std::collections::BTreeMap;

use zeropp_comm::Topology;
use zeropp_partition::PartitionPlan;

use super::quant;
use super::tags;
use crate::EngineError;
use crate::config::EngineConfig;
use crate::metrics::LinkBytes;

/// Bytes sent per rank per optimizer step, by operation tag.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct ByteModel {
    /// Per operation tag.
    pub by_op: BTreeMap<String, LinkBytes>,
}

impl ByteModel {
    /// The sum over operations.
    pub fn total(&self) -> LinkBytes {
        let mut t = LinkBytes::default();
        for v in self.by_op.values() {
            t.add(v);
        }
        t
    }

    /// One operation (zero when absent).
    pub fn op(&self, tag: &str) -> LinkBytes {
        self.by_op.get(tag).copied().unwrap_or_default()
    }

    fn add(&mut self, tag: &str, bytes: LinkBytes) {
        self.by_op.entry(tag.to_string()).or_default().add(&bytes);
    }
}

/// Bytes a rank sends when it sends `payload` bytes to every other member of
/// the world (a world all-gather or an equal all-to-all).
fn to_world(t: &Topology, payload: usize) -> LinkBytes {
    let p = payload as f64;
    LinkBytes { intra: p * (t.local_size() - 1) as f64, inter: p * (t.world() - t.local_size()) as f64 }
}

/// Bytes of a group all-gather inside one node of `size` members.
fn to_node_group(size: usize, payload: usize) -> LinkBytes {
    LinkBytes { intra: (payload * (size - 1)) as f64, inter: 0.0 }
}

/// The analytic bytes per rank per step of `cfg` on `plan`, with `micro_batches`
/// micro-batches per step (the gradient accumulation).
///
/// ```
/// use zeropp_comm::Topology;
/// use zeropp_engine::config::{EngineConfig, ZeroConfig};
/// use zeropp_engine::engine::{build_plan, bytes::step_bytes};
/// use zeropp_engine::model::{Gpt, GptConfig};
/// let model = Gpt::new(GptConfig::tiny())?;
/// let t = Topology::new(8, 4).map_err(|e| zeropp_engine::EngineError::InvalidConfig(e.to_string()))?;
/// let z3 = EngineConfig::default();
/// let zpp = EngineConfig { zero: ZeroConfig::zeropp(4), ..EngineConfig::default() };
/// let b3 = step_bytes(&build_plan(&model, &z3, t)?, &z3, 1)?.total();
/// let bpp = step_bytes(&build_plan(&model, &zpp, t)?, &zpp, 1)?.total();
/// assert!(bpp.inter < 0.3 * b3.inter);
/// # Ok::<(), zeropp_engine::EngineError>(())
/// ```
pub fn step_bytes(
    plan: &PartitionPlan,
    cfg: &EngineConfig,
    micro_batches: usize,
) -> Result<ByteModel, EngineError> {
    let t = plan.topology();
    let z = &cfg.zero;
    let b = z.comm_dtype.bytes();
    let a = micro_batches.max(1);
    let perr = |e: zeropp_partition::PartitionError| EngineError::Partition(e.to_string());
    let mut m = ByteModel::default();
    for l in 0..plan.num_buckets() {
        let s = plan.shard_len(l).map_err(perr)?;
        let padded = plan.bucket(l).map_err(perr)?.padded_len;
        let world_gather =
            if z.qwz { quant::qwz_payload_bytes(s, z.qwz_bits, z.qwz_group_size)? } else { s * b };
        let gather = to_world(&t, world_gather);
        if z.hpz() {
            let sec = to_node_group(z.hpz_size, padded / z.hpz_size * b);
            m.add(tags::FWD_GATHER, gather);
            m.add(tags::FWD_GATHER, sec.scaled((a - 1) as f64));
            m.add(tags::BWD_GATHER, sec.scaled(a as f64));
        } else {
            m.add(tags::FWD_GATHER, gather.scaled(a as f64));
            m.add(tags::BWD_GATHER, gather.scaled(a as f64));
        }
        let reduce = if z.qgz {
            quant::qgz_bytes(&t, padded, z.qgz_bits, z.qgz_group_size)?
        } else {
            to_world(&t, s * b)
        };
        m.add(tags::GRAD_REDUCE, reduce.scaled(a as f64));
    }
    // One f32 all-reduce of the squared norm: reduce-scatter + all-gather of
    // ceil(1 / W) = 1 float, 8 bytes to every other rank.
    m.add(tags::GRAD_NORM, to_world(&t, 8));
    Ok(m)
}

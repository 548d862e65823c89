//! The analytic communication-volume model: bytes sent per rank per optimizer
//! step, by operation tag and link class.
//!
//! It follows the engine's schedule exactly (see [`super`]) over the run's own
//! plan of collectives ([`CommPlan`]: the same choices, the same qgZ options),
//! and is composed of the byte formulas that sit beside each collective in `zeropp_comm`
//! (`world_all_gather_bytes`, `world_qwz_bytes`, `world_reduce_scatter_bytes`,
//! `group_all_gather_bytes`), so the traffic counters of a run must equal it to
//! the byte. With `W` ranks, `L` per node, `N` nodes, `H` the hpZ group size, a
//! layer padded to `P` elements (`s = P / W` per rank) and `A` micro-batches:
//!
//! | op | per layer |
//! |---|---|
//! | `fwd_gather` | without hpZ: `A` world gathers (dense or qwZ, with the config's routing); with hpZ: one world gather, then `A-1` hpZ gathers |
//! | `bwd_gather` | without hpZ: `A` world gathers; with hpZ: `A` hpZ gathers (`P/H` dense elements, or `W/H` qwZ encodings of `s` elements with `--hpz-wire int8`) over the `H-1` hpZ peers |
//! | `grad_reduce` | `A` world reduce-scatters of `P` elements (dense, routed), or `A` qgZ calls: `N·E(s)` to each of the `L-1` local peers, `E(s)` to each of the `N-1` rail peers, plus, with the 1-D exclusion, the 1-D elements of each rank's shard to that rank |
//! | `grad_norm` | one all-gather of an f64: 8 bytes to each of the `W-1` peers |
//!
//! With qwZ-Δ a step is one of two kinds ([`StepKind`]): a **full** step
//! gathers as above (the first of a run, every `refresh_every`-th, the one after
//! a skipped step or a checkpoint), a **difference** step replaces the forward
//! world gather by `fwd_delta`, qwZ-Δ's exchange of one INT4 encoding per shard
//! (`zeropp_comm::collectives::qwz_delta_bytes`), and gathers every micro-batch's
//! forward from the hpZ copy (`A` hpZ gathers under `fwd_gather`).
//!
//! Flat routing sends `(W-L)·s·b` across nodes per world collective, hierarchical
//! `(N-1)·s·b`: a hierarchical ZeRO-3 step sends `3·M·(N-1)/W` across nodes per
//! rank (`M = P·b` summed over layers), ZeRO++ about a quarter of that.
//! Asymmetric traffic (the 1-D exchange) is averaged over the ranks, as the
//! counters of a run are.

use std::collections::BTreeMap;

use zeropp_partition::PartitionPlan;

use zeropp_comm::collectives::{self, QgzSeeds};
use zeropp_comm::{Group, LinkBytes as CommBytes};
use zeropp_quant::encoded_len;

use super::comm_plan::{CommPlan, WeightGather};
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

/// Which gathers a step runs: all of them ([`StepKind::Full`], every step
/// without qwZ-Δ), or qwZ-Δ's difference step ([`StepKind::Delta`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StepKind {
    /// The forward gather over the world (rebuilding the hpZ copies).
    Full,
    /// qwZ-Δ: differences into the hpZ copies, the forward gather from them.
    Delta,
}

/// The analytic bytes per rank per step of `cfg` on `plan`, with `micro_batches`
/// micro-batches per step (the gradient accumulation): a full step
/// ([`step_bytes_of`] with [`StepKind::Full`]).
///
/// ```
/// use zeropp_comm::Topology;
/// use zeropp_engine::config::{EngineConfig, ZeroConfig};
/// use zeropp_engine::engine::{build_plan, bytes::step_bytes};
/// use zeropp_engine::model::{Gpt, GptConfig};
/// let model = Gpt::new(GptConfig::tiny())?;
/// let t = Topology::ranks(8).per_node(4).map_err(zeropp_engine::EngineError::InvalidTopology)?;
/// let z3 = EngineConfig::default(); // hierarchical ZeRO-3
/// let zpp = EngineConfig { zero: ZeroConfig::zeropp(4), ..EngineConfig::default() };
/// let b3 = step_bytes(&build_plan(&model, &z3, t)?, &z3, 1)?.total();
/// let bpp = step_bytes(&build_plan(&model, &zpp, t)?, &zpp, 1)?.total();
/// assert!(bpp.inter < 0.35 * b3.inter);
/// # Ok::<(), zeropp_engine::EngineError>(())
/// ```
pub fn step_bytes(
    plan: &PartitionPlan,
    cfg: &EngineConfig,
    micro_batches: usize,
) -> Result<ByteModel, EngineError> {
    step_bytes_of(plan, cfg, micro_batches, StepKind::Full)
}

/// [`step_bytes`] of a step of `kind` (without qwZ-Δ both kinds are the same).
pub fn step_bytes_of(
    plan: &PartitionPlan,
    cfg: &EngineConfig,
    micro_batches: usize,
    kind: StepKind,
) -> Result<ByteModel, EngineError> {
    let cp = CommPlan::new(plan, cfg)?;
    let t = cp.topology();
    let delta = cp.delta();
    let delta_step = kind == StepKind::Delta && delta.is_some() && cp.hpz_size() > 1;
    let w = t.world();
    let (dense, routing, hpz) = (cp.dense(), cp.routing(), cp.hpz_size());
    let b = dense.bytes();
    let a = micro_batches.max(1) as u64;
    let wu = w as u64;
    // Every call of a run has the same byte count: the options without seeds.
    let qgz = cp.qgz_options(QgzSeeds::default())?;
    // Totals over all ranks; divided by W at the end, as the counters are averaged.
    let mut sums: BTreeMap<&str, CommBytes> = BTreeMap::new();
    let mut add = |tag: &'static str, bytes: CommBytes| *sums.entry(tag).or_default() += bytes;
    let hpz_groups = cp.hpz_groups(plan)?;
    for layer in cp.layers() {
        let (s, padded) = (layer.shard_len, layer.padded_len);
        if padded == 0 {
            // A layer whose parameters are all persistent: nothing moves.
            continue;
        }
        let world_gather = match cp.weights() {
            WeightGather::Qwz { spec, .. } => collectives::world_qwz_bytes(&t, routing, spec, s),
            WeightGather::Dense(_) => collectives::world_all_gather_bytes(&t, routing, dense, s),
        };
        if layer.persistent {
            // Gathered densely once per step, never per layer.
            let once = collectives::world_all_gather_bytes(&t, routing, dense, s);
            add(tags::PERSIST_GATHER, once.scaled(wu));
        } else if hpz > 1 {
            for (r, g) in hpz_groups.iter().enumerate() {
                let sec = match cp.weights() {
                    WeightGather::Qwz { spec, .. } if cp.hpz_int8() => {
                        let payload = w / hpz * encoded_len(spec, s);
                        collectives::group_all_gather_bytes(&t, r, g, 1, payload)
                    }
                    _ => collectives::group_all_gather_bytes(&t, r, g, b, padded / hpz),
                };
                match delta {
                    Some(d) if delta_step => {
                        let e = encoded_len(d.spec, s);
                        let delta = collectives::qwz_delta_bytes(&t, hpz, r, e).map_err(EngineError::Comm)?;
                        if delta.total() > 0 {
                            add(tags::FWD_DELTA, delta);
                        }
                        add(tags::FWD_GATHER, sec.scaled(a));
                    }
                    _ => add(tags::FWD_GATHER, world_gather + sec.scaled(a - 1)),
                }
                add(tags::BWD_GATHER, sec.scaled(a));
            }
        } else {
            add(tags::FWD_GATHER, world_gather.scaled(a * wu));
            add(tags::BWD_GATHER, world_gather.scaled(a * wu));
        }
        for c in &layer.reduces {
            let call = c.chunk.len() * w;
            match &qgz {
                Some(opts) => {
                    add(tags::GRAD_REDUCE, collectives::qgz_bytes(&t, opts, call).scaled(a * wu));
                    if !c.dense_1d.is_empty() {
                        for r in 0..w {
                            add(tags::GRAD_REDUCE, c.dense_1d.bytes(&t, routing, r, b).scaled(a));
                        }
                    }
                }
                None => add(
                    tags::GRAD_REDUCE,
                    collectives::world_reduce_scatter_bytes(&t, routing, dense, call).scaled(a * wu),
                ),
            }
        }
    }
    // The norm exchange: an all-gather of one f64 over the world.
    let world = Group::world(&t);
    for r in 0..w {
        add(tags::GRAD_NORM, collectives::group_all_gather_bytes(&t, r, &world, 8, 1));
    }
    let mut m = ByteModel::default();
    for (tag, v) in sums {
        m.add(tag, LinkBytes { intra: v.intra as f64 / w as f64, inter: v.inter as f64 / w as f64 });
    }
    Ok(m)
}

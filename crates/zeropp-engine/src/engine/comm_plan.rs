//! The plan of collectives: for every layer of a [`PartitionPlan`], which
//! collective moves its weights and its gradient, chosen once from the config.
//!
//! Three readers take their choices from it and from nowhere else:
//!
//! | reader | what it does with the plan |
//! |---|---|
//! | `layer_comm` (the run) | calls each layer's collectives with the plan's options |
//! | [`super::bytes`] (the byte model) | composes comm's byte formula of each planned call with the schedule's multiplicities |
//! | [`super::memory`] (the memory model) | sizes the largest gathered layer and qgZ's residuals |
//!
//! So a new qgZ option lives in comm's [`QgzConfig`] (its settings and
//! [`QgzConfig::options`]) and in the stages that act on it; this plan carries
//! the config as it is.
//!
//! ```
//! use zeropp_comm::Topology;
//! use zeropp_engine::config::{EngineConfig, ZeroConfig};
//! use zeropp_engine::engine::{CommPlan, build_plan};
//! use zeropp_engine::model::{Gpt, GptConfig, Model};
//! let model = Gpt::new(GptConfig::tiny())?;
//! let t = Topology::ranks(8).per_node(4).map_err(zeropp_engine::EngineError::InvalidTopology)?;
//! let cfg = EngineConfig { zero: ZeroConfig::zeropp(4), ..EngineConfig::default() };
//! let plan = CommPlan::new(&build_plan(&model, &cfg, t)?, &cfg)?;
//! assert!(plan.qgz().is_some() && plan.hpz_size() == 4);
//! assert_eq!(plan.layers().len(), model.layers().len());
//! # Ok::<(), zeropp_engine::EngineError>(())
//! ```

use std::ops::Range;

use zeropp_comm::collectives::{DenseWire, QgzConfig, QgzOptions, QgzSeeds, Routing};
use zeropp_comm::{Group, Topology};
use zeropp_partition::PartitionPlan;
use zeropp_quant::QuantSpec;

use crate::EngineError;
use crate::config::{DeltaConfig, EngineConfig, HpzWire};

/// How a layer's primary shards travel in a world gather.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum WeightGather {
    /// Dense elements of the baseline type.
    Dense(DenseWire),
    /// qwZ: block-quantized, dequantized on arrival (and rounded to bf16 when the
    /// working precision is bf16, as DeepSpeed dequantizes into its 16-bit dtype,
    /// so the forward and the backward see the same weights).
    Qwz {
        /// The quantization of the shards.
        spec: QuantSpec,
        /// Whether the dequantized weights are rounded to bf16 values.
        round_bf16: bool,
    },
}

/// One gradient reduce call of a layer.
#[derive(Debug, Clone)]
pub struct ReduceCall {
    /// The elements of every rank's shard this call carries.
    pub chunk: Range<usize>,
    /// The 1-D parameters in it that go to their owners densely (empty unless
    /// qgZ excludes them).
    pub(crate) dense_1d: DenseSlices,
}

/// One layer's collectives.
#[derive(Debug, Clone)]
pub struct LayerPlan {
    /// Elements of one rank's shard.
    pub shard_len: usize,
    /// Elements of the padded layer (`W × shard_len`).
    pub padded_len: usize,
    /// The persistent bucket: gathered densely once per step, never per layer.
    pub persistent: bool,
    /// The gradient reduce calls (one unless `reduce_bucket_size` splits it).
    pub reduces: Vec<ReduceCall>,
}

/// The collectives of a run, per layer (see the [module docs](self)).
#[derive(Debug, Clone)]
pub struct CommPlan {
    topology: Topology,
    routing: Routing,
    dense: DenseWire,
    weights: WeightGather,
    hpz_size: usize,
    hpz_wire: HpzWire,
    qgz: Option<QgzConfig>,
    delta: Option<DeltaConfig>,
    layers: Vec<LayerPlan>,
}

impl CommPlan {
    /// The collectives of `cfg` on `plan` (built from `cfg` by
    /// [`build_plan`](super::build_plan)).
    pub fn new(plan: &PartitionPlan, cfg: &EngineConfig) -> Result<Self, EngineError> {
        let z = &cfg.zero;
        let dense = z.comm_dtype.wire();
        let weights = match z.qwz {
            Some(spec) => WeightGather::Qwz { spec, round_bf16: dense == DenseWire::Bf16 },
            None => WeightGather::Dense(dense),
        };
        let last = plan.num_buckets().saturating_sub(1);
        let layers = (0..plan.num_buckets())
            .map(|l| {
                let layout = plan.bucket(l)?;
                let reduces = reduce_chunks(plan, cfg, l)?
                    .into_iter()
                    .map(|chunk| {
                        let dense_1d = if z.exclude_1d() {
                            DenseSlices::of_chunk(plan, l, chunk.clone())?
                        } else {
                            DenseSlices::default()
                        };
                        Ok(ReduceCall { chunk, dense_1d })
                    })
                    .collect::<Result<Vec<_>, EngineError>>()?;
                Ok(LayerPlan {
                    shard_len: plan.shard_len(l)?,
                    padded_len: layout.padded_len,
                    persistent: layout.name == super::PERSISTENT_BUCKET && l == last,
                    reduces,
                })
            })
            .collect::<Result<Vec<_>, EngineError>>()?;
        Ok(Self {
            topology: plan.topology(),
            routing: z.routing,
            dense,
            weights,
            hpz_size: z.hpz_size,
            hpz_wire: z.hpz_wire,
            qgz: z.qgz,
            delta: z.qwz_delta,
            layers,
        })
    }

    /// The layers' collectives, in bucket order.
    pub fn layers(&self) -> &[LayerPlan] {
        &self.layers
    }

    /// The cluster.
    pub fn topology(&self) -> Topology {
        self.topology
    }

    /// The routing of every world collective (qgZ is hierarchical by construction).
    pub fn routing(&self) -> Routing {
        self.routing
    }

    /// The baseline collectives' element type.
    pub fn dense(&self) -> DenseWire {
        self.dense
    }

    /// How the world gathers send the weights.
    pub fn weights(&self) -> WeightGather {
        self.weights
    }

    /// hpZ's group size (1: off).
    pub fn hpz_size(&self) -> usize {
        self.hpz_size
    }

    /// Whether the hpZ copy holds and gathers qwZ's INT8 encodings.
    pub fn hpz_int8(&self) -> bool {
        matches!(self.weights, WeightGather::Qwz { .. }) && self.hpz_wire == HpzWire::Int8
    }

    /// qgZ's settings (`None`: the dense reduce-scatter).
    pub fn qgz(&self) -> Option<&QgzConfig> {
        self.qgz.as_ref()
    }

    /// qgZ's options of one call with `seeds` (`None` without qgZ).
    pub fn qgz_options(&self, seeds: QgzSeeds) -> Result<Option<QgzOptions>, EngineError> {
        Ok(self.qgz.map(|q| q.options(seeds)).transpose()?)
    }

    /// qwZ-Δ's settings (`None`: off).
    pub fn delta(&self) -> Option<DeltaConfig> {
        self.delta
    }

    /// The reduce calls of every layer, in order (the index of a call's qgZ
    /// residuals).
    pub fn reduce_calls(&self) -> usize {
        self.layers.iter().map(|l| l.reduces.len()).sum()
    }

    /// The hpZ group of every rank (empty without hpZ).
    pub(crate) fn hpz_groups(&self, plan: &PartitionPlan) -> Result<Vec<Group>, EngineError> {
        if self.hpz_size <= 1 {
            return Ok(Vec::new());
        }
        (0..self.topology.world())
            .map(|r| {
                let g = plan.hpz_group(r)?;
                Group::new(&self.topology, g.ranks).map_err(EngineError::InvalidTopology)
            })
            .collect()
    }
}

/// The elements of one layer that are reduced densely instead of by qgZ (the 1-D
/// parameters): for every rank, the flat ranges of those elements inside its
/// primary shard, in order.
#[derive(Debug, Clone, Default)]
pub(crate) struct DenseSlices {
    pub(crate) per_rank: Vec<Vec<Range<usize>>>,
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

    /// Bytes rank `rank` sends in the exchange of these elements, `b` bytes each:
    /// with hierarchical routing (and more than one node of more than one rank)
    /// to its local peers the elements of every owner with their local rank, then
    /// over its rail the elements of each other node's owner with its own local
    /// rank; flat, each owner's elements straight to it.
    pub(crate) fn bytes(
        &self,
        topology: &Topology,
        routing: Routing,
        rank: usize,
        b: usize,
    ) -> zeropp_comm::LinkBytes {
        let t = topology;
        let (n, l) = (t.nodes(), t.local_size());
        let count = |r: usize| self.count(r) as u64 * b as u64;
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
            out.intra = (0..l)
                .filter(|&j| j != me_l)
                .map(|j| (0..n).map(|m| count(t.rank_of(m, j))).sum::<u64>())
                .sum();
            out.inter = (0..n).filter(|&m| m != me_m).map(|m| count(t.rank_of(m, me_l))).sum();
        }
        out
    }
}

/// The reduce calls of bucket `layer`: ranges of every rank's shard, each
/// reduced by its own collective. One call for the whole shard, unless
/// `reduce_bucket_size` (in padded elements over all ranks) is smaller than
/// the bucket: then pieces of `W·k` elements, `k` a multiple of the shard
/// alignment (at least one alignment unit per rank).
fn reduce_chunks(
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

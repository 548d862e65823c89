//! The partition plan: who owns which elements of every bucket.

use std::ops::Range;

use serde::{Deserialize, Serialize};
use zeropp_comm::Topology;

use crate::error::{PartitionError, Result};
use crate::layout::{BucketLayout, ParamRegistry};

/// Parameters of a [`PartitionPlan`] besides the topology.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct PlanConfig {
    /// Alignment in elements of every primary shard: each rank's shard of
    /// each bucket is a whole number of `align`-element groups. Set it to the
    /// quantization group size (or a common multiple of the qwZ and qgZ group
    /// sizes; even, so INT4 packing never splits a byte). Must be `>= 1`.
    pub align: usize,
    /// hpZ group size: the secondary copy of each bucket is partitioned across
    /// `hpz` consecutive ranks of a node. Must divide `local_size`; `1`
    /// disables hpZ (like DeepSpeed's `zero_hpz_partition_size`).
    pub hpz: usize,
    /// Alignment in elements of every parameter inside its bucket: each parameter
    /// starts at a multiple of `param_align` (zero padding in between). With the
    /// quantization group size here (and `align` a multiple of it), no
    /// quantization group ever holds elements of two parameters, so a tensor of
    /// small values (weights) never shares a scale with one of large values (a
    /// LayerNorm gain): quantization is per tensor, as in DeepSpeed. `1` packs
    /// parameters back to back.
    pub param_align: usize,
}

impl Default for PlanConfig {
    /// `align = 1`, `hpz = 1`, `param_align = 1` (no alignment, hpZ off).
    fn default() -> Self {
        Self { align: 1, hpz: 1, param_align: 1 }
    }
}

impl PlanConfig {
    /// A config with the given alignment and hpZ group size (parameters packed).
    pub fn new(align: usize, hpz: usize) -> Self {
        Self { align, hpz, param_align: 1 }
    }

    /// This config with every parameter aligned to `param_align` elements.
    pub fn with_param_align(self, param_align: usize) -> Self {
        Self { param_align, ..self }
    }
}

/// A rank's hpZ group: the `hpz` consecutive ranks of its node that contain it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct HpzGroup {
    /// Member ranks, in order; the secondary shards of the members, concatenated
    /// in this order, are the full bucket.
    pub ranks: Vec<usize>,
    /// Position of the rank inside `ranks` (the index of its secondary shard).
    pub index: usize,
}

/// Everything the plan says about one rank, bucket by bucket.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RankPlan {
    /// The rank.
    pub rank: usize,
    /// Its node.
    pub node: usize,
    /// Its rank inside the node.
    pub local_rank: usize,
    /// Primary shard range of each bucket (also its gradient shard and the
    /// range of optimizer state it owns).
    pub primary: Vec<Range<usize>>,
    /// Secondary (hpZ) shard range of each bucket; `None` when hpZ is off.
    pub secondary: Option<Vec<Range<usize>>>,
    /// Its hpZ group (just `[rank]` when hpZ is off).
    pub hpz_group: HpzGroup,
    /// qgZ send order: entry `l` lists the world shards (by owning rank) sent
    /// to local peer `l` in the intra-node all-to-all.
    pub qgz_send_order: Vec<Vec<usize>>,
}

/// The part of one parameter that falls inside one rank's primary shard.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ShardPiece {
    /// Index of the parameter in its bucket (`BucketLayout::params`).
    pub param: usize,
    /// Element range inside the shard (`0..shard_len`).
    pub in_shard: Range<usize>,
    /// The same elements as a range of the parameter's flattened tensor.
    pub in_param: Range<usize>,
}

/// Analytic per-rank memory of the sharded model states, in bytes.
///
/// See the crate documentation for the formula; `Ψ` here is the padded
/// parameter count ([`MemoryReport::padded_params`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct MemoryReport {
    /// The rank described.
    pub rank: usize,
    /// Real parameter count (without padding).
    pub params: usize,
    /// Padded parameter count `Ψ` (sum of the buckets' `padded_len`).
    pub padded_params: usize,
    /// Elements of the rank's primary shards (`Ψ / world`).
    pub primary_elems: usize,
    /// Elements of the rank's secondary shards (`Ψ / hpz`, or 0 when hpZ is off).
    pub secondary_elems: usize,
    /// f32 master weights: `4 · Ψ / world`.
    pub master_bytes: usize,
    /// 16-bit working copy of the primary shard: `2 · Ψ / world`.
    pub working_bytes: usize,
    /// 16-bit secondary (hpZ) shards: `2 · Ψ / hpz` (0 when hpZ is off).
    pub secondary_bytes: usize,
    /// 16-bit gradient shards: `2 · Ψ / world`.
    pub gradient_bytes: usize,
    /// f32 optimizer moments (`exp_avg`, `exp_avg_sq`): `8 · Ψ / world`.
    pub optimizer_bytes: usize,
}

impl MemoryReport {
    /// Sum of all components.
    pub fn total_bytes(&self) -> usize {
        self.master_bytes
            + self.working_bytes
            + self.secondary_bytes
            + self.gradient_bytes
            + self.optimizer_bytes
    }

    /// The analytic formula `(2 + 2 + 12) · Ψ / world + 2 · Ψ / hpz`
    /// (the hpZ term only when `hpz > 1`), for a padded count `psi`.
    pub fn formula(psi: usize, world: usize, hpz: usize) -> usize {
        let zero3 = 16 * psi / world;
        let hpz_term = if hpz > 1 { 2 * psi / hpz } else { 0 };
        zero3 + hpz_term
    }
}

/// Which rank owns which elements of every bucket, for a [`Topology`].
///
/// All answers are pure ranges and maps; nothing here communicates.
///
/// ```
/// use zeropp_comm::Topology;
/// use zeropp_partition::{DType, ParamRegistry, ParamSpec, PartitionPlan, PlanConfig};
///
/// let mut reg = ParamRegistry::new();
/// reg.push_bucket("layer0", vec![ParamSpec::new("layer0.w", [10, 10], DType::BF16)])?;
/// // 2 nodes × 4 ranks, shards aligned to 8-element quantization groups, hpZ over 4 ranks.
/// let plan = PartitionPlan::new(&reg, Topology::ranks(8).per_node(4)?, PlanConfig::new(8, 4))?;
///
/// let b = plan.bucket(0)?;
/// assert_eq!((b.numel, b.padded_len), (100, 128)); // padded to a multiple of 8 × 8
/// assert_eq!(plan.primary_range(5, 0)?, 80..96); // rank 5 owns 16 elements
/// assert_eq!(plan.grad_range(5, 0)?, 80..96); // and receives their gradients
/// assert_eq!(plan.hpz_group(5)?.ranks, vec![4, 5, 6, 7]);
/// assert_eq!(plan.secondary_range(5, 0)?, Some(32..64)); // 1/4 of the bucket
/// assert_eq!(plan.qgz_peer_shards(1)?, vec![1, 5]); // shards of ranks (m, 1)
///
/// let full: Vec<f32> = (0..128).map(|i| i as f32).collect();
/// let shards = plan.partition(0, &full)?;
/// assert_eq!(plan.gather(0, &shards)?, full);
/// # Ok::<(), zeropp_partition::PartitionError>(())
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PartitionPlan {
    topology: Topology,
    config: PlanConfig,
    registry: ParamRegistry,
    buckets: Vec<BucketLayout>,
}

impl PartitionPlan {
    /// Lays out every bucket of `registry` for `topology` and validates the
    /// config (`align >= 1`; `hpz >= 1` dividing `local_size`).
    pub fn new(registry: &ParamRegistry, topology: Topology, config: PlanConfig) -> Result<Self> {
        if config.align == 0 || config.param_align == 0 {
            return Err(PartitionError::InvalidConfig("align and param_align must be >= 1".into()));
        }
        if config.hpz == 0 || !topology.local_size().is_multiple_of(config.hpz) {
            return Err(PartitionError::InvalidHpz { hpz: config.hpz, local_size: topology.local_size() });
        }
        let granule = topology.world().checked_mul(config.align).ok_or_else(|| {
            PartitionError::InvalidConfig(format!(
                "world {} × align {} overflows",
                topology.world(),
                config.align
            ))
        })?;
        let buckets = registry
            .buckets()
            .iter()
            .map(|b| BucketLayout::new(b, granule, config.param_align))
            .collect::<Result<Vec<_>>>()?;
        Ok(Self { topology, config, registry: registry.clone(), buckets })
    }

    /// The topology.
    pub fn topology(&self) -> Topology {
        self.topology
    }

    /// The config (alignment, hpZ group size).
    pub fn config(&self) -> PlanConfig {
        self.config
    }

    /// The registry the plan was built from.
    pub fn registry(&self) -> &ParamRegistry {
        &self.registry
    }

    /// World size.
    pub fn world(&self) -> usize {
        self.topology.world()
    }

    /// True when hpZ is on (`hpz > 1`).
    pub fn hpz_enabled(&self) -> bool {
        self.config.hpz > 1
    }

    /// All bucket layouts.
    pub fn buckets(&self) -> &[BucketLayout] {
        &self.buckets
    }

    /// Number of buckets.
    pub fn num_buckets(&self) -> usize {
        self.buckets.len()
    }

    /// One bucket's layout.
    pub fn bucket(&self, bucket: usize) -> Result<&BucketLayout> {
        self.buckets
            .get(bucket)
            .ok_or(PartitionError::BucketOutOfRange { bucket, buckets: self.buckets.len() })
    }

    pub(crate) fn check_rank(&self, rank: usize) -> Result<()> {
        if rank < self.world() {
            Ok(())
        } else {
            Err(PartitionError::RankOutOfRange { rank, world: self.world() })
        }
    }

    /// Length of every primary shard of `bucket` (`padded_len / world`).
    pub fn shard_len(&self, bucket: usize) -> Result<usize> {
        Ok(self.bucket(bucket)?.padded_len / self.world())
    }

    /// Length of every secondary shard of `bucket` (`padded_len / hpz`;
    /// the whole bucket when hpZ is off).
    pub fn secondary_len(&self, bucket: usize) -> Result<usize> {
        Ok(self.bucket(bucket)?.padded_len / self.config.hpz)
    }

    /// The primary shard of `rank` in `bucket`: the elements it owns, keeps
    /// in f32, updates and checkpoints. The world's primary shards tile
    /// `0..padded_len` in rank order.
    pub fn primary_range(&self, rank: usize, bucket: usize) -> Result<Range<usize>> {
        self.check_rank(rank)?;
        let len = self.shard_len(bucket)?;
        Ok(rank * len..(rank + 1) * len)
    }

    /// The gradient shard `rank` receives from the reduce-scatter: equal to
    /// its primary shard.
    pub fn grad_range(&self, rank: usize, bucket: usize) -> Result<Range<usize>> {
        self.primary_range(rank, bucket)
    }

    /// The optimizer state `rank` owns (f32 master, `exp_avg`,
    /// `exp_avg_sq`): the same range as its primary shard, padding included
    /// (padding stays zero: zero weights with zero gradients are fixed
    /// points of AdamW, weight decay included).
    pub fn optimizer_range(&self, rank: usize, bucket: usize) -> Result<Range<usize>> {
        self.primary_range(rank, bucket)
    }

    /// The hpZ group of `rank`: the `hpz` consecutive ranks of its node that
    /// contain it (`[rank]` when hpZ is off).
    pub fn hpz_group(&self, rank: usize) -> Result<HpzGroup> {
        self.check_rank(rank)?;
        let hpz = self.config.hpz;
        let node = self.topology.node_of(rank);
        let local = self.topology.local_rank(rank);
        let first = local / hpz * hpz;
        Ok(HpzGroup {
            ranks: (first..first + hpz).map(|l| self.topology.rank_of(node, l)).collect(),
            index: local - first,
        })
    }

    /// The secondary (hpZ) shard of `rank` in `bucket`: the bucket is
    /// partitioned across the rank's hpZ group, in group order. `None` when
    /// hpZ is off.
    pub fn secondary_range(&self, rank: usize, bucket: usize) -> Result<Option<Range<usize>>> {
        let group = self.hpz_group(rank)?;
        let len = self.secondary_len(bucket)?;
        if !self.hpz_enabled() {
            return Ok(None);
        }
        Ok(Some(group.index * len..(group.index + 1) * len))
    }

    /// qgZ reordering for the intra-node all-to-all: the world shards (named
    /// by owning rank) sent to local peer `local_peer`, in order — the shards
    /// of ranks `(node m, local_peer)` for `m = 0..nodes`. The same on every
    /// rank. After the intra-node all-to-all and reduction, chunk `m` of what
    /// a rank holds goes to node `m` in the inter-node all-to-all.
    pub fn qgz_peer_shards(&self, local_peer: usize) -> Result<Vec<usize>> {
        let local_size = self.topology.local_size();
        if local_peer >= local_size {
            return Err(PartitionError::LocalRankOutOfRange { local: local_peer, local_size });
        }
        Ok((0..self.topology.nodes()).map(|m| self.topology.rank_of(m, local_peer)).collect())
    }

    /// The full qgZ slice permutation: position `p` of the reordered
    /// gradient buffer holds world shard `qgz_slice_order()[p]`; the reordered
    /// buffer splits into `local_size` contiguous chunks, chunk `l` going to
    /// local peer `l` (see [`PartitionPlan::qgz_peer_shards`]).
    pub fn qgz_slice_order(&self) -> Vec<usize> {
        let t = self.topology;
        (0..t.local_size()).flat_map(|l| (0..t.nodes()).map(move |m| t.rank_of(m, l))).collect()
    }

    /// Element ranges of `bucket`'s full gradient buffer, in qgZ send order
    /// (the primary ranges of [`PartitionPlan::qgz_slice_order`]).
    pub fn qgz_reordered_ranges(&self, bucket: usize) -> Result<Vec<Range<usize>>> {
        let len = self.shard_len(bucket)?;
        Ok(self.qgz_slice_order().into_iter().map(|r| r * len..(r + 1) * len).collect())
    }

    /// The parameters (or parts of them) inside `rank`'s primary shard of
    /// `bucket`, in order; elements of the shard not covered by any piece are
    /// padding. Useful for per-parameter optimizer options (e.g. no weight
    /// decay on biases) applied to a shard.
    pub fn shard_pieces(&self, rank: usize, bucket: usize) -> Result<Vec<ShardPiece>> {
        let shard = self.primary_range(rank, bucket)?;
        let layout = self.bucket(bucket)?;
        Ok(layout
            .params
            .iter()
            .enumerate()
            .filter_map(|(i, p)| {
                let start = p.offset.max(shard.start);
                let end = (p.offset + p.numel).min(shard.end);
                (start < end).then(|| ShardPiece {
                    param: i,
                    in_shard: start - shard.start..end - shard.start,
                    in_param: start - p.offset..end - p.offset,
                })
            })
            .collect())
    }

    /// Everything about one rank.
    pub fn rank_plan(&self, rank: usize) -> Result<RankPlan> {
        self.check_rank(rank)?;
        let n = self.num_buckets();
        let primary = (0..n).map(|b| self.primary_range(rank, b)).collect::<Result<Vec<_>>>()?;
        let secondary = if self.hpz_enabled() {
            Some(
                (0..n)
                    .map(|b| {
                        let len = self.secondary_len(b)?;
                        let idx = self.topology.local_rank(rank) % self.config.hpz;
                        Ok(idx * len..(idx + 1) * len)
                    })
                    .collect::<Result<Vec<_>>>()?,
            )
        } else {
            None
        };
        let qgz_send_order =
            (0..self.topology.local_size()).map(|l| self.qgz_peer_shards(l)).collect::<Result<Vec<_>>>()?;
        Ok(RankPlan {
            rank,
            node: self.topology.node_of(rank),
            local_rank: self.topology.local_rank(rank),
            primary,
            secondary,
            hpz_group: self.hpz_group(rank)?,
            qgz_send_order,
        })
    }

    /// Real parameter count (without padding).
    pub fn numel(&self) -> usize {
        self.buckets.iter().map(|b| b.numel).sum()
    }

    /// Padded parameter count `Ψ` (sum of `padded_len`).
    pub fn padded_numel(&self) -> usize {
        self.buckets.iter().map(|b| b.padded_len).sum()
    }

    /// Per-rank memory of the model states (see the crate docs for the formula).
    pub fn memory_report(&self, rank: usize) -> Result<MemoryReport> {
        self.check_rank(rank)?;
        let mut primary = 0;
        let mut secondary = 0;
        for b in 0..self.num_buckets() {
            primary += self.primary_range(rank, b)?.len();
            secondary += self.secondary_range(rank, b)?.map_or(0, |r| r.len());
        }
        Ok(MemoryReport {
            rank,
            params: self.numel(),
            padded_params: self.padded_numel(),
            primary_elems: primary,
            secondary_elems: secondary,
            master_bytes: 4 * primary,
            working_bytes: 2 * primary,
            secondary_bytes: 2 * secondary,
            gradient_bytes: 2 * primary,
            optimizer_bytes: 8 * primary,
        })
    }

    /// Copies `rank`'s primary shard out of a full bucket buffer. `full` may
    /// be `numel` long (the parameters back to back, as a model holds them;
    /// padding is filled with `T::default()`) or `padded_len` (the flat layout).
    pub fn shard_of<T: Copy + Default>(&self, bucket: usize, rank: usize, full: &[T]) -> Result<Vec<T>> {
        let layout = self.bucket(bucket)?;
        let range = self.primary_range(rank, bucket)?;
        check_full_len(layout, full.len())?;
        if full.len() == layout.padded_len || layout.is_packed() {
            return Ok(range.map(|i| full.get(i).copied().unwrap_or_default()).collect());
        }
        let flat = layout.expand(full)?;
        Ok(flat.get(range).map(<[T]>::to_vec).unwrap_or_default())
    }

    /// Splits a full bucket buffer into the `world` primary shards (see
    /// [`PartitionPlan::shard_of`] for the accepted lengths).
    pub fn partition<T: Copy + Default>(&self, bucket: usize, full: &[T]) -> Result<Vec<Vec<T>>> {
        (0..self.world()).map(|r| self.shard_of(bucket, r, full)).collect()
    }

    /// Concatenates the `world` primary shards of `bucket` (in rank order)
    /// into the `padded_len` buffer: the inverse of [`PartitionPlan::partition`].
    pub fn gather<T: Copy, S: AsRef<[T]>>(&self, bucket: usize, shards: &[S]) -> Result<Vec<T>> {
        let layout = self.bucket(bucket)?;
        if shards.len() != self.world() {
            return Err(PartitionError::LengthMismatch {
                what: format!("shards of bucket {:?}", layout.name),
                expected: self.world(),
                actual: shards.len(),
            });
        }
        let len = self.shard_len(bucket)?;
        let mut full = Vec::with_capacity(layout.padded_len);
        for (r, s) in shards.iter().enumerate() {
            let s = s.as_ref();
            if s.len() != len {
                return Err(PartitionError::LengthMismatch {
                    what: format!("shard of rank {r} in bucket {:?}", layout.name),
                    expected: len,
                    actual: s.len(),
                });
            }
            full.extend_from_slice(s);
        }
        Ok(full)
    }
}

fn check_full_len(layout: &BucketLayout, len: usize) -> Result<()> {
    if len == layout.numel || len == layout.padded_len {
        Ok(())
    } else {
        Err(PartitionError::LengthMismatch {
            what: format!("full buffer of bucket {:?} (numel or padded_len)", layout.name),
            expected: layout.padded_len,
            actual: len,
        })
    }
}

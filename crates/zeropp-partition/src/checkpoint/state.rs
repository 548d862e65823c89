//! What one rank saves: its primary shard of every bucket, plus rank-local
//! extra state.

use std::collections::BTreeMap;

use super::format::check_extra_name;
use crate::error::{PartitionError, Result};
use crate::plan::PartitionPlan;

/// The optimizer state of one bucket. In a [`ShardState`], one rank's saved
/// primary shard (`plan.shard_len(bucket)` elements, padding included); as a
/// [`FullBucket`](super::FullBucket), the whole bucket consolidated from
/// every rank's shard (`numel` elements, padding stripped).
#[derive(Debug, Clone, PartialEq, Default)]
pub struct BucketShard {
    /// f32 master weights of the primary shard.
    pub master: Vec<f32>,
    /// AdamW first moment.
    pub exp_avg: Vec<f32>,
    /// AdamW second moment.
    pub exp_avg_sq: Vec<f32>,
    /// Optimizer step counter of this bucket (steps actually applied).
    pub step: u64,
}

/// One rank's saved state: one [`BucketShard`] per bucket, in bucket order,
/// and the rank's extra state.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct ShardState {
    /// Per-bucket primary state.
    pub buckets: Vec<BucketShard>,
    /// Rank-local extra state: named f32 vectors that belong to this rank
    /// only, not to a parameter shard (e.g. the qgZ error-feedback
    /// residuals, without which a resumed run is not bitwise identical).
    /// Empty by default.
    ///
    /// Saved bit for bit in the rank's shard file as tensors `extra/NAME`
    /// and listed in the manifest ([`Manifest::extras`]). Opaque to this
    /// crate: names must be non-empty and free of control characters, the
    /// lengths are the owner's business. They cannot be re-sharded:
    /// [`Checkpoint::shard_for`] returns them only on the saved
    /// partitioning (see [`Checkpoint::extras_dropped`]).
    ///
    /// [`Manifest::extras`]: super::Manifest::extras
    /// [`Checkpoint::shard_for`]: super::Checkpoint::shard_for
    /// [`Checkpoint::extras_dropped`]: super::Checkpoint::extras_dropped
    pub extra: BTreeMap<String, Vec<f32>>,
}

impl ShardState {
    /// Zero master weights and moments, step 0, shaped for `rank` of `plan`.
    pub fn zeros(plan: &PartitionPlan, rank: usize) -> Result<Self> {
        plan.check_rank(rank)?;
        let buckets = (0..plan.num_buckets())
            .map(|b| {
                let n = plan.shard_len(b)?;
                Ok(BucketShard {
                    master: vec![0.0; n],
                    exp_avg: vec![0.0; n],
                    exp_avg_sq: vec![0.0; n],
                    step: 0,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Self { buckets, extra: BTreeMap::new() })
    }

    /// Initial state of `rank`: master weights cut from full per-bucket
    /// buffers (`numel` or `padded_len` long each), zero moments, step 0.
    pub fn from_full_master(plan: &PartitionPlan, rank: usize, full: &[&[f32]]) -> Result<Self> {
        if full.len() != plan.num_buckets() {
            return Err(PartitionError::LengthMismatch {
                what: "full master buffers (one per bucket)".into(),
                expected: plan.num_buckets(),
                actual: full.len(),
            });
        }
        let buckets = full
            .iter()
            .enumerate()
            .map(|(b, f)| {
                let master = plan.shard_of(b, rank, f)?;
                let n = master.len();
                Ok(BucketShard { master, exp_avg: vec![0.0; n], exp_avg_sq: vec![0.0; n], step: 0 })
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Self { buckets, extra: BTreeMap::new() })
    }

    /// Names and lengths of the extras: what the manifest lists for this
    /// rank (see [`Manifest::with_extras`](super::Manifest::with_extras)).
    pub fn extra_lens(&self) -> BTreeMap<String, usize> {
        self.extra.iter().map(|(name, v)| (name.clone(), v.len())).collect()
    }

    /// Checks that the state has the shape `plan` requires for `rank`, and
    /// that the names of its extras are valid.
    pub fn validate(&self, plan: &PartitionPlan, rank: usize) -> Result<()> {
        if self.buckets.len() != plan.num_buckets() {
            return Err(PartitionError::LengthMismatch {
                what: format!("buckets in the shard state of rank {rank}"),
                expected: plan.num_buckets(),
                actual: self.buckets.len(),
            });
        }
        for (b, s) in self.buckets.iter().enumerate() {
            let n = plan.primary_range(rank, b)?.len();
            for (what, v) in [("master", &s.master), ("exp_avg", &s.exp_avg), ("exp_avg_sq", &s.exp_avg_sq)] {
                if v.len() != n {
                    return Err(PartitionError::LengthMismatch {
                        what: format!("{what} of rank {rank} in bucket {b}"),
                        expected: n,
                        actual: v.len(),
                    });
                }
            }
        }
        for name in self.extra.keys() {
            check_extra_name(name).map_err(|e| PartitionError::InvalidConfig(format!("rank {rank}: {e}")))?;
        }
        Ok(())
    }
}

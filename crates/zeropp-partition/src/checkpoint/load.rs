//! Reading checkpoints: resolving `LATEST`, verifying and consolidating the
//! shards, and cutting the state of any rank of any new plan out of them
//! (the consolidating path; `stream.rs` reads without consolidating).

use std::collections::BTreeMap;
use std::path::Path;

use safetensors::tensor::{Dtype, SafeTensors};

use super::format::{
    EXTRA_PREFIX, bytes_f32, check_shard_metadata, compare_extras, extra_tensor_name, tensor_name,
};
use super::fs::read_file;
use super::manifest::Manifest;
use super::state::{BucketShard, ShardState};
use super::stream::CheckpointReader;
use crate::error::{PartitionError, Result};
use crate::plan::PartitionPlan;

/// A loaded checkpoint, consolidated: full per-bucket state with padding
/// stripped and every saved rank's extras, beside the opened checkpoint
/// ([`Checkpoint::reader`]: its folder, manifest, step and user config).
#[derive(Debug, Clone, PartialEq)]
pub struct Checkpoint {
    /// The checkpoint as opened: folder, verified manifest, saved plan.
    pub(super) reader: CheckpointReader,
    pub(super) buckets: Vec<FullBucket>,
    /// Rank-local extras, one map per saved rank (empty maps when none).
    pub(super) extras: Vec<BTreeMap<String, Vec<f32>>>,
}

/// The consolidated state of one bucket: the fields of a [`BucketShard`],
/// `numel` real elements each (padding stripped), and the step counter
/// every rank saved (identical on every rank, checked on load).
pub type FullBucket = BucketShard;

/// Loads and verifies a checkpoint: `dir` is either a checkpoint folder
/// or a parent folder whose `LATEST` names one (see [`save_checkpoint`](super::save_checkpoint)
/// for an example).
///
/// Verifies the manifest's own checksum and structure, then the size and
/// crc32c of every shard file, then each file's tensors, rank-local extras
/// included (exactly those [`Manifest::extras`] lists, f32, of the listed
/// lengths); any missing, truncated or corrupted file or tensor is an error
/// naming the file. Checkpoints written before extras existed load with
/// no extras.
///
/// This holds the whole model three times over (master weights and both
/// moments, consolidated) plus one shard file's bytes: O(model) memory. To
/// resume or re-shard a rank, or to export, use [`CheckpointReader`], which
/// reads the same state shard by shard within one rank's share.
///
/// [`CheckpointReader`]: super::CheckpointReader
pub fn load_checkpoint(dir: &Path) -> Result<Checkpoint> {
    let reader = CheckpointReader::open(dir)?;
    let (step_dir, manifest, plan) = (reader.dir(), reader.manifest(), reader.saved_plan());
    let mut buckets: Vec<FullBucket> = plan.buckets().iter().map(|_| FullBucket::default()).collect();
    let mut extras = vec![BTreeMap::new(); plan.world()];
    for rec in &manifest.shards {
        let path = step_dir.join(&rec.file);
        let bytes = read_file(&path)?;
        if bytes.len() as u64 != rec.size {
            return Err(PartitionError::SizeMismatch {
                path,
                expected: rec.size,
                actual: bytes.len() as u64,
            });
        }
        let crc = crc32c::crc32c(&bytes);
        if crc != rec.crc32c {
            return Err(PartitionError::ChecksumMismatch { path, expected: rec.crc32c, actual: crc });
        }
        read_shard(&path, &bytes, plan, manifest, rec.rank, &mut buckets, &mut extras[rec.rank])?;
    }
    for (b, layout) in buckets.iter_mut().zip(plan.buckets()) {
        // Drop the padding (between parameters too): the parameters back to back.
        for v in [&mut b.master, &mut b.exp_avg, &mut b.exp_avg_sq] {
            *v = layout.compact(v)?;
        }
    }
    Ok(Checkpoint { reader, buckets, extras })
}

/// Checks one verified (size, crc32c) shard file and appends its primary
/// state to the consolidated `buckets`; its extras go to `extras`.
fn read_shard(
    path: &Path,
    bytes: &[u8],
    plan: &PartitionPlan,
    manifest: &Manifest,
    rank: usize,
    buckets: &mut [FullBucket],
    extras: &mut BTreeMap<String, Vec<f32>>,
) -> Result<()> {
    let bad = |reason: String| PartitionError::corrupt(path, reason);
    let (_, meta) = SafeTensors::read_metadata(bytes).map_err(|e| bad(e.to_string()))?;
    let st = SafeTensors::deserialize(bytes).map_err(|e| bad(e.to_string()))?;
    let info = meta.metadata().clone().unwrap_or_default();
    check_shard_metadata(&info, rank, plan.world(), manifest.step).map_err(bad)?;
    for (b, full) in buckets.iter_mut().enumerate() {
        let n = plan.shard_len(b)?;
        let get = |what: &str, dtype: Dtype, len: usize| -> Result<Vec<u8>> {
            let name = tensor_name(b, what);
            let t = st.tensor(&name).map_err(|e| bad(format!("tensor {name}: {e}")))?;
            if t.dtype() != dtype || t.shape() != [len] {
                return Err(bad(format!(
                    "tensor {name} is {:?}{:?}, expected {dtype:?}[{len}]",
                    t.dtype(),
                    t.shape()
                )));
            }
            Ok(t.data().to_vec())
        };
        full.master.extend(bytes_f32(&get("master", Dtype::F32, n)?));
        full.exp_avg.extend(bytes_f32(&get("exp_avg", Dtype::F32, n)?));
        full.exp_avg_sq.extend(bytes_f32(&get("exp_avg_sq", Dtype::F32, n)?));
        let raw = get("step", Dtype::U64, 1)?;
        let mut step = [0u8; 8];
        step.copy_from_slice(&raw);
        let step = u64::from_le_bytes(step);
        if rank == 0 {
            full.step = step;
        } else if full.step != step {
            return Err(bad(format!("bucket {b} step counter {step} differs from rank 0's {}", full.step)));
        }
    }
    let found = st
        .iter()
        .filter_map(|(name, t)| {
            name.strip_prefix(EXTRA_PREFIX).map(|n| (n.to_string(), (t.dtype(), t.shape().to_vec())))
        })
        .collect();
    let listed = manifest.extras_of(rank);
    compare_extras(&found, listed).map_err(bad)?;
    for name in listed.keys() {
        let tensor = extra_tensor_name(name);
        let t = st.tensor(&tensor).map_err(|e| bad(format!("tensor {tensor}: {e}")))?;
        extras.insert(name.clone(), bytes_f32(t.data()));
    }
    Ok(())
}

impl Checkpoint {
    /// The checkpoint as opened: its folder, verified manifest, step, user
    /// config, registry and saved plan, and plans for new topologies
    /// ([`CheckpointReader::plan_for`]).
    pub fn reader(&self) -> &CheckpointReader {
        &self.reader
    }

    /// Consolidated per-bucket state (padding stripped).
    pub fn buckets(&self) -> &[FullBucket] {
        &self.buckets
    }

    /// f32 master weights of one parameter, by name.
    pub fn master_of(&self, name: &str) -> Option<&[f32]> {
        self.reader.manifest().buckets.iter().zip(&self.buckets).find_map(|(layout, full)| {
            let (_, r) = layout.compact_ranges().into_iter().find(|(p, _)| p.name == name)?;
            full.master.get(r)
        })
    }

    /// The rank-local extras saved by `rank` of the saved topology (name →
    /// values, bit for bit as saved; empty if that rank saved none), or
    /// `None` if `rank` is not below the saved world size.
    pub fn rank_extra(&self, rank: usize) -> Option<&BTreeMap<String, Vec<f32>>> {
        self.extras.get(rank)
    }

    /// Whether any rank saved extras.
    pub fn has_extras(&self) -> bool {
        self.extras.iter().any(|e| !e.is_empty())
    }

    /// Whether [`Checkpoint::shard_for`] under `plan` leaves saved extras
    /// out: true when the checkpoint has extras ([`Checkpoint::has_extras`])
    /// and `plan` partitions differently from the saved plan. Extras belong
    /// to a rank, not to parameter elements, so they cannot be re-sharded;
    /// a caller resuming onto another topology should warn that this state
    /// (e.g. qgZ error feedback) restarts from zero.
    ///
    /// "The same partitioning" means the same world size, the same ranks
    /// per node, and the same bucket layouts (so every rank owns the same
    /// elements as when it saved: an alignment change that alters the
    /// padding counts as different). The hpZ group size may differ.
    pub fn extras_dropped(&self, plan: &PartitionPlan) -> bool {
        self.has_extras() && !self.same_partitioning(plan)
    }

    /// Same world size, ranks per node and bucket layouts as at save time.
    fn same_partitioning(&self, plan: &PartitionPlan) -> bool {
        self.reader.manifest().same_partitioning(plan)
    }

    /// The state of `rank` under `plan`, which may have any topology,
    /// alignment or hpZ size, but must describe the same model (same buckets
    /// with the same parameter names, shapes and dtypes, in order).
    /// Padding is zero.
    ///
    /// The rank's extras ([`ShardState::extra`]) are those it saved when
    /// `plan` partitions like the saved plan, and empty otherwise: check
    /// [`Checkpoint::extras_dropped`] to tell that apart from a checkpoint
    /// without extras.
    pub fn shard_for(&self, plan: &PartitionPlan, rank: usize) -> Result<ShardState> {
        plan.check_rank(rank)?;
        self.reader.manifest().check_same_model(plan)?;
        let buckets = self
            .buckets
            .iter()
            .enumerate()
            .map(|(b, full)| {
                Ok(BucketShard {
                    master: plan.shard_of(b, rank, &full.master)?,
                    exp_avg: plan.shard_of(b, rank, &full.exp_avg)?,
                    exp_avg_sq: plan.shard_of(b, rank, &full.exp_avg_sq)?,
                    step: full.step,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let extra = if self.same_partitioning(plan) {
            self.extras.get(rank).cloned().unwrap_or_default()
        } else {
            BTreeMap::new()
        };
        Ok(ShardState { buckets, extra })
    }
}

//! Writing checkpoints: every rank's shard file, then rank 0's commit
//! (manifest, then `LATEST`).

use std::collections::HashMap;
use std::fs;
use std::path::{Path, PathBuf};

use safetensors::tensor::{Dtype, TensorView};

use super::format::{
    SHARD_FORMAT, compare_extras, extra_tensor_name, f32_bytes, read_header_extras, shard_file_name,
    step_dir_name, tensor_name,
};
use super::fs::atomic_write;
use super::manifest::{Manifest, ShardRecord};
use super::state::ShardState;
use super::{FORMAT_VERSION, LATEST_FILE, MANIFEST_FILE};
use crate::error::{PartitionError, Result};
use crate::plan::PartitionPlan;

/// Writes `rank`'s shard file of the checkpoint of `step` into
/// `dir/step-…/` and returns its [`ShardRecord`]. Called by every rank.
///
/// The file holds the rank's primary state of every bucket and its
/// rank-local extras ([`ShardState::extra`], as tensors `extra/NAME`); rank
/// 0 must list the extras in the manifest ([`Manifest::with_extras`]).
///
/// Fails with [`PartitionError::CheckpointExists`] if that checkpoint is
/// already committed; files of an uncommitted (failed) attempt are replaced.
pub fn write_shard(
    dir: &Path,
    plan: &PartitionPlan,
    step: u64,
    rank: usize,
    state: &ShardState,
) -> Result<ShardRecord> {
    state.validate(plan, rank)?;
    let step_dir = dir.join(step_dir_name(step));
    if step_dir.join(MANIFEST_FILE).exists() {
        return Err(PartitionError::CheckpointExists { path: step_dir });
    }
    fs::create_dir_all(&step_dir).map_err(|e| PartitionError::io(&step_dir, e))?;

    let mut data: Vec<(String, Dtype, Vec<u8>)> =
        Vec::with_capacity(4 * state.buckets.len() + state.extra.len());
    for (b, s) in state.buckets.iter().enumerate() {
        data.push((tensor_name(b, "master"), Dtype::F32, f32_bytes(&s.master)));
        data.push((tensor_name(b, "exp_avg"), Dtype::F32, f32_bytes(&s.exp_avg)));
        data.push((tensor_name(b, "exp_avg_sq"), Dtype::F32, f32_bytes(&s.exp_avg_sq)));
        data.push((tensor_name(b, "step"), Dtype::U64, s.step.to_le_bytes().to_vec()));
    }
    for (name, v) in &state.extra {
        data.push((extra_tensor_name(name), Dtype::F32, f32_bytes(v)));
    }
    let world = plan.world();
    let file = shard_file_name(rank, world);
    let path = step_dir.join(&file);
    let views = data
        .iter()
        .map(|(name, dtype, bytes)| {
            let n = bytes.len() * 8 / dtype.bitsize();
            TensorView::new(*dtype, vec![n], bytes)
                .map(|v| (name.clone(), v))
                .map_err(|e| PartitionError::corrupt(&path, e.to_string()))
        })
        .collect::<Result<Vec<_>>>()?;
    let metadata: HashMap<String, String> = [
        ("format", SHARD_FORMAT.to_string()),
        ("format_version", FORMAT_VERSION.to_string()),
        ("rank", rank.to_string()),
        ("world", world.to_string()),
        ("step", step.to_string()),
        ("buckets", state.buckets.len().to_string()),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v))
    .collect();
    let bytes = safetensors::serialize(views, Some(metadata))
        .map_err(|e| PartitionError::corrupt(&path, format!("cannot serialize: {e}")))?;
    atomic_write(&path, &bytes)?;
    Ok(ShardRecord { rank, file, size: bytes.len() as u64, crc32c: crc32c::crc32c(&bytes) })
}

/// Commits a checkpoint (rank 0, after every rank's [`write_shard`]
/// returned): checks that every shard file exists with its recorded size
/// and holds exactly the extras the manifest lists (from the file headers
/// only), writes `manifest.json` atomically, then points `dir/LATEST` at it
/// (atomically). Returns the checkpoint folder.
///
/// A shard whose extras differ from [`Manifest::extras`] (typically: the
/// manifest was built without [`Manifest::with_extras`]) is a
/// [`PartitionError::Corrupt`] naming the file, and nothing is committed,
/// so a committed checkpoint always loads.
pub fn commit_checkpoint(dir: &Path, manifest: &Manifest) -> Result<PathBuf> {
    manifest.check_shards()?;
    manifest.check_extras()?;
    let step_dir = dir.join(step_dir_name(manifest.step));
    let manifest_path = step_dir.join(MANIFEST_FILE);
    if manifest_path.exists() {
        return Err(PartitionError::CheckpointExists { path: step_dir });
    }
    for s in &manifest.shards {
        let path = step_dir.join(&s.file);
        let meta = fs::metadata(&path).map_err(|e| PartitionError::io(&path, e))?;
        if meta.len() != s.size {
            return Err(PartitionError::SizeMismatch { path, expected: s.size, actual: meta.len() });
        }
        compare_extras(&read_header_extras(&path)?, manifest.extras_of(s.rank))
            .map_err(|reason| PartitionError::corrupt(&path, reason))?;
    }
    atomic_write(&manifest_path, &manifest.to_file_bytes()?)?;
    let pointer = format!("{}\n", step_dir_name(manifest.step));
    atomic_write(&dir.join(LATEST_FILE), pointer.as_bytes())?;
    Ok(step_dir)
}

/// Saves a whole checkpoint from one process: writes the shard of every
/// rank of `plan` (`shards[r]` is rank `r`'s state, extras included), then
/// commits it with the extras listed. Returns the checkpoint folder.
///
/// ```
/// use zeropp_comm::Topology;
/// use zeropp_partition::*;
///
/// let mut reg = ParamRegistry::new();
/// reg.push_bucket("layer0", vec![ParamSpec::new("w", [3, 5], DType::BF16)])?;
/// let weights: Vec<f32> = (0..15).map(|i| i as f32 * 0.5).collect();
///
/// // Save with 4 ranks …
/// let plan4 = PartitionPlan::new(&reg, Topology::ranks(4).per_node(2)?, PlanConfig::new(2, 2))?;
/// let shards = (0..4)
///     .map(|r| ShardState::from_full_master(&plan4, r, &[&weights]))
///     .collect::<Result<Vec<_>, _>>()?;
/// let dir = std::env::temp_dir().join(format!("zeropp-doc-{}", std::process::id()));
/// save_checkpoint(&dir, &plan4, 7, &shards, serde_json::json!({"lr": 1e-3}))?;
///
/// // … load into 3 ranks.
/// let ckpt = load_checkpoint(&dir)?;
/// assert_eq!(ckpt.reader().step(), 7);
/// assert_eq!(ckpt.master_of("w"), Some(&weights[..]));
/// let plan3 = ckpt.reader().plan_for(Topology::ranks(3).per_node(3)?, PlanConfig::default())?;
/// let s1 = ckpt.shard_for(&plan3, 1)?;
/// assert_eq!(s1.buckets[0].master, weights[5..10]);
/// # std::fs::remove_dir_all(&dir).ok();
/// # Ok::<(), PartitionError>(())
/// ```
pub fn save_checkpoint(
    dir: &Path,
    plan: &PartitionPlan,
    step: u64,
    shards: &[ShardState],
    user_config: serde_json::Value,
) -> Result<PathBuf> {
    if shards.len() != plan.world() {
        return Err(PartitionError::LengthMismatch {
            what: "shard states (one per rank)".into(),
            expected: plan.world(),
            actual: shards.len(),
        });
    }
    for (r, s) in shards.iter().enumerate() {
        s.validate(plan, r)?;
    }
    let records = shards
        .iter()
        .enumerate()
        .map(|(r, s)| write_shard(dir, plan, step, r, s))
        .collect::<Result<Vec<_>>>()?;
    let manifest = Manifest::new(plan, step, user_config, records)?
        .with_extras(shards.iter().map(ShardState::extra_lens).collect())?;
    commit_checkpoint(dir, &manifest)
}

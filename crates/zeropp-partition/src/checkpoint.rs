//! Sharded checkpoints: per-rank safetensors shard files plus a JSON manifest.
//!
//! # On-disk layout
//!
//! ```text
//! DIR/
//!   LATEST                               "step-00000200\n", replaced atomically after the manifest is durable
//!   step-00000100/                       one folder per checkpoint, never modified once committed
//!     rank-00000-of-00004.safetensors    rank 0's primary shards: master, exp_avg, exp_avg_sq, step per bucket
//!     ...
//!     manifest.json                      written last (by rank 0): its presence marks the checkpoint committed
//!   step-00000200/
//! ```
//!
//! Every file is written to `NAME.tmp`, fsynced, renamed to `NAME`, and the
//! folder is fsynced. A save that fails or crashes before the manifest is
//! renamed leaves no manifest in its folder, and `LATEST` still names the
//! previous checkpoint, which stays loadable. A save that crashes between
//! the manifest and `LATEST` leaves a complete checkpoint that `LATEST` does
//! not name yet: it can be loaded by its folder.
//!
//! # Two phases
//!
//! This crate does no communication. Each rank calls [`write_shard`], which
//! returns a [`ShardRecord`] (file name, size, crc32c). The engine collects
//! every rank's record on rank 0 over its communicator (an all-gather or a
//! gather), and rank 0 calls [`commit_checkpoint`] with a [`Manifest`] built
//! by [`Manifest::new`]. The folder must be on a filesystem every rank
//! writes to and that the loader can read (a shared filesystem for
//! multi-node jobs). [`save_checkpoint`] does both phases in one process.
//!
//! # Secondary (hpZ) shards are never saved
//!
//! Only primary state (f32 master weights, AdamW moments and step counters)
//! is saved. hpZ secondary shards are a cache of the 16-bit weights that is
//! rebuilt from the primary shards at the next forward all-gather. DeepSpeed
//! users have hit stale secondary copies after loading a checkpoint (the
//! loaded primaries did not refresh the cached secondaries); here a loaded
//! [`ShardState`] carries no secondary data at all, so the engine must rebuild
//! them, and they cannot be stale by construction.
//!
//! # Re-sharding
//!
//! [`load_checkpoint`] consolidates the shards into full per-bucket buffers
//! ([`Checkpoint`]), with padding stripped; [`Checkpoint::shard_for`] cuts the
//! state of any rank of any new plan (other world size, local size, alignment
//! or hpZ group size) out of them.

use std::collections::HashMap;
use std::fs::{self, File};
use std::io::Write;
use std::path::{Path, PathBuf};

use safetensors::tensor::{Dtype, SafeTensors, TensorView};
use serde::{Deserialize, Serialize};
use zeropp_comm::Topology;

use crate::error::{PartitionError, Result};
use crate::layout::{BucketLayout, DType, ParamRegistry};
use crate::plan::{PartitionPlan, PlanConfig};

/// Version of the checkpoint format written by this crate.
pub const FORMAT_VERSION: u32 = 1;

/// Name of the pointer file naming the latest committed checkpoint folder.
pub const LATEST_FILE: &str = "LATEST";

/// Name of the manifest inside a checkpoint folder.
pub const MANIFEST_FILE: &str = "manifest.json";

fn one() -> usize {
    1
}

const MANIFEST_PREFIX: &str = "{\n  \"manifest_crc32c\": \"";
const MANIFEST_CRC_PLACEHOLDER: &str = "00000000";
const SHARD_FORMAT: &str = "zeropp-shard";

/// One rank's saved state for one bucket: its primary shard
/// (`plan.shard_len(bucket)` elements, padding included).
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

/// One rank's saved state: one [`BucketShard`] per bucket, in bucket order.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct ShardState {
    /// Per-bucket primary state.
    pub buckets: Vec<BucketShard>,
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
        Ok(Self { buckets })
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
        Ok(Self { buckets })
    }

    /// Checks that the state has the shape `plan` requires for `rank`.
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
        Ok(())
    }
}

/// What one rank wrote: the file name (relative to the checkpoint folder),
/// its size and its crc32c. Rank 0 needs every rank's record to commit.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ShardRecord {
    /// The rank that wrote the file.
    pub rank: usize,
    /// File name inside the checkpoint folder.
    pub file: String,
    /// Size in bytes.
    pub size: u64,
    /// crc32c (Castagnoli) of the whole file.
    pub crc32c: u32,
}

/// The topology a checkpoint was written with.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct TopologyInfo {
    /// World size.
    pub world: usize,
    /// Ranks per node.
    pub local_size: usize,
    /// Number of nodes.
    pub nodes: usize,
}

/// The checkpoint manifest (`manifest.json`), written by rank 0 last.
///
/// The file also carries a crc32c of its own bytes (`manifest_crc32c`,
/// computed with that field set to `"00000000"`), verified on load.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Manifest {
    /// [`FORMAT_VERSION`] of the writer.
    pub format_version: u32,
    /// Training step of the checkpoint.
    pub step: u64,
    /// Topology at save time.
    pub topology: TopologyInfo,
    /// Plan alignment at save time.
    pub align: usize,
    /// hpZ group size at save time (informational: secondary shards are not saved).
    pub hpz: usize,
    /// Parameter alignment inside each bucket at save time (1 when absent: the
    /// checkpoints written before it existed were packed).
    #[serde(default = "one")]
    pub param_align: usize,
    /// Bucket layouts at save time (names, shapes, dtypes, offsets, padding).
    pub buckets: Vec<BucketLayout>,
    /// Opaque user configuration (e.g. the training config).
    pub user_config: serde_json::Value,
    /// One record per rank, in rank order.
    pub shards: Vec<ShardRecord>,
}

impl Manifest {
    /// Builds the manifest of a checkpoint of `plan` at `step`, from every
    /// rank's [`ShardRecord`] (in any order; exactly one per rank).
    pub fn new(
        plan: &PartitionPlan,
        step: u64,
        user_config: serde_json::Value,
        mut shards: Vec<ShardRecord>,
    ) -> Result<Self> {
        shards.sort_by_key(|s| s.rank);
        let t = plan.topology();
        let manifest = Self {
            format_version: FORMAT_VERSION,
            step,
            topology: TopologyInfo { world: t.world(), local_size: t.local_size(), nodes: t.nodes() },
            align: plan.config().align,
            hpz: plan.config().hpz,
            param_align: plan.config().param_align,
            buckets: plan.buckets().to_vec(),
            user_config,
            shards,
        };
        manifest.check_shards()?;
        Ok(manifest)
    }

    fn check_shards(&self) -> Result<()> {
        let world = self.topology.world;
        if self.shards.len() != world {
            return Err(PartitionError::LengthMismatch {
                what: "shard records (one per rank)".into(),
                expected: world,
                actual: self.shards.len(),
            });
        }
        for (r, s) in self.shards.iter().enumerate() {
            let expected = shard_file_name(r, world);
            if s.rank != r || s.file != expected {
                return Err(PartitionError::InvalidConfig(format!(
                    "shard record {r} is for rank {} file {:?}; expected rank {r} file {expected:?}",
                    s.rank, s.file
                )));
            }
        }
        Ok(())
    }

    /// The topology at save time.
    pub fn topology(&self) -> Result<Topology> {
        Ok(Topology::new(self.topology.world, self.topology.local_size)?)
    }

    /// The registry (buckets and parameters) of the saved model.
    pub fn registry(&self) -> Result<ParamRegistry> {
        let mut reg = ParamRegistry::new();
        for b in &self.buckets {
            let spec = b.spec();
            reg.push_bucket(spec.name, spec.params)?;
        }
        Ok(reg)
    }

    /// The plan the checkpoint was saved with.
    pub fn plan(&self) -> Result<PartitionPlan> {
        PartitionPlan::new(
            &self.registry()?,
            self.topology()?,
            PlanConfig::new(self.align, self.hpz).with_param_align(self.param_align),
        )
    }

    /// Total size in bytes of the shard files.
    pub fn total_shard_bytes(&self) -> u64 {
        self.shards.iter().map(|s| s.size).sum()
    }

    /// Structural validation: version, topology, layouts and records agree.
    fn validate(&self, path: &Path) -> Result<PartitionPlan> {
        if self.format_version != FORMAT_VERSION {
            return Err(PartitionError::corrupt(
                path,
                format!(
                    "unsupported format version {} (this build reads {FORMAT_VERSION})",
                    self.format_version
                ),
            ));
        }
        let bad = |e: PartitionError| PartitionError::corrupt(path, e.to_string());
        let plan = self.plan().map_err(bad)?;
        if plan.buckets() != self.buckets.as_slice() {
            return Err(PartitionError::corrupt(
                path,
                "bucket layouts are inconsistent with the recorded topology and alignment",
            ));
        }
        if self.topology.nodes != plan.topology().nodes() {
            return Err(PartitionError::corrupt(path, "node count is inconsistent"));
        }
        self.check_shards().map_err(bad)?;
        Ok(plan)
    }

    fn to_file_bytes(&self) -> Result<Vec<u8>> {
        let body = serde_json::to_string_pretty(self)
            .map_err(|e| PartitionError::InvalidConfig(format!("cannot serialize manifest: {e}")))?;
        let rest = body
            .strip_prefix("{\n")
            .ok_or_else(|| PartitionError::InvalidConfig("unexpected manifest serialization".into()))?;
        let assemble = |crc: &str| format!("{MANIFEST_PREFIX}{crc}\",\n{rest}\n").into_bytes();
        let crc = crc32c::crc32c(&assemble(MANIFEST_CRC_PLACEHOLDER));
        Ok(assemble(&format!("{crc:08x}")))
    }

    fn from_file_bytes(path: &Path, bytes: &[u8]) -> Result<Self> {
        let start = MANIFEST_PREFIX.len();
        let end = start + MANIFEST_CRC_PLACEHOLDER.len();
        if bytes.len() < end + 3
            || !bytes.starts_with(MANIFEST_PREFIX.as_bytes())
            || &bytes[end..end + 3] != b"\",\n"
        {
            return Err(PartitionError::corrupt(
                path,
                "not a zeropp manifest (missing manifest_crc32c header)",
            ));
        }
        let recorded = std::str::from_utf8(&bytes[start..end])
            .ok()
            .and_then(|s| u32::from_str_radix(s, 16).ok())
            .ok_or_else(|| PartitionError::corrupt(path, "malformed manifest_crc32c"))?;
        let mut zeroed = bytes.to_vec();
        zeroed[start..end].copy_from_slice(MANIFEST_CRC_PLACEHOLDER.as_bytes());
        let actual = crc32c::crc32c(&zeroed);
        if actual != recorded {
            return Err(PartitionError::ChecksumMismatch {
                path: path.to_path_buf(),
                expected: recorded,
                actual,
            });
        }
        serde_json::from_slice(bytes)
            .map_err(|e| PartitionError::corrupt(path, format!("invalid manifest JSON: {e}")))
    }
}

/// Name of a checkpoint folder: `step-00000123`.
pub fn step_dir_name(step: u64) -> String {
    format!("step-{step:08}")
}

/// Name of a rank's shard file: `rank-00003-of-00008.safetensors`.
pub fn shard_file_name(rank: usize, world: usize) -> String {
    format!("rank-{rank:05}-of-{world:05}.safetensors")
}

fn tensor_name(bucket: usize, what: &str) -> String {
    format!("bucket.{bucket:05}.{what}")
}

fn f32_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

fn bytes_f32(b: &[u8]) -> Vec<f32> {
    b.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect()
}

fn sync_dir(dir: &Path) -> Result<()> {
    #[cfg(unix)]
    {
        File::open(dir).and_then(|d| d.sync_all()).map_err(|e| PartitionError::io(dir, e))?;
    }
    #[cfg(not(unix))]
    let _ = dir;
    Ok(())
}

/// Writes `bytes` to `path` atomically: `path.tmp`, fsync, rename, fsync the folder.
fn atomic_write(path: &Path, bytes: &[u8]) -> Result<()> {
    // A bare file name has an empty parent: that is the current directory.
    let dir = path.parent().filter(|d| !d.as_os_str().is_empty()).unwrap_or_else(|| Path::new("."));
    let mut tmp_name = path.file_name().unwrap_or_default().to_os_string();
    tmp_name.push(".tmp");
    let tmp = dir.join(tmp_name);
    let mut f = File::create(&tmp).map_err(|e| PartitionError::io(&tmp, e))?;
    f.write_all(bytes).and_then(|()| f.sync_all()).map_err(|e| PartitionError::io(&tmp, e))?;
    drop(f);
    fs::rename(&tmp, path).map_err(|e| PartitionError::io(path, e))?;
    sync_dir(dir)
}

fn read_file(path: &Path) -> Result<Vec<u8>> {
    fs::read(path).map_err(|e| PartitionError::io(path, e))
}

/// Writes `rank`'s shard file of the checkpoint of `step` into
/// `dir/step-…/` and returns its [`ShardRecord`]. Called by every rank.
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

    let mut data: Vec<(String, Dtype, Vec<u8>)> = Vec::with_capacity(4 * state.buckets.len());
    for (b, s) in state.buckets.iter().enumerate() {
        data.push((tensor_name(b, "master"), Dtype::F32, f32_bytes(&s.master)));
        data.push((tensor_name(b, "exp_avg"), Dtype::F32, f32_bytes(&s.exp_avg)));
        data.push((tensor_name(b, "exp_avg_sq"), Dtype::F32, f32_bytes(&s.exp_avg_sq)));
        data.push((tensor_name(b, "step"), Dtype::U64, s.step.to_le_bytes().to_vec()));
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
/// returned): checks that every shard file exists with its recorded size,
/// writes `manifest.json` atomically, then points `dir/LATEST` at it
/// (atomically). Returns the checkpoint folder.
pub fn commit_checkpoint(dir: &Path, manifest: &Manifest) -> Result<PathBuf> {
    manifest.check_shards()?;
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
    }
    atomic_write(&manifest_path, &manifest.to_file_bytes()?)?;
    let pointer = format!("{}\n", step_dir_name(manifest.step));
    atomic_write(&dir.join(LATEST_FILE), pointer.as_bytes())?;
    Ok(step_dir)
}

/// Saves a whole checkpoint from one process: writes the shard of every
/// rank of `plan` (`shards[r]` is rank `r`'s state), then commits it.
/// Returns the checkpoint folder.
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
/// let plan4 = PartitionPlan::new(&reg, Topology::new(4, 2)?, PlanConfig::new(2, 2))?;
/// let shards = (0..4)
///     .map(|r| ShardState::from_full_master(&plan4, r, &[&weights]))
///     .collect::<Result<Vec<_>, _>>()?;
/// let dir = std::env::temp_dir().join(format!("zeropp-doc-{}", std::process::id()));
/// save_checkpoint(&dir, &plan4, 7, &shards, serde_json::json!({"lr": 1e-3}))?;
///
/// // … load into 3 ranks.
/// let ckpt = load_checkpoint(&dir)?;
/// assert_eq!(ckpt.step(), 7);
/// assert_eq!(ckpt.master_of("w"), Some(&weights[..]));
/// let plan3 = ckpt.plan_for(Topology::new(3, 3)?, PlanConfig::default())?;
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
    let manifest = Manifest::new(plan, step, user_config, records)?;
    commit_checkpoint(dir, &manifest)
}

/// The checkpoint folder `load_checkpoint(dir)` would read: `dir` itself
/// if it holds a manifest, else the folder named by `dir/LATEST`.
pub fn resolve_checkpoint_dir(dir: &Path) -> Result<PathBuf> {
    if !dir.is_dir() {
        return Err(PartitionError::NoCheckpoint {
            dir: dir.to_path_buf(),
            reason: "not a directory (or does not exist)".into(),
        });
    }
    if dir.join(MANIFEST_FILE).is_file() {
        return Ok(dir.to_path_buf());
    }
    let latest = dir.join(LATEST_FILE);
    let text = match fs::read_to_string(&latest) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            return Err(PartitionError::NoCheckpoint {
                dir: dir.to_path_buf(),
                reason: format!("neither {MANIFEST_FILE} nor {LATEST_FILE} exists"),
            });
        }
        Err(e) => return Err(PartitionError::io(&latest, e)),
    };
    let name = text.trim();
    let valid =
        name.strip_prefix("step-").is_some_and(|d| !d.is_empty() && d.bytes().all(|c| c.is_ascii_digit()));
    if !valid {
        return Err(PartitionError::corrupt(
            &latest,
            format!("expected a folder name like step-00000123, found {name:?}"),
        ));
    }
    Ok(dir.join(name))
}

/// A loaded checkpoint, consolidated: full per-bucket state with padding
/// stripped, plus the manifest.
#[derive(Debug, Clone, PartialEq)]
pub struct Checkpoint {
    dir: PathBuf,
    manifest: Manifest,
    buckets: Vec<FullBucket>,
}

/// The consolidated state of one bucket: `numel` real elements each.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct FullBucket {
    /// f32 master weights.
    pub master: Vec<f32>,
    /// AdamW first moment.
    pub exp_avg: Vec<f32>,
    /// AdamW second moment.
    pub exp_avg_sq: Vec<f32>,
    /// Optimizer step counter (identical on every rank, checked on load).
    pub step: u64,
}

/// Loads and verifies a checkpoint: `dir` is either a checkpoint folder
/// or a parent folder whose `LATEST` names one (see [`save_checkpoint`]
/// for an example).
///
/// Verifies the manifest's own checksum and structure, then the size and
/// crc32c of every shard file, then each file's tensors; any missing,
/// truncated or corrupted file is an error naming the file.
pub fn load_checkpoint(dir: &Path) -> Result<Checkpoint> {
    let step_dir = resolve_checkpoint_dir(dir)?;
    let manifest_path = step_dir.join(MANIFEST_FILE);
    let manifest = Manifest::from_file_bytes(&manifest_path, &read_file(&manifest_path)?)?;
    let plan = manifest.validate(&manifest_path)?;

    let mut buckets: Vec<FullBucket> = plan.buckets().iter().map(|_| FullBucket::default()).collect();
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
        read_shard(&path, &bytes, &plan, &manifest, rec.rank, &mut buckets)?;
    }
    for (b, layout) in buckets.iter_mut().zip(plan.buckets()) {
        // Drop the padding (between parameters too): the parameters back to back.
        for v in [&mut b.master, &mut b.exp_avg, &mut b.exp_avg_sq] {
            *v = layout.compact(v)?;
        }
    }
    Ok(Checkpoint { dir: step_dir, manifest, buckets })
}

fn read_shard(
    path: &Path,
    bytes: &[u8],
    plan: &PartitionPlan,
    manifest: &Manifest,
    rank: usize,
    buckets: &mut [FullBucket],
) -> Result<()> {
    let bad = |reason: String| PartitionError::corrupt(path, reason);
    let (_, meta) = SafeTensors::read_metadata(bytes).map_err(|e| bad(e.to_string()))?;
    let st = SafeTensors::deserialize(bytes).map_err(|e| bad(e.to_string()))?;
    let info = meta.metadata().clone().unwrap_or_default();
    let expect = [
        ("format", SHARD_FORMAT.to_string()),
        ("rank", rank.to_string()),
        ("world", plan.world().to_string()),
        ("step", manifest.step.to_string()),
    ];
    for (k, v) in expect {
        if info.get(k) != Some(&v) {
            return Err(bad(format!("metadata {k} is {:?}, expected {v:?}", info.get(k))));
        }
    }
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
    Ok(())
}

impl Checkpoint {
    /// The checkpoint folder that was loaded.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The verified manifest.
    pub fn manifest(&self) -> &Manifest {
        &self.manifest
    }

    /// Training step.
    pub fn step(&self) -> u64 {
        self.manifest.step
    }

    /// The user config saved with the checkpoint.
    pub fn user_config(&self) -> &serde_json::Value {
        &self.manifest.user_config
    }

    /// Consolidated per-bucket state (padding stripped).
    pub fn buckets(&self) -> &[FullBucket] {
        &self.buckets
    }

    /// The registry of the saved model.
    pub fn registry(&self) -> Result<ParamRegistry> {
        self.manifest.registry()
    }

    /// A plan for the saved model on a new topology and config.
    pub fn plan_for(&self, topology: Topology, config: PlanConfig) -> Result<PartitionPlan> {
        PartitionPlan::new(&self.registry()?, topology, config)
    }

    /// f32 master weights of one parameter, by name.
    pub fn master_of(&self, name: &str) -> Option<&[f32]> {
        self.manifest.buckets.iter().zip(&self.buckets).find_map(|(layout, full)| {
            let (_, r) = layout.compact_ranges().into_iter().find(|(p, _)| p.name == name)?;
            full.master.get(r)
        })
    }

    /// The state of `rank` under `plan`, which may have any topology,
    /// alignment or hpZ size, but must describe the same model (same buckets
    /// with the same parameter names, shapes and dtypes, in order).
    /// Padding is zero.
    pub fn shard_for(&self, plan: &PartitionPlan, rank: usize) -> Result<ShardState> {
        let saved = &self.manifest.buckets;
        if plan.num_buckets() != saved.len() {
            return Err(PartitionError::LayoutMismatch(format!(
                "plan has {} buckets, checkpoint has {}",
                plan.num_buckets(),
                saved.len()
            )));
        }
        for (p, s) in plan.buckets().iter().zip(saved) {
            if p.spec() != s.spec() {
                return Err(PartitionError::LayoutMismatch(format!(
                    "bucket {:?} of the plan differs from bucket {:?} of the checkpoint",
                    p.name, s.name
                )));
            }
        }
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
        Ok(ShardState { buckets })
    }

    /// Writes the master weights as one consolidated safetensors file:
    /// one tensor per parameter, named by parameter name, with its shape and
    /// declared dtype (f32 masters rounded to nearest for bf16/f16), padding
    /// stripped. Written atomically. Returns the file size in bytes.
    pub fn export_safetensors(&self, out: &Path) -> Result<u64> {
        let mut data: Vec<(String, Dtype, Vec<usize>, Vec<u8>)> = Vec::new();
        for (layout, full) in self.manifest.buckets.iter().zip(&self.buckets) {
            for (p, range) in layout.compact_ranges() {
                let vals = full.master.get(range).ok_or_else(|| {
                    PartitionError::LayoutMismatch(format!("parameter {:?} out of bounds", p.name))
                })?;
                let (dtype, bytes): (Dtype, Vec<u8>) = match p.dtype {
                    DType::F32 => (Dtype::F32, f32_bytes(vals)),
                    DType::BF16 => (
                        Dtype::BF16,
                        vals.iter().flat_map(|&x| half::bf16::from_f32(x).to_le_bytes()).collect(),
                    ),
                    DType::F16 => (
                        Dtype::F16,
                        vals.iter().flat_map(|&x| half::f16::from_f32(x).to_le_bytes()).collect(),
                    ),
                };
                data.push((p.name.clone(), dtype, p.shape.clone(), bytes));
            }
        }
        let views = data
            .iter()
            .map(|(name, dtype, shape, bytes)| {
                TensorView::new(*dtype, shape.clone(), bytes)
                    .map(|v| (name.clone(), v))
                    .map_err(|e| PartitionError::corrupt(out, format!("tensor {name}: {e}")))
            })
            .collect::<Result<Vec<_>>>()?;
        let metadata: HashMap<String, String> = [
            ("format".to_string(), "pt".to_string()),
            ("producer".to_string(), "zeropp".to_string()),
            ("step".to_string(), self.step().to_string()),
        ]
        .into_iter()
        .collect();
        let bytes = safetensors::serialize(views, Some(metadata))
            .map_err(|e| PartitionError::corrupt(out, format!("cannot serialize: {e}")))?;
        atomic_write(out, &bytes)?;
        Ok(bytes.len() as u64)
    }
}

//! The checkpoint manifest and its self-checksummed file encoding.

use std::collections::BTreeMap;
use std::path::Path;

use serde::{Deserialize, Serialize};
use zeropp_comm::Topology;

use super::FORMAT_VERSION;
use super::format::{check_extra_name, shard_file_name};
use crate::error::{PartitionError, Result};
use crate::layout::{BucketLayout, ParamRegistry};
use crate::plan::{PartitionPlan, PlanConfig};

fn one() -> usize {
    1
}

fn is_one(x: &usize) -> bool {
    *x == 1
}

const MANIFEST_PREFIX: &str = "{\n  \"manifest_crc32c\": \"";
const MANIFEST_CRC_PLACEHOLDER: &str = "00000000";

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
    /// Left out of the file when 1, so packed checkpoints keep the original format.
    #[serde(default = "one", skip_serializing_if = "is_one")]
    pub param_align: usize,
    /// Bucket layouts at save time (names, shapes, dtypes, offsets, padding).
    pub buckets: Vec<BucketLayout>,
    /// Opaque user configuration (e.g. the training config).
    pub user_config: serde_json::Value,
    /// One record per rank, in rank order.
    pub shards: Vec<ShardRecord>,
    /// Rank-local extras ([`ShardState::extra`](super::ShardState::extra)):
    /// either empty (no rank saved any), or one map per rank, in rank
    /// order, from the name of each extra of that rank to its length.
    ///
    /// Empty is not written to the file at all, so a checkpoint without
    /// extras is byte for byte the format of before extras existed, and
    /// such older manifests read as empty. Loading checks every shard file
    /// against this listing: a missing, unlisted, mistyped or truncated
    /// extra is an error naming the file.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub extras: Vec<BTreeMap<String, usize>>,
}

/// What [`Manifest::extras_of`] answers for a rank without extras.
static NO_EXTRAS: BTreeMap<String, usize> = BTreeMap::new();

impl Manifest {
    /// Builds the manifest of a checkpoint of `plan` at `step`, from every
    /// rank's [`ShardRecord`] (in any order; exactly one per rank).
    ///
    /// The manifest lists no extras; if any rank's shard holds some, add
    /// them with [`Manifest::with_extras`] before committing
    /// ([`commit_checkpoint`](super::commit_checkpoint) refuses a manifest
    /// that does not list exactly what the shard files hold).
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
            extras: Vec::new(),
        };
        manifest.check_shards()?;
        Ok(manifest)
    }

    /// Lists the rank-local extras of every rank: `extras[r]` is
    /// [`ShardState::extra_lens`](super::ShardState::extra_lens) of rank
    /// `r`'s state (one map per rank, in rank order). If every map is empty
    /// nothing is listed, and the manifest stays in the format of before
    /// extras existed.
    ///
    /// In a multi-process save each rank sends its (usually identical)
    /// listing to rank 0 along with its [`ShardRecord`].
    ///
    /// ```
    /// use std::collections::BTreeMap;
    /// use zeropp_comm::Topology;
    /// use zeropp_partition::*;
    ///
    /// let mut reg = ParamRegistry::new();
    /// reg.push_bucket("layer0", vec![ParamSpec::new("w", [8], DType::F32)])?;
    /// let plan = PartitionPlan::new(&reg, Topology::ranks(2).per_node(2)?, PlanConfig::default())?;
    /// let dir = std::env::temp_dir().join(format!("zeropp-doc-extras-{}", std::process::id()));
    ///
    /// // Phase 1, on every rank: write the shard, keep its extras listing.
    /// let mut records = Vec::new();
    /// let mut listings = Vec::new();
    /// for rank in 0..2 {
    ///     let mut state = ShardState::zeros(&plan, rank)?;
    ///     state.extra.insert("qgz.residual".into(), vec![0.25 * rank as f32; 3]);
    ///     records.push(write_shard(&dir, &plan, 1, rank, &state)?);
    ///     listings.push(state.extra_lens());
    /// }
    /// // Phase 2, on rank 0: list the extras, then commit.
    /// let manifest = Manifest::new(&plan, 1, serde_json::Value::Null, records)?.with_extras(listings)?;
    /// commit_checkpoint(&dir, &manifest)?;
    ///
    /// let ckpt = load_checkpoint(&dir)?;
    /// assert_eq!(ckpt.rank_extra(1).and_then(|e| e.get("qgz.residual")), Some(&vec![0.25; 3]));
    /// assert_eq!(ckpt.shard_for(&plan, 1)?.extra["qgz.residual"], [0.25; 3]);
    /// # std::fs::remove_dir_all(&dir).ok();
    /// # Ok::<(), PartitionError>(())
    /// ```
    pub fn with_extras(mut self, extras: Vec<BTreeMap<String, usize>>) -> Result<Self> {
        self.extras = if extras.iter().all(BTreeMap::is_empty) { Vec::new() } else { extras };
        self.check_extras()?;
        Ok(self)
    }

    /// The extras listed for `rank` (name → length); empty when the rank
    /// saved none, when no rank did, or when `rank` is out of range.
    pub fn extras_of(&self, rank: usize) -> &BTreeMap<String, usize> {
        self.extras.get(rank).unwrap_or(&NO_EXTRAS)
    }

    /// Checks that a list of `what` holds `len` entries, one per saved rank.
    fn check_one_per_rank(&self, what: &str, len: usize) -> Result<()> {
        let world = self.topology.world;
        if len != world {
            return Err(PartitionError::LengthMismatch {
                what: format!("{what} (one per rank)"),
                expected: world,
                actual: len,
            });
        }
        Ok(())
    }

    /// Checks the extras listing: empty, or one map per rank with valid names.
    pub(super) fn check_extras(&self) -> Result<()> {
        if self.extras.is_empty() {
            return Ok(());
        }
        self.check_one_per_rank("extras listings", self.extras.len())?;
        for (rank, listing) in self.extras.iter().enumerate() {
            for name in listing.keys() {
                check_extra_name(name)
                    .map_err(|e| PartitionError::InvalidConfig(format!("extras of rank {rank}: {e}")))?;
            }
        }
        Ok(())
    }

    /// Checks the shard records: one per rank, in rank order, with the
    /// expected file names.
    pub(super) fn check_shards(&self) -> Result<()> {
        self.check_one_per_rank("shard records", self.shards.len())?;
        let world = self.topology.world;
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
        Ok(Topology::ranks(self.topology.world).per_node(self.topology.local_size)?)
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

    /// Checks that `plan` describes the saved model: the same buckets with
    /// the same parameter names, shapes and dtypes, in order (any topology,
    /// alignment or hpZ size).
    pub(super) fn check_same_model(&self, plan: &PartitionPlan) -> Result<()> {
        let saved = &self.buckets;
        if plan.num_buckets() != saved.len() {
            return Err(PartitionError::LayoutMismatch(format!(
                "plan has {} buckets, checkpoint has {}",
                plan.num_buckets(),
                saved.len()
            )));
        }
        for (p, s) in plan.buckets().iter().zip(saved) {
            let (ps, ss) = (p.spec(), s.spec());
            if ps != ss {
                // Name the first parameter that differs, so that a model whose
                // tensor changed shape (a transposed weight) says which.
                let first = ps.params.iter().zip(&ss.params).find(|(a, b)| a != b).map_or_else(
                    || format!("{} parameters against {}", ps.params.len(), ss.params.len()),
                    |(a, b)| {
                        format!(
                            "{} {:?} {:?} against {} {:?} {:?}",
                            a.name, a.shape, a.dtype, b.name, b.shape, b.dtype
                        )
                    },
                );
                return Err(PartitionError::LayoutMismatch(format!(
                    "bucket {:?} of the plan differs from bucket {:?} of the checkpoint: {first}",
                    p.name, s.name
                )));
            }
        }
        Ok(())
    }

    /// Whether `plan` partitions like the saved plan: the same world size,
    /// ranks per node and bucket layouts (the hpZ size may differ). Only
    /// then do the saved ranks' extras carry over.
    pub(super) fn same_partitioning(&self, plan: &PartitionPlan) -> bool {
        let topology = plan.topology();
        topology.world() == self.topology.world
            && topology.local_size() == self.topology.local_size
            && plan.buckets() == self.buckets.as_slice()
    }

    /// Whether any rank saved extras.
    pub(super) fn lists_extras(&self) -> bool {
        self.extras.iter().any(|e| !e.is_empty())
    }

    /// Total size in bytes of the shard files.
    pub fn total_shard_bytes(&self) -> u64 {
        self.shards.iter().map(|s| s.size).sum()
    }

    /// Structural validation: version, topology, layouts and records agree.
    pub(super) fn validate(&self, path: &Path) -> Result<PartitionPlan> {
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
        self.check_extras().map_err(bad)?;
        Ok(plan)
    }

    /// The file bytes: pretty JSON with `manifest_crc32c` first.
    pub(super) fn to_file_bytes(&self) -> Result<Vec<u8>> {
        let body = serde_json::to_string_pretty(self)
            .map_err(|e| PartitionError::InvalidConfig(format!("cannot serialize manifest: {e}")))?;
        let rest = body
            .strip_prefix("{\n")
            .ok_or_else(|| PartitionError::InvalidConfig("unexpected manifest serialization".into()))?;
        let assemble = |crc: &str| format!("{MANIFEST_PREFIX}{crc}\",\n{rest}\n").into_bytes();
        let crc = crc32c::crc32c(&assemble(MANIFEST_CRC_PLACEHOLDER));
        Ok(assemble(&format!("{crc:08x}")))
    }

    /// Parses file bytes, verifying `manifest_crc32c` first.
    pub(super) fn from_file_bytes(path: &Path, bytes: &[u8]) -> Result<Self> {
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

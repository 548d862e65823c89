//! The crate's error type.

use std::path::PathBuf;

/// Everything that can go wrong while building layouts and plans, or while
/// writing and reading sharded checkpoints.
///
/// Every error about a file names that file.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum PartitionError {
    /// The topology could not be built.
    #[error(transparent)]
    Topology(#[from] zeropp_comm::CommError),
    /// A plan or layout parameter is invalid (alignment, hpZ group size, overflow).
    #[error("invalid configuration: {0}")]
    InvalidConfig(String),
    /// The hpZ group size does not divide the node size.
    #[error(
        "invalid hpZ group size {hpz}: it must be >= 1 and divide local_size {local_size} (1 disables hpZ)"
    )]
    InvalidHpz {
        /// Requested hpZ group size.
        hpz: usize,
        /// Ranks per node of the topology.
        local_size: usize,
    },
    /// A parameter registry is malformed (duplicate or empty names, overflowing shapes).
    #[error("invalid parameter registry: {0}")]
    InvalidRegistry(String),
    /// A rank outside `0..world` was asked for.
    #[error("rank {rank} out of range for world size {world}")]
    RankOutOfRange {
        /// Requested rank.
        rank: usize,
        /// World size of the plan.
        world: usize,
    },
    /// A local rank outside `0..local_size` was asked for.
    #[error("local rank {local} out of range for local_size {local_size}")]
    LocalRankOutOfRange {
        /// Requested local rank.
        local: usize,
        /// Ranks per node.
        local_size: usize,
    },
    /// A bucket index outside `0..buckets` was asked for.
    #[error("bucket {bucket} out of range ({buckets} buckets)")]
    BucketOutOfRange {
        /// Requested bucket.
        bucket: usize,
        /// Number of buckets.
        buckets: usize,
    },
    /// A buffer did not have the length the layout requires.
    #[error("length mismatch for {what}: expected {expected}, got {actual}")]
    LengthMismatch {
        /// What was being checked.
        what: String,
        /// Expected number of elements (or items).
        expected: usize,
        /// Actual number.
        actual: usize,
    },
    /// A checkpoint's model layout does not match the plan it is loaded into.
    #[error("layout mismatch: {0}")]
    LayoutMismatch(String),
    /// An I/O operation failed.
    #[error("I/O error on {}: {source}", path.display())]
    Io {
        /// The file or directory involved.
        path: PathBuf,
        /// The underlying error.
        source: std::io::Error,
    },
    /// A file the checkpoint needs does not exist.
    #[error("missing checkpoint file {}", path.display())]
    MissingFile {
        /// The missing file.
        path: PathBuf,
    },
    /// No committed checkpoint was found in a directory.
    #[error("no checkpoint found in {}: {reason}", dir.display())]
    NoCheckpoint {
        /// The directory searched.
        dir: PathBuf,
        /// Why nothing was found.
        reason: String,
    },
    /// A checkpoint for this step is already committed; old checkpoints are never modified.
    #[error("checkpoint {} already exists and is never overwritten", path.display())]
    CheckpointExists {
        /// The existing checkpoint directory.
        path: PathBuf,
    },
    /// A file has a different size than the manifest records (e.g. truncated).
    #[error("size mismatch in {}: manifest records {expected} bytes, file has {actual} (truncated or replaced?)", path.display())]
    SizeMismatch {
        /// The file.
        path: PathBuf,
        /// Recorded size.
        expected: u64,
        /// Actual size.
        actual: u64,
    },
    /// A file's crc32c differs from the one the manifest records.
    #[error("checksum mismatch in {}: manifest records crc32c {expected:08x}, file has {actual:08x} (corrupted)", path.display())]
    ChecksumMismatch {
        /// The file.
        path: PathBuf,
        /// Recorded checksum.
        expected: u32,
        /// Computed checksum.
        actual: u32,
    },
    /// A file is present but its content is invalid (bad JSON, bad safetensors, wrong tensors).
    #[error("corrupt checkpoint file {}: {reason}", path.display())]
    Corrupt {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        reason: String,
    },
}

/// Shorthand for `Result<T, PartitionError>`.
pub type Result<T, E = PartitionError> = std::result::Result<T, E>;

impl PartitionError {
    pub(crate) fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        let path = path.into();
        if source.kind() == std::io::ErrorKind::NotFound {
            Self::MissingFile { path }
        } else {
            Self::Io { path, source }
        }
    }

    pub(crate) fn corrupt(path: impl Into<PathBuf>, reason: impl Into<String>) -> Self {
        Self::Corrupt { path: path.into(), reason: reason.into() }
    }
}

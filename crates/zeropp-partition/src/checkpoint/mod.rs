//! Sharded checkpoints: per-rank safetensors shard files plus a JSON manifest.
//!
//! # On-disk layout
//!
//! ```text
//! DIR/
//!   LATEST                               "step-00000200\n", replaced atomically after the manifest is durable
//!   step-00000100/                       one folder per checkpoint, never modified once committed
//!     rank-00000-of-00004.safetensors    rank 0's primary shards: master, exp_avg, exp_avg_sq, step per bucket,
//!                                        and its rank-local extras (extra/NAME), if any
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
//! [`CheckpointReader::shard_for`] reads the state of any rank of any new
//! plan (other world size, local size, alignment, parameter alignment or hpZ
//! group size) shard by shard: only the saved shard files whose shards
//! overlap the new one are read, each once, front to back, through a running
//! crc32c (the manifest records one checksum per file, so each file read is
//! verified whole, header and metadata included), and only the overlapping
//! ranges are kept. Peak memory is the rank's new share plus two
//! [`CHUNK_BYTES`] buffers; [`CheckpointReader::shards_for`] does the same
//! for several ranks of one process (the thread backend) in one pass over the
//! files. [`CheckpointReader::export_safetensors`] verifies
//! every file the same way, then writes the consolidated file's header and
//! streams each tensor from the shard files holding it, [`CHUNK_BYTES`] at a
//! time. The engine resumes with the reader.
//!
//! [`load_checkpoint`] instead consolidates the shards into full per-bucket
//! buffers ([`Checkpoint`]), with padding stripped, and
//! [`Checkpoint::shard_for`] cuts any rank's state out of them: simpler,
//! O(model) memory, and it verifies every file and every step counter up
//! front. It stays as the reference the streaming paths are tested against
//! (bit for bit), and for inspection. A streaming read checks the step
//! counters of the files it reads, and a rank never reads a file it does
//! not overlap (a file holding only padding for it), so corruption there
//! does not fail that rank; [`CheckpointReader::verify`] checks every file.
//!
//! # Rank-local extras
//!
//! A rank may also save named f32 vectors that belong to it rather than to
//! parameter elements ([`ShardState::extra`]; e.g. the qgZ error-feedback
//! residuals, which a bitwise resume needs). They are stored bit for bit in
//! the rank's shard file as tensors `extra/NAME`, under the same file
//! crc32c, and listed per rank in the manifest ([`Manifest::extras`],
//! filled by [`Manifest::with_extras`]); a missing, unlisted, mistyped or
//! truncated extra is an error naming the file, at commit and at load.
//!
//! Extras cannot be re-sharded: [`Checkpoint::shard_for`] (and
//! [`CheckpointReader::shard_for`]) returns them only
//! under a plan that partitions like the saved one (same world size, ranks
//! per node and bucket layouts) and an empty map otherwise;
//! [`Checkpoint::extras_dropped`] tells the caller when to warn.
//! [`Checkpoint::rank_extra`] reads them by saved rank regardless. They are
//! not model weights and stay out of [`Checkpoint::export_safetensors`].
//!
//! A checkpoint without extras is written exactly as before extras existed
//! (no `extras` key, no `extra/` tensors, [`FORMAT_VERSION`] unchanged), and
//! such checkpoints load with no extras. Readers that predate extras
//! ignore them.
//!
//! # Source map
//!
//! * `manifest.rs`: [`Manifest`], [`ShardRecord`], [`TopologyInfo`] and the
//!   self-checksummed `manifest.json` encoding.
//! * `state.rs`: what one rank saves ([`ShardState`], [`BucketShard`]).
//! * `format.rs`: names of folders, shard files and tensors; f32 encoding;
//!   checks of the extras a shard file holds against the manifest.
//! * `fs.rs`: atomic writes (temporary file, fsync, rename, fsync folder).
//! * `save.rs`: [`write_shard`], [`commit_checkpoint`], [`save_checkpoint`].
//! * `load.rs`: [`resolve_checkpoint_dir`], [`load_checkpoint`],
//!   [`Checkpoint`] (the consolidated state beside the [`CheckpointReader`]
//!   it was opened with, [`Checkpoint::reader`]) and re-sharding with
//!   [`Checkpoint::shard_for`].
//! * `stream.rs`: [`CheckpointReader`]: streaming, verified re-sharding.
//! * `export.rs`: [`Checkpoint::export_safetensors`] and the streamed
//!   [`CheckpointReader::export_safetensors`].

mod export;
mod format;
mod fs;
mod load;
mod manifest;
mod save;
mod shard_file;
mod state;
mod stream;

pub use format::{shard_file_name, step_dir_name};
pub use fs::resolve_checkpoint_dir;
pub use load::{Checkpoint, FullBucket, load_checkpoint};
pub use manifest::{Manifest, ShardRecord, TopologyInfo};
pub use save::{commit_checkpoint, save_checkpoint, write_shard};
pub use shard_file::CHUNK_BYTES;
pub use state::{BucketShard, ShardState};
pub use stream::CheckpointReader;

/// Version of the checkpoint format written by this crate.
pub const FORMAT_VERSION: u32 = 1;

/// Name of the pointer file naming the latest committed checkpoint folder.
pub const LATEST_FILE: &str = "LATEST";

/// Name of the manifest inside a checkpoint folder.
pub const MANIFEST_FILE: &str = "manifest.json";

//! # zeropp-partition
//!
//! Pure bookkeeping for ZeRO-3 / ZeRO++ sharding: flat bucket layouts,
//! primary and secondary (hpZ) shard maps, the qgZ slice order, optimizer
//! state ownership, a per-rank memory report, and sharded checkpoints.
//! Nothing here communicates; the engine drives the collectives.
//!
//! ## Layout
//!
//! A [`ParamRegistry`] groups named parameters (name, shape, [`DType`]) into
//! buckets, each the unit of one all-gather. A [`PartitionPlan`] lays every
//! bucket out as a flat buffer ([`BucketLayout`]): parameters back to back
//! from offset 0, then zero padding up to `padded_len`, the smallest multiple
//! of `world × align` that holds them. Real values and padding never mix:
//! `0..numel` is real, `numel..padded_len` is padding.
//!
//! ## Who owns what (rank `r`, bucket of `P = padded_len` elements, `W` ranks)
//!
//! * **Primary shard**: `r·P/W .. (r+1)·P/W`, a whole number of `align`
//!   groups. The rank keeps these elements in f32 (master), updates them
//!   and checkpoints them.
//! * **Gradient shard** (reduce-scatter output): the same range.
//! * **Optimizer state** (`exp_avg`, `exp_avg_sq`, step): the same range.
//! * **Secondary (hpZ) shard**: with hpZ group size `h > 1` (dividing
//!   `local_size`), the `h` consecutive ranks of a node containing `r` form
//!   its hpZ group; the rank at position `i` in it holds `i·P/h .. (i+1)·P/h`
//!   of the 16-bit weights. `h = 1` turns hpZ off.
//! * **qgZ slice order**: in the intra-node all-to-all, a rank sends local
//!   peer `l` the world shards of ranks `(node m, local l)` for
//!   `m = 0..nodes`, in that order ([`PartitionPlan::qgz_peer_shards`]).
//!
//! ## Memory per rank
//!
//! With `Ψ` the **padded** parameter count (sum of every bucket's
//! `padded_len`), [`PartitionPlan::memory_report`] gives
//!
//! ```text
//! f32 master       4·Ψ/W ┐
//! exp_avg+exp_avg_sq 8·Ψ/W ┘ 12·Ψ/W  optimizer states
//! 16-bit working   2·Ψ/W
//! 16-bit gradients 2·Ψ/W
//! hpZ secondary    2·Ψ/h   (0 when h = 1)
//! total = (2 + 2 + 12)·Ψ/W + 2·Ψ/h
//! ```
//!
//! which is exact (not rounded) because every `padded_len` is a multiple of
//! `W·align`, and `h` divides `W`. Padding enters only through `Ψ`: it is at
//! most `W·align − 1` elements per bucket. The 16-bit figures hold whatever
//! the declared [`DType`] of a parameter is (the working buffers are 16-bit).
//!
//! ## Checkpoints
//!
//! See the [`checkpoint`] module: per-rank safetensors shards, a JSON
//! manifest with crc32c checksums, atomic commits, verified loads,
//! re-sharding to any topology, and rank-local extra state (such as qgZ
//! error-feedback residuals) restored on the saved topology.

pub mod checkpoint;
mod error;
mod layout;
mod plan;

pub use checkpoint::{
    BucketShard, Checkpoint, CheckpointReader, FullBucket, Manifest, ShardRecord, ShardState, TopologyInfo,
    commit_checkpoint, load_checkpoint, resolve_checkpoint_dir, save_checkpoint, write_shard,
};
pub use error::{PartitionError, Result};
pub use layout::{BucketLayout, BucketSpec, DType, ParamRegistry, ParamSlot, ParamSpec};
pub use plan::{HpzGroup, MemoryReport, PartitionPlan, PlanConfig, RankPlan, ShardPiece};
/// Re-exported so users of the plan need not depend on `zeropp-comm` directly.
pub use zeropp_comm::Topology;

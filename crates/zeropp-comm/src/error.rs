//! The crate's error type.

use std::time::Duration;

/// Everything that can go wrong in topology, communicators and collectives.
#[derive(Debug, thiserror::Error, Clone, PartialEq)]
#[non_exhaustive]
pub enum CommError {
    /// `world` and `local_size` do not form a valid layout.
    #[error(
        "invalid topology: world {world} with {local_size} ranks per node (both must be > 0 and local_size must divide world)"
    )]
    InvalidTopology {
        /// Requested world size.
        world: usize,
        /// Requested ranks per node.
        local_size: usize,
    },
    /// A group was malformed (empty, duplicate or out-of-range ranks), or the
    /// calling rank is not a member of the group it called a collective on.
    #[error("invalid group: {0}")]
    InvalidGroup(String),
    /// Ranks disagreed on a collective (sizes, kinds or order of calls), or the
    /// caller's buffers do not have the sizes the collective requires.
    #[error("collective mismatch: {0}")]
    Mismatch(String),
    /// A peer rank vanished (panicked, returned early, or its process died).
    #[error("peer rank {rank} was lost: {reason}")]
    PeerLost {
        /// The lost rank.
        rank: usize,
        /// What was observed.
        reason: String,
    },
    /// A peer stayed silent for longer than the configured timeout.
    #[error("timed out after {after:?} waiting for rank {rank} in {op}")]
    Timeout {
        /// The rank that was waited for.
        rank: usize,
        /// The collective that waited.
        op: String,
        /// How long it waited.
        after: Duration,
    },
    /// A configuration string or option was invalid (e.g. a `--link` value).
    #[error("invalid configuration: {0}")]
    InvalidConfig(String),
    /// Quantizing, dequantizing or decoding a quantized payload failed (e.g. a
    /// non-finite gradient, or corrupted wire bytes).
    #[error("quantization: {0}")]
    Quant(#[from] zeropp_quant::QuantError),
    /// A device library call failed (`api`: `cuda` for the driver, `nccl`): its
    /// status code (-1: the library could not be loaded) and what was called.
    /// The code is kept rather than the library's error type so that the enum
    /// stays `Clone + PartialEq`.
    #[error("{api} error {code}: {what}")]
    Device {
        /// Which library (`cuda`, `nccl`).
        api: &'static str,
        /// Its status code.
        code: i32,
        /// The call and the library's message.
        what: String,
    },
    /// A background communication worker ([`crate::AsyncComm`]) is gone.
    #[error("communication worker closed: {0}")]
    Closed(String),
}

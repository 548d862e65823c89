//! The crate's error type.

use std::path::PathBuf;

/// Everything that can go wrong in the engine: models, data, training.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum EngineError {
    /// A model or data configuration is unusable (zero sizes, indivisible dimensions, ...).
    #[error("invalid configuration: {0}")]
    InvalidConfig(String),
    /// A layer index past the end of the model's layer list.
    #[error("layer {layer} out of range: the model has {layers} layers")]
    LayerOutOfRange {
        /// The requested layer.
        layer: usize,
        /// Number of layers of the model.
        layers: usize,
    },
    /// A buffer does not have the length the operation needs.
    #[error("length mismatch for {what}: expected {expected}, got {got}")]
    LengthMismatch {
        /// Which buffer.
        what: &'static str,
        /// Required length.
        expected: usize,
        /// Actual length.
        got: usize,
    },
    /// A token id is not below the vocabulary size.
    #[error("token id {token} out of range for a vocabulary of {vocab}")]
    TokenOutOfRange {
        /// The offending token id.
        token: u32,
        /// Vocabulary size.
        vocab: usize,
    },
    /// A quantization spec (bits, group size) is unusable.
    #[error("invalid configuration: invalid quantization spec: {0}")]
    InvalidQuantSpec(#[source] zeropp_quant::QuantError),
    /// A JSON document (a DeepSpeed config, the saved configuration, a metrics
    /// record) cannot be parsed or serialized.
    #[error("invalid configuration: {what}: {source}")]
    Json {
        /// What was being read or written.
        what: &'static str,
        /// The JSON error.
        #[source]
        source: serde_json::Error,
    },
    /// A batch whose shape is inconsistent or unsupported by the model.
    #[error("invalid batch: {0}")]
    InvalidBatch(String),
    /// Model calls made out of order (e.g. `forward(2)` before `forward(1)`, `backward` before `loss`).
    #[error("call order violated: {0}")]
    CallOrder(String),
    /// The text is empty: there is nothing to train on.
    #[error("empty text: no characters to build a dataset from")]
    EmptyText,
    /// A text split is too short for the requested sequence length.
    #[error("{split} split has {len} tokens, fewer than seq_len + 1 = {needed}")]
    TextTooShort {
        /// Which split ("train" or "validation").
        split: &'static str,
        /// Tokens in the split.
        len: usize,
        /// Tokens needed (`seq_len + 1`).
        needed: usize,
    },
    /// A global batch cannot be split evenly over the ranks.
    #[error(
        "cannot shard a batch of {batch} sequences over rank {rank} of {world}: batch must be divisible by world and rank < world"
    )]
    InvalidShard {
        /// Sequences in the global batch.
        batch: usize,
        /// Requested rank.
        rank: usize,
        /// World size.
        world: usize,
    },
    /// Reading or writing a file (data, config, metrics, plots) failed.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The underlying error.
        #[source]
        source: std::io::Error,
    },
    /// A collective failed (peer lost, mismatch, timeout). The failing rank is
    /// named once, by the driver: [`EngineError::RankFailed`] on the thread
    /// backend, the `rank R of W: fatal:` line of the MPI abort.
    #[error("communication failed: {0}")]
    Comm(#[from] zeropp_comm::CommError),
    /// The world, node size or a group is rejected by the communication layer.
    #[error("invalid configuration: {0}")]
    InvalidTopology(#[source] zeropp_comm::CommError),
    /// The thread cluster could not start its ranks.
    #[error("training failed: cannot start the cluster: {0}")]
    ClusterSetup(#[source] zeropp_comm::CommError),
    /// Partitioning or checkpoint I/O failed.
    #[error("partition/checkpoint error: {0}")]
    Partition(#[from] zeropp_partition::PartitionError),
    /// A checkpoint's metadata is unusable, or a collective save failed on
    /// another rank (this rank only learns that it failed; the error itself is
    /// reported on that rank).
    #[error("partition/checkpoint error: {0}")]
    Checkpoint(String),
    /// A rank's thread panicked; the panic message.
    #[error("panicked: {0}")]
    Panicked(String),
    /// A rank failed; `cause` is its own error (the root cause, not a peer's echo).
    #[error("rank {rank} failed: {cause}")]
    RankFailed {
        /// The failing rank.
        rank: usize,
        /// What went wrong on that rank.
        #[source]
        cause: Box<EngineError>,
    },
    /// Training cannot continue (e.g. every step is non-finite).
    #[error("training failed: {0}")]
    Training(String),
    /// A model's own computation failed in one of its layers (a model written
    /// with another framework, such as `zeropp-candle`'s, reports its errors
    /// this way): the model, the layer, and the model's error as the source.
    #[error("model {model:?}, layer {layer:?}: {source}")]
    Model {
        /// The model's name.
        model: String,
        /// The layer (gather unit) that failed.
        layer: String,
        /// The model's own error.
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
}

/// Shorthand for `Result<T, EngineError>`.
pub type Result<T, E = EngineError> = std::result::Result<T, E>;

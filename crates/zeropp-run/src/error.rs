//! [`RunError`]: the run layer's one error type.

use std::path::PathBuf;

use zeropp_candle::CandleError;
use zeropp_engine::EngineError;

/// Why a run could not be configured, built or trained.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum RunError {
    /// The engine refused the run or failed while training it.
    #[error(transparent)]
    Engine(#[from] EngineError),
    /// The candle Llama could not be built.
    #[error(transparent)]
    Candle(#[from] CandleError),
    /// A configuration the run layer reads (a DeepSpeed file, a model spec) is
    /// invalid; the message names the setting.
    #[error("{0}")]
    InvalidConfig(String),
    /// A configuration file is not valid JSON.
    #[error("{what}: {source}")]
    Json {
        /// Which file.
        what: &'static str,
        /// The parser's error.
        source: serde_json::Error,
    },
    /// A configuration file could not be read.
    #[error("{}: {source}", path.display())]
    Io {
        /// The file.
        path: PathBuf,
        /// The I/O error.
        source: std::io::Error,
    },
}

/// `Result` with [`RunError`].
pub type Result<T, E = RunError> = std::result::Result<T, E>;

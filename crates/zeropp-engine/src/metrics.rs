//! Per-step metrics, the run summary and the JSON Lines writer.
//!
//! A metrics file holds one [`StepRecord`] object per optimizer step, then one
//! `{"summary": {...}}` line ([`Summary`]).

use std::collections::BTreeMap;
use std::io::Write;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::EngineError;

/// Bytes sent by one rank on each link class.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct LinkBytes {
    /// Bytes sent to peers on the same node.
    pub intra: f64,
    /// Bytes sent to peers on other nodes.
    pub inter: f64,
}

impl LinkBytes {
    /// `intra + inter`.
    pub fn total(&self) -> f64 {
        self.intra + self.inter
    }

    /// Element-wise sum.
    pub fn add(&mut self, other: &LinkBytes) {
        self.intra += other.intra;
        self.inter += other.inter;
    }

    /// Both classes multiplied by `k`.
    pub fn scaled(&self, k: f64) -> LinkBytes {
        LinkBytes { intra: self.intra * k, inter: self.inter * k }
    }
}

/// One optimizer step, as written to the metrics file.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StepRecord {
    /// Step index, from 0.
    pub step: usize,
    /// Mean training loss of the step's global batch (mean over micro-batches and ranks).
    pub loss: f32,
    /// Global gradient norm before clipping (NaN or inf when the step was skipped).
    pub grad_norm: f32,
    /// Wall time of the step, slowest rank, in seconds.
    pub step_time_s: f64,
    /// Tokens of the global batch divided by the step time.
    pub tokens_per_s: f64,
    /// Intra-node bytes sent, mean per rank, this step.
    pub intra_node_bytes: f64,
    /// Inter-node bytes sent, mean per rank, this step.
    pub inter_node_bytes: f64,
    /// Bytes sent by operation tag (`fwd_gather`, `bwd_gather`, `grad_reduce`, `grad_norm`, `other`).
    pub bytes_by_op: BTreeMap<String, LinkBytes>,
    /// True when the step found a non-finite gradient and was skipped.
    pub skipped: bool,
    /// Where the slowest rank's step time went (zero under MPI).
    #[serde(default)]
    pub times: crate::engine::StepTimes,
    /// Gathers prefetched this step, summed over ranks (0 under MPI).
    #[serde(default)]
    pub prefetched_gathers: usize,
}

/// The final line of a metrics file and the body of the printed summary.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Summary {
    /// Loss of the last step.
    pub final_loss: f32,
    /// Validation loss after the last step (`None` when not evaluated).
    pub val_loss: Option<f32>,
    /// Steps run (including skipped ones).
    pub steps: usize,
    /// Skipped steps (non-finite gradients).
    pub skipped_steps: usize,
    /// Ranks.
    pub world: usize,
    /// Ranks per node.
    pub local_size: usize,
    /// `zero3`, `zeropp`, or the enabled techniques (`qwz+hpz`).
    pub mode: String,
    /// Baseline communication dtype.
    pub comm_dtype: String,
    /// Model name.
    pub model: String,
    /// Number of (unpadded) parameters.
    pub params: usize,
    /// Loss floor of the data (entropy rate of the Markov source, in nats), when known.
    pub entropy_rate: Option<f64>,
    /// Mean step time in seconds (first step excluded when there are more than one).
    pub mean_step_time_s: f64,
    /// Mean tokens per second.
    pub tokens_per_s: f64,
    /// Measured bytes sent per rank per step (mean), by link class.
    pub bytes_per_step: LinkBytes,
    /// Measured bytes sent per rank per step (mean), by operation.
    pub bytes_by_op: BTreeMap<String, LinkBytes>,
    /// The analytic model's bytes per rank per step (mean over ranks), by link class.
    pub model_bytes_per_step: LinkBytes,
    /// The analytic model's bytes per rank per step (mean over ranks), by operation.
    pub model_bytes_by_op: BTreeMap<String, LinkBytes>,
}

/// A JSON Lines writer for [`StepRecord`]s and the final [`Summary`].
#[derive(Debug)]
pub struct MetricsWriter {
    path: PathBuf,
    out: std::io::BufWriter<std::fs::File>,
}

impl MetricsWriter {
    /// Creates (truncates) `path`.
    pub fn create(path: &Path) -> Result<Self, EngineError> {
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::create_dir_all(dir)
                .map_err(|source| EngineError::Io { path: dir.to_path_buf(), source })?;
        }
        let f = std::fs::File::create(path)
            .map_err(|source| EngineError::Io { path: path.to_path_buf(), source })?;
        Ok(Self { path: path.to_path_buf(), out: std::io::BufWriter::new(f) })
    }

    fn line<T: Serialize>(&mut self, value: &T) -> Result<(), EngineError> {
        let s = serde_json::to_string(value)
            .map_err(|source| EngineError::Json { what: "cannot serialise metrics", source })?;
        writeln!(self.out, "{s}")
            .and_then(|()| self.out.flush())
            .map_err(|source| EngineError::Io { path: self.path.clone(), source })
    }

    /// Appends one step.
    pub fn step(&mut self, record: &StepRecord) -> Result<(), EngineError> {
        self.line(record)
    }

    /// Appends the summary line `{"summary": {...}}`.
    pub fn summary(&mut self, summary: &Summary) -> Result<(), EngineError> {
        #[derive(Serialize)]
        struct Wrap<'a> {
            summary: &'a Summary,
        }
        self.line(&Wrap { summary })
    }
}

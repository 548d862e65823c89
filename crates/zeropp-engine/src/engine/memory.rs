//! The memory model of one rank: the sharded model states of
//! [`PartitionPlan::memory_report`] (`16·Ψ/W + 2·Ψ/hpz`) plus the transients of a
//! step, the gathered layers and the activations, to compare with what a run
//! measures (peak RSS per process under MPI, an allocation counter with the
//! thread backend).
//!
//! What this engine holds per rank, against the report's terms:
//!
//! | report term | held here |
//! |---|---|
//! | master `4·Ψ/W` + optimizer `8·Ψ/W` | the f32 master shard and the two f32 AdamW moments |
//! | working `2·Ψ/W` + gradient `2·Ψ/W` | one f32 gradient accumulator (`4·Ψ/W`): the same 16 bytes per element in all |
//! | secondary `2·Ψ/hpz` | the hpZ secondary shards, bf16 (less with the INT8 hpZ wire) |
//! | transient layers | at most [`GATHERED_COPIES`] f32 copies of the largest layer: the gathered layer, the prefetched next one, its gradient, the compact views, the wire buffers |
//! | activations | [`Model::activation_bytes`] of one micro-batch |
//! | (not in the report) qwZ-Δ's `Ŵ` | with qwZ-Δ: this rank's reconstruction of its primary shards, in the copy's element type (`b·Ψ/W`, `b` = 2 for the bf16 copy, 4 for f32); the hpZ copy itself is the secondary term above, held across steps instead of rebuilt every step |
//! | (not in the report) LoCo residuals | only with qgZ error feedback (opt-in): per layer, the first hop's residual over the whole padded gradient (`b·Ψ` in all, every rank quantizes its full gradient) and the second hop's (`b·N·Ψ/W`), with `b` = 2 bytes (bf16 residuals, the default) or 4 (f32); one copy (a skipped step resets them instead of restoring a saved copy) |
//!
//! The LoCo residuals do not shrink with W: on the first hop every rank
//! quantizes its whole local gradient, so its error is as large as the model
//! (DeepSpeed's LoCo keeps such buffers too). Past a few ranks they are the
//! largest term; error feedback is off by default.
//!
//! ```
//! use zeropp_comm::Topology;
//! use zeropp_engine::config::{EngineConfig, ZeroConfig};
//! use zeropp_engine::engine::{build_plan, memory::predict};
//! use zeropp_engine::model::{Gpt, GptConfig};
//! let model = Gpt::new(GptConfig::default_small())?;
//! let cfg = EngineConfig { zero: ZeroConfig::zeropp(4), ..EngineConfig::default() };
//! let at = |w: usize| -> Result<usize, zeropp_engine::EngineError> {
//!     let t = Topology::ranks(w).per_node(w.min(4)).map_err(zeropp_engine::EngineError::InvalidTopology)?;
//!     let cfg = EngineConfig { zero: ZeroConfig::zeropp(w.min(4)), ..cfg.clone() };
//!     Ok(predict(&model, &build_plan(&model, &cfg, t)?, &cfg, 1)?.states)
//! };
//! assert!(at(8)? < at(4)?); // the states fall with W
//! # Ok::<(), zeropp_engine::EngineError>(())
//! ```

use zeropp_partition::PartitionPlan;

use crate::EngineError;
use crate::config::EngineConfig;
use crate::engine::comm_plan::CommPlan;
use crate::model::Model;

/// f32 copies of the largest layer one rank may hold at once during a step
/// (see the [module docs](self)).
pub const GATHERED_COPIES: usize = 6;

/// Predicted peak bytes of one rank.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MemoryPrediction {
    /// The sharded model states and hpZ shards (`memory_report(rank).total_bytes()`).
    pub states: usize,
    /// Gathered layers in flight: [`GATHERED_COPIES`] × 4 × the largest padded layer.
    pub transient_layers: usize,
    /// Activations of one micro-batch.
    pub activations: usize,
    /// qgZ's LoCo residuals, both hops (0 without error feedback).
    pub error_feedback: usize,
    /// qwZ-Δ's `Ŵ` of the rank's primary shards (0 without qwZ-Δ).
    pub delta_copy: usize,
    /// Bytes of the full f32 model (`4·Ψ`): no rank may come near it.
    pub full_f32_model: usize,
}

impl MemoryPrediction {
    /// The predicted peak: states + transient layers + activations.
    pub fn total(&self) -> usize {
        self.states + self.transient_layers + self.activations + self.error_feedback + self.delta_copy
    }
}

/// The memory model of rank 0 (ranks differ by padding only) of `model` on
/// `plan` (built from `cfg`), for micro-batches of `micro_batch` sequences.
pub fn predict<M: Model + ?Sized>(
    model: &M,
    plan: &PartitionPlan,
    cfg: &EngineConfig,
    micro_batch: usize,
) -> Result<MemoryPrediction, EngineError> {
    let report = plan.memory_report(0)?;
    let cp = CommPlan::new(plan, cfg)?;
    let largest = cp.layers().iter().map(|l| l.padded_len).max().unwrap_or(0);
    let nodes = cp.topology().nodes();
    let error_feedback = match cp.qgz().and_then(|q| q.error_feedback) {
        Some(loco) => {
            // Per reduce call: hop 1's residual over the call's padded gradient,
            // hop 2's over N of its shards.
            let w = cp.topology().world();
            let elements: usize = cp
                .layers()
                .iter()
                .flat_map(|l| &l.reduces)
                .map(|c| c.chunk.len() * w + nodes * c.chunk.len())
                .sum();
            loco.residual_dtype.bytes() * elements
        }
        None => 0,
    };
    let delta_copy = if cp.delta().is_some() { cp.dense().bytes() * report.primary_elems } else { 0 };
    Ok(MemoryPrediction {
        delta_copy,
        states: report.total_bytes(),
        transient_layers: GATHERED_COPIES * 4 * largest,
        activations: model.activation_bytes(micro_batch, model.seq_len()),
        error_feedback,
        full_f32_model: 4 * plan.padded_numel(),
    })
}

/// This process's peak resident set (`VmHWM` of `/proc/self/status`), in bytes;
/// `None` where that file is absent (not Linux). Under MPI, one rank's peak.
pub fn peak_rss() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let kb = status.lines().find_map(|l| l.strip_prefix("VmHWM:"))?.trim().trim_end_matches("kB").trim();
    kb.parse::<u64>().ok().map(|kb| kb * 1024)
}

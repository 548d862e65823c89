//! The checks every driver (threads or MPI) makes before it starts a rank.

use std::path::Path;

use zeropp_comm::Topology;
use zeropp_partition::PartitionPlan;

use crate::EngineError;
use crate::data::TextDataset;
use crate::engine::build_plan;
use crate::engine::bytes::{ByteModel, StepKind, step_bytes_of};
use crate::model::Model;

use super::config::RunConfig;
use super::report::Work;

/// A run checked and planned on its cluster: what both drivers start from.
pub(crate) struct Prepared {
    /// The model's sequence length.
    pub(crate) seq_len: usize,
    /// Tokens per optimizer step, over all ranks.
    pub(crate) tokens: usize,
    /// The partition plan of the model on the cluster.
    pub(crate) plan: PartitionPlan,
    /// The analytic bytes per step: of a full step, and of a qwZ-Δ difference step.
    pub(crate) analytic: [ByteModel; 2],
}

/// [`check_run`], then the plan on `topo` and its analytic bytes.
pub(crate) fn prepare<M: Model>(work: &Work<'_, M>, topo: Topology) -> Result<Prepared, EngineError> {
    let cfg = work.run;
    let (seq_len, micro) = check_run(work.model, work.data, cfg)?;
    let plan = build_plan(work.model, &cfg.engine, topo)?;
    let a = cfg.engine.grad_accum;
    let analytic = [
        step_bytes_of(&plan, &cfg.engine, a, StepKind::Full)?,
        step_bytes_of(&plan, &cfg.engine, a, StepKind::Delta)?,
    ];
    let tokens = micro * cfg.world * cfg.engine.grad_accum * seq_len;
    Ok(Prepared { seq_len, tokens, plan, analytic })
}

/// Checks the engine config, the sequence length, the batch arithmetic, a
/// non-zero step count, and data large enough for one global batch (and for
/// validation). Returns `(seq_len, micro-batch per rank)`.
pub(crate) fn check_run<M: Model>(
    model: &M,
    data: &TextDataset,
    cfg: &RunConfig,
) -> Result<(usize, usize), EngineError> {
    cfg.engine.validate(cfg.world, cfg.local_size)?;
    if data.vocab_size() > model.vocab_size() {
        return Err(EngineError::InvalidConfig(format!(
            "the data's vocabulary ({} ids) exceeds model {:?}'s ({} ids): token ids up to {} would \
             index past its embedding",
            data.vocab_size(),
            model.name(),
            model.vocab_size(),
            data.vocab_size() - 1
        )));
    }
    let seq_len = model.seq_len();
    data.check_seq_len(seq_len)?;
    let micro = cfg.engine.micro_batch(cfg.world)?;
    if cfg.steps == 0 {
        return Err(EngineError::InvalidConfig("steps must be > 0".into()));
    }
    let windows = data.train_tokens().len().saturating_sub(seq_len);
    if micro * cfg.world > windows {
        return Err(EngineError::InvalidConfig(format!(
            "a batch of {} sequences of {seq_len} tokens is larger than the training data ({windows} windows)",
            micro * cfg.world
        )));
    }
    if cfg.eval_batches > 0 {
        data.val_batches(micro * cfg.world, seq_len, 1)?;
    }
    Ok((seq_len, micro))
}

/// Where a run starts: step 0 and no state without `cfg.resume`, else the
/// step and state `load` (the driver's way of reading the checkpoint in
/// `cfg.resume`) returns. An error when that step is not before the last.
pub(crate) fn resume_point<S>(
    cfg: &RunConfig,
    load: impl FnOnce(&Path) -> Result<(usize, S), EngineError>,
) -> Result<(usize, Option<S>), EngineError> {
    let (start_step, state) = match &cfg.resume {
        Some(dir) => {
            let (step, state) = load(dir)?;
            (step, Some(state))
        }
        None => (0, None),
    };
    if start_step >= cfg.steps {
        return Err(EngineError::InvalidConfig(format!(
            "the checkpoint is at step {start_step}, not before the last step {}",
            cfg.steps
        )));
    }
    Ok((start_step, state))
}

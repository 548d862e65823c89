//! The run's [`Summary`]: losses, mean step time and bytes over the steps,
//! beside the analytic byte model.

use std::collections::BTreeMap;

use crate::engine::bytes::{ByteModel, StepKind};
use crate::metrics::{LinkBytes, StepRecord, Summary};
use crate::model::Model;

use super::config::RunConfig;
use crate::data::DataInfo;

/// The kind of each recorded step, by the engine's rule for qwZ-Δ (every step
/// is full without it): full at the run's first step, at every
/// `refresh_every`-th step, after a skipped step and after a step whose end
/// saved a checkpoint; a difference step otherwise.
pub(crate) fn step_kinds(records: &[StepRecord], cfg: &RunConfig) -> Vec<StepKind> {
    let z = &cfg.engine.zero;
    let Some(every) = z.qwz_delta.filter(|_| z.hpz()).map(|d| d.refresh_every) else {
        return vec![StepKind::Full; records.len()];
    };
    let mut refresh = true;
    records
        .iter()
        .map(|r| {
            let full = refresh || (every > 0 && r.step.is_multiple_of(every));
            let done = r.step + 1;
            let saved = cfg.save.is_some()
                && ((cfg.save_every > 0 && done.is_multiple_of(cfg.save_every)) || done == cfg.steps);
            refresh = r.skipped || saved;
            if full { StepKind::Full } else { StepKind::Delta }
        })
        .collect()
}

/// The analytic bytes per step over the run's steps: each step's kind's model
/// (`analytic` = [full, difference]), summed over the steps and divided once,
/// as the measured bytes are.
fn mean_model(records: &[StepRecord], cfg: &RunConfig, analytic: &[ByteModel; 2]) -> ByteModel {
    let kinds = step_kinds(records, cfg);
    if kinds.iter().all(|&k| k == StepKind::Full) {
        return analytic[0].clone();
    }
    let mut out = ByteModel::default();
    for k in &kinds {
        let m = if *k == StepKind::Full { &analytic[0] } else { &analytic[1] };
        for (op, b) in &m.by_op {
            out.by_op.entry(op.clone()).or_default().add(b);
        }
    }
    let n = kinds.len() as f64;
    for v in out.by_op.values_mut() {
        *v = LinkBytes { intra: v.intra / n, inter: v.inter / n };
    }
    out
}

/// Summarises the step records of a run (the first step is left out of the
/// times when there are more, as it warms up).
pub(crate) fn summarize<M: Model>(
    records: &[StepRecord],
    val_loss: Option<f32>,
    info: &DataInfo,
    cfg: &RunConfig,
    model: &M,
    analytic: &[ByteModel; 2],
) -> Summary {
    let analytic = &mean_model(records, cfg, analytic);
    let n = records.len().max(1) as f64;
    let timed: &[StepRecord] = if records.len() > 1 { &records[1..] } else { records };
    let mean_time = timed.iter().map(|r| r.step_time_s).sum::<f64>() / timed.len().max(1) as f64;
    let tokens_per_s = timed.iter().map(|r| r.tokens_per_s).sum::<f64>() / timed.len().max(1) as f64;
    // Sums over steps, divided once at the end (exact when every step is the same).
    let mut by_op: BTreeMap<String, LinkBytes> = BTreeMap::new();
    let mut total = LinkBytes::default();
    for r in records {
        for (k, v) in &r.bytes_by_op {
            by_op.entry(k.clone()).or_default().add(v);
        }
        total.add(&LinkBytes { intra: r.intra_node_bytes, inter: r.inter_node_bytes });
    }
    for v in by_op.values_mut() {
        *v = LinkBytes { intra: v.intra / n, inter: v.inter / n };
    }
    let total = LinkBytes { intra: total.intra / n, inter: total.inter / n };
    Summary {
        final_loss: records.last().map_or(f32::NAN, |r| r.loss),
        val_loss,
        steps: records.len(),
        skipped_steps: records.iter().filter(|r| r.skipped).count(),
        world: cfg.world,
        local_size: cfg.local_size,
        mode: cfg.engine.zero.label(),
        comm_dtype: cfg.engine.zero.comm_dtype.name().to_string(),
        model: model.name().to_string(),
        params: model.layers().iter().map(|l| l.numel()).sum(),
        entropy_rate: info.entropy_rate,
        mean_step_time_s: mean_time,
        tokens_per_s,
        bytes_per_step: total,
        bytes_by_op: by_op,
        model_bytes_per_step: analytic.total(),
        model_bytes_by_op: analytic.by_op.clone(),
    }
}

/// The mean validation loss over every rank's batches, given per rank in rank
/// order (`None` when none ran). Per-rank sums first, then over the ranks, in
/// f64: both drivers sum in this order, so their losses agree bitwise.
pub(crate) fn mean_val_loss<'a>(ranks: impl Iterator<Item = &'a [f32]>) -> Option<f32> {
    let (mut sum, mut count) = (0.0f64, 0usize);
    for r in ranks {
        sum += r.iter().map(|&v| f64::from(v)).sum::<f64>();
        count += r.len();
    }
    (count > 0).then(|| (sum / count as f64) as f32)
}

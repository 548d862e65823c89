//! The run's [`Summary`]: losses, mean step time and bytes over the steps,
//! beside the analytic byte model.

use std::collections::BTreeMap;

use crate::engine::bytes::ByteModel;
use crate::metrics::{LinkBytes, StepRecord, Summary};
use crate::model::Model;

use super::RunConfig;
use crate::data::DataInfo;

/// Summarises the step records of a run (the first step is left out of the
/// times when there are more, as it warms up).
pub(crate) fn summarize<M: Model>(
    records: &[StepRecord],
    val_loss: Option<f32>,
    info: &DataInfo,
    cfg: &RunConfig,
    model: &M,
    analytic: &ByteModel,
) -> Summary {
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

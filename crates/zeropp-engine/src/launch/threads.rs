//! The thread driver: one OS thread per rank on a [`ThreadCluster`] (simulated
//! nodes), the per-step records aggregated on the calling thread as they arrive.

use std::collections::BTreeMap;
use std::sync::mpsc;

use zeropp_comm::{ThreadCluster, ThreadOptions, Topology};

use crate::EngineError;
use crate::engine::checkpoint;
use crate::metrics::{MetricsWriter, StepRecord};
use crate::model::Model;

use super::aggregate::aggregate;
use super::failure::root_cause;
use super::pool::{on_rank_pool, rank_pool};
use super::preflight::{Prepared, prepare, resume_point};
use super::rank::{RankJob, RankResult, RankStep, run_rank};
use super::report::{TrainReport, Work};
use super::summary::{mean_val_loss, summarize};

/// Trains on the thread backend on the simulated cluster `topo` (see
/// [`super::Launch::run`]).
pub(super) fn run<M: Model>(
    work: Work<'_, M>,
    topo: Topology,
    on_step: &mut dyn FnMut(&StepRecord),
) -> Result<TrainReport, EngineError> {
    let Work { model, data, info, run: cfg } = work;
    let Prepared { seq_len, tokens, plan, analytic } = prepare(&work, topo)?;

    // Resume: read every rank's state before starting the ranks.
    let (start_step, resume_states) = resume_point(cfg, |dir| checkpoint::load(dir, &plan, &cfg.engine))?;

    let mut metrics = match &cfg.metrics {
        Some(p) => Some(MetricsWriter::create(p)?),
        None => None,
    };
    let mut options = ThreadOptions::default().with_timeout(cfg.timeout);
    if let Some(l) = cfg.link {
        options = options.with_link_model(l);
    }
    let cluster = ThreadCluster::new(topo, options);

    let (tx, rx) = mpsc::channel::<RankStep>();
    let mut records = Vec::new();
    let mut pending: BTreeMap<usize, Vec<RankStep>> = BTreeMap::new();
    let mut metrics_err = None;
    let results = std::thread::scope(|scope| {
        let runner = scope.spawn(move || {
            let tx = tx;
            cluster.run_each(|comm| {
                let job = RankJob {
                    model,
                    data,
                    cfg,
                    seq_len,
                    start_step,
                    resume: resume_states.as_ref().and_then(|s| s.get(comm.rank()).cloned()),
                };
                let pool = rank_pool(comm.rank(), cfg.world, zeropp_comm::threads::RANK_STACK);
                let tx = tx.clone();
                on_rank_pool(pool.as_ref(), move || {
                    let sink = |r: RankStep| {
                        // The driver only stops listening once every rank is done.
                        let _ = tx.send(r);
                    };
                    run_rank(comm, &job, &sink)
                })
            })
        });
        for ev in rx {
            let step = ev.step;
            let entry = pending.entry(step).or_default();
            entry.push(ev);
            if entry.len() == cfg.world
                && let Some(mut ranks) = pending.remove(&step)
            {
                ranks.sort_by_key(|r| r.rank);
                let rec = aggregate(step, &ranks, tokens);
                if let Some(m) = metrics.as_mut()
                    && let Err(e) = m.step(&rec)
                {
                    metrics_err.get_or_insert(e);
                }
                on_step(&rec);
                records.push(rec);
            }
        }
        runner.join()
    });
    let results = results.map_err(|_| EngineError::Training("the cluster runner panicked".into()))?;
    let mut ok = Vec::new();
    let mut errors = Vec::new();
    for r in results {
        match r {
            Ok(v) => ok.push(v),
            Err(e) => errors.push(e),
        }
    }
    if !errors.is_empty() {
        return Err(root_cause(errors));
    }
    if let Some(e) = metrics_err {
        return Err(e);
    }
    ok.sort_by_key(|r| r.rank);
    check_skips_agree(&ok)?;

    let val_loss =
        if cfg.eval_batches > 0 { mean_val_loss(ok.iter().map(|r| r.val_losses.as_slice())) } else { None };
    let params = if cfg.keep_params {
        let mut full = Vec::new();
        for l in 0..plan.num_buckets() {
            let shards: Vec<&[f32]> = ok
                .iter()
                .filter_map(|r| r.master.as_ref().and_then(|m| m.get(l)).map(Vec::as_slice))
                .collect();
            let v = plan.gather(l, &shards)?;
            full.push(plan.bucket(l)?.compact(&v)?);
        }
        Some(full)
    } else {
        None
    };
    let summary = summarize(&records, val_loss, info, cfg, model, &analytic);
    if let Some(m) = metrics.as_mut() {
        m.summary(&summary)?;
    }
    Ok(TrainReport { steps: records, summary, params, rank: 0 })
}

/// Every rank takes the same skip decision (one f64 norm exchange); a
/// disagreement would mean ranks applied different updates.
fn check_skips_agree(ranks: &[RankResult]) -> Result<(), EngineError> {
    if let Some(first) = ranks.first()
        && let Some(other) = ranks.iter().find(|r| r.skipped != first.skipped)
    {
        return Err(EngineError::Training(format!(
            "ranks disagree on skipped steps: rank {} skipped {}, rank {} skipped {}",
            first.rank, first.skipped, other.rank, other.skipped
        )));
    }
    Ok(())
}

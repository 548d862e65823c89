//! The training loop of one rank, on any communicator.
//!
//! [`run_rank`] is generic over `C: Communicator + ?Sized`, so every driver
//! runs the same loop: the thread driver ([`super::threads`]) on a
//! `ThreadComm`, the MPI driver (`mpi`) on an `MpiComm`. Each step's
//! [`RankStep`] goes to the driver out of band (no traffic on the engine's
//! counters), which aggregates them ([`super::aggregate`]).

use std::time::Instant;

use zeropp_comm::{Communicator, TrafficSnapshot};

use crate::EngineError;
use crate::data::{TextDataset, shard};
use crate::engine::checkpoint::{self, RankState};
use crate::engine::{Inject, Prefetcher, ZeroEngine};
use crate::model::{Batch, Model};

use super::config::{Faults, RunConfig};

/// What one rank reports after each step (sent out of band to the driver).
#[derive(Debug, Clone)]
pub(crate) struct RankStep {
    /// The rank.
    pub(crate) rank: usize,
    /// Step index.
    pub(crate) step: usize,
    /// This rank's mean loss.
    pub(crate) loss: f32,
    /// Global gradient norm.
    pub(crate) grad_norm: f32,
    /// Whether the step was skipped.
    pub(crate) skipped: bool,
    /// Wall time of the step on this rank.
    pub(crate) time_s: f64,
    /// This rank's traffic during the step (main and prefetch streams).
    pub(crate) traffic: TrafficSnapshot,
    /// Where the step's time went on this rank.
    pub(crate) times: crate::engine::StepTimes,
    /// Gathers this rank prefetched in the step.
    pub(crate) prefetched: usize,
}

/// What one rank returns at the end of the run.
#[derive(Debug, Clone)]
pub(crate) struct RankResult {
    /// The rank.
    pub(crate) rank: usize,
    /// Mean loss of each validation batch (this rank's share).
    pub(crate) val_losses: Vec<f32>,
    /// Final master shards (when requested).
    pub(crate) master: Option<Vec<Vec<f32>>>,
    /// Steps skipped.
    pub(crate) skipped: usize,
}

/// Everything a rank needs besides its communicator.
#[derive(Debug)]
pub(crate) struct RankJob<'a, M: Model> {
    /// The model.
    pub(crate) model: &'a M,
    /// The dataset.
    pub(crate) data: &'a TextDataset,
    /// The run's configuration.
    pub(crate) cfg: &'a RunConfig,
    /// Sequence length.
    pub(crate) seq_len: usize,
    /// First step to run (after a resume).
    pub(crate) start_step: usize,
    /// State to resume from: per-layer master shards, optimizer states, steps, skipped.
    pub(crate) resume: Option<RankState>,
}

/// The traffic of `comm` and of the prefetcher's stream, merged.
fn traffic<C: Communicator + ?Sized>(
    comm: &C,
    prefetch: Option<&Prefetcher>,
) -> Result<TrafficSnapshot, EngineError> {
    let mut all = comm.traffic().snapshot();
    if let Some(p) = prefetch {
        all.merge(&p.traffic()?);
    }
    Ok(all)
}

/// The fault `cfg` injects into `rank` at `step`, if any.
fn injected(faults: Faults, rank: usize, step: usize) -> Inject {
    match faults {
        Faults { fail: Some((r, s)), .. } if r == rank && s == step => Inject::FailMidStep,
        Faults { nan_gradient: Some((r, s)), .. } if r == rank && s == step => Inject::NanGradient,
        _ => Inject::None,
    }
}

/// The training loop of one rank, on any communicator: steps `start_step..steps`,
/// optional checkpoints, then validation. `report` receives one [`RankStep`] per step.
pub(crate) fn run_rank<M: Model, C: Communicator + ?Sized>(
    comm: &mut C,
    job: &RankJob<'_, M>,
    report: &dyn Fn(RankStep),
) -> Result<RankResult, EngineError> {
    let cfg = job.cfg;
    let rank = comm.rank();
    let topo = *comm.topology();
    let world = topo.world();
    let ecfg = &cfg.engine;
    let micro = ecfg.micro_batch(world)?;
    let mut engine = ZeroEngine::new(job.model, ecfg, topo, rank)?;
    if let Some(state) = &job.resume {
        engine.restore(state)?;
    }
    let mut prefetch = if ecfg.zero.prefetch { Some(Prefetcher::new(comm)?) } else { None };
    for step in job.start_step..cfg.steps {
        // Every rank draws the same global batches and keeps its shard.
        let mut micro_batches = Vec::with_capacity(ecfg.grad_accum);
        for m in 0..ecfg.grad_accum {
            let global = job.data.global_batch(step as u64, m, micro * world, job.seq_len, ecfg.seed)?;
            micro_batches.push(shard(&global, rank, world)?);
        }
        engine.inject_fault(injected(cfg.faults, rank, step));
        let before = traffic(comm, prefetch.as_ref())?;
        let t0 = Instant::now();
        let out = engine.train_step(comm, prefetch.as_mut(), &micro_batches)?;
        let time_s = t0.elapsed().as_secs_f64();
        let after = traffic(comm, prefetch.as_ref())?;
        report(RankStep {
            rank,
            step,
            loss: out.loss,
            grad_norm: out.grad_norm,
            skipped: out.skipped,
            time_s,
            traffic: after.since(&before),
            times: out.times,
            prefetched: out.prefetched,
        });
        let done = step + 1;
        if let Some(dir) = &cfg.save
            && ((cfg.save_every > 0 && done.is_multiple_of(cfg.save_every)) || done == cfg.steps)
        {
            checkpoint::save(comm, &engine, dir, done, &cfg.engine)?;
            // qwZ-Δ: the next step refreshes, as a run resumed from here will.
            engine.note_checkpoint();
        }
    }
    let mut val_losses = Vec::new();
    if cfg.eval_batches > 0 {
        let vb = job.data.val_batches(micro * world, job.seq_len, cfg.eval_batches)?;
        for b in &vb {
            let mine: Batch = shard(b, rank, world)?;
            val_losses.push(engine.evaluate(comm, prefetch.as_mut(), &mine)?);
        }
    }
    if let Some(p) = prefetch.take() {
        p.shutdown()?;
    }
    Ok(RankResult {
        rank,
        val_losses,
        master: cfg.keep_params.then(|| engine.master_shards().to_vec()),
        skipped: engine.skipped_steps(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn faults_hit_only_their_rank_and_step() {
        let f = Faults { fail: Some((1, 2)), nan_gradient: Some((3, 0)) };
        assert_eq!(injected(f, 1, 2), Inject::FailMidStep);
        assert_eq!(injected(f, 3, 0), Inject::NanGradient);
        assert_eq!(injected(f, 1, 0), Inject::None);
        assert_eq!(injected(f, 0, 2), Inject::None);
        assert_eq!(injected(Faults::default(), 0, 0), Inject::None);
    }
}

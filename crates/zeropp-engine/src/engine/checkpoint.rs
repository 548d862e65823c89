//! Sharded checkpoints of the engine, on top of `zeropp_partition::checkpoint`.
//!
//! Save (collective): every rank writes its primary state (f32 master shard,
//! AdamW moments and update count per layer) with `write_shard`; the records
//! (size, crc32c) are all-gathered (tag `checkpoint`, outside the step
//! metrics); rank 0 commits the manifest and moves `LATEST`; rank 0's outcome is
//! broadcast so every rank fails if the commit failed. hpZ secondary shards are
//! never saved: they are rebuilt at the next forward gather.
//!
//! Load: [`load`] consolidates the checkpoint and cuts every rank's state for
//! the current plan (any world size, local size or hpZ size).

use std::path::Path;

use zeropp_comm::{CommExt, Communicator, Group};
use zeropp_partition::checkpoint::shard_file_name;
use zeropp_partition::{
    BucketShard, Manifest, PartitionPlan, ShardRecord, ShardState, commit_checkpoint, load_checkpoint,
    write_shard,
};

use super::ZeroEngine;
use crate::EngineError;
use crate::config::EngineConfig;
use crate::model::Model;
use crate::optim::AdamW;

/// One rank's restorable state.
#[derive(Debug, Clone, PartialEq)]
pub struct RankState {
    /// Master shard of every layer.
    pub master: Vec<Vec<f32>>,
    /// AdamW state of every layer's shard.
    pub optim: Vec<AdamW>,
    /// Training steps done.
    pub steps: usize,
    /// Steps skipped so far.
    pub skipped: usize,
    /// The qgZ error-feedback residuals of every layer `(hop 1, hop 2)`, when the
    /// checkpoint has them and the topology is the one they were saved on.
    pub feedback: Option<Vec<(Vec<f32>, Vec<f32>)>>,
}

/// The checkpoint extra holding reduce call `l`'s hop-`hop` qgZ residual (one call
/// per bucket unless `reduce_bucket_size` splits them).
fn feedback_key(l: usize, hop: u8) -> String {
    format!("qgz_feedback.{l}.hop{hop}")
}

/// Saves the checkpoint of training step `step` (steps done) into `dir` (collective).
pub fn save<M: Model, C: Communicator + ?Sized, U: serde::Serialize>(
    comm: &mut C,
    engine: &ZeroEngine<'_, M>,
    dir: &Path,
    step: usize,
    user_config: &U,
) -> Result<(), EngineError> {
    let rank = comm.rank();
    let plan = engine.plan();
    let state = ShardState {
        buckets: engine
            .master_shards()
            .iter()
            .zip(engine.optimizer_states())
            .map(|(m, o)| BucketShard {
                master: m.clone(),
                exp_avg: o.m().to_vec(),
                exp_avg_sq: o.v().to_vec(),
                step: o.steps(),
            })
            .collect(),
        extra: engine
            .feedback_state()
            .into_iter()
            .enumerate()
            .flat_map(|(l, (h1, h2))| [(feedback_key(l, 1), h1.to_vec()), (feedback_key(l, 2), h2.to_vec())])
            .collect(),
    };
    let written = write_shard(dir, plan, step as u64, rank, &state);
    // Exchange (ok, size, crc) so rank 0 can commit, and everyone learns of failures.
    let mine: [u64; 3] = match &written {
        Ok(r) => [1, r.size, u64::from(r.crc32c)],
        Err(_) => [0, 0, 0],
    };
    let world = Group::world(comm.topology());
    comm.set_op("checkpoint");
    let mut all = vec![0u64; 3 * world.size()];
    comm.all_gather(&world, &mine, &mut all)?;
    written?;
    if let Some(r) = all.chunks(3).position(|c| c[0] == 0) {
        comm.set_op("other");
        return Err(EngineError::Checkpoint(format!("rank {r} could not write its checkpoint shard")));
    }
    let mut status = [1u8];
    let mut commit_err = None;
    if rank == 0 {
        let records = all
            .chunks(3)
            .enumerate()
            .map(|(r, c)| ShardRecord {
                rank: r,
                file: shard_file_name(r, world.size()),
                size: c[1],
                crc32c: c[2] as u32,
            })
            .collect();
        let res = match serde_json::to_value(user_config) {
            Ok(cfg) => {
                let meta = serde_json::json!({ "engine": cfg, "skipped": engine.skipped_steps() });
                // Every rank saves the same extras (the residuals of every layer).
                let extras = vec![state.extra_lens(); world.size()];
                Manifest::new(plan, step as u64, meta, records)
                    .and_then(|m| m.with_extras(extras))
                    .and_then(|m| commit_checkpoint(dir, &m))
                    .map_err(EngineError::from)
            }
            Err(source) => Err(EngineError::Json { what: "the configuration cannot be saved", source }),
        };
        if let Err(e) = res {
            status[0] = 0;
            commit_err = Some(e);
        }
    }
    comm.broadcast(&world, 0, &mut status)?;
    comm.set_op("other");
    if let Some(e) = commit_err {
        return Err(e);
    }
    if status[0] == 0 {
        return Err(EngineError::Checkpoint("rank 0 could not commit the checkpoint".into()));
    }
    Ok(())
}

/// Loads the checkpoint in `dir` (a checkpoint folder or a parent with `LATEST`)
/// and returns the training steps done and every rank's state under `plan`.
pub fn load(
    dir: &Path,
    plan: &PartitionPlan,
    cfg: &EngineConfig,
) -> Result<(usize, Vec<RankState>), EngineError> {
    let ckpt = load_checkpoint(dir)?;
    let steps = ckpt.step() as usize;
    // A checkpoint without the count (not written by `save`) starts it at zero;
    // one that holds something else than a count is corrupt, not silently zero.
    let skipped = match ckpt.user_config().get("skipped") {
        None => 0,
        Some(v) => v.as_u64().and_then(|n| usize::try_from(n).ok()).ok_or_else(|| {
            EngineError::Checkpoint(format!("the manifest's `skipped` is not a step count: {v}"))
        })?,
    };
    let mut out = Vec::with_capacity(plan.world());
    if ckpt.has_extras() && ckpt.extras_dropped(plan) {
        eprintln!(
            "warning: the checkpoint's qgZ error-feedback residuals were saved on another topology or layout; \
             they start from zero"
        );
    }
    for r in 0..plan.world() {
        let s = ckpt.shard_for(plan, r)?;
        // One residual pair per reduce call (per bucket, or per piece with
        // `reduce_bucket_size`), numbered from 0.
        let feedback: Vec<_> = (0..)
            .map_while(|l| {
                Some((s.extra.get(&feedback_key(l, 1))?.clone(), s.extra.get(&feedback_key(l, 2))?.clone()))
            })
            .collect();
        let feedback = (!feedback.is_empty()).then_some(feedback);
        let mut master = Vec::new();
        let mut optim = Vec::new();
        for b in s.buckets {
            optim.push(AdamW::from_state(cfg.optim, b.step, b.exp_avg, b.exp_avg_sq)?);
            master.push(b.master);
        }
        out.push(RankState { master, optim, steps, skipped, feedback });
    }
    Ok((steps, out))
}

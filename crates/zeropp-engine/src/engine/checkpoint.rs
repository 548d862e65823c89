//! Sharded checkpoints of the engine, on top of `zeropp_partition::checkpoint`.
//!
//! Save (collective): every rank writes its primary state (f32 master shard,
//! AdamW moments and update count per layer) with `write_shard`; the records
//! (size, crc32c) are all-gathered (tag `checkpoint`, outside the step
//! metrics); rank 0 commits the manifest and moves `LATEST`; rank 0's outcome is
//! broadcast so every rank fails if the commit failed. hpZ secondary shards are
//! never saved: they are rebuilt at the next forward gather.
//!
//! Load: [`load`] (every rank's state, for the thread driver) and [`load_rank`]
//! (one rank's, for a process of an MPI job) read the checkpoint with a
//! streaming `CheckpointReader`: each rank's state for the current plan (any
//! world size, local size or hpZ size) is read shard by shard from the saved
//! files that overlap it, without consolidating the model.

use std::path::Path;

use zeropp_comm::{CommExt, Communicator, Group};
use zeropp_partition::checkpoint::shard_file_name;
use zeropp_partition::{
    BucketShard, CheckpointReader, Manifest, PartitionPlan, ShardRecord, ShardState, commit_checkpoint,
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
    let reader = open(dir, plan, true)?;
    // Every rank's state in one pass over the shard files.
    let ranks: Vec<usize> = (0..plan.world()).collect();
    let out = reader
        .shards_for(plan, &ranks)?
        .into_iter()
        .map(|s| rank_state(&reader, cfg, s))
        .collect::<Result<Vec<_>, _>>()?;
    Ok((reader.step() as usize, out))
}

/// Loads `rank`'s state under `plan` only, reading just the saved shards
/// that overlap it (one process of a multi-process job); returns the
/// training steps done with it. Only rank 0 warns about dropped residuals.
pub fn load_rank(
    dir: &Path,
    plan: &PartitionPlan,
    cfg: &EngineConfig,
    rank: usize,
) -> Result<(usize, RankState), EngineError> {
    let reader = open(dir, plan, rank == 0)?;
    let state = rank_state(&reader, cfg, reader.shard_for(plan, rank)?)?;
    Ok((reader.step() as usize, state))
}

/// [`load_rank`] on every rank of `comm` (collective: every rank calls it).
/// Each rank reads only the shard files its state overlaps, so a corrupt file
/// fails only the ranks that read it; the ranks then exchange success (tag
/// `checkpoint`, outside the step metrics) and all fail alike, each naming the
/// first rank that could not load (the failing ranks with their own error).
pub fn load_rank_collective<C: Communicator + ?Sized>(
    comm: &mut C,
    dir: &Path,
    plan: &PartitionPlan,
    cfg: &EngineConfig,
) -> Result<(usize, RankState), EngineError> {
    let loaded = load_rank(dir, plan, cfg, comm.rank());
    let mine = [u64::from(loaded.is_ok())];
    let world = Group::world(comm.topology());
    comm.set_op("checkpoint");
    let mut all = vec![0u64; world.size()];
    let gathered = comm.all_gather(&world, &mine, &mut all);
    comm.set_op("other");
    let loaded = loaded?;
    gathered?;
    if let Some(r) = all.iter().position(|&ok| ok == 0) {
        return Err(EngineError::Checkpoint(format!("rank {r} could not load its checkpoint state")));
    }
    Ok(loaded)
}

/// Opens the checkpoint for streaming; warns (if `warn`) when its qgZ
/// residuals cannot follow onto `plan`.
fn open(dir: &Path, plan: &PartitionPlan, warn: bool) -> Result<CheckpointReader, EngineError> {
    let reader = CheckpointReader::open(dir)?;
    if warn && reader.has_extras() && reader.extras_dropped(plan) {
        eprintln!(
            "warning: the checkpoint's qgZ error-feedback residuals were saved on another topology or layout; \
             they start from zero"
        );
    }
    Ok(reader)
}

/// The engine's state of a rank from its checkpoint state `s`.
fn rank_state(
    reader: &CheckpointReader,
    cfg: &EngineConfig,
    s: ShardState,
) -> Result<RankState, EngineError> {
    let steps = reader.step() as usize;
    // A checkpoint without the count (not written by `save`) starts it at zero;
    // one that holds something else than a count is corrupt, not silently zero.
    let skipped = match reader.user_config().get("skipped") {
        None => 0,
        Some(v) => v.as_u64().and_then(|n| usize::try_from(n).ok()).ok_or_else(|| {
            EngineError::Checkpoint(format!("the manifest's `skipped` is not a step count: {v}"))
        })?,
    };
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
    Ok(RankState { master, optim, steps, skipped, feedback })
}

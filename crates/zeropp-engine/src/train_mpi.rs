//! The MPI training driver behind `zeropp train --backend mpi` (feature `mpi`).
//!
//! Each MPI process is one rank: [`train_mpi`] runs the same per-rank loop as the
//! thread backend (the crate-private `train::rank` module) on an [`MpiComm`], so with the default
//! [`Reduction::Ordered`](zeropp_comm::mpi::Reduction::Ordered) the losses, norms and
//! byte counters equal those of `--backend threads` with the same world and node size.
//!
//! The per-step records of every rank are gathered to all ranks on a
//! private duplicate of the world communicator (after each step, outside the timed
//! region and outside the engine's traffic counters), and aggregated exactly as the
//! thread driver does; only rank 0 writes the metrics file and receives the report.
//!
//! Errors are returned on the failing rank only; the caller must end the job with
//! [`or_abort`] (or [`zeropp_comm::mpi::abort`]) so its peers never wait forever.

use std::cell::RefCell;

pub use zeropp_comm::mpi::{LOCAL_SIZE_ENV, MpiComm, MpiOptions, or_abort};
use zeropp_comm::{CommExt, Communicator, Group, OpTraffic, TrafficSnapshot};

use crate::EngineError;
use crate::data::TextDataset;
use crate::engine::{build_plan, bytes::step_bytes};
use crate::metrics::{MetricsWriter, StepRecord};
use crate::model::{Gpt, Mlp, Model};
use crate::train::aggregate::aggregate;
use crate::train::preflight::{check_run, resume_point};
use crate::train::rank::{RankJob, RankStep, run_rank};
use crate::train::summary::summarize;
use crate::train::{Backend, DataInfo, ModelChoice, TrainConfig, TrainReport, load_data};

/// Trains as configured with this process as one rank of `comm`'s world
/// (collective over the MPI world: every rank must call it with the same `cfg`).
///
/// `cfg.world` and `cfg.local_size` must equal `comm`'s topology, and
/// `cfg.backend` must be [`Backend::Mpi`]. `on_step` is called on rank 0 only,
/// after every step, with the record aggregated over all ranks. Rank 0 writes
/// `cfg.metrics` and returns `Some(report)`; the other ranks return `None`.
/// `cfg.keep_params` is not supported (the report's `params` is `None`).
pub fn train_mpi(
    comm: &mut MpiComm,
    cfg: &TrainConfig,
    on_step: &mut dyn FnMut(&StepRecord),
) -> Result<Option<TrainReport>, EngineError> {
    check_mpi_job(comm, cfg)?;
    let (data, info) = load_data(&cfg.data)?;
    match &cfg.model {
        ModelChoice::Gpt(g) => {
            let model = Gpt::new(g.with_vocab(data.vocab_size()))?;
            run_model_mpi(comm, &model, &data, &info, cfg, on_step)
        }
        ModelChoice::Mlp(m) => {
            let model = Mlp::new(m.with_vocab(data.vocab_size()))?;
            run_model_mpi(comm, &model, &data, &info, cfg, on_step)
        }
    }
}

/// [`train_mpi`] for a model and data of your own (see
/// [`crate::train::train_model`]; `cfg.model` and `cfg.data` are not read):
/// the same per-rank loop, so a model trains under `mpirun` exactly as on the
/// thread backend. Collective over the MPI world; rank 0 returns the report.
pub fn train_model_mpi<M: Model>(
    comm: &mut MpiComm,
    model: &M,
    data: &TextDataset,
    cfg: &TrainConfig,
    on_step: &mut dyn FnMut(&StepRecord),
) -> Result<Option<TrainReport>, EngineError> {
    check_mpi_job(comm, cfg)?;
    let info = DataInfo::of(data, crate::train::describe_tokens(data));
    run_model_mpi(comm, model, data, &info, cfg, on_step)
}

/// `cfg` asks for the MPI backend and for this job's world and node size.
fn check_mpi_job(comm: &MpiComm, cfg: &TrainConfig) -> Result<(), EngineError> {
    if cfg.backend != Backend::Mpi {
        return Err(EngineError::InvalidConfig("train_mpi needs backend = Backend::Mpi".into()));
    }
    let topo = *comm.topology();
    if cfg.world != topo.world() || cfg.local_size != topo.local_size() {
        return Err(EngineError::InvalidConfig(format!(
            "the configuration asks for {} ranks in nodes of {}, the MPI job has {} ranks in nodes of {}",
            cfg.world,
            cfg.local_size,
            topo.world(),
            topo.local_size()
        )));
    }
    Ok(())
}

/// The per-rank records of one step, gathered from every rank on a side communicator.
struct StepGather {
    side: MpiComm,
    world: Group,
    /// The first error of the gathers or of the metrics file (reported after the run).
    error: Option<EngineError>,
}

impl StepGather {
    /// Gathers `mine` from every rank (in rank order); collective over the world.
    fn gather(&mut self, mine: &RankStep) -> Result<Vec<RankStep>, EngineError> {
        let bytes = encode(mine);
        let n = self.world.size();
        let mut lens = vec![0u64; n];
        self.side.all_gather(&self.world, &[bytes.len() as u64], &mut lens)?;
        let max = lens.iter().copied().max().unwrap_or(0) as usize;
        let mut padded = bytes;
        padded.resize(max, 0);
        let mut all = vec![0u8; max * n];
        self.side.all_gather_bytes(&self.world, &padded, &mut all)?;
        all.chunks(max.max(1))
            .zip(&lens)
            .map(|(chunk, &len)| decode(chunk.get(..len as usize).unwrap_or(chunk)))
            .collect()
    }
}

fn put(out: &mut Vec<u8>, v: u64) {
    out.extend_from_slice(&v.to_le_bytes());
}

/// Encodes a [`RankStep`] (floats as bits, so the round trip is exact).
fn encode(r: &RankStep) -> Vec<u8> {
    let mut out = Vec::with_capacity(64 + r.traffic.by_op.len() * 96);
    put(&mut out, r.rank as u64);
    put(&mut out, r.step as u64);
    put(&mut out, u64::from(r.loss.to_bits()));
    put(&mut out, u64::from(r.grad_norm.to_bits()));
    put(&mut out, u64::from(r.skipped));
    put(&mut out, r.time_s.to_bits());
    put(&mut out, r.traffic.by_op.len() as u64);
    for (tag, op) in &r.traffic.by_op {
        put(&mut out, tag.len() as u64);
        out.extend_from_slice(tag.as_bytes());
        for c in [&op.intra, &op.inter] {
            for v in [c.bytes_sent, c.bytes_received, c.messages_sent, c.messages_received] {
                put(&mut out, v);
            }
        }
    }
    out
}

/// A bounds-checked reader over an encoded [`RankStep`].
struct Reader<'a>(&'a [u8]);

impl<'a> Reader<'a> {
    fn bytes(&mut self, n: usize) -> Result<&'a [u8], EngineError> {
        if n > self.0.len() {
            return Err(EngineError::Training("malformed step record from a peer rank".into()));
        }
        let (a, b) = self.0.split_at(n);
        self.0 = b;
        Ok(a)
    }

    fn u64(&mut self) -> Result<u64, EngineError> {
        let mut a = [0u8; 8];
        a.copy_from_slice(self.bytes(8)?);
        Ok(u64::from_le_bytes(a))
    }

    fn f32(&mut self) -> Result<f32, EngineError> {
        let v = self.u64()?;
        u32::try_from(v)
            .map(f32::from_bits)
            .map_err(|_| EngineError::Training("malformed step record from a peer rank".into()))
    }
}

/// Decodes what [`encode`] wrote.
fn decode(bytes: &[u8]) -> Result<RankStep, EngineError> {
    let mut r = Reader(bytes);
    let rank = r.u64()? as usize;
    let step = r.u64()? as usize;
    let loss = r.f32()?;
    let grad_norm = r.f32()?;
    let skipped = r.u64()? != 0;
    let time_s = f64::from_bits(r.u64()?);
    let ops = r.u64()?;
    let mut traffic = TrafficSnapshot::default();
    for _ in 0..ops {
        let len = r.u64()? as usize;
        let tag = String::from_utf8(r.bytes(len)?.to_vec())
            .map_err(|_| EngineError::Training("malformed step record from a peer rank".into()))?;
        let mut op = OpTraffic::default();
        for c in [&mut op.intra, &mut op.inter] {
            c.bytes_sent = r.u64()?;
            c.bytes_received = r.u64()?;
            c.messages_sent = r.u64()?;
            c.messages_received = r.u64()?;
        }
        traffic.by_op.insert(tag, op);
    }
    // The time split and the prefetch count stay on their rank under MPI.
    Ok(RankStep {
        rank,
        step,
        loss,
        grad_norm,
        skipped,
        time_s,
        traffic,
        times: Default::default(),
        prefetched: 0,
    })
}

/// Trains `model` on `data` with this process as one rank (see [`train_mpi`]).
fn run_model_mpi<M: Model>(
    comm: &mut MpiComm,
    model: &M,
    data: &TextDataset,
    info: &DataInfo,
    cfg: &TrainConfig,
    on_step: &mut dyn FnMut(&StepRecord),
) -> Result<Option<TrainReport>, EngineError> {
    // The same checks as the thread driver, on every rank (they all fail alike).
    let (seq_len, micro) = check_run(model, data, cfg)?;
    let topo = *comm.topology();
    let rank = comm.rank();
    let plan = build_plan(model, &cfg.engine, topo)?;
    let analytic = step_bytes(&plan, &cfg.engine, cfg.engine.grad_accum)?;

    // Resume: every rank reads only its own state from the checkpoint; all fail
    // together if one cannot.
    let (start_step, resume) = resume_point(cfg, |dir| {
        crate::engine::checkpoint::load_rank_collective(comm, dir, &plan, &cfg.engine)
    })?;
    let mut metrics = match (&cfg.metrics, rank) {
        (Some(p), 0) => Some(MetricsWriter::create(p)?),
        _ => None,
    };
    let tokens = micro * cfg.world * cfg.engine.grad_accum * seq_len;

    let world = Group::world(&topo);
    let side = comm.split_stream()?;
    let gather = RefCell::new(StepGather { side, world: world.clone(), error: None });
    let records = RefCell::new(Vec::new());
    let on_step = RefCell::new(on_step);
    let metrics_cell = RefCell::new(metrics.as_mut());
    let sink = |r: RankStep| {
        let mut g = gather.borrow_mut();
        if g.error.is_some() {
            return;
        }
        match g.gather(&r) {
            Ok(mut ranks) => {
                if rank != 0 {
                    return;
                }
                ranks.sort_by_key(|x| x.rank);
                let rec = aggregate(r.step, &ranks, tokens);
                if let Some(m) = metrics_cell.borrow_mut().as_mut()
                    && let Err(e) = m.step(&rec)
                {
                    g.error.get_or_insert(e);
                }
                (on_step.borrow_mut())(&rec);
                records.borrow_mut().push(rec);
            }
            Err(e) => {
                g.error.get_or_insert(e);
            }
        }
    };
    let job = RankJob { model, data, cfg, seq_len, start_step, resume };
    let result = run_rank(comm, &job, &sink)?;
    let mut gather = gather.into_inner();
    if let Some(e) = gather.error.take() {
        return Err(e);
    }

    // Validation losses of every rank, summed as the thread driver does.
    let n = result.val_losses.len();
    let mut all_val = vec![0f32; n * world.size()];
    gather.side.all_gather(&world, &result.val_losses, &mut all_val)?;
    drop(gather);
    if rank != 0 {
        return Ok(None);
    }
    let val_loss = if cfg.eval_batches > 0 && n > 0 {
        let mut sum = 0.0f64;
        for r in all_val.chunks(n) {
            sum += r.iter().map(|&v| f64::from(v)).sum::<f64>();
        }
        Some((sum / (n * world.size()) as f64) as f32)
    } else {
        None
    };
    let records = records.into_inner();
    let summary = summarize(&records, val_loss, info, cfg, model, &analytic);
    if let Some(m) = metrics.as_mut() {
        m.summary(&summary)?;
    }
    Ok(Some(TrainReport { steps: records, summary, params: None }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn step_records_round_trip() -> Result<(), EngineError> {
        let mut traffic = TrafficSnapshot::default();
        let mut op = OpTraffic::default();
        op.intra.bytes_sent = 7;
        op.inter.messages_received = 3;
        traffic.by_op.insert("fwd_gather".into(), op);
        let r = RankStep {
            rank: 5,
            step: 9,
            loss: 1.234_567,
            grad_norm: f32::NAN,
            skipped: true,
            time_s: 0.25,
            traffic,
            times: Default::default(),
            prefetched: 0,
        };
        let back = decode(&encode(&r))?;
        assert_eq!((back.rank, back.step, back.skipped), (5, 9, true));
        assert_eq!(back.loss.to_bits(), r.loss.to_bits());
        assert_eq!(back.grad_norm.to_bits(), r.grad_norm.to_bits());
        assert_eq!(back.time_s, r.time_s);
        assert_eq!(back.traffic, r.traffic);
        assert!(decode(&encode(&r)[..20]).is_err());
        Ok(())
    }
}

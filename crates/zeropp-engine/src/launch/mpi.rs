//! The MPI driver behind [`Launch::run`](super::Launch::run) (feature `mpi`):
//! this process is one rank of the MPI job.
//!
//! It runs the same per-rank loop as the thread driver (`rank`) on an
//! [`MpiComm`], so with the default
//! [`Reduction::Ordered`](zeropp_comm::mpi::Reduction::Ordered) the losses, norms
//! and byte counters equal those of the thread backend with the same world and
//! node size.
//!
//! The per-step records of every rank are gathered to all ranks on a private
//! duplicate of the world communicator (after each step, outside the timed region
//! and outside the engine's traffic counters) and aggregated exactly as the thread
//! driver does, so every rank returns the report; only rank 0 writes the metrics
//! file and calls `on_step`. Once the job is up, an error on any rank ends the job
//! through `MPI_Abort`, and rank 0's watchdog ends it when no step completes
//! within [`RunConfig::timeout`] (MPI itself never times out).

use std::cell::RefCell;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use zeropp_comm::mpi::{MpiComm, MpiOptions};
use zeropp_comm::{CommExt, Communicator, Group, OpTraffic, TrafficSnapshot};

use crate::EngineError;
use crate::metrics::{MetricsWriter, StepRecord};
use crate::model::Model;

use super::aggregate::aggregate;
use super::config::Backend;
use super::detect::Job;
use super::pool::{cores, threads_per_rank};
use super::preflight::{Prepared, prepare, resume_point};
use super::rank::{RankJob, RankStep, run_rank};
use super::report::{Started, TrainReport, Work};
use super::summary::{mean_val_loss, summarize};

/// Trains `model` on `data` with this process as one rank of the MPI job: MPI
/// starts, the job's world and node size replace `run`'s, and any error from
/// then on aborts the job (see the module docs).
pub(super) fn run<M: Model>(
    work: Work<'_, M>,
    job: Option<Job>,
    node_size: Option<usize>,
    on_start: &mut dyn FnMut(&Started),
    on_step: &mut dyn FnMut(&StepRecord),
) -> Result<TrainReport, EngineError> {
    let mut comm = MpiComm::init(MpiOptions { local_size: node_size, ..MpiOptions::default() })?;
    let rank = comm.rank();
    let result = (|| {
        let topo = *comm.topology();
        if let Some(j) = &job
            && j.world != topo.world()
        {
            return Err(EngineError::InvalidConfig(format!(
                "{} started {} processes, but MPI sees a world of {}: the MPI library does not talk \
                 to this launcher (under Slurm, try `srun --mpi=pmix`, or start with `mpirun`)",
                j.launcher,
                j.world,
                topo.world()
            )));
        }
        let run = work.run.on_job(topo.world(), topo.local_size());
        let on_host = job.as_ref().and_then(|j| j.local_size).unwrap_or(topo.local_size());
        size_thread_pool(&|k| std::env::var_os(k), on_host);
        on_start(&Started {
            backend: Backend::Mpi,
            rank,
            topology: topo,
            job: job.clone(),
            mpi_thread_level: Some(comm.thread_level().to_string()),
            threads: rayon::current_num_threads(),
        });
        let watchdog = (rank == 0).then(|| Watchdog::start(run.timeout.max(Duration::from_secs(1))));
        let mut progress = |r: &StepRecord| {
            if let Some(w) = &watchdog {
                w.progress();
            }
            on_step(r);
        };
        let report = run_rank_mpi(&mut comm, Work { run: &run, ..work }, &mut progress);
        if let Some(w) = &watchdog {
            w.stop();
        }
        report
    })();
    match result {
        Ok(r) => Ok(r),
        Err(e) => comm.abort(1, &format!("zeropp: rank {rank} failed: {e}")),
    }
}

/// Builds rayon's global pool with [`threads_per_rank`] threads, before the first
/// parallel loop would build it with one thread per core. (If something in this
/// process built it already, that pool stays: its size is what `Started` reports.)
fn size_thread_pool(env: &dyn Fn(&str) -> Option<std::ffi::OsString>, ranks_on_host: usize) {
    if let Some(n) = threads_per_rank(env, cores(), ranks_on_host) {
        let _already_built = rayon::ThreadPoolBuilder::new().num_threads(n).build_global();
    }
}

/// Rank 0's watchdog: when no step completes within its limit (a peer rank or the
/// link to it went silent), it ends the job through `MPI_Abort` with a message
/// that says so.
struct Watchdog {
    last: Arc<Mutex<Option<Instant>>>,
}

impl Watchdog {
    fn start(limit: Duration) -> Self {
        let last = Arc::new(Mutex::new(Some(Instant::now())));
        let seen = Arc::clone(&last);
        std::thread::spawn(move || {
            loop {
                std::thread::sleep(Duration::from_millis(200));
                let since = match *seen.lock().unwrap_or_else(PoisonError::into_inner) {
                    Some(t) => t.elapsed(),
                    None => return,
                };
                if since > limit {
                    zeropp_comm::mpi::abort(
                        3,
                        &format!(
                            "no training step completed for {} s (the run's timeout): a peer rank \
                             or the network between the nodes is gone",
                            limit.as_secs()
                        ),
                    );
                }
            }
        });
        Self { last }
    }

    fn set(&self, v: Option<Instant>) {
        *self.last.lock().unwrap_or_else(PoisonError::into_inner) = v;
    }

    fn progress(&self) {
        self.set(Some(Instant::now()));
    }

    fn stop(&self) {
        self.set(None);
    }
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
    let t = &r.times;
    for v in [t.compute_s, t.comm_s, t.quant_s, t.optim_s] {
        put(&mut out, v.to_bits());
    }
    put(&mut out, r.prefetched as u64);
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
    let mut split = [0.0f64; 4];
    for v in &mut split {
        *v = f64::from_bits(r.u64()?);
    }
    let [compute_s, comm_s, quant_s, optim_s] = split;
    let times = crate::engine::StepTimes { compute_s, comm_s, quant_s, optim_s };
    let prefetched = r.u64()? as usize;
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
    Ok(RankStep { rank, step, loss, grad_norm, skipped, time_s, traffic, times, prefetched })
}

/// The run on this rank, once the job is up: the per-rank loop, the step
/// records gathered to every rank, validation, the report.
fn run_rank_mpi<M: Model>(
    comm: &mut MpiComm,
    work: Work<'_, M>,
    on_step: &mut dyn FnMut(&StepRecord),
) -> Result<TrainReport, EngineError> {
    let Work { model, data, info, run: cfg } = work;
    let topo = *comm.topology();
    let rank = comm.rank();
    // The same checks as the thread driver, on every rank (they all fail alike).
    let Prepared { seq_len, tokens, plan, analytic } = prepare(&work, topo)?;

    // Resume: every rank reads only its own state from the checkpoint; all fail
    // together if one cannot.
    let (start_step, resume) = resume_point(cfg, |dir| {
        crate::engine::checkpoint::load_rank_collective(comm, dir, &plan, &cfg.engine)
    })?;
    let mut metrics = match (&cfg.metrics, rank) {
        (Some(p), 0) => Some(MetricsWriter::create(p)?),
        _ => None,
    };

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
                ranks.sort_by_key(|x| x.rank);
                let rec = aggregate(r.step, &ranks, tokens);
                if rank == 0 {
                    if let Some(m) = metrics_cell.borrow_mut().as_mut()
                        && let Err(e) = m.step(&rec)
                    {
                        g.error.get_or_insert(e);
                    }
                    (on_step.borrow_mut())(&rec);
                }
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
    let val_loss = if cfg.eval_batches > 0 && n > 0 { mean_val_loss(all_val.chunks(n)) } else { None };
    let records = records.into_inner();
    let summary = summarize(&records, val_loss, info, cfg, model, &analytic);
    if let Some(m) = metrics.as_mut() {
        m.summary(&summary)?;
    }
    Ok(TrainReport { steps: records, summary, params: None, rank })
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
            times: crate::engine::StepTimes {
                compute_s: 0.125,
                comm_s: 0.0625,
                quant_s: 0.03125,
                optim_s: 0.5,
            },
            prefetched: 6,
        };
        let back = decode(&encode(&r))?;
        // The time split and the prefetch count travel too (`cargo xtask bench
        // torch` reports the slowest rank's split of an MPI run).
        assert_eq!((back.times, back.prefetched), (r.times, 6));
        assert_eq!((back.rank, back.step, back.skipped), (5, 9, true));
        assert_eq!(back.loss.to_bits(), r.loss.to_bits());
        assert_eq!(back.grad_norm.to_bits(), r.grad_norm.to_bits());
        assert_eq!(back.time_s, r.time_s);
        assert_eq!(back.traffic, r.traffic);
        assert!(decode(&encode(&r)[..20]).is_err());
        Ok(())
    }
}
